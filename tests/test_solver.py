"""opsched.solving.solver (one home for MIP models and statuses) and how the planner treats crashes and bugs in its solves."""

import faulthandler
import os

import mip
import pytest

import opsched.plan.search as planner
import opsched.solving.solver as solver_module
from opsched.cli import main
from opsched.cost.cluster import Training, cluster_from_dict, preset
from opsched.errors import OpschedError
from opsched.model.graph import Block
from opsched.lower import solve
from opsched.schedule import chain_stage_graph, validate
from opsched.solving.solver import Objective, Status, new_model, require
from opsched.upper.layouts import Layout
from opsched.upper.mip import solve_upper, upper_problem
from helpers import SLOW_LINK_CLUSTER
from test_plan_cli import MODELS, two_tower_graph


@pytest.fixture
def no_highs(monkeypatch):
    """python-mip as it behaves without a HiGHS library: creating a HiGHS model raises a plain exception."""
    class Model(mip.Model):
        def __init__(self, *args, solver_name="", **kwargs):
            if solver_name == "HiGHS":
                self.solver = None  # what mip.Model.__del__ deletes
                raise FileNotFoundError("libhighs.so: cannot open shared object file")
            super().__init__(*args, solver_name=solver_name, **kwargs)

    monkeypatch.setattr(solver_module.mip, "Model", Model)
    solver_module._backend_check.cache_clear()
    yield
    solver_module._backend_check.cache_clear()


def test_a_missing_highs_is_the_same_one_line_error_at_both_levels(no_highs):
    with pytest.raises(OpschedError) as upper:
        p = upper_problem(two_tower_graph(), Layout(4, 2), cluster_from_dict(SLOW_LINK_CLUSTER), Training(4))
        solve_upper(p, solver="highs")
    with pytest.raises(OpschedError) as lower:
        solve(chain_stage_graph(2), 4, solver="highs")
    assert str(upper.value) == str(lower.value)
    assert 'pip install "opsched[highs]"' in str(lower.value) and "\n" not in str(lower.value)


def test_plan_with_a_missing_highs_exits_2_before_any_work(no_highs, tmp_path, capsys, monkeypatch):
    def no_import(*args, **kwargs):  # the check must come before the model is even read
        raise AssertionError("the model was imported before the solver was checked")

    monkeypatch.setattr("opsched.model.onnx_import.import_onnx", no_import)
    out = tmp_path / "out"
    code = main(["plan", str(MODELS / "clip_vit_l14.onnx"), "--devices", "4", "--solver", "highs", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and 'pip install "opsched[highs]"' in err and "Traceback" not in err
    assert not out.exists()


def test_new_model_is_silent_single_threaded_and_seeded():
    model = new_model("cbc", threads=2, seed=3, max_gap=1e-6)
    assert (model.verbose, model.threads, model.seed) == (0, 2, 3)
    assert model.max_mip_gap == pytest.approx(1e-6)
    with pytest.raises(OpschedError, match="unknown solver 'glpk'; choose cbc or highs"):
        require("glpk")


def test_statuses_and_objectives_print_and_compare_as_their_values():
    assert Status.TIME_LIMIT == "time limit reached" and f"{Status.OPTIMAL}" == "optimal"
    assert Objective("zb-span") is Objective.ZB_SPAN
    with pytest.raises(OpschedError, match="choose makespan or zb-span"):
        solve(chain_stage_graph(2), 4, objective="span")
    assert Status.of_mip(mip.OptimizationStatus.INT_INFEASIBLE) is Status.INFEASIBLE
    assert Status.of_mip(mip.OptimizationStatus.ERROR) is Status.ERROR


def test_lower_result_status_is_a_status():
    result = solve(chain_stage_graph(2, f=1, b=2, w=1), 4, time_limit=5)
    assert result.status is Status.OPTIMAL


def _lower_level_aborts(*args, **kwargs):
    """A lower solve whose native code aborts as CBC's did: glibc's message, then SIGABRT."""
    os.write(2, b"double free or corruption (out)\n")
    faulthandler.disable()  # pytest's handler would print this process's stack (noise: the abort is the test)
    os.abort()


def test_a_solver_crash_costs_a_candidate_not_the_plan(monkeypatch):
    monkeypatch.setattr(planner, "_lower_solve", _lower_level_aborts)
    result = planner.plan_block_graph(two_tower_graph(), cluster_from_dict(SLOW_LINK_CLUSTER), Training(4),
                                      planner.PlanOptions(time_limit=10))
    # every lower solve crashed: the plan is the best baseline, and each candidate says what happened
    assert result.source.startswith("baseline ")
    validate(result.schedule)
    failed = [c for c in result.candidates if c.status.startswith("lower failed")]
    assert failed and all("crashed" in c.status for c in failed)


def _bug_in_the_lower_level(sg, *args, **kwargs):
    return {}["a bug"]


def test_a_bug_in_an_isolated_solve_fails_the_command_with_its_traceback(monkeypatch):
    monkeypatch.setattr(planner, "lower_schedule", _bug_in_the_lower_level)
    with pytest.raises(KeyError) as bug:
        planner.plan_block_graph(two_tower_graph(), cluster_from_dict(SLOW_LINK_CLUSTER), Training(4),
                                 planner.PlanOptions(time_limit=10))
    assert "_bug_in_the_lower_level" in str(bug.value.__cause__)


def test_the_planner_never_catches_user_errors_as_candidate_failures():
    # a memory limit below anything that fits is the user's error: one line, not a candidate status
    with pytest.raises(OpschedError, match="smallest memory that works"):
        planner.plan_block_graph(two_tower_graph(), preset("h100-sxm", 4), Training(4),
                                 planner.PlanOptions(memory_limit=1e6, time_limit=10))


def _sleepy_lower_schedule(*args, **kwargs):
    import time

    time.sleep(600)  # a solve that ignores its own time limit


def test_the_time_limit_is_a_wall_clock_limit_even_when_a_solve_ignores_it(monkeypatch):
    import time

    monkeypatch.setattr(planner, "lower_schedule", _sleepy_lower_schedule)
    began = time.monotonic()
    result = planner.plan_block_graph(two_tower_graph(), cluster_from_dict(SLOW_LINK_CLUSTER), Training(4),
                                      planner.PlanOptions(time_limit=4))
    took = time.monotonic() - began
    # every lower solve was stopped at its part of the clock; the plan is the best baseline, found in time
    assert took <= 4 * 1.1 + 1.0, took
    assert result.source.startswith("baseline ")
    stopped = [c for c in result.candidates if c.status.startswith(("lower failed", "not scheduled"))]
    assert stopped and all("did not return" in c.status or "time limit" in c.status for c in stopped)


@pytest.mark.slow
def test_the_plan_is_the_same_for_any_number_of_workers():
    # budgets in work, not the clock, decide every solve here (the limit is far away): two workers give the
    # very plan one gives, candidate by candidate
    plans = [planner.plan_block_graph(two_tower_graph(), cluster_from_dict(SLOW_LINK_CLUSTER), Training(4),
                                      planner.PlanOptions(time_limit=300, workers=w)) for w in (1, 2)]
    one, two = plans
    assert (one.source, one.layout, one.step_time) == (two.source, two.layout, two.step_time)
    assert one.schedule.events == two.schedule.events
    assert [(c.layout, c.status, c.step_time, c.lower_bound) for c in one.candidates] == \
        [(c.layout, c.status, c.step_time, c.lower_bound) for c in two.candidates]


def test_baselines_past_their_deadline_keep_what_they_found_and_say_what_was_not_tried():
    """Past the deadline the first pipeline depth runs its methods until one gives a baseline (none has one yet),
    then stops; the other depths are not tried, and nothing left untried is called a refusal."""
    import networkx as nx

    from opsched.plan.contiguous import contiguous_baselines

    bg = nx.DiGraph(kind="BlockGraph")
    for i in range(8):
        bg.add_node(i, block=Block(i, f"layers.{i}", (), (), flops=1e12 * (1 + i % 3), param_count=10**8,
                                   output_bytes=1e8, saved_bytes=1e8, tp_comm_bytes=1e7))
    bg.add_edges_from([(i, i + 1) for i in range(7)], bytes=1e8)
    cluster, training = cluster_from_dict({**SLOW_LINK_CLUSTER, "devices": 8, "devices_per_node": 4}), Training(8)
    every, _, refused_everywhere = contiguous_baselines(bg, cluster, training, 2e9)
    assert len(every) >= 2
    cut, best, refused = contiguous_baselines(bg, cluster, training, 2e9, deadline=0.0)
    assert len(cut) == 1 and best is cut[0] and cut[0].layout.startswith("2x4 ")  # the first depth: 2 groups
    assert set(refused_everywhere) <= set(refused) and best.method not in refused
    for method, why in refused.items():  # at 4 and 8 groups not tried: not called a refusal there
        assert why.startswith("not tried") and "the time limit was spent" in why and "8 groups" not in why
        if method in refused_everywhere and why != "not tried: the time limit was spent":
            assert why.startswith("not tried on every split: the time limit was spent (at 2 groups: ")
    # two workers start the first two depths at once, each stopping at its first baseline; the third is skipped
    cut, _, refused = contiguous_baselines(bg, cluster, training, 2e9, deadline=0.0, workers=2)
    assert 1 <= len(cut) <= 2 and set(refused_everywhere) <= set(refused)
    assert all(why.startswith("not tried") and "8 groups" not in why for why in refused.values())
    # with a plan found elsewhere (the search on half the nodes, as a chain, or the Megatron-style layouts) the
    # clock alone decides: past the deadline no depth runs to find one to fall back on
    for workers in (1, 2):
        cut, best, refused = contiguous_baselines(bg, cluster, training, 2e9, deadline=0.0, workers=workers,
                                                  found_elsewhere=True)
        assert cut == [] and best is None
        assert set(refused) == set(refused_everywhere) | set(every_method(every)) and \
            all(why == "not tried: the time limit was spent" for why in refused.values())


def every_method(rows) -> set[str]:
    return {b.method for b in rows}


def test_a_search_that_holds_a_plan_elsewhere_stops_at_its_deadline(caplog):
    """The planner's search past its deadline runs its baselines until one is found (a plan to write), unless
    its caller holds one (``found_elsewhere``: the search as a chain, on half the nodes): then nothing runs."""
    import time

    from opsched.errors import MemoryTooSmall

    bg, cluster = two_tower_graph(), cluster_from_dict(SLOW_LINK_CLUSTER)
    late = planner.plan_block_graph(bg, cluster, Training(4), planner.PlanOptions(deadline=time.monotonic() - 1))
    assert late.source.startswith("baseline ")  # the fallback a user gets when the clock is spent
    caplog.clear()
    with caplog.at_level("INFO", logger="opsched"):
        with pytest.raises(MemoryTooSmall, match="time limit was spent"):
            planner.plan_block_graph(bg, cluster, Training(4), planner.PlanOptions(deadline=time.monotonic() - 1, found_elsewhere=True))
    assert not any(r.getMessage().startswith("baseline: ") and "step time" in r.getMessage() for r in caplog.records)
    assert any("not costed" in r.getMessage() for r in caplog.records)  # one layout's problem costed, not all
