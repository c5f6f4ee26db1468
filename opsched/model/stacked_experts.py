"""Experts stored as stacked weight tensors, imported like separate experts.

Hugging Face's batched experts (transformers' ``batched_mm`` experts,
Mixtral, Qwen2-MoE...) keep the experts of a layer in one weight of shape
``[E, ...]`` and read it by expert index, so the exported graph has one
operator for all E experts where the per-expert style has E parallel
branches (``experts.0`` ... ``experts.{E-1}``). This module finds those
operators and splits them into E per-expert copies, so that parameters, FLOPs,
coarsening (parallel branches) and expert parallelism (``cost.expert_count``)
see E experts, as for the per-expert style.

A **stacked weight** is a float weight (or an alias of one: Identity,
Transpose, Cast) of rank 3 or more whose leading dim E is the expert count of
a router in the same model (a ``TopK`` over an axis of E that picks fewer
than E). It is read in one of two ways:

* **gather**: ``Gather`` (axis 0) or ``GatherND`` (``batch_dims`` 0) of the
  weight by expert index selects one expert's weight per routed row
  (``weight[expert_ids]``); the rows are the S = tokens x top_k token-expert
  pairs, the index tensor's size;
* **batched**: a ``MatMul`` / ``Einsum`` with the weight as its second (or
  later) operand and a first operand of leading dim E as well (a batched
  matmul over the expert axis, e.g. dense or capacity-style dispatch).

The **expert region** of a layer is the reads above and every operator on a
path from one of them to an expert matmul (the matmul that consumes a
gathered weight, or the batched matmul itself), following only operators
whose first output keeps the rows on its leading axis (S rows for the gather
style, E for the batched style) and that sit in the module scope of the reads
(or have no scope: optimiser-made nodes). The routing-weight multiply and the
sum over the top-k that follow the last matmul are the combine step, as in
the per-expert style, and stay whole.

Each operator of a region becomes E copies, keyed ``KEY/experts.e``, with the
scope ``.../experts.e`` (the ``experts`` module gets the index; a scope
without one gets ``experts.e`` appended). A copy carries 1/E of the
operator's parameters (the stacked weight's slice of one expert) and the
share of its FLOPs and bytes of one expert's rows:

* gather style: ``n = min(S, ceil(capacity_factor * S / E))`` of the S rows,
  the balanced-routing rule the importer applies to data-dependent expert
  loops (``ceil(cf * tokens * top_k / num_experts)``), so that
  ``--capacity-factor`` means the same in both styles;
* batched style: 1/E (each expert's slice of the batch is in the graph).

Edges into, inside and out of a region are split the same way, with tensor
names suffixed ``@experts.e``. A gather of a weight is folded into the
matmul that reads it, and the gathered copy of the weights (rows x one
expert's weight) counts as neither written nor read: each expert matmul reads
its weight in place, as in the per-expert style. With capacity factor 1 and E
dividing S the totals of FLOPs and parameters are unchanged by the split, and
those of bytes lose exactly the gathered copies.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field

import networkx as nx
import onnx

from opsched.model.graph import COST_FIELDS, OpNode, add_op, common_scope

# Ops through which a weight stays the same weight, leading axis included.
_SAME_AXES = frozenset({"Identity", "Transpose", "Cast"})
_MATMULS = frozenset({"MatMul", "Einsum", "FusedMatMul", "Gemm"})
_EXPERTS_MODULE = re.compile(r"^experts?$", re.IGNORECASE)


@dataclass
class Family:
    """One layer's stacked experts: the ONNX node indices of its region and how to split them."""

    experts: int
    rows: int | None  # S token-expert rows (gather style) or None (batched style)
    nodes: set[int] = field(default_factory=set)
    per_expert: float = 0.0  # share of each op's FLOPs and bytes one expert copy gets
    reads: set[int] = field(default_factory=set)  # the Gather/GatherND reads of stacked weights
    name: str = ""


def router_sizes(nodes, shapes, small_ints) -> set[int]:
    """Expert counts of the model's routers: the axis size of each TopK that keeps fewer than all.

    A TopK with K equal to the axis size is a sort, not a router.
    """
    out = set()
    for n in nodes:
        if n.op_type != "TopK":
            continue
        shape = shapes.get(n.input[0], (None, 0))[0]
        if not _static(shape) or not shape:
            continue
        size = shape[_attr(n, "axis", -1) % len(shape)]
        k = small_ints.get(n.input[1]) if len(n.input) > 1 else None
        if k and 0 < k[0] < size:
            out.add(size)
    return out


def stacked_weights(nodes, order, shapes, weights, sizes) -> dict[str, int]:
    """Tensor name -> E for stacked weights and their same-axes aliases (see the module docstring)."""
    out: dict[str, int] = {}
    for name in weights:
        shape = shapes.get(name, (None, 0))[0]
        if _static(shape) and len(shape) >= 3 and shape[0] in sizes:
            out[name] = shape[0]
    for i in order:
        n = nodes[i]
        if n.op_type in _SAME_AXES and n.input and n.input[0] in out:
            shape = shapes.get(n.output[0], (None, 0))[0]
            if _static(shape) and len(shape) >= 3 and shape[0] == out[n.input[0]]:
                out[n.output[0]] = out[n.input[0]]
    return out


def find_families(nodes, order, shapes, stacked, scopes, capacity_factor) -> list[Family]:
    """The expert regions of the model, one :class:`Family` per connected region."""
    consumers: dict[str, list[int]] = {}
    for i in order:
        for x in nodes[i].input:
            if x:
                consumers.setdefault(x, []).append(i)
    seeds = {}
    for i in order:
        read = _stacked_read(nodes[i], shapes, stacked)
        if read is not None:
            seeds[i] = read
    if not seeds:
        return []
    region = _regions(nodes, seeds, consumers, shapes, scopes)
    return _families(nodes, region, seeds, capacity_factor)


def _stacked_read(n, shapes, stacked) -> tuple[int, int | None] | None:
    """(E, rows) when node ``n`` reads a stacked weight by expert (rows None for a batched matmul)."""
    if n.op_type in ("Gather", "GatherND") and n.input and n.input[0] in stacked:
        if n.op_type == "Gather" and _attr(n, "axis", 0) != 0:
            return None
        if n.op_type == "GatherND" and _attr(n, "batch_dims", 0) != 0:
            return None
        idx = shapes.get(n.input[1], (None, 0))[0] if len(n.input) > 1 else None
        if not _static(idx):
            return stacked[n.input[0]], None
        rows = math.prod(idx[:-1] if n.op_type == "GatherND" else idx)
        return stacked[n.input[0]], rows
    if n.op_type in _MATMULS and len(n.input) > 1 and any(x in stacked for x in n.input[1:]):
        e = next(stacked[x] for x in n.input[1:] if x in stacked)
        first = shapes.get(n.input[0], (None, 0))[0]
        if _static(first) and len(first) >= 3 and first[0] == e:
            return e, None
    return None


def _regions(nodes, seeds, consumers, shapes, scopes) -> set[int]:
    """Seeds plus every op on a row-keeping path from a seed to an expert matmul, within the seeds' scopes."""
    reach: set[int] = set(seeds)
    queue = deque(seeds)
    lead = {i: (seeds[i][1] if seeds[i][1] is not None else seeds[i][0]) for i in seeds}
    home = {i: scopes[i] for i in seeds}
    while queue:
        u = queue.popleft()
        for o in nodes[u].output:
            for v in consumers.get(o, []):
                if v in reach or not _keeps_rows(nodes[v], shapes, lead[u]):
                    continue
                if scopes[v] and scopes[v][: len(home[u])] != home[u]:
                    continue
                reach.add(v)
                lead[v], home[v] = lead[u], home[u]
                queue.append(v)
    matmuls = {v for v in reach if nodes[v].op_type in _MATMULS}
    keep: set[int] = set(matmuls)
    producer = {o: i for i in reach for o in nodes[i].output if o}
    queue = deque(matmuls)
    while queue:
        v = queue.popleft()
        for x in nodes[v].input:
            u = producer.get(x)
            if u is not None and u not in keep:
                keep.add(u)
                queue.append(u)
    return keep | {i for i in seeds if nodes[i].op_type in _MATMULS}


def _keeps_rows(n, shapes, rows) -> bool:
    outs = [o for o in n.output if o]
    if not outs:
        return False
    shape = shapes.get(outs[0], (None, 0))[0]
    return _static(shape) and len(shape) >= 1 and shape[0] == rows


def _families(nodes, region, seeds, capacity_factor) -> list[Family]:
    """Connected components of the region, each with its expert count and per-expert share."""
    g = nx.Graph()
    g.add_nodes_from(region)
    producer = {o: i for i in region for o in nodes[i].output if o}
    for v in region:
        for x in nodes[v].input:
            if x in producer:
                g.add_edge(producer[x], v)
    out = []
    for comp in nx.connected_components(g):
        reads = [seeds[i] for i in comp if i in seeds]
        counts = {e for e, _ in reads}
        if len(counts) != 1 or not any(nodes[i].op_type in _MATMULS for i in comp):
            continue
        e = counts.pop()
        rows = {r for _, r in reads if r is not None}
        fam = Family(e, rows.pop() if len(rows) == 1 else None, set(comp))
        fam.reads = {i for i in comp if i in seeds and nodes[i].op_type in ("Gather", "GatherND")}
        if fam.rows:
            fam.per_expert = min(fam.rows, math.ceil(capacity_factor * fam.rows / e - 1e-9)) / fam.rows
        else:
            fam.per_expert = 1.0 / e
        out.append(fam)
    return out


def split_families(g: nx.DiGraph, families: list[Family], keys: list[str]) -> None:
    """Replace every op of each family's region in OpGraph ``g`` by E per-expert copies (in place)."""
    tensor_bytes = g.graph.setdefault("tensor_bytes", {})
    for fam in families:
        members = {keys[i] for i in fam.nodes}
        members -= _fold_reads(g, [keys[i] for i in sorted(fam.reads)], members)
        common = common_scope([g.nodes[k]["op"].scope for k in members if g.nodes[k]["op"].scope])
        fam.name = "/".join(common) or sorted(members)[0]
        copies = {k: [f"{k}/experts.{e}" for e in range(fam.experts)] for k in members}
        for k in sorted(members):
            _split_node(g, k, copies[k], fam, common)
        _split_edges(g, members, copies, fam, tensor_bytes)
        g.remove_nodes_from(members)


def _fold_reads(g, reads, members) -> set[str]:
    """Fold each weight read with one reader in the region into that reader (its matmul); the folded keys.

    In the per-expert style an expert matmul reads its weight directly; so
    does the copy of a batched matmul once the gather of its weight is part
    of it. FLOPs and parameters are summed. The gathered copy of the weights
    (one ``[in, out]`` matrix per routed row: rows x the expert's weight) is
    no activation: a grouped GEMM, as training runs MoE experts, reads each
    expert's weight in place. So the folded op writes what the matmul
    writes, and reads the stacked weight instead of the gathered copy
    (:func:`_folded_cost`); at Mixtral-8x7B's size and seq 4096 the copies
    are 2.9 TB a layer.
    """
    folded = set()
    for r in reads:
        readers = set(g.successors(r))
        if len(readers) != 1 or not readers <= members:
            continue
        w = readers.pop()
        gathered = g.edges[r, w].get("bytes", g.nodes[r]["op"].output_bytes)
        g.nodes[w]["op"] = _folded_cost(g.nodes[r]["op"], g.nodes[w]["op"], gathered)
        g.nodes[w]["const"] = g.nodes[w].get("const", False) and g.nodes[r].get("const", False)
        for u, _, data in list(g.in_edges(r, data=True)):
            if g.has_edge(u, w):
                edge = g.edges[u, w]
                new = [t for t in data.get("tensors", []) if t not in edge.get("tensors", [])]
                edge["tensors"] = list(edge.get("tensors", [])) + new
                edge["bytes"] = edge.get("bytes", 0.0) + data.get("bytes", 0.0) * bool(new)
            else:
                g.add_edge(u, w, **data)
        g.remove_node(r)
        folded.add(r)
    return folded


def _folded_cost(read: OpNode, matmul: OpNode, gathered: float) -> OpNode:
    """``matmul`` with the weight gather ``read`` folded in: every cost summed, but the ``gathered`` bytes
    (``read``'s output, ``matmul``'s weight operand) neither written nor read; the stacked weight read instead.

    >>> gather = OpNode("g", "GatherND", (), param_count=96, output_bytes=800.0, io_bytes=1192.0)
    >>> mm = OpNode("m", "MatMul", (), flops=400.0, output_bytes=40.0, io_bytes=880.0, matmul_io_bytes=880.0)
    >>> f = _folded_cost(gather, mm, 800.0)
    >>> f.param_count, f.flops, f.output_bytes, f.io_bytes, f.matmul_io_bytes
    (96, 400.0, 40.0, 472.0, 472.0)
    """
    summed = {f: getattr(read, f) + getattr(matmul, f) for f in COST_FIELDS}
    weight_read = read.io_bytes - read.output_bytes  # the stacked weight and the expert ids
    summed["output_bytes"] = matmul.output_bytes
    # the matmul kept the gathered copy for its backward (its other operand's gradient reads it); a grouped GEMM
    # keeps the stacked weight instead, a parameter
    summed["saved_bytes"] = read.saved_bytes + max(0.0, matmul.saved_bytes - gathered)
    summed["tp_replicated_bytes"] = min(summed["tp_replicated_bytes"], summed["saved_bytes"])
    summed["fp8_input_saving"] = min(summed["fp8_input_saving"], summed["saved_bytes"])
    summed["io_bytes"] = matmul.io_bytes - gathered + weight_read
    summed["matmul_io_bytes"] = max(0.0, matmul.matmul_io_bytes - gathered) + weight_read * bool(matmul.matmul_io_bytes)
    return OpNode(matmul.name, matmul.op_type, matmul.scope, **summed)


def _split_node(g, key, names, fam: Family, common: tuple[str, ...]) -> None:
    op: OpNode = g.nodes[key]["op"]
    const = g.nodes[key].get("const", False)
    base, extra = divmod(op.param_count, fam.experts)
    for e, name in enumerate(names):
        scope = _expert_scope(op.scope, common, e)
        scaled = {f: getattr(op, f) * fam.per_expert for f in COST_FIELDS if f not in ("param_count", "param_bytes")}
        add_op(g, OpNode(name, op.op_type, scope, param_count=base + (extra if e == 0 else 0),
                         param_bytes=op.param_bytes / fam.experts, **scaled))
        g.nodes[name]["const"] = const


def _expert_scope(scope: tuple[str, ...], common: tuple[str, ...], e: int) -> tuple[str, ...]:
    """``(..., "experts", rest)`` -> ``(..., "experts.e", rest)`` where ``common`` is the region's scope;
    without an experts module ``experts.e`` follows ``common``; an op without a scope gets ``common``'s.

    >>> _expert_scope(("layers.0", "mlp", "experts", "act_fn"), ("layers.0", "mlp", "experts"), 2)
    ('layers.0', 'mlp', 'experts.2', 'act_fn')
    >>> _expert_scope(("layers.0", "moe"), ("layers.0", "moe"), 1)
    ('layers.0', 'moe', 'experts.1')
    >>> _expert_scope((), ("layers.0", "mlp", "experts"), 0)
    ('layers.0', 'mlp', 'experts.0')
    """
    depth = len(common)
    head = list(scope[:depth]) if scope else list(common)
    if head and _EXPERTS_MODULE.match(head[-1]):
        head[-1] = f"{head[-1]}.{e}"
    else:
        head.append(f"experts.{e}")
    return tuple(head) + tuple(scope[depth:])


def _split_edges(g, members, copies, fam: Family, tensor_bytes) -> None:
    share = fam.per_expert
    for u, v, data in list(g.edges(data=True)):
        if u not in members and v not in members:
            continue
        tensors = list(data.get("tensors", []))
        for e in range(fam.experts):
            a = copies[u][e] if u in members else u
            b = copies[v][e] if v in members else v
            names = [f"{t}@experts.{e}" for t in tensors]
            for t, t_e in zip(tensors, names):
                tensor_bytes[t_e] = tensor_bytes.get(t, 0.0) * share
            g.add_edge(a, b, bytes=data.get("bytes", 0.0) * share, tensors=names)


def _static(shape) -> bool:
    return shape is not None and None not in shape


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default
