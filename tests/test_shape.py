"""What a plan does, visible (issue 45 item 6): branches side by side and what overlapped pairs save."""

import itertools
from pathlib import Path

import networkx as nx
import pytest
from hypothesis import given, strategies as st

from opsched.cost.cluster import Training, cluster_from_dict
from opsched.plan.search import PlanOptions, plan_block_graph
from opsched.schedule import Edge, Job, Pair, Schedule, Stage, StageGraph, chain_stage_graph, pair_duration, simulate
from opsched.units import seconds_text
from opsched.schedule.shape import branches_text, overlap_text, schedule_shape, shape_title
from helpers import SLOW_LINK_CLUSTER
from test_plan_cli import two_tower_graph

TIMES = {"F": 1.0, "I": 1.0, "W": 1.0}


@st.composite
def stage_dags(draw):
    """A random DAG of up to 8 stages (edges go from lower to higher ids) on up to 4 devices."""
    n = draw(st.integers(1, 8))
    edges = [(a, b) for a, b in itertools.combinations(range(n), 2) if draw(st.booleans())]
    devices = [draw(st.integers(0, 3)) for _ in range(n)]
    return StageGraph([Stage(k, (devices[k],), TIMES) for k in range(n)], [Edge(a, b) for a, b in edges],
                      num_devices=4)


def reach(sg: StageGraph) -> nx.DiGraph:
    g = nx.DiGraph([(e.src, e.dst) for e in sg.edges])
    g.add_nodes_from(s.id for s in sg.stages)
    return nx.transitive_closure_dag(g)


def width_by_brute_force(sg: StageGraph) -> int:
    closure = reach(sg)
    joined = lambda a, b: closure.has_edge(a, b) or closure.has_edge(b, a)  # noqa: E731
    ids = [s.id for s in sg.stages]
    return max(k for k in range(1, len(ids) + 1)
               if any(all(not joined(a, b) for a, b in itertools.combinations(c, 2))
                      for c in itertools.combinations(ids, k)))


@given(stage_dags())
def test_branches_are_apart_and_never_more_than_the_graph_is_wide(sg):
    """No path joins two branches; every stage beside no other is on no branch; the width is exact."""
    shape = schedule_shape(Schedule(sg, 1, []))
    closure = reach(sg)
    for one, other in itertools.combinations(shape.branches, 2):
        for a, b in itertools.product(one.stages, other.stages):
            assert not closure.has_edge(a, b) and not closure.has_edge(b, a), (a, b)
    on_branches = [s for b in shape.branches for s in b.stages]
    assert len(on_branches) == len(set(on_branches))
    for sid in on_branches:  # a stage every other reaches or is reached by runs beside none
        assert len(nx.ancestors(closure, sid) | nx.descendants(closure, sid)) < len(sg.stages) - 1
    for b in shape.branches:
        assert b.devices == tuple(sorted({d for sid in b.stages for d in sg.stage(sid).devices}))
    assert shape.width == width_by_brute_force(sg)
    assert len(shape.branches) <= shape.width and shape.forks >= (1 if shape.branches else 0)
    # the line never calls a graph a chain when two stages may run at once
    assert ("one chain" in branches_text(shape)) == (shape.width == 1 and not shape.skips)


def test_a_chain_and_a_v_have_no_branch():
    for sg in (chain_stage_graph(4), chain_stage_graph(4, devices=2, placement="v")):
        shape = schedule_shape(Schedule(sg, 1, []))
        assert shape.branches == () and shape.width == 1
        assert branches_text(shape) == "none side by side: the stages form one chain"


def test_an_edge_past_the_next_stage_is_no_chain_a_runtime_runs():
    """A --branches off plan of towers: stages one after another, but tower 0's output skips to the join (stage 0
    feeds 1 and 2), which the runtimes' checks refuse as branching; the line must not call it a chain."""
    sg = StageGraph([Stage(k, (k,), TIMES) for k in range(3)], [Edge(0, 1), Edge(1, 2), Edge(0, 2)])
    shape = schedule_shape(Schedule(sg, 1, []))
    assert shape.branches == () and shape.width == 1 and shape.skips == ((0, 2),)
    text = branches_text(shape)
    assert "one chain" not in text and "1 edge passes over a stage (stage 0 feeds stage 2)" in text, text
    assert "one chain" not in shape_title(shape)


def test_dualpipes_second_copy_is_not_a_branch():
    """DualPipe's reversed copy of the chain runs other microbatches: the model is still one chain."""
    from opsched.baselines import dualpipe

    sg = dualpipe.place(chain_stage_graph(4), 8)
    assert any(s.copy_of is not None for s in sg.stages)
    assert schedule_shape(Schedule(sg, 8, [])).branches == ()


def test_two_towers_between_a_fork_and_a_join_are_two_branches_on_their_devices():
    t = TIMES
    sg = StageGraph([Stage(0, (0, 1), t), Stage(1, (0,), t), Stage(2, (0,), t), Stage(3, (1,), t), Stage(4, (0, 1), t)],
                    [Edge(0, 1), Edge(1, 2), Edge(0, 3), Edge(2, 4), Edge(3, 4)])
    shape = schedule_shape(Schedule(sg, 1, []))
    assert [(b.stages, b.devices) for b in shape.branches] == [((1, 2), (0,)), ((3,), (1,))]
    assert branches_text(shape) == "2 side by side: stages 1-2 on device 0; stage 3 on device 1"
    assert shape_title(shape).startswith("2 branches side by side (devices 0 | 1)")


def test_edges_that_cross_between_branches_are_said_as_a_width():
    t = TIMES
    sg = StageGraph([Stage(k, (k,), t) for k in range(4)], [Edge(0, 2), Edge(0, 3), Edge(1, 2), Edge(1, 3)])
    shape = schedule_shape(Schedule(sg, 1, []))
    assert shape.branches == () and shape.width == 2
    assert "up to 2 stages may run side by side" in branches_text(shape)


@pytest.mark.parametrize("gain", [0.0, 0.5, 1.0])
def test_pair_savings_add_what_each_pair_saves(gain):
    sg = chain_stage_graph(1, f=1, b=2, w=1, overlap_gain=gain)
    order = {0: [Job(0, 0, "F"), Pair(Job(0, 1, "F"), Job(0, 0, "B")), Pair(Job(0, 2, "F"), Job(0, 1, "B")),
                 Job(0, 2, "B")]}
    schedule = Schedule(sg, 3, simulate(sg, order, 3))
    shape = schedule_shape(schedule)
    pair = pair_duration(sg, Pair(Job(0, 1, "F"), Job(0, 0, "B")))
    assert shape.pairs == 2 and shape.overlapped == (2 if gain else 0)
    assert shape.saving == pytest.approx(2 * (1 + 2 - pair))
    assert shape.saving == pytest.approx(2 * gain)  # gain x the shorter pass (F, 1 s) per pair
    if gain:
        assert overlap_text(shape) == (f"2 of 2 F&B pairs overlapped, {seconds_text(2 * gain)} shorter in all than "
                                       "their passes one after the other")
    else:
        assert "none shorter than its two passes" in overlap_text(shape)


def test_the_plan_summary_report_and_gantt_title_say_the_branches(tmp_path):
    """The two towers' plan: the summary, report.md and every Gantt title name the branches and their devices."""
    from opsched.plan.report import report_text, summary_dict, summary_text
    from opsched.export.gantt import write_html, write_trace

    cluster, training = cluster_from_dict(SLOW_LINK_CLUSTER), Training(microbatches=8)
    result = plan_block_graph(two_tower_graph(), cluster, training, PlanOptions(time_limit=10))
    shape = schedule_shape(result.schedule)
    assert len(shape.branches) == 2 and not shape.share_devices
    line = branches_text(shape)
    summary = summary_text("towers.onnx", cluster, training, result, 8, Path("out"), ["plan.json"])
    report = report_text("towers.onnx", cluster, training, 3e10, result)
    assert f"  branches    {line}" in summary.splitlines()
    assert f"- branches: {line}" in report.splitlines()
    assert f"- F&B pairs: {overlap_text(shape)}" in report.splitlines()
    fields = summary_dict("towers.onnx", cluster, training, result, Path("out"), ["plan.json"])
    assert fields["branches"] == [{"stages": list(b.stages), "devices": list(b.devices)} for b in shape.branches]
    assert fields["pairs"] == {"count": shape.pairs, "overlapped": shape.overlapped, "saving_seconds": shape.saving}
    html = write_html(result.schedule, tmp_path / "g.html", title="T").read_text()
    assert shape_title(shape).replace("&", "&amp;") in html
    assert shape_title(shape) in write_trace(result.schedule, tmp_path / "t.json", title="T").read_text()
