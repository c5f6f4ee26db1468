"""Shrink a BlockGraph to a size the upper MIP solves quickly, keeping its branches.

Coarsening keeps every expert a block of its own (hundreds of blocks for a
32-layer MoE). The upper MIP needs tens. Two merges, both of which keep the
graph a DAG and conserve every cost exactly:

1. **experts**: sibling expert blocks (same predecessors, same successors,
   each holding an expert) are merged into ``expert_parts`` blocks per layer.
   A merged block holds several experts, so it may take the expert-parallel
   mode on its group; with ``expert_parts = 2`` the two halves may also take
   different groups and run side by side.
2. **single-producer edges**: a block whose only producer is u is folded
   into u (the graph stays a DAG), lightest pair first, until ``target``
   blocks remain. A join is never folded into its producers, so parallel
   branches (the towers of a two-tower model) stay apart: they only get shorter.

>>> import networkx as nx
>>> from opsched.model.graph import Block
>>> g = nx.DiGraph(kind="BlockGraph")
>>> g.add_node(0, block=Block(0, "attn", ("l0",), ("l0/attn",), flops=4.0))
>>> for i in (1, 2, 3):
...     g.add_node(i, block=Block(i, f"e{i}", ("l0", f"experts.{i}"), (f"l0/experts.{i}/w",), flops=1.0))
...     g.add_edge(0, i, bytes=2.0)
...     g.add_edge(i, 4, bytes=2.0)
>>> g.add_node(4, block=Block(4, "combine", ("l0",), ("l0/add",), flops=1.0))
>>> small, members = reduce_block_graph(g, target=1)
>>> small.number_of_nodes(), members[0], small.nodes[0]["block"].flops
(1, [0, 1, 2, 3, 4], 8.0)
"""

from __future__ import annotations

import heapq
from collections import defaultdict

import networkx as nx

from opsched.cost.blocks import expert_count
from opsched.model.graph import COST_FIELDS, Block, common_heads, common_scope
from opsched.upper.stages import LAYER_COMPONENT, layer_path


def reduce_block_graph(
    bg: nx.DiGraph, target: int, expert_parts: int = 1, whole_layers: bool = False
) -> tuple[nx.DiGraph, dict[int, list[int]]]:
    """A smaller BlockGraph and, for each of its blocks, the original block ids it holds.

    Node ids of the result are 0..n-1 in topological order; each node also
    carries ``expert_params``, the parameters of its members that are experts,
    and what its experts' all-to-alls move (:func:`expert_traffic`). With
    ``whole_layers``, first every numbered layer's blocks become one block
    (:func:`_merge_layers`), so no stage of a plan made from the result
    splits a layer: what a runtime that builds its stages from whole layers
    needs (``opsched run --hf-config``, Megatron-LM, torchtitan).
    """
    members = {b: [b] for b in bg.nodes}
    g = nx.DiGraph()
    g.add_nodes_from(bg.nodes)
    for u, v, d in bg.edges(data=True):
        g.add_edge(u, v, bytes=float(d.get("bytes", 0.0)))
    records = {b: bg.nodes[b]["block"] for b in bg.nodes}
    if whole_layers:
        _merge_layers(g, members, records)
    _merge_expert_siblings(g, members, records, expert_parts)
    _contract_chains(g, members, records, target)
    small, held = _renumbered(g, members, records)
    for b, ids in held.items():
        small.nodes[b]["expert_tokens"], small.nodes[b]["moe_layers"] = expert_traffic(bg, ids)
    return small, held


def expert_traffic(bg: nx.DiGraph, ids: list[int]) -> tuple[float, int]:
    """(bytes routed into the experts among blocks ``ids`` of ``bg``, MoE layers they belong to).

    The bytes are what each expert receives from outside the experts (its
    routed tokens, the top-k copies included), summed: what the dispatch
    all-to-all moves for them, and the combine back. A reduced block holding
    whole layers would otherwise show only its input (one layer's hidden
    states, no top-k). Each MoE layer dispatches and combines once, whatever
    blocks its experts were exported as.

    >>> g = nx.DiGraph(kind="BlockGraph")
    >>> g.add_node(0, block=Block(0, "model/layers.0/router", (), ()))
    >>> for e in (1, 2):
    ...     g.add_node(e, block=Block(e, f"model/layers.0/mlp/experts.{e}", (), ()))
    ...     g.add_edge(0, e, bytes=3.0)
    >>> expert_traffic(g, [0, 1, 2])
    (6.0, 1)
    """
    experts = [m for m in ids if expert_count(bg.nodes[m]["block"]) > 0]
    routed = sum(d.get("bytes", 0.0) for m in experts for u, _, d in bg.in_edges(m, data=True)
                 if expert_count(bg.nodes[u]["block"]) == 0)
    return float(routed), len({layer_path(bg.nodes[m]["block"].name) for m in experts})


def _merge(g: nx.DiGraph, members, keep: int, gone: int) -> None:
    """Fold block ``gone`` into ``keep``: its members, and its edges with bytes summed."""
    members[keep].extend(members.pop(gone))
    for u, _, d in list(g.in_edges(gone, data=True)):
        if u != keep:
            _add_bytes(g, u, keep, d["bytes"])
    for _, v, d in list(g.out_edges(gone, data=True)):
        if v != keep:
            _add_bytes(g, keep, v, d["bytes"])
    g.remove_node(gone)


def _add_bytes(g: nx.DiGraph, u: int, v: int, nbytes: float) -> None:
    if g.has_edge(u, v):
        g[u][v]["bytes"] += nbytes
    else:
        g.add_edge(u, v, bytes=nbytes)


def _merge_layers(g: nx.DiGraph, members, records) -> None:
    """Fold each numbered layer's blocks (:func:`opsched.upper.stages.layer_path`), with every block that lies on
    a path between two of them, into one block: the layer's convex hull, so the graph stays a DAG.

    An exporter may leave a layer's ops without a scope (``(root)`` between two of its blocks, DeepSeek-V3's MLA);
    they run inside the layer, and go with it. Layers whose hulls overlap end up in one block.

    >>> g = nx.DiGraph()
    >>> names = ["embed", "layers.0/attn", "(root)", "layers.0/mlp", "layers.1/attn", "layers.1/mlp", "head"]
    >>> g.add_edges_from((i, i + 1, {"bytes": 1.0}) for i in range(6))
    >>> members = {i: [i] for i in range(7)}
    >>> _merge_layers(g, members, {i: Block(i, n, (), ()) for i, n in enumerate(names)})
    >>> sorted(members.values())
    [[0], [1, 2, 3], [4, 5], [6]]
    """
    layers: dict[str, list[int]] = defaultdict(list)
    for b in sorted(g.nodes):
        path = layer_path(records[b].name)
        if LAYER_COMPONENT.match(".".join(path.split(".")[-2:])):
            layers[path].append(b)
    home = {b: b for b in g.nodes}  # the block each original block was folded into
    for blocks in layers.values():
        now = sorted({home[b] for b in blocks})
        hull = sorted(set(now) | (_reached(g.successors, now) & _reached(g.predecessors, now)))
        for other in hull[1:]:
            for m in members[other]:
                home[m] = hull[0]
            _merge(g, members, hull[0], other)


def _reached(step, start: list[int]) -> set[int]:
    """The blocks outside ``start`` that one or more ``step``s (successors or predecessors) lead to from it."""
    inside, seen, todo = set(start), set(), list(start)
    while todo:
        for n in step(todo.pop()):
            if n not in seen and n not in inside:
                seen.add(n)
                todo.append(n)
    return seen


def _merge_expert_siblings(g: nx.DiGraph, members, records, parts: int) -> None:
    families: dict[tuple, list[int]] = defaultdict(list)
    for b in sorted(g.nodes):
        if expert_count(records[b]) > 0:
            families[(frozenset(g.predecessors(b)), frozenset(g.successors(b)))].append(b)
    for siblings in families.values():
        if len(siblings) <= max(1, parts):
            continue
        size = -(-len(siblings) // parts)  # ceil: consecutive experts share a part
        for i in range(0, len(siblings), size):
            chunk = siblings[i : i + size]
            for other in chunk[1:]:
                _merge(g, members, chunk[0], other)


def _weight(members, records, b: int) -> float:
    return sum(records[m].flops for m in members[b])


def _contract_chains(g: nx.DiGraph, members, records, target: int) -> None:
    """Fold blocks with a single producer into it, lightest pair first, down to ``target`` blocks.

    When v's only predecessor is u, no other path leads from u to v, so the
    graph stays a DAG. A join (a block with several producers) is never
    folded into any of them, so parallel branches stay apart.
    """
    weight = {b: _weight(members, records, b) for b in g.nodes}
    heap = [(weight[u] + weight[v], u, v) for u, v in g.edges]
    heapq.heapify(heap)
    while g.number_of_nodes() > target and heap:
        w, u, v = heapq.heappop(heap)
        if not g.has_edge(u, v) or w != weight[u] + weight[v] or g.in_degree(v) != 1:
            continue
        _merge(g, members, u, v)
        weight[u] += weight.pop(v)
        for a, b in list(g.in_edges(u)) + list(g.out_edges(u)):
            heapq.heappush(heap, (weight[a] + weight[b], a, b))


def _renumbered(g: nx.DiGraph, members, records) -> tuple[nx.DiGraph, dict[int, list[int]]]:
    order = list(nx.lexicographical_topological_sort(g, key=lambda b: min(members[b])))
    new_id = {b: i for i, b in enumerate(order)}
    out = nx.DiGraph(kind="BlockGraph")
    held = {}
    for b in order:
        ids = sorted(members[b])
        recs = [records[m] for m in ids]
        sums = {f: sum(getattr(r, f) for r in recs) for f in COST_FIELDS}
        sums["param_count"] = int(sums["param_count"])
        op_types: dict[str, int] = {}
        for r in recs:
            for k, n in r.op_types.items():
                op_types[k] = op_types.get(k, 0) + n
        name = recs[0].name if len(recs) == 1 else f"{recs[0].name}..{recs[-1].name}"
        out.add_node(
            new_id[b],
            block=Block(
                new_id[b],
                name,
                common_scope([r.scope for r in recs]),
                tuple(op for r in recs for op in r.ops),
                op_types=op_types,
                attention_heads=common_heads(recs),
                **sums,
            ),
        )
        # the expert part of the block, for the expert-parallel mode's memory (cost.block_cost)
        out.nodes[new_id[b]]["expert_params"] = float(sum(r.param_count for r in recs if expert_count(r) > 0))
        held[new_id[b]] = ids
    for u, v, d in g.edges(data=True):
        out.add_edge(new_id[u], new_id[v], bytes=d["bytes"])
    return out, held
