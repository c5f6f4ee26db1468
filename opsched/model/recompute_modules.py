"""Megatron-Core's recomputation by module (``--recompute-modules``): which operators each module names.

Megatron-Core's selective recomputation runs again, in the backward, the forward of the modules it is told
(``TransformerConfig.recompute_modules``): ``core_attn`` the attention core, ``layernorm`` the input and
pre-MLP norms, ``mla_up_proj`` multi-latent attention's query and key/value up-projections, ``mlp`` a dense
MLP, ``moe_act`` the experts' activation function, ``shared_experts`` the shared experts, ``moe`` the whole
MoE layer (routed and shared experts). DeepSeek-V3 recomputes its RMSNorms and MLA up-projections
(arXiv 2412.19437 §3.3.3). Each operator of an imported model falls in at most one *part* (its scope and
kind decide, :func:`module_part`); a module is a set of parts (:data:`PARTS`). Coarsening sums each block's
operators per part (:attr:`opsched.model.graph.Block.parts`), and the cost model charges a recomputed
part's forward again in the backward and stores none of what it saved (:func:`opsched.cost.blocks.block_cost`).

>>> sorted(parts_of(("moe",)))
['moe_act', 'moe_experts', 'shared_experts']
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

#: Megatron-Core's module names, as ``--recompute-modules`` takes them
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")

#: module -> the parts it recomputes
PARTS = {
    "core_attn": frozenset({"core_attn"}),
    "moe_act": frozenset({"moe_act"}),
    "layernorm": frozenset({"layernorm"}),
    "mla_up_proj": frozenset({"mla_up_proj"}),
    "mlp": frozenset({"mlp"}),
    "moe": frozenset({"moe_act", "moe_experts", "shared_experts"}),
    "shared_experts": frozenset({"shared_experts"}),
}

_EXPERT = re.compile(r"^experts\.\d+$")
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm")
_MLP_SCOPES = ("mlp", "block_sparse_moe", "feed_forward")
#: a MoE layer's routing operators, which sit in its MLP scope beside no expert
_ROUTING = ("TopK", "NonZero", "GatherND", "ScatterND", "Equal")
_NORMS = ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
          "SkipSimplifiedLayerNormalization")


class PartCost(NamedTuple):
    """The forward costs of a block's operators in one part (the fields :func:`opsched.cost.blocks.compute_time`
    reads, and what they save for the backward)."""

    part: str
    flops: float
    matmul_flops: float
    matmul_padded_flops: float
    io_bytes: float
    matmul_io_bytes: float
    attention_flops: float
    attention_io_bytes: float
    saved_bytes: float
    fp8_input_saving: float = 0.0  # of saved_bytes: what keeping weight matmuls' inputs in FP8 frees
    #: what recomputing the part keeps to run it again, when no other part keeps it (a MoE activation's inputs: the
    #: gate and up projections' outputs), and what keeping that in FP8 frees of it (under ``--dtype fp8``)
    kept_bytes: float = 0.0
    kept_fp8_saving: float = 0.0


#: a part whose recomputation keeps inputs (``PartCost.kept_bytes``) -> the part that makes them: recomputing both
#: (``moe``) makes the inputs again from further back instead of keeping them
INPUTS_MADE_BY = {"moe_act": "moe_experts"}


def kept_for_recompute(part: PartCost, parts: frozenset[str]) -> tuple[float, float]:
    """(bytes, of them what FP8 frees) recomputing ``part`` keeps when the parts ``parts`` are recomputed.

    >>> act = PartCost("moe_act", 0, 0, 0, 0, 0, 0, 0, 512.0, 64.0, 256.0, 128.0)
    >>> kept_for_recompute(act, frozenset({"moe_act"})), kept_for_recompute(act, parts_of(("moe",)))
    ((256.0, 128.0), (0.0, 0.0))
    """
    if INPUTS_MADE_BY.get(part.part) in parts:
        return 0.0, 0.0
    return part.kept_bytes, part.kept_fp8_saving


def parts_of(modules) -> frozenset[str]:
    """The parts recomputing ``modules`` (Megatron names) runs again."""
    return frozenset().union(*(PARTS[m] for m in modules)) if modules else frozenset()


def modules_without_parts(modules, present) -> list[str]:
    """Of ``modules`` (Megatron names), those none of whose parts is among ``present`` (the parts a model's blocks
    hold): recomputing them changes nothing opsched costs, and Megatron-Core refuses some of them outright
    (``mla_up_proj`` without multi-latent attention).

    >>> modules_without_parts(("layernorm", "mla_up_proj"), {"layernorm", "core_attn"})
    ['mla_up_proj']
    """
    return [m for m in modules if not PARTS[m] & set(present)]


def module_part(op) -> str | None:
    """The part an :class:`opsched.model.graph.OpNode` belongs to, or None (recomputed by no module).

    >>> from opsched.model.graph import OpNode
    >>> module_part(OpNode("n", "RMSNormalization", ("model", "layers.3", "input_layernorm")))
    'layernorm'
    >>> module_part(OpNode("m", "MatMul", ("model", "layers.3", "self_attn", "kv_b_proj"), matmul_flops=1.0))
    'mla_up_proj'
    >>> module_part(OpNode("s", "Sigmoid", ("model", "layers.3", "mlp", "experts.7")))
    'moe_act'
    """
    scope = op.scope
    if op.attention_flops > 0 or op.attention_io_bytes > 0:
        return "core_attn"
    if "q_b_proj" in scope or "kv_b_proj" in scope:
        return "mla_up_proj"
    if op.op_type in _NORMS and scope and scope[-1] in _LAYER_NORMS:
        return "layernorm"
    if "shared_experts" in scope:
        return "shared_experts"
    if any(_EXPERT.match(part) for part in scope):
        return "moe_act" if op.matmul_flops == 0 else "moe_experts"
    if any(part in _MLP_SCOPES for part in scope):
        return "moe_experts" if op.op_type in _ROUTING or "gate" in scope or op.in_moe_layer else "mlp"
    return None


def _mlp_prefix(scope: tuple[str, ...]) -> tuple[str, ...] | None:
    """``scope`` up to its MLP scope (``model/layers.3/mlp``), or None outside any MLP."""
    for k, part in enumerate(scope):
        if part in _MLP_SCOPES:
            return scope[:k + 1]
    return None


def mark_moe_layers(g) -> None:
    """Mark (``OpNode.in_moe_layer``) every operator of an OpGraph that sits in the MLP scope of a layer with
    experts, outside them: the routing weights' multiply or a reshape of the combine is no dense MLP, so
    ``recompute_modules=mlp`` must not free what it keeps (Megatron-Core applies ``mlp`` to dense MLPs only).

    >>> import networkx as nx
    >>> from opsched.model.graph import OpNode
    >>> g = nx.DiGraph()
    >>> g.add_node("e", op=OpNode("e", "MatMul", ("model", "layers.1", "mlp", "experts.0", "down_proj")))
    >>> g.add_node("w", op=OpNode("w", "Mul", ("model", "layers.1", "mlp")))
    >>> g.add_node("d", op=OpNode("d", "Mul", ("model", "layers.0", "mlp")))
    >>> mark_moe_layers(g); [module_part(g.nodes[v]["op"]) for v in "wd"]
    ['moe_experts', 'mlp']
    """
    moe = {_mlp_prefix(data["op"].scope) for _, data in g.nodes(data=True)
           if any(_EXPERT.match(part) for part in data["op"].scope)} - {None}
    for v, data in g.nodes(data=True):
        op = data["op"]
        inside_an_expert = any(_EXPERT.match(part) for part in op.scope)
        if not op.in_moe_layer and not inside_an_expert and _mlp_prefix(op.scope) in moe:
            data["op"] = dataclasses.replace(op, in_moe_layer=True)


def part_costs(ops) -> tuple[PartCost, ...]:
    """Each part's summed forward costs over ``ops`` (OpNode records), parts in first-met order.

    A part's saved bytes are what recomputing it frees. For ``mla_up_proj``
    that is not what the up-projections keep (their inputs, the latents, are
    what Megatron-Core's checkpoint of them keeps to run them again) but the
    queries, keys and values they made, which the attention kept
    (``OpNode.mla_qkv_saved_bytes``; Megatron-Core's multi-latent attention
    discards them after the core attention and recomputes them in the
    backward); the attention's part keeps the rest of its saved bytes.
    Likewise ``moe_act`` frees, besides what the activation's operators keep,
    the activation's output the down projection keeps
    (``OpNode.act_output_saved_bytes``), and keeps the activation's inputs
    (``kept_bytes``): Megatron-Core's checkpoint of the activation keeps its
    input and discards its output once the down projection has run.
    """
    sums: dict[str, list[float]] = {}
    for op in ops:
        part = module_part(op)
        if part is None:
            continue
        row = sums.setdefault(part, [0.0] * 11)
        kept = 0.0 if part == "mla_up_proj" else op.saved_bytes - op.mla_qkv_saved_bytes - op.act_output_saved_bytes
        fp8 = 0.0 if part == "mla_up_proj" else op.fp8_input_saving
        moved_fp8 = op.fp8_input_saving * op.act_output_saved_bytes / op.saved_bytes if op.saved_bytes else 0.0
        for k, value in enumerate((op.flops, op.matmul_flops, op.matmul_padded_flops, op.io_bytes, op.matmul_io_bytes,
                                   op.attention_flops, op.attention_io_bytes, kept, fp8 - moved_fp8,
                                   op.act_input_bytes, op.act_input_fp8_saving)):
            row[k] += value
        if op.mla_qkv_saved_bytes:
            sums.setdefault("mla_up_proj", [0.0] * 11)[7] += op.mla_qkv_saved_bytes
        if op.act_output_saved_bytes:
            act = sums.setdefault("moe_act", [0.0] * 11)
            act[7] += op.act_output_saved_bytes
            act[8] += moved_fp8
    return tuple(PartCost(part, *row) for part, row in sums.items())


def mark_activation_checkpoints(g) -> None:
    """Mark on an OpGraph (:mod:`opsched.model.graph`) what recomputing each MoE expert's activation keeps and frees.

    Megatron-Core's ``moe_act`` checkpoints the experts' activation function (the SwiGLU): it keeps the
    activation's input, the gate and up projections' outputs, and discards its output once the down projection
    has run, making it again in the backward. DeepSeek-V3 does the same ("cache the inputs of the SwiGLU operator
    and recompute its output in the backward pass", keeping them in FP8: arXiv 2412.19437 §3.3.3). Per activation
    (the connected operators of part ``moe_act``): its first reader of each input written outside it gets the
    input's bytes (``OpNode.act_input_bytes``), and a weight matmul reading its output (the down projection) gets
    what it keeps of that output (``OpNode.act_output_saved_bytes``). What keeping the inputs in FP8 frees
    (``act_input_fp8_saving``) takes the down projection's ratio: the activation is elementwise, its inputs and
    output of one element type.
    """
    import networkx as nx

    act = [v for v, data in g.nodes(data=True) if module_part(data["op"]) == "moe_act"]
    tensor_bytes = g.graph.get("tensor_bytes", {})
    for region in nx.weakly_connected_components(g.subgraph(act)):
        inputs: dict[str, tuple[str, float]] = {}  # tensor -> (its first reader in the region, bytes)
        ratio = 0.0
        for v in sorted(region):
            for u, _, data in g.in_edges(v, data=True):
                if u in region or g.nodes[u].get("const"):
                    continue
                tensors = data.get("tensors") or [f"{u}->{v}"]
                for t in tensors:
                    inputs.setdefault(t, (v, tensor_bytes.get(t, data.get("bytes", 0.0) / len(tensors))))
            for _, w, data in g.out_edges(v, data=True):
                down = g.nodes[w]["op"]
                if w in region or not (down.param_count and down.matmul_flops and down.saved_bytes):
                    continue
                out = min(down.saved_bytes - down.act_output_saved_bytes, data.get("bytes", 0.0))
                g.nodes[w]["op"] = dataclasses.replace(down, act_output_saved_bytes=down.act_output_saved_bytes + out)
                ratio = down.fp8_input_saving / down.saved_bytes
        for v, nbytes in inputs.values():
            op = g.nodes[v]["op"]
            g.nodes[v]["op"] = dataclasses.replace(op, act_input_bytes=op.act_input_bytes + nbytes,
                                                   act_input_fp8_saving=op.act_input_fp8_saving + nbytes * ratio)
