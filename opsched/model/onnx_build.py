"""ONNX nodes -> OpGraph nodes and edges: the graph builder of :mod:`opsched.model.onnx_import`.

Given a shape-inferred model, :func:`_build_graph` makes one OpNode per ONNX
node with its forward cost, the parameters it reads (weights followed through
alias ops, tied weights counted once, rule 6 of the importer's docstring), the
activations it keeps for the backward, the attention cores an exporter wrote
out as operators, and what Megatron's tensor parallelism splits; and one edge
per tensor read from another node. It also holds the rule telling which graph
inputs are weights (:func:`_weight_inputs`).
"""

from __future__ import annotations

import dataclasses
import math
import os

from opsched.model.gemm import matmul_shape, padded_flops
from opsched.model.graph import OpNode, new_op_graph
from opsched.model.onnx_ops import (
    _COSTED_OPS, _DTYPE_BYTES, _FLOAT_TYPES, ALIAS_OPS, DEDUP_LIMIT, MATMUL_OPS, NAME_SCOPES_KEY, NORM_OPS,
    SHAPE_READERS, _attention_dims, _attr, _numel, _static, op_flops,
)
from opsched.model.saved import NO_GRADIENT, VIEW_OPS, saved_tensors


# --------------------------------------------------------------------------- parameters


def _weight_inputs(model, shapes, data_meta: list[str] | None) -> set[str]:
    """Graph inputs that are weights (see the module docstring for the rule)."""
    g = model.graph
    init_names = {t.name for t in g.initializer}
    inputs = [vi for vi in g.input if vi.name not in init_names]
    if data_meta is not None:
        return {vi.name for vi in inputs} - set(data_meta)
    consumers: dict[str, list] = {}
    for n in g.node:
        for k, name in enumerate(n.input):
            if name:
                consumers.setdefault(name, []).append((n, k))
    weights = set()
    for vi in inputs:
        shape, elem = shapes.get(vi.name, (None, 0))
        if elem not in _FLOAT_TYPES or not _static(shape):
            continue
        if _read_as_weight(vi.name, consumers, shapes):
            weights.add(vi.name)
    return weights


def _read_as_weight(name, consumers, shapes, depth=0) -> bool:
    """True when every read of ``name`` (following alias ops) is in a weight position."""
    reads = consumers.get(name, [])
    if not reads:
        return False
    for n, k in reads:
        if n.op_type in ALIAS_OPS and k == 0 and depth < 4:
            if not _read_as_weight(n.output[0], consumers, shapes, depth + 1):
                return False
        elif not _weight_position(n, k, shapes, strong=True):
            return False
    return True


def _weight_position(node, k, shapes, strong: bool) -> bool:
    """Whether input ``k`` of ``node`` is where a weight goes."""
    t = node.op_type
    if t in ("MatMul", "Gemm", "Einsum", "MatMulInteger", "FusedMatMul"):
        return k >= 1 or not strong
    if t in ("Conv", "ConvTranspose", "ConvInteger", "PRelu"):
        return k >= 1
    if t in NORM_OPS:
        return 1 <= k <= (2 if t != "SkipLayerNormalization" else 4)
    if t in ("Gather", "GatherND"):
        return k == 0
    if t in ("Add", "Sub", "Mul", "Div"):
        if not strong:
            return True
        me = shapes.get(node.input[k], (None, 0))[0]
        others = [shapes.get(x, (None, 0))[0] for j, x in enumerate(node.input) if j != k]
        return me is not None and any(o is not None and len(o) > len(me) for o in others)
    return False


#: operators that read only the rows (elements) their indices select from input 0 (what their io_bytes charge)
GATHERS = ("Gather", "GatherND", "GatherElements")


def _tensor_bytes(shapes, name) -> float:
    """Bytes of one tensor (0 when its shape is unknown)."""
    shape, elem = shapes.get(name, (None, 0))
    return float(_numel(shape) * _DTYPE_BYTES.get(elem, 4)) if _static(shape) else 0.0


def _fp8_input_saving(saved: dict[str, float], shapes) -> float:
    """What a weight matmul's kept inputs (``saved``: storage tensor -> bytes) would free kept in FP8, one byte an
    element in place of their own type's bytes (Transformer Engine's Linear keeps the FP8-cast input).

    >>> from onnx import TensorProto
    >>> _fp8_input_saving({"x": 64.0}, {"x": ((4, 8), TensorProto.BFLOAT16)})
    32.0
    """
    total = 0.0
    for name, nbytes in saved.items():
        element = _DTYPE_BYTES.get(shapes.get(name, (None, 0))[1], 4)
        total += nbytes * (1 - 1 / element) if element > 1 else 0.0
    return total


class _BytesOf(dict):
    """Memoised tensor name -> bytes for one shape table; a tensor outside ``unscaled`` (one a data input reaches)
    counts ``batch_scale`` times its shape's bytes (a static batch rescaled, see :func:`_build_graph`)."""

    def __init__(self, shapes, batch_scale: float = 1.0, unscaled: frozenset[str] = frozenset()):
        super().__init__()
        self.shapes, self.batch_scale, self.unscaled = shapes, batch_scale, unscaled

    def __missing__(self, name):
        scale = 1.0 if name in self.unscaled else self.batch_scale
        value = self[name] = _tensor_bytes(self.shapes, name) * scale
        return value


def constant_tensors(nodes, order, seeds: set[str]) -> frozenset[str]:
    """``seeds`` (initializers, weights) and every tensor computed from them alone: what no data input reaches.

    >>> import onnx
    >>> nodes = [onnx.helper.make_node("Transpose", ["w"], ["wt"]), onnx.helper.make_node("MatMul", ["x", "wt"], ["y"])]
    >>> sorted(constant_tensors(nodes, [0, 1], {"w"}))
    ['w', 'wt']
    """
    const = set(seeds)
    for i in order:
        if all((not x) or x in const for x in nodes[i].input):
            const.update(o for o in nodes[i].output if o)
    return frozenset(const)


def _exporter(model) -> str:
    if model.producer_name.lower().startswith("pytorch"):
        for n in model.graph.node[:50]:
            if any(p.key == NAME_SCOPES_KEY for p in n.metadata_props):
                return "dynamo"
        return "legacy"
    return "helper"


def _build_graph(model, path, order, shapes, dims, weight_inputs, warnings, capacity_factor, routing, masks, keys,
                 scopes, batch_scale: float = 1.0):
    """One OpNode per ONNX node, in topological ``order``, and one edge per tensor read from another node.

    ``keys`` and ``scopes`` are per node index (:func:`_node_keys`, :func:`node_scope`).
    Nodes and edges go into the graph in two bulk calls, in the order they are met (the
    order coarsening's topological sort sees). ``batch_scale`` rescales a
    static batch: every tensor a data input reaches, and every such
    operator's FLOPs, count that many times their shapes' (each sample's
    work is independent of the others', so both grow linearly with the batch).
    """
    g_onnx = model.graph
    init_names = {t.name for t in g_onnx.initializer}
    g = _new_graph(model, path, init_names, dims, weight_inputs, warnings, capacity_factor, routing, masks)
    weights = _ParamCounter(g_onnx, weight_inputs, shapes)
    unscaled = constant_tensors(g_onnx.node, order, init_names | set(weight_inputs)) if batch_scale != 1 else frozenset()
    bytes_of = _BytesOf(shapes, batch_scale, unscaled)
    const_tensors = set(init_names) | set(weight_inputs)
    producer: dict[str, str] = {}  # tensor -> key of the node writing it
    unknown: dict[str, int] = {}  # op type -> count of nodes op_flops cannot cost
    uncosted: list[str] = []  # keys of costed op types whose shapes are unknown
    tensor_bytes: dict[str, float] = {}
    readers = _readers(g_onnx.node)  # tensor -> the nodes reading it
    nodes: list[tuple[str, dict]] = []
    split_tensors: set[str] = set()  # activations each tensor-parallel rank holds a part of (see _split_over_tensor_ranks)
    kept = _KeptActivations(weights, const_tensors, bytes_of, readers)
    unfused = _UnfusedAttention(nodes, kept)
    mla, e5m6 = _MlaUpProjections(g_onnx.node, keys, scopes, producer), _E5M6AttentionOutputs(nodes, kept, shapes)
    edges: dict[tuple[str, str], dict] = {}  # (writer, reader) -> bytes and tensors, in the order met
    for i in order:
        n = g_onnx.node[i]
        key, op_type = keys[i], n.op_type
        inputs, outputs = list(n.input), [o for o in n.output if o]
        # an operator a data input reaches scales with the batch (rescaled static batch; 1 otherwise)
        scale = batch_scale if any(o not in unscaled for o in outputs) else 1.0
        flops = _costed_flops(n, key, shapes, unknown, uncosted) * scale
        param_count, param_bytes = weights.read_by(n)
        out_bytes = sum(bytes_of[o] for o in outputs)
        in_bytes = sum(bytes_of[x] for x in inputs if x)
        if op_type in GATHERS and inputs and inputs[0]:
            # a gather reads the rows it selects (its output), not its whole table: an embedding lookup reads
            # a sequence's rows of the vocabulary, an MoE dispatch gather the tokens routed to one expert
            in_bytes += min(0.0, out_bytes - bytes_of[inputs[0]])
        # a vocabulary-parallel embedding (a Gather from a weight) all-reduces its output too
        row_parallel = param_count > 0 and (op_type == "Gather" or op_type in ("MatMul", "Gemm") and _feeds_residual(
            n.output[0], readers, const_tensors))
        kind = {"matmul": op_type in MATMUL_OPS, "attention": op_type == "Attention"}
        split = _split_over_tensor_ranks(op_type, inputs, param_count, row_parallel, split_tensors)
        if split:
            split_tensors.update(outputs)
        saved = kept.see(len(nodes), op_type, inputs, outputs)
        op = OpNode(key, op_type, scopes[i], flops=float(flops), param_count=int(param_count),
                    param_bytes=float(param_bytes), output_bytes=float(out_bytes), io_bytes=float(in_bytes + out_bytes),
                    tp_comm_bytes=float(out_bytes) if row_parallel else 0.0,
                    matmul_flops=float(flops) if kind["matmul"] else 0.0,
                    matmul_io_bytes=float(in_bytes + out_bytes) if kind["matmul"] else 0.0,
                    matmul_padded_flops=_matmul_padded_flops(n, shapes, flops / scale) * scale if kind["matmul"] else 0.0,
                    attention_flops=float(flops) if kind["attention"] else 0.0,
                    attention_io_bytes=float(in_bytes + out_bytes) if kind["attention"] else 0.0,
                    saved_bytes=float(sum(saved.values())),
                    tp_replicated_bytes=float(sum(b for t, b in saved.items() if t not in split_tensors)),
                    attention_kv_bytes=float(sum(bytes_of[x] for x in inputs[1:3] if x)) if kind["attention"] else 0.0,
                    mla_qkv_saved_bytes=mla.saved_bytes(inputs[:3], saved, kept.storage) if kind["attention"] else 0.0,
                    fp8_input_saving=_fp8_input_saving(saved, shapes) if kind["matmul"] and param_count else 0.0,
                    **(_attention_shape_fields(n, shapes, scale) if kind["attention"] else {}))
        is_const = all((not x) or x in const_tensors for x in inputs)
        e5m6.see(op, inputs)
        nodes.append((key, {"op": op, "const": is_const}))
        unfused.see(len(nodes) - 1, inputs, outputs, is_const, bytes_of)
        if is_const:
            const_tensors.update(outputs)
        _add_input_edges(edges, op_type, inputs, key, producer, bytes_of, tensor_bytes)
        producer.update((o, key) for o in outputs)
    g.add_nodes_from(nodes)
    g.add_edges_from((u, v, data) for (u, v), data in edges.items())
    warnings.extend(_cost_warnings(unknown, uncosted))
    g.graph["tensor_bytes"] = tensor_bytes
    return g


#: the operators transformers' ``repeat_kv`` writes a grouped-query attention's key or value repeat with
_REPEAT_OPS = frozenset({"Reshape", "Expand", "Unsqueeze", "Identity", "Cast"})


def mark_grouped_kv_heads(g, model, keys: list[str], shapes) -> None:
    """Fused attentions whose keys were repeated up to the query heads before the op (transformers' ``repeat_kv``:
    unsqueeze, expand to ``[batch, kv heads, repeats, seq, dim]``, reshape): their ``attention_heads`` become the
    gcd of the query heads and the key-value heads before the repeat, which the key and value projections hold
    and a tensor-parallel degree must divide (Megatron-Core's ``num_query_groups``)."""
    writer = {o: n for n in model.graph.node for o in n.output}
    for key, n in zip(keys, model.graph.node):
        op = g.nodes[key]["op"] if n.op_type == "Attention" and key in g else None
        if op is None or not op.attention_heads or len(n.input) < 2:
            continue
        kv = _heads_before_repeat(n.input[1], writer, shapes)
        if kv and op.attention_heads % kv == 0:
            g.nodes[key]["op"] = dataclasses.replace(op, attention_heads=math.gcd(op.attention_heads, kv))


def _heads_before_repeat(tensor: str, writer, shapes, depth: int = 4) -> int:
    """The key-value heads ``tensor`` was repeated from: the second axis of the 5-d tensor an ``Expand`` made on
    its way (``[batch, kv heads, repeats, seq, dim]``), through at most ``depth`` repeat operators; 0: no repeat."""
    for _ in range(depth):
        n = writer.get(tensor)
        if n is None or n.op_type not in _REPEAT_OPS or not n.input:
            return 0
        shape = shapes.get(n.output[0], (None, 0))[0]
        if n.op_type == "Expand" and shape is not None and len(shape) == 5 and isinstance(shape[1], int):
            return shape[1]
        tensor = n.input[0]
    return 0


def _new_graph(model, path, init_names, dims, weight_inputs, warnings, capacity_factor, routing, masks):
    """The empty OpGraph with the import's graph attributes, kept apart so :func:`_build_graph` reads as the node walk.

    Its name is the ONNX graph's, else the file's stem; its data inputs are
    the graph inputs that are neither initializers nor weights.
    """
    g_onnx = model.graph
    graph_inputs = [vi.name for vi in g_onnx.input if vi.name not in init_names]
    data_inputs = [n for n in graph_inputs if n not in weight_inputs]
    name = g_onnx.name or os.path.splitext(os.path.basename(path))[0]
    return new_op_graph(name, dims=dict(dims), warnings=warnings, exporter=_exporter(model),
                        capacity_factor=capacity_factor, data_inputs=data_inputs, source=os.path.basename(path),
                        moe_routing=routing, nonzero_masks=masks)


#: the scopes of multi-latent attention's up-projections (DeepSeek-V2/V3: the query's, the keys' and values')
MLA_UP_PROJECTIONS = ("q_b_proj", "kv_b_proj")


#: bytes an element of DeepSeek-V3's E5M6 format takes (1 sign, 5 exponent and 6 mantissa bits), in which it keeps the
#: input of the linear layer after the attention (arXiv 2412.19437 §3.3.3, "Low-Precision Activation" (1))
E5M6_BYTES = 1.5


class _E5M6AttentionOutputs:
    """Marks on a fused attention what keeping its output in E5M6 frees under ``--dtype fp8``.

    DeepSeek-V3 caches the inputs of its FP8 linear layers in FP8, except the input of the linear layer after the
    attention, which the attention's backward reads too: that one is kept in E5M6 (arXiv 2412.19437 §3.3.3). The
    attention keeps its output first (a fused attention's backward reads it), so the linear layer's FP8 rule frees
    nothing of it; when a weight matmul reads that output (through views), the attention's ``fp8_input_saving``
    gains its bytes less their E5M6 size, once per output.
    """

    def __init__(self, nodes: list, kept: "_KeptActivations", shapes):
        self.nodes, self.kept, self.shapes, self.done = nodes, kept, shapes, set()

    def see(self, op: OpNode, inputs: list[str]) -> None:
        """``op`` (its OpNode, not yet in ``nodes``) reads ``inputs``: a weight matmul reading an attention's output
        marks the attention."""
        if op.op_type not in MATMUL_OPS or not op.param_count:
            return
        for x in inputs[:1]:
            base = self.kept.storage.get(x, x)
            j = self.kept.keeper.get(base)
            if j is None or base in self.done or self.kept.producer.get(base) != j:
                continue
            attention = self.nodes[j][1]["op"]
            element = _DTYPE_BYTES.get(self.shapes.get(base, (None, 0))[1], 4)
            if attention.op_type != "Attention" or element <= E5M6_BYTES:
                continue
            self.done.add(base)
            saving = self.kept.by_node[j].get(base, 0.0) * (1 - E5M6_BYTES / element)
            self.nodes[j][1]["op"] = dataclasses.replace(attention,
                                                         fp8_input_saving=attention.fp8_input_saving + saving)


class _MlaUpProjections:
    """Which of an attention's inputs multi-latent attention's up-projections made (through reshapes, splits,
    concatenations and RoPE, not through another matmul): what recomputing ``mla_up_proj`` frees."""

    #: how many tensors back from an attention input the walk looks (RoPE and the head reshapes take a few)
    REACH = 24

    def __init__(self, nodes, keys, scopes, producer: dict[str, str]):
        self.nodes, self.scopes, self.producer = nodes, scopes, producer
        self.index = {key: i for i, key in enumerate(keys)}
        self.found = any(p in scope for scope in scopes for p in MLA_UP_PROJECTIONS)

    def saved_bytes(self, inputs: list[str], saved: dict[str, float], storage: dict[str, str]) -> float:
        """Of ``saved`` (storage tensor -> bytes an attention is the first to keep; ``storage``: view -> the
        tensor whose storage it shares), the bytes of its ``inputs`` an up-projection made."""
        if not self.found:
            return 0.0
        made = {storage.get(x, x) for x in inputs if x and self._made_by_up_projection(x)}
        return float(sum(saved.get(base, 0.0) for base in made))

    def _made_by_up_projection(self, tensor: str) -> bool:
        todo, seen = [tensor], set()
        while todo and len(seen) < self.REACH:
            t = todo.pop()
            if t in seen or t not in self.producer:
                continue
            seen.add(t)
            i = self.index[self.producer[t]]
            if self.nodes[i].op_type in MATMUL_OPS:
                if any(p in self.scopes[i] for p in MLA_UP_PROJECTIONS):
                    return True
                continue  # another projection: not this one's output
            todo.extend(x for x in self.nodes[i].input if x)
        return False


def _readers(nodes) -> dict[str, list]:
    """Tensor -> the nodes reading it, in node order: what residual and SiLU detection look ahead through."""
    readers: dict[str, list] = {}
    for n in nodes:
        for x in n.input:
            if x:
                readers.setdefault(x, []).append(n)
    return readers


#: ops that only reshape or pass a tensor on, between a linear layer and the residual Add
_PASS_THROUGH = frozenset({"Reshape", "Identity", "Dropout", "Cast", "Squeeze", "Unsqueeze", "Flatten"})


class _KeptActivations:
    """The activations each node keeps for the backward (:mod:`opsched.model.saved`), each storage counted once.

    Walks the nodes in topological order, tracking which tensors need a
    gradient (parameters and what is computed from them), which storage a
    view shares, and which node keeps each storage first: that node's
    ``saved_bytes`` counts it. Weights and constants are no activations.
    """

    def __init__(self, weights: "_ParamCounter", const_tensors: set[str], bytes_of, readers: dict[str, list]):
        self.weights, self.const_tensors, self.bytes_of, self.readers = weights, const_tensors, bytes_of, readers
        self.silu_sigmoid: dict[str, str] = {}  # the output of a Sigmoid that is half of a SiLU -> its input
        self.gradient: set[str] = set()  # activations that need a gradient
        self.storage: dict[str, str] = {}  # view -> the tensor whose storage it shares
        self.keeper: dict[str, int] = {}  # storage tensor -> index of the first node keeping it
        self.producer: dict[str, int] = {}  # tensor -> index of the node writing it
        self.by_node: list[dict[str, float]] = []  # per node index: storage tensor -> bytes it keeps first

    def needs_gradient(self, name: str) -> bool:
        return name in self.gradient or self.weights.is_parameter(name)

    def see(self, index: int, op_type: str, inputs: list[str], outputs: list[str]) -> dict[str, float]:
        """Storage tensors node ``index`` keeps first, with their bytes; nodes must come in topological order."""
        mine: dict[str, float] = {}
        kept = saved_tensors(op_type, inputs, outputs, self.needs_gradient)
        if op_type == "Sigmoid" and inputs and outputs and self._silu_half(inputs[0], outputs[0]):
            # PyTorch's SiLU keeps only x, and recomputes the sigmoid in its backward; an export writes it as
            # x · sigmoid(x), whose rules alone would keep the sigmoid's output too (FFN-wide, per SwiGLU layer)
            self.silu_sigmoid[outputs[0]] = inputs[0]
            kept = ()
        elif op_type == "Mul" and any(self.silu_sigmoid.get(s) == x for x, s in (inputs, inputs[::-1])):
            kept = tuple(x for x in inputs if x not in self.silu_sigmoid)
        for name in kept:
            base = self.storage.get(name, name)
            if base not in self.const_tensors and base not in self.keeper:
                self.keeper[base] = index
                mine[base] = float(self.bytes_of[base])
        if op_type not in NO_GRADIENT and any(self.needs_gradient(x) for x in inputs if x):
            self.gradient.update(outputs[:1] if op_type == "TopK" else outputs)
        if inputs and (op_type in VIEW_OPS or op_type == "Dropout" and len(outputs) == 1):
            self.storage.update((o, self.storage.get(inputs[0], inputs[0])) for o in outputs)
        self.producer.update((o, index) for o in outputs)
        self.by_node.append(mine)
        return mine

    def _silu_half(self, x: str, sigmoid: str) -> bool:
        """Whether ``sigmoid`` = Sigmoid(``x``) is read by a ``Mul(x, sigmoid)``: SiLU written out."""
        return any(n.op_type == "Mul" and sorted(n.input) == sorted((x, sigmoid))
                   for n in self.readers.get(sigmoid, ()))

    def kept_from(self, index: int, writers: set[int]) -> float:
        """Bytes node ``index`` keeps first of tensors written by the nodes ``writers``."""
        return sum(b for t, b in self.by_node[index].items() if self.producer.get(t) in writers)


class _UnfusedAttention:
    """Marks attention cores an exporter wrote as operators: ``MatMul(Q, Kᵀ)`` → ... → ``Softmax`` → ... → ``MatMul(·, V)``.

    A MatMul of two activations (no weight, not constant) starts a chain;
    operators other than matmuls reading a chain's tensor extend it (scaling,
    mask, softmax, dropout, casts); a second such MatMul reading it after a
    Softmax closes it. The closed chain's operators become attention
    (``attention_flops``, ``attention_io_bytes``), the tensors before the
    closing MatMul its scores (``attention_scores_bytes``: what the chain
    keeps of them, Korthikanti et al.'s ``5·a·s²·b`` with dropout, the
    softmax's output without), and the two MatMuls' second inputs its keys and
    values (``attention_kv_bytes``). A router's Softmax reads a weight
    matmul's output, so it never starts a chain.
    """

    def __init__(self, nodes: list[tuple[str, dict]], kept: _KeptActivations):
        self.nodes, self.kept = nodes, kept
        self.chains: dict[str, tuple[tuple[int, ...], bool, float]] = {}  # tensor -> (node indices, softmax seen, K bytes)

    def see(self, index: int, inputs: list[str], outputs: list[str], is_const: bool, bytes_of) -> None:
        op = self.nodes[index][1]["op"]
        found = next((self.chains[x] for x in inputs if x in self.chains), None)
        activations_matmul = op.op_type in ("MatMul", "Einsum") and op.param_count == 0 and not is_const
        if activations_matmul and found is not None:
            if found[1]:  # attention over V closes the chain
                self._mark(found[0], index, found[2] + (bytes_of[inputs[1]] if len(inputs) > 1 else 0.0))
            return
        if activations_matmul:
            found = ((), False, bytes_of[inputs[1]] if len(inputs) > 1 else 0.0)
        elif found is None or op.op_type in MATMUL_OPS:
            return
        chain = (found[0] + (index,), found[1] or op.op_type == "Softmax", found[2])
        self.chains.update((o, chain) for o in outputs)

    def _mark(self, scores: tuple[int, ...], closing: int, kv_bytes: float) -> None:
        for i in (*scores, closing):
            data = self.nodes[i][1]
            op = data["op"]
            data["op"] = dataclasses.replace(
                op, attention_flops=op.flops, attention_io_bytes=op.io_bytes,
                attention_scores_bytes=self.kept.kept_from(i, set(scores)),
                attention_kv_bytes=kv_bytes if i == closing else 0.0)


def _split_over_tensor_ranks(op_type: str, inputs: list[str], param_count: float, row_parallel: bool,
                             split_tensors: set[str]) -> bool:
    """Whether Megatron's tensor parallelism leaves each rank a part of this op's output (else every rank holds it whole).

    A column-parallel layer (a weight matmul that is not row-parallel) splits
    its output over the ranks, and so does every op reading a split tensor,
    up to the row-parallel layer whose all-reduce makes the output whole
    again (Shoeybi et al. 2019). What is left whole (norms, residual adds,
    row-parallel outputs, the embedding) is what sequence parallelism splits
    along the sequence (Korthikanti et al. 2022, section 4.2.2).

    >>> _split_over_tensor_ranks("MatMul", ["x", "w"], 16, False, set())   # column-parallel
    True
    >>> _split_over_tensor_ranks("MatMul", ["h", "w2"], 16, True, {"h"})   # row-parallel: all-reduced
    False
    >>> _split_over_tensor_ranks("Add", ["x", "y"], 0, False, set())       # residual stream
    False
    """
    if row_parallel:
        return False
    if param_count > 0 and op_type in MATMUL_OPS:
        return True
    return any(x in split_tensors for x in inputs if x)


def _feeds_residual(tensor: str, readers: dict[str, list], const_tensors: set[str], depth: int = 3) -> bool:
    """Whether ``tensor`` reaches an Add of two activations, through bias Adds and shape-only ops.

    A bias Add (one constant input) and pass-through ops are followed up to
    ``depth`` steps; an Add whose other input is computed is the residual.
    """
    if depth == 0:
        return False
    for n in readers.get(tensor, ()):
        if n.op_type == "Add":
            other = [x for x in n.input if x != tensor]
            if other and all(x not in const_tensors for x in other):
                return True
            if _feeds_residual(n.output[0], readers, const_tensors, depth - 1):
                return True
        elif n.op_type in _PASS_THROUGH and n.output and _feeds_residual(n.output[0], readers, const_tensors,
                                                                          depth - 1):
            return True
    return False


def _node_keys(nodes) -> list[str]:
    """A unique OpGraph key per ONNX node: its name, else ``OpType_index``; repeats get ``#index``."""
    keys: list[str] = []
    used: set[str] = set()
    for i, n in enumerate(nodes):
        key = n.name or f"{n.op_type}_{i}"
        if key in used:
            key = f"{key}#{i}"
        used.add(key)
        keys.append(key)
    return keys


def _matmul_padded_flops(n, shapes, flops: float) -> float:
    """A matmul's FLOPs with its dimensions padded to the GEMM tile (``opsched.model.gemm``); ``flops`` if its shape is unknown.

    >>> import onnx
    >>> n = onnx.helper.make_node("MatMul", ["x", "w"], ["y"])
    >>> shapes = {"x": ((8, 4096), 0), "w": ((4096, 4096), 0), "y": ((8, 4096), 0)}
    >>> _matmul_padded_flops(n, shapes, 2.0 * 8 * 4096 * 4096) == 2.0 * 128 * 4096 * 4096   # 8 rows fill a 128-row tile
    True
    """
    in_shapes = _input_shapes(n, shapes)
    out_shape = shapes.get(n.output[0], (None, 0))[0] if n.output else None
    shape = matmul_shape(n.op_type, in_shapes, out_shape, trans_a=bool(_attr(n, "transA", 0)))
    if shape is None or shape.flops <= 0:
        return float(flops)
    # a Gemm's bias adds FLOPs outside the GEMM: scale the counted FLOPs by the padding
    return float(flops) * padded_flops(shape) / shape.flops


def _attention_shape_fields(n, shapes, batch_scale: float = 1.0) -> dict[str, float | int]:
    """An ``Attention`` op's ``attention_scores`` and ``attention_gemm_padded_flops``, ``batch_scale`` times its
    shapes' (a rescaled static batch), and the ``attention_heads`` a tensor-parallel degree must divide; none if its
    shapes are unknown."""
    dims = _attention_dims(n, _input_shapes(n, shapes))
    if dims is None:
        return {}
    return {"attention_scores": float(dims.scores) * batch_scale,
            "attention_gemm_padded_flops": dims.gemm_padded_flops() * batch_scale,
            "attention_heads": math.gcd(dims.heads, dims.kv_heads)}


def _input_shapes(n, shapes) -> list:
    """The static shapes of a node's inputs (None for an absent or unknown one), as the cost rules take them."""
    return [shapes.get(x, (None, 0))[0] if x else None for x in n.input]


def _costed_flops(n, key: str, shapes, unknown: dict[str, int], uncosted: list[str]) -> float:
    """The node's FLOPs, or 0 when they cannot be costed: its op type counted in ``unknown``, or its key listed in
    ``uncosted`` (a costed op type whose shapes are unknown), for the import's warnings."""
    flops = _node_flops(n, shapes)
    if flops is None:
        if n.op_type in _COSTED_OPS:
            uncosted.append(key)
        else:
            unknown[n.op_type] = unknown.get(n.op_type, 0) + 1
        return 0.0
    return flops


def _node_flops(n, shapes) -> float | None:
    in_shapes = _input_shapes(n, shapes)
    out_shapes = [shapes.get(x, (None, 0))[0] if x else None for x in n.output]
    return op_flops(n.op_type, n, in_shapes, out_shapes)


class _ParamCounter:
    """Parameters each node reads, following weights through alias ops (rule 6 of the module docstring).

    The state lives across nodes: which tensors derive from a weight, and which
    big weights were counted already, so a weight read twice (maybe transposed)
    counts once.
    """

    def __init__(self, g_onnx, weight_inputs, shapes):
        self.shapes = shapes
        # Weight-derived tensor name -> the weight it comes from.
        self.weightlike = {t.name: t.name for t in g_onnx.initializer if t.data_type in _FLOAT_TYPES}
        self.weightlike.update((w, w) for w in weight_inputs)
        self.counted: set[str] = set()
        self.parameters: dict[str, bool] = {}  # weight -> is_parameter's answer

    def is_parameter(self, name: str) -> bool:
        """Whether tensor ``name`` is a weight (or a view of one) of at least two elements: a trained parameter."""
        weight = self.weightlike.get(name)
        if weight is None:
            return False
        known = self.parameters.get(weight)
        if known is None:
            shape, _ = self.shapes.get(weight, (None, 0))
            known = self.parameters[weight] = _static(shape) and _numel(shape) >= 2
        return known

    def read_by(self, n) -> tuple[int, float]:
        """(parameter count, parameter bytes) node ``n`` reads; nodes must come in topological order."""
        if n.op_type in ALIAS_OPS:
            # a view of a weight is that weight: its reader counts it, not the alias
            if n.input and n.input[0] in self.weightlike:
                for o in n.output:
                    if o:
                        self.weightlike[o] = self.weightlike[n.input[0]]
            return 0, 0.0
        count, nbytes = 0, 0.0
        for k, x in enumerate(n.input):
            if not (x and x in self.weightlike and _weight_position(n, k, self.shapes, strong=False)):
                continue
            shape, elem = self.shapes.get(x, (None, 0))
            if not _static(shape) or _numel(shape) < 2:
                continue
            if _numel(shape) > DEDUP_LIMIT:
                if self.weightlike[x] in self.counted:
                    continue  # a big weight read twice (maybe transposed) is one tied weight
                self.counted.add(self.weightlike[x])
            count += _numel(shape)
            nbytes += _numel(shape) * _DTYPE_BYTES.get(elem, 4)
        return count, nbytes


def _add_input_edges(edges, op_type, inputs, key, producer, bytes_of, tensor_bytes) -> None:
    """Edges into ``key`` from the nodes writing its ``inputs`` (``producer``: tensor -> writer's key).

    ``edges`` maps (writer, reader) to the edge's ``bytes`` and ``tensors``.
    """
    for x in inputs:
        u = producer.get(x)
        if u is None:
            continue
        b = 0.0 if op_type in SHAPE_READERS else bytes_of[x]
        tensor_bytes[x] = bytes_of[x]
        data = edges.get((u, key))
        if data is None:
            edges[(u, key)] = {"bytes": b, "tensors": [x]}
        elif x not in data["tensors"]:
            data["tensors"].append(x)
            data["bytes"] += b


def _cost_warnings(unknown: dict[str, int], uncosted: list[str]) -> list[str]:
    out = []
    if unknown:
        listing = ", ".join(f"{t} x{c}" for t, c in sorted(unknown.items()))
        out.append(f"unknown op types costed as bytes only: {listing}")
    if uncosted:
        out.append(f"{len(uncosted)} ops have unknown shapes, FLOPs counted as 0: {', '.join(uncosted[:5])}"
                   + (" ..." if len(uncosted) > 5 else ""))
    return out
