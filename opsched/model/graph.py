"""Operator and block graphs: networkx DiGraphs whose nodes carry typed cost records.

An **OpGraph** has one node per ONNX node, keyed by the node's unique name, with
the attribute ``"op"`` holding an :class:`OpNode`. A **BlockGraph** has one
node per block (a connected set of merged operators), keyed by an integer id,
with the attribute ``"block"`` holding a :class:`Block`. In both, an edge
``u -> v`` means v reads a tensor u writes; its attribute ``"bytes"`` is the
total size of those tensors (one microbatch) and ``"tensors"`` their names.

Costs are per microbatch, for the forward pass, at the dims given at import.

An OpGraph made by :func:`opsched.model.onnx_import.import_onnx` also carries the
node attribute ``"const"`` (True when the op computes from constants and
weights only, e.g. a ``Constant``) and the graph attribute ``"tensor_bytes"``
(tensor name -> bytes), which coarsening uses to charge a block edge once per
distinct tensor that crosses it. Both are optional for hand-built graphs.

>>> import networkx as nx
>>> g = new_op_graph("tiny")
>>> add_op(g, OpNode("mm", "MatMul", ("layer",), flops=2 * 4 * 8 * 16, param_count=128,
...                  param_bytes=512, output_bytes=256, io_bytes=1024))
>>> totals(g)["flops"]
1024.0
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import networkx as nx


@dataclass(frozen=True)
class OpNode:
    """One ONNX operator and its forward cost for one microbatch."""

    name: str
    op_type: str
    scope: tuple[str, ...]  # module path, e.g. ("layers.3", "mlp", "experts.1")
    flops: float = 0.0  # forward floating-point operations (a multiply-add is 2)
    param_count: int = 0  # parameters this op owns (a shared weight is owned by one op)
    param_bytes: float = 0.0  # bytes of those parameters in their stored dtype
    output_bytes: float = 0.0  # bytes of the tensors this op writes
    io_bytes: float = 0.0  # bytes read + written (memory traffic, for the roofline)
    #: bytes of the activations kept for the backward that this op is the first to keep (opsched.model.saved:
    #: a weight matmul keeps its input, a norm its input, a bias or residual add nothing; views share storage)
    saved_bytes: float = 0.0
    #: bytes a tensor-parallel all-reduce moves after this op: its output when it is a row-parallel
    #: linear layer (a weight matmul that feeds the residual stream), else 0 (see onnx_import)
    tp_comm_bytes: float = 0.0
    #: of ``flops`` / ``io_bytes``: what matrix multiplies (tensor cores) and fused attention do;
    #: the rest is vector work, memory-bound in practice (see cost.compute_time)
    matmul_flops: float = 0.0
    matmul_io_bytes: float = 0.0
    attention_flops: float = 0.0
    attention_io_bytes: float = 0.0
    #: ``matmul_flops`` with each GEMM's dimensions padded to the tile it runs in (``opsched.model.gemm``: tile
    #: quantisation); what ``cost.compute_time`` charges at the matmul ceiling (0: not known, ``matmul_flops``)
    matmul_padded_flops: float = 0.0
    #: of ``saved_bytes``: what a tensor-parallel group keeps whole on every rank unless sequence parallelism
    #: splits it (tensors outside the column-/row-parallel pairs: norms' inputs and outputs, residual adds)
    tp_replicated_bytes: float = 0.0
    #: bytes of the keys and values an attention reads: what context parallelism's ring passes around
    attention_kv_bytes: float = 0.0
    #: of ``saved_bytes``: the queries, keys and values a fused attention keeps that multi-latent attention's
    #: up-projections made (what recomputing them frees: Megatron-Core's ``mla_up_proj`` discards them once the
    #: attention has run and makes them again in the backward); 0 for any other attention
    mla_qkv_saved_bytes: float = 0.0
    #: of ``saved_bytes``: what an unfused attention keeps of its scores (softmax output, dropout mask and
    #: output), which selective recomputation does not store (a fused Attention never writes them)
    attention_scores_bytes: float = 0.0
    #: score elements (batch × heads × query length × key length) of a fused ``Attention`` op, and the FLOPs of its
    #: two multiplies (Q·Kᵀ and scores·V) run as batched GEMMs padded to their tiles: what the op costs when the
    #: run computes attention unfused, writing the scores to memory (``cost.compute_time``); 0 for an attention
    #: exported as its MatMul / Softmax chain, whose ops carry that traffic already
    attention_scores: float = 0.0
    attention_gemm_padded_flops: float = 0.0
    #: of ``saved_bytes``: what keeping the activation inputs of weight matmuls (linear layers) in FP8, one byte
    #: an element, frees: an FP8 GEMM keeps its input cast to FP8 for the weight gradient (Transformer Engine's
    #: Linear; DeepSeek-V3 caches these activations in FP8, arXiv 2412.19437 §3.3), read with ``--dtype fp8``. On a
    #: fused attention: what keeping its output, the input of the linear layer after it, in E5M6 (12 bits) frees
    #: (DeepSeek-V3 keeps that one activation in E5M6 for both backwards, arXiv 2412.19437 §3.3.3 (1))
    fp8_input_saving: float = 0.0
    #: of an operator of a MoE expert's activation (Megatron-Core's ``moe_act``, the SwiGLU): bytes of the inputs it
    #: reads from outside the activation (the gate and up projections' outputs), which recomputing the activation
    #: keeps to run it again, and what keeping those in FP8 frees of them (:func:`opsched.model.recompute_modules.
    #: mark_activation_checkpoints`). Not in :data:`COST_FIELDS`: read per operator by ``part_costs``.
    act_input_bytes: float = 0.0
    act_input_fp8_saving: float = 0.0
    #: of a weight matmul's ``saved_bytes``: the output of a MoE activation it keeps (the down projection's input),
    #: which recomputing the activation does not store (it is made again in the backward)
    act_output_saved_bytes: float = 0.0
    #: an operator of a MoE layer's MLP scope outside its experts (the router, dispatch, combine and the routing
    #: weights' multiply): Megatron-Core's ``mlp`` recompute module names a dense MLP and does not cover it, its
    #: ``moe`` module does (:func:`opsched.model.recompute_modules.mark_moe_layers`)
    in_moe_layer: bool = False
    #: of a fused ``Attention`` op: the greatest common divisor of its query heads and key-value heads, which a
    #: tensor-parallel degree must divide (Megatron-Core divides both over the ranks); 0 when not an attention or
    #: its shapes are unknown (an attention exported as its MatMul / Softmax chain)
    attention_heads: int = 0


@dataclass(frozen=True)
class Block:
    """A connected set of operators merged by coarsening; costs are exact sums over ``ops``."""

    id: int
    name: str
    scope: tuple[str, ...]  # the common module path of its ops
    ops: tuple[str, ...]  # OpGraph node names, in topological order
    flops: float = 0.0
    param_count: int = 0
    param_bytes: float = 0.0
    output_bytes: float = 0.0
    io_bytes: float = 0.0
    saved_bytes: float = 0.0
    tp_comm_bytes: float = 0.0
    matmul_flops: float = 0.0
    matmul_io_bytes: float = 0.0
    attention_flops: float = 0.0
    attention_io_bytes: float = 0.0
    tp_replicated_bytes: float = 0.0
    attention_kv_bytes: float = 0.0
    mla_qkv_saved_bytes: float = 0.0
    attention_scores_bytes: float = 0.0
    attention_scores: float = 0.0
    attention_gemm_padded_flops: float = 0.0
    matmul_padded_flops: float = 0.0
    fp8_input_saving: float = 0.0  # OpNode.fp8_input_saving, summed
    #: what every tensor-parallel degree of this block must divide: :func:`common_heads` of its attentions (0: none)
    attention_heads: int = 0
    op_types: dict[str, int] = field(default_factory=dict, compare=False)
    #: the forward costs of its operators by the part of Megatron's recompute modules they belong to
    #: (:func:`opsched.model.recompute_modules.part_costs`; empty for a hand-made Block)
    parts: tuple = field(default=(), compare=False)


COST_FIELDS = ("flops", "param_count", "param_bytes", "output_bytes", "io_bytes", "saved_bytes", "tp_comm_bytes",
               "matmul_flops", "matmul_io_bytes", "attention_flops", "attention_io_bytes", "tp_replicated_bytes",
               "attention_kv_bytes", "mla_qkv_saved_bytes", "attention_scores_bytes", "attention_scores", "attention_gemm_padded_flops",
               "matmul_padded_flops", "fp8_input_saving")


def common_heads(records) -> int:
    """The heads every attention of ``records`` (operators or blocks) splits into: the gcd of their
    ``attention_heads``, so a tensor-parallel degree dividing it divides each; 0 when none has attention.

    >>> from types import SimpleNamespace as R
    >>> common_heads([R(attention_heads=0), R(attention_heads=28), R(attention_heads=4)])
    4
    """
    return math.gcd(*(r.attention_heads for r in records)) if records else 0


def common_scope(scopes) -> tuple[str, ...]:
    """The longest module path every one of ``scopes`` starts with.

    >>> common_scope([("model", "layers.1", "mlp"), ("model", "layers.1", "attn")])
    ('model', 'layers.1')
    """
    scopes = list(scopes)
    prefix = list(scopes[0]) if scopes else []
    for s in scopes[1:]:
        n = 0
        while n < min(len(prefix), len(s)) and prefix[n] == s[n]:
            n += 1
        prefix = prefix[:n]
    return tuple(prefix)


@contextmanager
def gc_paused():
    """Keep Python's cyclic garbage collector out of building a large graph (import, coarsening).

    Importing and coarsening DeepSeek-V3 (182,000 operators) allocates millions
    of dicts and tuples that live as long as the graph; the collector scanned
    them again each time allocations passed its thresholds, 6 of 33 CPU
    seconds, and found nothing to free. Cycles made meanwhile are freed by the
    next collection after it. Also a decorator: ``@gc_paused()``.

    >>> with gc_paused():
    ...     gc.isenabled()
    False
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def new_op_graph(name: str = "model", **attrs) -> nx.DiGraph:
    """An empty OpGraph; graph attributes record provenance (dims, warnings...)."""
    g = nx.DiGraph(name=name, kind="OpGraph", **attrs)
    return g


def add_op(g: nx.DiGraph, op: OpNode) -> None:
    g.add_node(op.name, op=op)


def ops(g: nx.DiGraph):
    """Iterate the OpNode records of an OpGraph (or the Block records of a BlockGraph)."""
    key = "block" if g.graph.get("kind") == "BlockGraph" else "op"
    return (data[key] for _, data in g.nodes(data=True))


def totals(g: nx.DiGraph) -> dict[str, float]:
    """Sum every cost field over the nodes of an OpGraph or BlockGraph.

    Coarsening must conserve these exactly; tests compare the two.
    """
    out = {f: 0.0 for f in COST_FIELDS}
    for rec in ops(g):
        for f in COST_FIELDS:
            out[f] += getattr(rec, f)
    out["edge_bytes"] = float(sum(b for _, _, b in g.edges(data="bytes", default=0.0)))
    return out
