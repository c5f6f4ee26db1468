"""Towers side by side (issue 44): the upper search's start with each tower on groups of its own.

The case it is for: a model whose towers interleave in the import's block order (GraphPipe's MMT numbers layer 0
of every tower, then layer 1, ...), so every contiguous cut is a chain of "layer l of each tower" stages and the
window search never reaches the towers side by side.
"""

from __future__ import annotations

import networkx as nx

from opsched.cost.cluster import Training, preset
from opsched.model.graph import Block
from opsched.plan.search import TOWERS_START, _upper_for_layout
from opsched.upper.layouts import Layout
from opsched.upper.mip import contiguous_start, estimate, towers_start, upper_problem
from opsched.upper.towers import regions, side_by_side_start, spine_positions


def interleaved_towers(towers: int, layers: int, head_flops: float = 8.6e9) -> tuple[nx.DiGraph, dict[int, int]]:
    """``towers`` chains of ``layers`` equal layers on inputs of their own, joined by a head; block ids layer by
    layer across the towers (as the import numbers MMT). Returns the graph and each tower block's tower."""
    g = nx.DiGraph(kind="BlockGraph")
    tower_of, last = {}, {}
    for k in range(layers):
        for t in range(towers):
            i = g.number_of_nodes()
            g.add_node(i, block=Block(i, f"branches.{t}/layers.{k}", (f"branches.{t}", f"layers.{k}"), (f"l{i}",),
                                      flops=2.7e10, param_count=12_600_000, output_bytes=2e6, saved_bytes=3e7,
                                      tp_comm_bytes=2e6))
            if t in last:
                g.add_edge(last[t], i, bytes=2e6)
            last[t], tower_of[i] = i, t
    head = g.number_of_nodes()
    g.add_node(head, block=Block(head, "fusion", ("fusion",), ("fusion",), flops=head_flops, param_count=4_000_000,
                                 output_bytes=2e6, saved_bytes=8e6))
    g.add_edges_from(((b, head) for b in last.values()), bytes=2e6)
    return g, tower_of


def groups_of_towers(p, assignment, tower_of) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for b, t in tower_of.items():
        out.setdefault(t, set()).add(p.group(assignment[b][0]))
    return out


def test_spine_and_regions_of_a_stem_three_towers_and_a_head():
    # 0 -> {1 -> 4, 2, 3 -> 5} -> 6 -> 7: the spine is 0, 6 and 7; one region of three towers
    edges = [(0, 1), (0, 2), (0, 3), (1, 4), (3, 5), (4, 6), (2, 6), (5, 6), (6, 7)]
    order = list(nx.lexicographical_topological_sort(nx.DiGraph(edges)))
    assert [order[i] for i in spine_positions(order, edges)] == [0, 6, 7]
    assert regions(order, edges) == [[[1, 4], [2], [3, 5]]]
    # two regions, one after the other, split at a spine block
    edges = [(0, 2), (1, 2), (2, 3), (2, 4), (3, 5), (4, 5)]
    assert regions([0, 1, 2, 3, 4, 5], edges) == [[[0], [1]], [[3], [4]]]
    # a chain has no region
    assert regions([0, 1, 2], [(0, 1), (1, 2)]) == []


def test_interleaved_towers_get_groups_of_their_own_and_a_better_estimate():
    g, tower_of = interleaved_towers(towers=4, layers=8)
    cluster = preset("v100-16g", 32)
    training = Training(microbatches=16, microbatch_size=4, dtype="fp16", whole_sequences=True, zero=1)
    for layout in (Layout(32, 8), Layout(32, 8, 2, "v"), Layout(32, 16, 2, "interleaved")):
        p = upper_problem(g, layout, cluster, training)
        start = towers_start(p)
        assert start is not None and estimate(p, start)["feasible"]
        groups = groups_of_towers(p, start, tower_of)
        assert all(len(gs) == layout.groups // 4 for gs in groups.values()), groups
        assert all(groups[a].isdisjoint(groups[b]) for a in groups for b in groups if a < b), groups
        assert all(start[u][0] <= start[v][0] for u, v in g.edges)  # no block flows back
        # the contiguous cut of the interleaved order puts layer l of every tower in one stage: every stage
        # boundary carries all four towers' activations, and the towers never run at once
        # (on 8 groups of 4, one a node, each such boundary crosses InfiniBand: the link is the bottleneck)
        ratio = estimate(p, start)["step_time"] / estimate(p, contiguous_start(p))["step_time"]
        assert ratio < (0.5 if layout == Layout(32, 8) else 1.0), (str(layout), ratio)
        assert towers_start(p) == start  # no clock decides it


def test_the_placement_mip_starts_from_the_towers_when_their_estimate_is_better():
    g, tower_of = interleaved_towers(towers=4, layers=8)
    cluster = preset("v100-16g", 32)
    training = Training(microbatches=16, microbatch_size=4, dtype="fp16", whole_sequences=True, zero=1)
    p = upper_problem(g, Layout(32, 8, 2, "v"), cluster, training)
    first, sol, start = _upper_for_layout(p, 30.0, "cbc")
    assert start == TOWERS_START
    groups = groups_of_towers(p, sol.assignment, tower_of)
    assert all(groups[a].isdisjoint(groups[b]) for a in groups for b in groups if a < b), groups
    assert sol.objective <= first * (1 + 1e-9)


def test_a_model_without_towers_has_no_such_start():
    g = nx.DiGraph(kind="BlockGraph")
    for i in range(4):
        g.add_node(i, block=Block(i, f"layers.{i}", (f"layers.{i}",), (f"l{i}",), flops=1e12, param_count=10**6,
                                  output_bytes=1e6, saved_bytes=1e6))
    g.add_edges_from([(0, 1), (1, 2), (2, 3)], bytes=1e6)
    p = upper_problem(g, Layout(4, 2), preset("h100-sxm", 4), Training(microbatches=4))
    assert towers_start(p) is None
    assert side_by_side_start(p, {b: p.modes[b][0] for b in p.blocks}) is None


def test_more_towers_than_groups_share_groups_and_blocks_before_and_after_keep_their_order():
    # a stem, 5 towers of unequal length, a join and a tail, on 4 groups in a V
    g = nx.DiGraph(kind="BlockGraph")

    def add(name, flops):
        i = g.number_of_nodes()
        g.add_node(i, block=Block(i, name, (name,), (name,), flops=flops, param_count=10**6, output_bytes=1e6,
                                  saved_bytes=1e6))
        return i

    stem = add("stem", 1e12)
    ends = []
    for t, n in enumerate([3, 1, 2, 1, 4]):
        prev = stem
        for k in range(n):
            cur = add(f"t{t}.{k}", 1e12)
            g.add_edge(prev, cur, bytes=1e6)
            prev = cur
        ends.append(prev)
    join = add("join", 1e12)
    g.add_edges_from(((e, join) for e in ends), bytes=1e6)
    tail = add("tail", 2e12)
    g.add_edge(join, tail, bytes=1e6)
    p = upper_problem(g, Layout(4, 4, 2, "v"), preset("h100-sxm", 4), Training(microbatches=8))
    a = side_by_side_start(p, {b: p.modes[b][0] for b in p.blocks})
    assert a is not None and set(a) == set(g.nodes)
    assert all(a[u][0] <= a[v][0] for u, v in g.edges)
    assert a[stem][0] == 0 and a[tail][0] == p.slots - 1
