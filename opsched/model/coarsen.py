"""Coarsening: merge an OpGraph's operators into blocks (a BlockGraph).

>>> from opsched.model.onnx_import import import_onnx                    # doctest: +SKIP
>>> bg = coarsen(import_onnx("models/mixtral_8x7b.onnx"), target_blocks=120)  # doctest: +SKIP

Three steps, each of which keeps the result a DAG and every cost exact:

1. **Labels by module scope.** Each op gets a label, a prefix of its scope:

   * ``depth=None`` (default): the scope up to and including its first
     indexed module (``layers.3``), or its first module if none is indexed;
   * ``depth=d``: the first ``d`` scope components;

   and in both cases at least down to its deepest **branch** module (by default
   down to the first indexed module inside it, if any: the layers of a tower). A branch
   is a child module that runs in parallel with a sibling: two children of
   one parent with no path between their ops in either direction, that are
   either indexed (``experts.0`` / ``experts.1`` / ``shared_experts.0``) or
   each carry at least 5 % of the model's FLOPs and sit outside any indexed
   module (the towers of a two-tower model, not the projections of a layer).
   So the experts of a layer and the towers of CLIP always get labels of
   their own, whatever the depth.

   Ops computed from constants and weights only (a ``Constant``, a legacy
   ``Identity`` of a weight) take the label of their consumers; one shared by
   consumers of different labels becomes a small source block of its own, so
   that it orders nothing (they cost no FLOPs).

2. **Acyclic split.** Merging by label alone can create cycles (a residual
   add in the parent scope sits both before and after a child). Each op gets
   a rank: ``rank(v) = max over preds u of rank(u) + (label(u) != label(v))``
   (constant-only ops as late as their consumers allow). A block is a
   connected set of ops with one label, one rank and one branch key: for
   each family of sibling branches the op reaches, which of them reach the
   op (ops before or after a whole family, like its router or combine step,
   are free of it). Along every edge between two blocks (rank, key) strictly
   increases, so the block graph is a DAG; and a path between blocks of two
   sibling branches would need a path between their ops, so parallel
   branches stay parallel. A layer's router, its experts and its combine
   step land in three consecutive ranks.

3. **Greedy contraction** of small blocks into a neighbour, smallest FLOPs
   first: blocks without FLOPs always, others down to ``target_blocks``. A
   contraction only merges ``u -> v`` when ``u`` has no other successor and
   ``v`` no other predecessor (a chain), which keeps the graph acyclic and
   leaves the reachability between all other ops unchanged: parallel
   branches stay parallel. When no chain edge is left the result has more
   blocks than the target (graph attribute ``target_met``).

Block costs are exact sums over their ops; a block edge carries the bytes of
the distinct tensors that cross it (a tensor read twice by one block is sent
once; tensors read only for their shape cost 0).
"""

from __future__ import annotations

import heapq
import re
from collections import defaultdict

import networkx as nx

from opsched.errors import OpschedError
from opsched.model.graph import COST_FIELDS, Block, common_heads, gc_paused
from opsched.model.recompute_modules import part_costs

#: the name of a block whose operators carry no module scope (the exporter left none): it belongs to no module
UNSCOPED = "(root)"

_INDEXED = re.compile(r"\.\d+$")
SHAPE_READERS = frozenset({"Shape", "Size"})
BIG_BRANCH_SHARE = 0.05
CONST_MARK = "<const>"
SMALL_BRANCH_SHARE = 1e-3


@gc_paused()
def coarsen(opgraph: nx.DiGraph, depth: int | None = None, target_blocks: int | None = None) -> nx.DiGraph:
    """Merge the operators of an OpGraph into a BlockGraph (see the module docstring).

    Returns a DiGraph with ``kind="BlockGraph"``, integer node ids in
    topological order, node attribute ``"block"`` (a :class:`Block`) and edge
    attributes ``"bytes"`` and ``"tensors"``.
    """
    if depth is not None and depth < 0:
        raise OpschedError(f"--depth must be 0 or more, got {depth}")
    if target_blocks is not None and target_blocks < 1:
        raise OpschedError(f"--blocks must be at least 1, got {target_blocks}")
    if opgraph.number_of_nodes() == 0:
        raise OpschedError("the operator graph is empty: nothing to coarsen")
    try:
        order = list(nx.topological_sort(opgraph))
    except nx.NetworkXUnfeasible:
        raise OpschedError("the operator graph has a cycle; an OpGraph must be a DAG") from None
    ops = _Ops(opgraph)
    branch_depth = _branch_depths(ops, order)
    labels = _labels(ops, order, depth, branch_depth)
    groups = _acyclic_groups(ops, order, labels, branch_depth)
    members, edges = _contract(ops, order, groups, labels, target_blocks)
    return _block_graph(opgraph, order, members, edges, labels, depth, target_blocks)


class _Ops:
    """Plain-dict views of an OpGraph, read many times by the passes below."""

    def __init__(self, opgraph: nx.DiGraph):
        self.rec = {v: data["op"] for v, data in opgraph.nodes(data=True)}
        self.const = {v for v, data in opgraph.nodes(data=True) if data.get("const")}
        self.pred = {v: list(opgraph.predecessors(v)) for v in opgraph}
        self.succ = {v: list(opgraph.successors(v)) for v in opgraph}
        self.edges = list(opgraph.edges())


# --------------------------------------------------------------------------- labels


def _branch_depths(ops, order) -> dict[tuple[str, ...], int]:
    """For each scope prefix that is a branch module, its length (see the module docstring).

    Candidates are checked one family of siblings at a time (:func:`_unordered`),
    so the bitsets are as wide as a family, not as the model: one over all
    60,000 scope prefixes of DeepSeek-V3 took 2.5 GB.
    """
    # Shared constants (legacy dedups them across towers) order nothing: left out.
    live = [v for v in order if v not in ops.const]
    flops: dict[tuple[str, ...], float] = defaultdict(float)
    first: dict[tuple[str, ...], int] = {}  # prefix -> position in ``live`` of its first op
    last: dict[tuple[str, ...], int] = {}
    for i, v in enumerate(live):
        scope = ops.rec[v].scope
        f = ops.rec[v].flops
        for k in range(1, len(scope) + 1):
            prefix = scope[:k]
            flops[prefix] += f
            first.setdefault(prefix, i)
            last[prefix] = i
    total = sum(ops.rec[v].flops for v in live) or 1.0
    children: dict[tuple[str, ...], list[tuple[str, ...]]] = defaultdict(list)
    for prefix in flops:
        children[prefix[:-1]].append(prefix)
    depths: dict[tuple[str, ...], int] = {}
    for parent, kids in children.items():
        indexed = [kid for kid in kids if _INDEXED.search(kid[-1])]
        big = []  # towers, not the projections of a layer
        if not any(_INDEXED.search(part) for part in parent):
            big = [kid for kid in kids if not _INDEXED.search(kid[-1]) and flops[kid] >= BIG_BRANCH_SHARE * total]
        for family in (indexed, big):
            if len(family) >= 2:
                window = live[min(first[kid] for kid in family):max(last[kid] for kid in family) + 1]
                depths.update((kid, len(kid)) for kid in _unordered(ops, window, family))
    return depths


def _unordered(ops, window, family) -> list[tuple[str, ...]]:
    """The modules of ``family`` (siblings) that have a sibling with no path between their ops either way.

    ``window`` is the stretch of the topological order from the family's first
    op to its last one: a path between two of its ops runs inside it. One
    forward pass gives, per module, the siblings with an op reaching one of its
    ops; "reached by" is the same relation read backwards.

    >>> from opsched.model.graph import OpNode
    >>> g = nx.DiGraph([("a1", "b1"), ("a1", "c1")])  # a before b and c; b, c parallel
    >>> for v, scope in [("a1", ("a",)), ("b1", ("b",)), ("c1", ("c",))]:
    ...     g.nodes[v]["op"] = OpNode(v, "Relu", scope)
    >>> _unordered(_Ops(g), ["a1", "b1", "c1"], [("a",), ("b",), ("c",)])
    [('b',), ('c',)]
    """
    depth = len(family[0])
    bit = {kid: 1 << i for i, kid in enumerate(family)}
    reach: dict[str, int] = {}  # op -> siblings with an op reaching it (its own included)
    before: dict[int, int] = defaultdict(int)  # sibling -> siblings reaching one of its ops
    for v in window:
        own = bit.get(ops.rec[v].scope[:depth], 0)
        m = own
        for u in ops.pred[v]:
            m |= reach.get(u, 0)  # ops before the window reach no sibling
        reach[v] = m
        if own:
            before[own] |= m
    related = dict(before)  # and the siblings it reaches
    for b, m in before.items():
        m &= ~b
        while m:
            c = m & -m
            related[c] |= b
            m ^= c
    everyone = (1 << len(family)) - 1
    return [kid for kid, b in bit.items() if everyone & ~related[b] & ~b]


def _labels(ops, order, depth, branch_depth) -> dict[str, tuple[str, ...]]:
    labels: dict[str, tuple[str, ...]] = {}
    for v in order:
        scope = ops.rec[v].scope
        if depth is None:
            cut = next((k + 1 for k, part in enumerate(scope) if _INDEXED.search(part)), min(1, len(scope)))
        else:
            cut = depth
        for k in range(len(scope), 0, -1):
            if scope[:k] in branch_depth:
                if depth is None and cut <= k:
                    # a tower of a ModuleList (``branches.2/layers.5``) splits into its layers, as a tower of
                    # its own name does (``vision_model/encoder/layers.5``): one block per tower would let no
                    # stage hold less than a whole tower (GraphPipe's MMT: 5 blocks for 32 devices)
                    cut = next((j + 1 for j in range(k, len(scope)) if _INDEXED.search(scope[j])), k)
                cut = max(cut, k)
                break
        labels[v] = scope[:cut]
    # Constant-only ops follow their consumers' label. One shared by consumers of several
    # labels (legacy exports reuse one Constant across layers and towers) gets a label of its
    # own: merging it with any consumer would order that consumer before the others.
    index = {v: i for i, v in enumerate(order)}
    for v in reversed(order):
        if v in ops.const and ops.succ[v]:
            consumers = sorted(ops.succ[v], key=index.__getitem__)
            consumer_labels = {labels[s] for s in consumers}
            if len(consumer_labels) == 1:
                labels[v] = consumer_labels.pop()
            elif _reaches_all(ops, consumers[0], consumers[1:], index):
                # all consumers come after the first one anyway: joining it orders nothing new
                labels[v] = labels[consumers[0]]
            else:
                labels[v] = ops.rec[v].scope + (f"{CONST_MARK}{v}",)
    return labels


def _reaches_all(ops, source, targets, index) -> bool:
    """Whether every target is reachable from ``source`` (search bounded by topological index)."""
    todo = set(targets)
    limit = max(index[t] for t in targets)
    stack, seen = [source], {source}
    while stack and todo:
        u = stack.pop()
        for w in ops.succ[u]:
            if w not in seen and index[w] <= limit:
                seen.add(w)
                todo.discard(w)
                stack.append(w)
    return not todo


def _visible(label: tuple[str, ...]) -> tuple[str, ...]:
    """A label without the private marker of a shared constant."""
    return label[:-1] if label and label[-1].startswith(CONST_MARK) else label


# --------------------------------------------------------------------------- acyclic split


def _branch_keys(ops, order, branch_depth) -> dict[str, tuple]:
    """Per op, a key that blocks must share so that sibling branches stay apart.

    For each family of sibling branches (the experts of one layer): nothing if
    none of its branches reaches the op; else, if the op reaches an op of the
    family, the set of its branches that reach the op; else "after the
    family". Encoded as (sorted (family, bitset of the reaching branches) of
    the families ahead, bitset of the families behind). Constant ops get the
    intersection of their consumers' sets. Along an edge every family's part
    only grows (nothing < sets by inclusion < "after"), which keeps the
    grouping acyclic.

    The branches reaching each op are a branch set (:func:`_join`): a family
    all of whose branches reach the op is one bit, so late ops, which every
    earlier expert reaches, cost a few bytes rather than a bit per expert of
    the model (DeepSeek-V3 has 14,848).
    """
    families = sorted({p[:-1] for p in branch_depth})
    fam_index = {f: i for i, f in enumerate(families)}
    place: dict[tuple[str, ...], tuple[int, int]] = {}  # branch -> (its family, its bit in the family)
    everyone = [0] * len(families)  # per family, the bits of all its branches
    for p in sorted(branch_depth):
        f = fam_index[p[:-1]]
        bit = everyone[f] + 1 & ~everyone[f]  # the lowest bit not yet taken
        place[p] = (f, bit)
        everyone[f] |= bit
    own: dict[str, tuple[int, dict[int, int]]] = {}  # op -> the branches it is part of (ops in none left out)
    deepest = max(map(len, branch_depth), default=0)
    for v in order:
        scope = ops.rec[v].scope
        parts: dict[int, int] = {}
        for k in range(1, min(len(scope), deepest) + 1):
            found = place.get(scope[:k])
            if found:
                parts[found[0]] = parts.get(found[0], 0) | found[1]
        if parts:
            own[v] = (0, parts)
    after: dict[str, tuple[int, dict[int, int]]] = {}  # op -> branches with an op reaching it, its own included
    for v in order:
        if v in ops.const:
            continue
        m = own.get(v, _NO_BRANCH)
        for u in ops.pred[v]:
            if u in after:  # constants come in below
                m = _join(m, after[u], everyone)
        after[v] = m
    ahead: dict[str, int] = {}  # op -> families with a branch it reaches
    for v in reversed(order):
        const = v in ops.const
        r = 0 if const else _families(own.get(v, _NO_BRANCH))
        for w in ops.succ[v]:
            r |= ahead[w]
        ahead[v] = r
        if const:
            m = None
            for w in ops.succ[v]:
                m = after[w] if m is None else _meet(m, after[w], everyone)
            after[v] = m or _NO_BRANCH
    keys: dict[str, tuple] = {}
    for v in order:
        r = ahead[v]
        full, parts = after[v]
        # families ahead: which of their branches reach it; families behind it: just "after"
        reaching = [(f, everyone[f]) for f in _bit_indices(full & r)]
        reaching += [(f, bits) for f, bits in parts.items() if r >> f & 1]
        keys[v] = (tuple(sorted(reaching)), _families(after[v]) & ~r)
    return keys


#: a branch set (full, parts): ``full`` a bitset of families all of whose branches are in
#: it, ``parts`` {family: bitset of some (not all, not none) of its branches}; see _join
_NO_BRANCH: tuple[int, dict[int, int]] = (0, {})


def _join(a, b, everyone):
    """The union of branch sets ``a`` and ``b`` (``everyone``: per family, all its branches).

    One of them when it holds the other, so that the ops of a chain share one
    set. A family that becomes whole moves into ``full``.

    >>> everyone = [0b11, 0b111]  # family 0 has 2 branches, family 1 has 3
    >>> _join((0, {0: 0b01, 1: 0b001}), (0, {0: 0b10}), everyone)
    (1, {1: 1})
    >>> b = (1, {1: 0b011})
    >>> _join((0, {0: 0b01, 1: 0b010}), b, everyone) is b
    True
    """
    if _holds(b, a):
        return b
    if _holds(a, b):
        return a
    full = a[0] | b[0]
    parts = {}
    for f in a[1].keys() | b[1].keys():
        if not full >> f & 1:
            bits = a[1].get(f, 0) | b[1].get(f, 0)
            if bits == everyone[f]:
                full |= 1 << f
            else:
                parts[f] = bits
    return full, parts


def _holds(a, b) -> bool:
    """Whether branch set ``a`` holds every branch of ``b``."""
    if b[0] & ~a[0]:
        return False
    return all(a[0] >> f & 1 or not bits & ~a[1].get(f, 0) for f, bits in b[1].items())


def _meet(a, b, everyone):
    """The intersection of branch sets ``a`` and ``b``.

    >>> _meet((1, {1: 0b011}), (0, {0: 0b10, 1: 0b110}), [0b11, 0b111])
    (0, {0: 2, 1: 2})
    """
    parts = {}
    for f in sorted(a[1].keys() | b[1].keys()):
        bits = (everyone[f] if a[0] >> f & 1 else a[1].get(f, 0)) & (everyone[f] if b[0] >> f & 1 else b[1].get(f, 0))
        if bits:
            parts[f] = bits
    return a[0] & b[0], parts


def _families(branches) -> int:
    """Bitset of the families with at least one branch in a branch set."""
    full, parts = branches
    for f in parts:
        full |= 1 << f
    return full


def _bit_indices(bits: int) -> list[int]:
    """Positions of the set bits, lowest first.

    >>> _bit_indices(0b10110)
    [1, 2, 4]
    """
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out


def _acyclic_groups(ops, order, labels, branch_depth) -> dict[str, int]:
    """Group id per op: connected pieces of equal (label, rank, branches before); a DAG."""
    rank: dict[str, int] = {}
    for v in order:
        r = 0
        for u in ops.pred[v]:
            r = max(r, rank[u] + (labels[u] != labels[v]))
        rank[v] = r
    # Ops computed from constants go as late as their consumers allow (their
    # predecessors are constant too, and are moved after them in this reverse pass).
    for v in reversed(order):
        if ops.succ[v] and v in ops.const:
            rank[v] = min(rank[s] - (labels[s] != labels[v]) for s in ops.succ[v])
    # Union-find over edges inside one (label, rank).
    parent = {v: v for v in order}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    key = _branch_keys(ops, order, branch_depth)
    for u, v in ops.edges:
        if labels[u] == labels[v] and rank[u] == rank[v] and key[u] == key[v]:
            ru, rv = find(u), find(v)
            if ru != rv:
                parent[ru] = rv
    group_id: dict[str, int] = {}
    groups: dict[str, int] = {}
    for v in order:
        root = find(v)
        if root not in group_id:
            group_id[root] = len(group_id)
        groups[v] = group_id[root]
    return groups


# --------------------------------------------------------------------------- contraction


def _contract(ops, order, groups, labels, target_blocks):
    """Greedy chain contraction; returns (members per group, set of group edges)."""
    members: dict[int, list[str]] = defaultdict(list)
    for v in order:
        members[groups[v]].append(v)
    succ: dict[int, set[int]] = defaultdict(set)
    pred: dict[int, set[int]] = defaultdict(set)
    for u, v in ops.edges:
        a, b = groups[u], groups[v]
        if a != b:
            succ[a].add(b)
            pred[b].add(a)
    flops = {g: sum(ops.rec[v].flops for v in vs) for g, vs in members.items()}
    io = {g: sum(ops.rec[v].io_bytes for v in vs) for g, vs in members.items()}
    alive = set(members)
    heap = [(flops[g], io[g], g) for g in members]
    heapq.heapify(heap)
    next_id = max(members) + 1 if members else 0
    while heap:
        f, b, g = heapq.heappop(heap)
        if g not in alive or f != flops[g]:
            continue
        if f > 0 and (target_blocks is None or len(alive) <= target_blocks):
            break  # blocks without FLOPs are always folded; others down to the target
        options = []
        if len(pred[g]) == 1:
            p = next(iter(pred[g]))
            if len(succ[p]) == 1:
                options.append((flops[p], io[p], p, p, g))
        if len(succ[g]) == 1:
            s = next(iter(succ[g]))
            if len(pred[s]) == 1:
                options.append((flops[s], io[s], s, g, s))
        if not options:
            continue  # a fork/join block: merging it would join parallel branches
        _, _, _, u, v = min(options)
        new = next_id
        next_id += 1
        members[new] = members.pop(u) + members.pop(v)
        succ[new] = succ.pop(v, set())
        pred[new] = pred.pop(u, set())
        succ.pop(u, None)
        pred.pop(v, None)
        for s in succ[new]:
            pred[s].discard(v)
            pred[s].add(new)
        for p in pred[new]:
            succ[p].discard(u)
            succ[p].add(new)
        flops[new] = flops.pop(u) + flops.pop(v)
        io[new] = io.pop(u) + io.pop(v)
        alive -= {u, v}
        alive.add(new)
        heapq.heappush(heap, (flops[new], io[new], new))
    edges = {(a, b) for a in alive for b in succ[a]}
    return {g: members[g] for g in alive}, edges


# --------------------------------------------------------------------------- result


def _common_prefix(scopes) -> tuple[str, ...]:
    scopes = list(scopes)
    first = scopes[0]
    k = len(first)
    for s in scopes[1:]:
        k = min(k, len(s))
        for i in range(k):
            if s[i] != first[i]:
                k = i
                break
    return first[:k]


def _dominant_label(recs, labels) -> tuple[str, ...]:
    """The label holding most FLOPs in a block (ties: the first), used to name it."""
    weight: dict[tuple[str, ...], float] = {}
    for rec, label in zip(recs, labels):
        weight[label] = weight.get(label, 0.0) + rec.flops
    return max(weight, key=lambda k: (weight[k], -labels.index(k)))


def _block_graph(opgraph, order, members, edges, labels, depth, target_blocks) -> nx.DiGraph:
    index = {v: i for i, v in enumerate(order)}
    gdag = nx.DiGraph()
    gdag.add_nodes_from(members)
    gdag.add_edges_from(edges)
    # Deterministic topological order of blocks: by the position of their first op.
    first = {g: min(index[v] for v in vs) for g, vs in members.items()}
    topo = list(nx.lexicographical_topological_sort(gdag, key=first.__getitem__))
    new_id = {g: i for i, g in enumerate(topo)}
    bg = nx.DiGraph(name=opgraph.graph.get("name", "model"), kind="BlockGraph", depth=depth,
                    target_blocks=target_blocks,
                    target_met=target_blocks is None or len(members) <= target_blocks,
                    dims=dict(opgraph.graph.get("dims", {})), source=opgraph.graph.get("source"))
    block_of: dict[str, int] = {}
    name_count: dict[str, int] = defaultdict(int)
    for g in topo:
        ops_sorted = sorted(members[g], key=index.__getitem__)
        for v in ops_sorted:
            block_of[v] = new_id[g]
        recs = [opgraph.nodes[v]["op"] for v in ops_sorted]
        scope = _common_prefix(_visible(labels[v]) for v in ops_sorted)
        base = "/".join(_dominant_label(recs, [_visible(labels[v]) for v in ops_sorted])) or UNSCOPED
        name_count[base] += 1
        name = base if name_count[base] == 1 else f"{base}#{name_count[base] - 1}"
        types: dict[str, int] = {}
        for r in recs:
            types[r.op_type] = types.get(r.op_type, 0) + 1
        sums = {f: sum(getattr(r, f) for r in recs) for f in COST_FIELDS}
        sums["param_count"] = int(sums["param_count"])
        bg.add_node(new_id[g], block=Block(new_id[g], name, scope, tuple(ops_sorted), op_types=types,
                                           parts=part_costs(recs), attention_heads=common_heads(recs), **sums))
    tensor_bytes = opgraph.graph.get("tensor_bytes", {})
    crossing: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    for u, v, data in opgraph.edges(data=True):
        a, b = block_of[u], block_of[v]
        if a == b:
            continue
        shape_only = opgraph.nodes[v]["op"].op_type in SHAPE_READERS
        seen = crossing[(a, b)]
        tensors = data.get("tensors") or [f"{u}->{v}"]
        for t in tensors:
            fallback = data.get("bytes", 0.0) if len(tensors) == 1 else 0.0  # hand-built graphs
            size = 0.0 if shape_only else float(tensor_bytes.get(t, fallback))
            seen[t] = max(seen.get(t, 0.0), size)
    for (a, b), tensors in sorted(crossing.items()):
        bg.add_edge(a, b, bytes=float(sum(tensors.values())), tensors=sorted(tensors))
    return bg


def parallel_branches(g: nx.DiGraph) -> int:
    """Width of a DAG by levels: the most nodes that share one ASAP level.

    A node's level is the length of the longest path from a source to it;
    two nodes on one level are never connected by a path, so this counts
    mutually unreachable blocks that can run at the same time (e.g. the
    experts of one MoE layer, plus its shared expert). Blocks (or ops) without
    FLOPs, such as a shared constant, or with less than 0.1 % of the largest
    block's FLOPs (an ArgMax over token ids) are not counted. It is a lower bound
    on the largest antichain, and equal to it for the series-parallel block
    graphs coarsening produces from layer stacks.

    >>> import networkx as nx
    >>> parallel_branches(nx.DiGraph([(0, 1), (0, 2), (0, 3), (1, 4), (2, 4), (3, 4)]))
    3
    """
    if g.number_of_nodes() == 0:
        return 0
    key = "block" if g.graph.get("kind") == "BlockGraph" else "op"
    recs = {v: g.nodes[v].get(key) for v in g.nodes}
    largest = max((r.flops for r in recs.values() if r is not None), default=0.0)
    level: dict = {}
    counts: dict[int, int] = defaultdict(int)
    for v in nx.topological_sort(g):
        level[v] = max((level[u] + 1 for u in g.predecessors(v)), default=0)
        rec = recs[v]
        if rec is None or (rec.flops > 0 and rec.flops >= SMALL_BRANCH_SHARE * largest):
            counts[level[v]] += 1
    return max(counts.values(), default=0)
