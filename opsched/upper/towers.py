"""Towers side by side: a start for the upper MIP that gives each parallel branch its own device groups.

:func:`opsched.upper.mip.contiguous_start` cuts one topological order of the blocks into slots. When a model's
branches interleave in that order (GraphPipe's MMT: the import numbers layer 0 of every tower, then layer 1, ...),
every cut is a chain of "layer l of each tower" stages, and the MIP's window search, which moves a block at most
a few slots a round, never reaches a plan whose towers run at once on groups of their own (on MMT at 32 devices
its estimates were twice that of such a plan). :func:`side_by_side_start` builds that plan directly:

* the **spine**: blocks every other block reaches or is reached from (:func:`spine_positions`); the blocks
  between two spine blocks form a **region**, whose weakly connected parts are its **towers**;
* the region with the most work among those of two towers or more is laid side by side: it takes a run of slots
  in proportion to its work, the groups those slots run on are shared out among its towers in proportion to
  their work (consecutive groups, at least one each; with more towers than groups, towers share a group, the
  heaviest first to the least loaded), and each tower is cut, in its own topological order, over the run's slots
  on its groups;
* the blocks before that region are cut over the slots before its run, those after it over the slots after it
  (each in proportion to work; with no slot to spare, into the run's first or last slot).

No block flows back: a tower's blocks take increasing slots, every block before the region a slot no later than
any tower's first, every block after it one no earlier than any tower's last. Only the start changes; the MIP,
its estimate and every cost rule are the same (a start is kept only where its estimate is better).

>>> import networkx as nx
>>> g = nx.DiGraph([(0, 2), (1, 3), (2, 4), (3, 4)])   # two towers 0-2 and 1-3, joined at 4
>>> spine_positions([0, 1, 2, 3, 4], list(g.edges))
[4]
>>> [sorted(map(sorted, t)) for t in regions([0, 1, 2, 3, 4], list(g.edges))]
[[[0, 2], [1, 3]]]
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import networkx as nx

from opsched.cost.blocks import Mode

if TYPE_CHECKING:
    from opsched.upper.mip import Assignment, UpperProblem


def spine_positions(order: list[int], edges: list[tuple[int, int]]) -> list[int]:
    """Positions in ``order`` (a topological order) of the blocks every other block reaches or is reached from.

    Block ``order[i]`` is one iff it is the only sink of ``order[:i+1]`` and the only source of ``order[i:]``
    (every block of a finite DAG reaches a sink of it): one sweep over the edges, no transitive closure.

    >>> spine_positions([0, 1, 2, 3], [(0, 1), (0, 2), (1, 3), (2, 3)])
    [0, 3]
    """
    n = len(order)
    pos = {b: i for i, b in enumerate(order)}
    first_succ = [n] * n  # earliest successor's position
    last_pred = [-1] * n  # latest predecessor's position
    for u, v in edges:
        pu, pv = pos[u], pos[v]
        first_succ[pu] = min(first_succ[pu], pv)
        last_pred[pv] = max(last_pred[pv], pu)
    sinks = [0] * (n + 1)  # difference array: block j is a sink of order[:i+1] for i in [j, first_succ[j])
    sources = [0] * (n + 1)  # block j is a source of order[i:] for i in (last_pred[j], j]
    for j in range(n):
        sinks[j] += 1
        sinks[first_succ[j]] -= 1
        sources[last_pred[j] + 1] += 1
        sources[j + 1] -= 1
    out, a, c = [], 0, 0
    for i in range(n):
        a += sinks[i]
        c += sources[i]
        if a == 1 and c == 1:
            out.append(i)
    return out


def regions(order: list[int], edges: list[tuple[int, int]]) -> list[list[list[int]]]:
    """The regions between spine blocks, in order, each as its towers (weakly connected parts, each in ``order``),
    the towers ordered by their first block."""
    spine = set(spine_positions(order, edges))
    graph = nx.DiGraph(edges)
    graph.add_nodes_from(order)
    pos = {b: i for i, b in enumerate(order)}
    out, run = [], []
    for i, b in enumerate(order + [None]):
        if b is None or i in spine:
            if run:
                parts = nx.weakly_connected_components(graph.subgraph(run))
                out.append(sorted((sorted(t, key=pos.__getitem__) for t in parts), key=lambda t: pos[t[0]]))
            run = []
        else:
            run.append(b)
    return out


def _shares(weights: list[float], total: int, least: int) -> list[int]:
    """``total`` whole units in proportion to ``weights``, at least ``least`` each (largest remainders; ties to the
    first), or None when ``least`` each does not fit.

    >>> _shares([3.0, 1.0], 8, 1), _shares([1.0, 1.0, 1.0], 4, 1), _shares([5.0, 1.0], 2, 0)
    ([6, 2], [2, 1, 1], [2, 0])
    """
    n = len(weights)
    if least * n > total:
        return None
    spare = total - least * n
    whole = sum(weights)
    exact = [spare * w / whole if whole > 0 else spare / n for w in weights]
    got = [least + math.floor(e) for e in exact]
    order = sorted(range(n), key=lambda k: (-(exact[k] - math.floor(exact[k])), k))
    for k in order[: total - sum(got)]:
        got[k] += 1
    return got


def _cut(blocks: list[int], slots: list[int], work: dict[int, float]) -> dict[int, int]:
    """``blocks`` (in a topological order) over ``slots`` (increasing) in proportion to work, as
    :func:`opsched.upper.mip._proportional_cut` cuts a whole model: block -> slot."""
    total = sum(work[b] for b in blocks) or 1.0
    run, out = 0.0, {}
    for b in blocks:
        k = min(len(slots) - 1, int(math.floor((run + work[b] / 2) / total * len(slots))))
        out[b] = slots[k]
        run += work[b]
    return out


def tower_regions(p: UpperProblem) -> list[list[list[int]]]:
    """The regions of ``p``'s blocks (:func:`regions`) with two towers or more and no expert among their blocks: an
    MoE layer's experts are the expert-parallel modes' to spread (and :func:`opsched.upper.reduce.reduce_block_graph`
    merges them), not towers (as :func:`opsched.plan.branches.has_parallel_towers` counts them)."""
    return [r for r in regions(p.blocks, list(p.edges))
            if len(r) >= 2 and not any(b in p.experts for t in r for b in t)]


def side_by_side_start(p: UpperProblem, chosen: dict[int, Mode],
                       found: list[list[list[int]]] | None = None) -> Assignment | None:
    """The start of the module docstring for ``p`` with each block in its mode ``chosen[b]``, or None (no region of
    two towers or more, or one group only). ``found``: :func:`tower_regions` of ``p``, when the caller has them.
    Memory is not checked here (:func:`opsched.upper.mip.estimate` is)."""
    S, G = p.slots, p.layout.groups
    if G < 2:
        return None
    work = {b: p.cost[(b, 0, chosen[b])].work for b in p.blocks}
    found = tower_regions(p) if found is None else found
    if not found:
        return None
    towers = max(found, key=lambda r: sum(work[b] for t in r for b in t))
    inside = {b for t in towers for b in t}
    pos = {b: i for i, b in enumerate(p.blocks)}
    first = min(pos[b] for b in inside)
    before = [b for b in p.blocks if pos[b] < first and b not in inside]
    after = [b for b in p.blocks if pos[b] > first and b not in inside]
    phase_work = [sum(work[b] for b in part) for part in (before, sorted(inside), after)]
    n_before, n_region, n_after = _shares(phase_work, S, 0)
    if n_region == 0:  # the region's own slot, taken from the larger of the others
        if n_before >= n_after:
            n_before -= 1
        else:
            n_after -= 1
        n_region = 1
    run = list(range(n_before, n_before + n_region))
    groups = sorted({p.group(s) for s in run})
    tower_work = [sum(work[b] for b in t) for t in towers]
    if len(towers) <= len(groups):
        counts = _shares(tower_work, len(groups), 1)
        bins, k = [], 0
        for c in counts:
            bins.append(groups[k:k + c])
            k += c
        members = [[t] for t in range(len(towers))]
    else:  # more towers than groups: one group a bin, the heaviest tower first to the least loaded bin
        bins = [[g] for g in groups]
        members, load = [[] for _ in groups], [0.0] * len(groups)
        for t in sorted(range(len(towers)), key=lambda t: (-tower_work[t], t)):
            k = min(range(len(groups)), key=lambda k: (load[k], k))
            members[k].append(t)
            load[k] += tower_work[t]
        members = [sorted(m) for m in members]
    slot_of: dict[int, int] = {}
    firsts, lasts = [], []
    for gs, ts in zip(bins, members):
        if not ts:
            continue
        slots = [s for s in run if p.group(s) in gs]
        seq = [b for t in ts for b in towers[t]]
        slot_of.update(_cut(seq, slots, work))
        firsts.append(min(slot_of[b] for b in seq))
        lasts.append(max(slot_of[b] for b in seq))
    # blocks before the region end no later than the first tower starts; those after start no earlier than the last ends
    head = list(range(0, n_before)) or [min(firsts)]
    slot_of.update({b: min(s, min(firsts)) for b, s in _cut(before, head, work).items()} if before else {})
    tail = list(range(n_before + n_region, S)) or [max(lasts)]
    slot_of.update({b: max(s, max(lasts)) for b, s in _cut(after, tail, work).items()} if after else {})
    return {b: (slot_of[b], chosen[b]) for b in p.blocks}
