"""Upper MIP: equals exhaustive enumeration on small BlockGraphs; layouts; stage graphs (issue 5 item 3)."""

import itertools

import networkx as nx
import pytest

from opsched.cost.cluster import Training, cluster_from_dict, preset
from opsched.cost.blocks import Mode
from opsched.errors import OpschedError
from opsched.model.graph import Block
from opsched.upper.layouts import Layout, layouts
from opsched.upper.mip import estimate, solve_upper, upper_problem
from opsched.upper.stages import build_stage_graph
from helpers import SLOW_LINK_CLUSTER

SPEC = SLOW_LINK_CLUSTER


def block_graph(flops, edges, params=None, out=None, edge_bytes=1e8):
    g = nx.DiGraph(kind="BlockGraph")
    for i, f in enumerate(flops):
        g.add_node(
            i,
            block=Block(
                i,
                f"b{i}",
                (f"layers.{i}",),
                (),
                flops=f,
                param_count=(params or [10**8] * len(flops))[i],
                output_bytes=(out or [1e8] * len(flops))[i], saved_bytes=(out or [1e8] * len(flops))[i],
            ),
        )
    for u, v in edges:
        g.add_edge(u, v, bytes=edge_bytes)
    return g


def brute_force(p):
    """Best feasible assignment by enumerating every slot and mode of every block."""
    choices = [[(s, m) for s in range(p.slots) for m in p.modes[b]] for b in p.blocks]
    best = None
    for combo in itertools.product(*choices):
        a = dict(zip(p.blocks, combo))
        est = estimate(p, a)
        if est["feasible"] and (best is None or est["step_time"] < best - 1e-12):
            best = est["step_time"]
    return best


DIAMOND = [(0, 1), (0, 2), (1, 3), (2, 3)]
CASES = [
    # (name, flops per block, edges, devices, layout, memory limit)
    ("chain on 2 groups of 2", [2e12, 1e12, 3e12, 1e12], [(0, 1), (1, 2), (2, 3)], 4, Layout(4, 2), None),
    ("two towers on 3 groups", [1e12, 4e12, 4e12, 1e12], DIAMOND, 3, Layout(3, 3), None),
    ("diamond, V layout", [1e12, 3e12, 2e12, 1e12], DIAMOND, 2, Layout(2, 2, 2, "v"), None),
    ("diamond, interleaved", [2e12, 1e12, 1e12, 2e12], DIAMOND, 2, Layout(2, 2, 2, "interleaved"), None),
    ("tight memory forces a split", [1e12, 1e12, 1e12, 3e12], [(0, 1), (1, 2), (2, 3)], 2, Layout(2, 2), 4e9),
]


@pytest.mark.parametrize("name,flops,edges,devices,layout,limit", CASES, ids=[c[0] for c in CASES])
def test_mip_equals_exhaustive_enumeration(name, flops, edges, devices, layout, limit):
    cluster = cluster_from_dict(dict(SPEC, devices=devices))
    bg = block_graph(flops, edges)
    p = upper_problem(bg, layout, cluster, Training(microbatches=4), memory_limit=limit)
    sol = solve_upper(p, time_limit=20)
    expected = brute_force(p)
    assert sol.status == "optimal"
    assert sol.estimate["feasible"] == 1.0
    assert sol.objective == pytest.approx(expected, rel=1e-6)
    assert sol.bound == pytest.approx(expected, rel=1e-4)


def test_tight_memory_changes_the_answer():
    cluster = cluster_from_dict(dict(SPEC, devices=2))
    # balanced in time is {0, 1, 2} | {3}, which holds 3 x (1.6e9 params + 2 x 1e8 act) = 5.4e9 on group 0
    bg = block_graph([1e12, 1e12, 1e12, 3e12], [(0, 1), (1, 2), (2, 3)])
    loose = solve_upper(upper_problem(bg, Layout(2, 2), cluster, Training(microbatches=4)))
    tight = solve_upper(upper_problem(bg, Layout(2, 2), cluster, Training(microbatches=4), memory_limit=4e9))
    assert loose.estimate["memory"] == pytest.approx(5.4e9)
    assert tight.estimate["memory"] == pytest.approx(3.6e9)
    assert tight.objective > loose.objective


def test_two_towers_take_different_groups_and_become_parallel_stages():
    cluster = cluster_from_dict(dict(SPEC, devices=4))
    bg = block_graph([0.5e12, 4e12, 4e12, 0.5e12], DIAMOND, edge_bytes=1e6)
    p = upper_problem(bg, Layout(4, 4), cluster, Training(microbatches=8))
    sol = solve_upper(p)
    slot1, slot2 = sol.assignment[1][0], sol.assignment[2][0]
    assert p.group(slot1) != p.group(slot2)
    plan = build_stage_graph(p, sol.assignment)
    sg = plan.stage_graph
    s1 = next(sid for sid, blocks in plan.blocks_of_stage.items() if 1 in blocks)
    s2 = next(sid for sid, blocks in plan.blocks_of_stage.items() if 2 in blocks)
    reach = nx.DiGraph([(e.src, e.dst) for e in sg.edges])
    reach.add_nodes_from(range(len(sg.stages)))
    assert not nx.has_path(reach, s1, s2) and not nx.has_path(reach, s2, s1)


def test_no_placement_fits_names_the_smallest_memory():
    cluster = cluster_from_dict(dict(SPEC, devices=2))
    bg = block_graph([1e12] * 3, [(0, 1), (1, 2)])
    p = upper_problem(bg, Layout(2, 2), cluster, Training(microbatches=4), memory_limit=1e6)
    with pytest.raises(OpschedError, match=r"smallest that fits is about [0-9.]+ GiB"):
        solve_upper(p)


def test_stage_graph_sums_block_costs_and_edges():
    cluster = cluster_from_dict(dict(SPEC, devices=2))
    bg = block_graph([1e12, 2e12, 3e12], [(0, 1), (1, 2), (0, 2)], edge_bytes=1e9)
    p = upper_problem(bg, Layout(2, 2), cluster, Training(microbatches=4))
    a = {0: (0, Mode()), 1: (0, Mode()), 2: (1, Mode())}
    plan = build_stage_graph(p, a)
    sg = plan.stage_graph
    assert [s.devices for s in sg.stages] == [(0,), (1,)]
    assert sg.stages[0].time["F"] == pytest.approx(3e12 / 50e12)
    assert sg.stages[1].time["W"] == pytest.approx(3e12 / 50e12)
    assert sg.stages[0].param_bytes == pytest.approx(2 * 10**8 * 16)
    (edge,) = sg.edges
    # two block edges (1->2, 0->2) cross: one message of 2e9 bytes on the inter-node link
    assert edge.bytes == 2e9 and edge.time == pytest.approx(10e-6 + 2e9 / 10e9)
    est = estimate(p, a)
    # critical path: both stages' F + I (W can wait) plus the transfer there and back
    path0, path1 = 2 * 3e12 / 50e12, 2 * 3e12 / 50e12
    assert est["critical_path"] == pytest.approx(path0 + path1 + 2 * edge.time)
    # bottleneck: the link, which carries 2e9 bytes each way per microbatch (more than a group's F + I + W)
    assert est["bottleneck"] == pytest.approx(max(3 * 3e12 / 50e12, 2 * edge.time)) == pytest.approx(2 * edge.time)


def test_backward_flow_is_rejected_by_the_stage_builder():
    cluster = cluster_from_dict(dict(SPEC, devices=2))
    bg = block_graph([1e12, 1e12], [(0, 1)])
    p = upper_problem(bg, Layout(2, 2), cluster, Training())
    assert estimate(p, {0: (1, Mode()), 1: (0, Mode())})["feasible"] == 0.0
    with pytest.raises(OpschedError, match="earlier slot"):
        build_stage_graph(p, {0: (1, Mode()), 1: (0, Mode())})


def test_layout_maps():
    v = Layout(4, 2, 2, "v")
    assert [v.group_of_slot(s) for s in range(4)] == [0, 1, 1, 0]
    i = Layout(4, 2, 2, "interleaved")
    assert [i.group_of_slot(s) for s in range(4)] == [0, 1, 0, 1]
    assert i.devices_of_group(1) == (2, 3)



def test_every_parallel_degree_has_its_words_and_its_line_in_the_notation():
    """The degrees of a mode are one list (cost.blocks.DEGREES); the notation explains each, and every mode's name
    parses back to itself, as a configuration with +ep too."""
    from opsched.cost.blocks import DEGREES
    from opsched.upper.layouts import _DEGREE_WORDS, NOTATION, config_name, parse_config

    assert set(_DEGREE_WORDS) == set(DEGREES)
    assert all(f"\n  {kind}N " in NOTATION for kind in DEGREES)
    every = Mode(**{kind: 2 for kind in DEGREES})
    assert str(every) == ".".join(f"{kind}2" for kind in DEGREES) and Mode.parse(str(every)) == every
    assert parse_config(config_name(every, True)) == (every, True)

def test_layouts_enumerate_divisors_and_reject_partial_nodes():
    found = {(l.groups, l.virtual, l.placement) for l in layouts(preset("h100-sxm", 16))}
    assert (16, 1, "chain") in found and (1, 1, "chain") in found and (8, 2, "v") in found
    assert all(16 % g == 0 for g, _, _ in found)
    with pytest.raises(OpschedError, match="do not fill whole nodes"):
        layouts(preset("h100-sxm", 12))


def test_same_input_same_answer():
    cluster = cluster_from_dict(dict(SPEC, devices=4))
    bg = block_graph([2e12, 1e12, 3e12, 1e12, 2e12], [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)])
    p = upper_problem(bg, Layout(4, 4), cluster, Training(microbatches=8))
    assert solve_upper(p).assignment == solve_upper(p).assignment


def _moe_layer_graph(layers=3, experts=4):
    """attn -> experts (parallel) -> combine, with a residual attn -> combine, per layer."""
    g = nx.DiGraph(kind="BlockGraph")
    nid, prev = 0, None
    for layer in range(layers):
        attn = nid
        g.add_node(attn, block=Block(attn, f"attn{layer}", (f"layers.{layer}",), (f"l{layer}/attn",), flops=2.0, param_count=5))
        nid += 1
        if prev is not None:
            g.add_edge(prev, attn, bytes=1.0)
        experts_ids = []
        for e in range(experts):
            g.add_node(nid, block=Block(nid, f"e{e}", (f"layers.{layer}", f"experts.{e}"), (f"l{layer}/experts.{e}/w",), flops=1.0, param_count=3))
            g.add_edge(attn, nid, bytes=0.5)
            experts_ids.append(nid)
            nid += 1
        comb = nid
        g.add_node(comb, block=Block(comb, f"combine{layer}", (f"layers.{layer}",), (f"l{layer}/add",), flops=0.5))
        nid += 1
        for x in experts_ids:
            g.add_edge(x, comb, bytes=0.5)
        g.add_edge(attn, comb, bytes=1.0)
        prev = comb
    return g


def test_reduce_merges_experts_keeps_a_dag_and_conserves_costs():
    from opsched.cost.blocks import expert_count
    from opsched.model.graph import totals
    from opsched.upper.reduce import reduce_block_graph

    bg = _moe_layer_graph()
    small, members = reduce_block_graph(bg, target=6)
    assert small.number_of_nodes() == 6
    assert nx.is_directed_acyclic_graph(small)
    assert sorted(b for held in members.values() for b in held) == sorted(bg.nodes)
    before, after = totals(bg), totals(small)
    for key in ("flops", "param_count", "output_bytes"):
        assert after[key] == pytest.approx(before[key])
    # every layer's four experts end up in one block, which may then run expert-parallel
    assert max(expert_count(small.nodes[b]["block"]) for b in small) == 4


def test_reduce_keeps_two_towers_apart():
    from opsched.upper.reduce import reduce_block_graph

    # two chains of 4 joined at the end: never merged into one another
    g = nx.DiGraph(kind="BlockGraph")
    for i in range(9):
        g.add_node(i, block=Block(i, f"b{i}", (), (), flops=1.0))
    g.add_edges_from([(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7), (3, 8), (7, 8)], bytes=1.0)
    small, members = reduce_block_graph(g, target=1)
    towers = [set(held) for held in members.values()]
    assert not any({0, 4} <= t for t in towers)
    assert nx.is_directed_acyclic_graph(small)


def test_a_reduced_moe_block_exchanges_what_its_experts_receive_once_per_layer():
    """Reduced to one block, two MoE layers of 8 experts behind their routers: its expert-parallel all-to-alls move
    the 16 experts' routed tokens (not the block's input) and pay two dispatches' and two combines' latency."""
    from opsched.upper.mip import CostTable
    from opsched.upper.reduce import reduce_block_graph

    g = nx.DiGraph(kind="BlockGraph")
    for layer in range(2):
        router = 10 * layer
        g.add_node(router, block=Block(router, f"model/layers.{layer}/router", (), (), flops=1e6))
        if layer:
            g.add_edge(9, router, bytes=5e6)
        for e in range(8):
            g.add_node(router + 1 + e, block=Block(router + 1 + e, f"model/layers.{layer}/mlp/experts.{e}", (), (),
                                                   flops=1e9, param_count=10**6))
            g.add_edge(router, router + 1 + e, bytes=1e6)
            g.add_edge(router + 1 + e, router + 9, bytes=1e6)
        g.add_node(router + 9, block=Block(router + 9, f"model/layers.{layer}/combine", (), (), flops=1e6))
    small, _ = reduce_block_graph(g, target=1)
    (b,) = small.nodes
    assert (small.nodes[b]["expert_tokens"], small.nodes[b]["moe_layers"]) == (16e6, 2)
    cluster = preset("h100-sxm", 8)
    cost = CostTable(small, cluster, Training()).cost(b, Mode(ep=8), tuple(range(8)))
    bw, lat = cluster.link(tuple(range(8)), tuple(range(8)))
    assert cost.f_comm == pytest.approx(2 * (2 * 7 * lat + 7 / 8 * (16e6 / 8) / bw))


@pytest.mark.parametrize("name,flops,edges,devices,layout,limit", CASES, ids=[c[0] for c in CASES])
def test_memory_floor_is_below_every_assignment(name, flops, edges, devices, layout, limit):
    """The floor the search skips a layout by is a bound: no assignment (enumerated, each slot and mode of each
    block, flowing back or not) needs less memory on its fullest group; and the least over them is reached by some."""
    from opsched.upper.constraints import memory_floor

    cluster = cluster_from_dict(dict(SPEC, devices=devices))
    p = upper_problem(block_graph(flops, edges, params=[3 * 10**8, 10**8, 2 * 10**8, 10**8]), layout, cluster,
                      Training(microbatches=4), memory_limit=limit)
    floor = memory_floor(p)
    choices = [[(s, m) for s in range(p.slots) for m in p.modes[b]] for b in p.blocks]
    least = min(estimate(p, dict(zip(p.blocks, combo)))["memory"] for combo in itertools.product(*choices))
    assert 0 < floor <= least * (1 + 1e-12)
