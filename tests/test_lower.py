"""Lower level: the MIP optimum equals an exhaustive search over orders; errors; determinism; validity."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from opsched.errors import OpschedError
from opsched.lower import minimum_memory_limit, solve
from opsched.lower.bounds import lower_bound
from opsched.lower.jobs import JobSet, activation_budgets, order_fits
from opsched.lower.listsched import best_list_schedule, list_schedule
from opsched.lower.slot_solve import solve_slot_problem
from opsched.lower.timeindexed import full_windows, slot_problem
from opsched.schedule import Schedule, chain_stage_graph, simulate, validate


def device_sequences(js: JobSet, device: int, budget: float | None, first_forwards: list | None):
    """Every order of the device's jobs that keeps same-device dependencies and fits the budget."""
    ks = js.on_device[device]
    local = set(ks)
    # transitive predecessors that sit on this device
    before = {k: set() for k in ks}
    for k in js.topo:
        if k in local:
            stack = [i for i, _ in js.preds[k]]
            seen = set()
            while stack:
                i = stack.pop()
                if i in seen:
                    continue
                seen.add(i)
                if i in local:
                    before[k].add(i)
                stack += [p for p, _ in js.preds[i]]
    out = []

    def extend(seq, placed, level):
        if len(seq) == len(ks):
            out.append(list(seq))
            return
        for k in ks:
            if k in placed or not before[k] <= placed:
                continue
            job = js.jobs[k]
            if first_forwards is not None and job in first_forwards:
                # renaming microbatches orders the first stage's forwards (loses nothing)
                if any(f not in {js.jobs[p] for p in placed} for f in first_forwards[: first_forwards.index(job)]):
                    continue
            up = level + max(js.mem[k], 0.0)
            if budget is not None and up > budget + 1e-9:
                continue
            seq.append(k)
            placed.add(k)
            extend(seq, placed, level + js.mem[k])
            seq.pop()
            placed.discard(k)

    extend([], set(), 0.0)
    return out


def brute_force(sg, microbatches, memory_limit, split_backward):
    """The least makespan over every per-device order (timed by the simulator)."""
    js = JobSet(sg, microbatches, split_backward)
    budgets = activation_budgets(sg, memory_limit)
    from opsched.schedule import Job

    firsts = [Job(0, m, "F") for m in range(microbatches)]
    per_device = []
    for d in sorted(js.on_device):
        per_device.append(
            device_sequences(js, d, None if budgets is None else budgets[d], firsts if d == sg.stage(0).devices[0] else None)
        )
    best = None
    count = 0
    for combo in itertools.product(*per_device):
        order = {d: [js.jobs[k] for k in seq] for d, seq in zip(sorted(js.on_device), combo)}
        try:
            events = simulate(sg, order, microbatches)
        except OpschedError:
            continue  # deadlocks
        count += 1
        span = max(e.end for e in events)
        best = span if best is None else min(best, span)
    return best, count


def mip_optimum(sg, microbatches, memory_limit, split_backward):
    js = JobSet(sg, microbatches, split_backward)
    budgets = activation_budgets(sg, memory_limit)
    _, span, _, _ = best_list_schedule(js, budgets)
    sp = slot_problem(js, 1.0, budgets)
    full_windows(sp, int(round(span)))
    out = solve_slot_problem(sp, time_limit=60)
    assert out.status == "optimal"
    return out.objective


CASES = [
    # (stages, devices, placement, microbatches, split_backward, memory limits)
    (2, 2, "chain", 3, False, [None, 2.0, 1.0]),
    (2, 2, "chain", 3, True, [1.0, 1.5]),
    (3, 3, "chain", 3, False, [1.0, 1.5]),
    (4, 2, "v", 2, False, [None, 2.0]),
    (2, 2, "chain", 4, False, [2.0]),
]


@pytest.mark.parametrize("stages,devices,placement,mb,split,limits", CASES)
def test_mip_optimum_equals_exhaustive_search(stages, devices, placement, mb, split, limits):
    sg = chain_stage_graph(stages, devices=devices, placement=placement, f=1, b=2, w=1, act=1, act_w=0.5)
    for limit in limits:
        expected, count = brute_force(sg, mb, limit, split)
        assert count > 0
        assert mip_optimum(sg, mb, limit, split) == pytest.approx(expected)
        result = solve(sg, mb, memory_limit=limit, split_backward=split, time_limit=20)
        assert result.makespan == pytest.approx(expected), (limit, result.warm_start)
        if split:
            assert result.status == "optimal" and result.gap == pytest.approx(0.0)
        else:  # the fused MIP's optimum is no bound: a split schedule (W deferred) may be shorter
            split_result = solve(sg, mb, memory_limit=limit, time_limit=20, search_budget=5)
            assert result.lower_bound <= split_result.makespan + 1e-9
            assert (result.status == "optimal") == (result.gap <= 1e-9)
        validate(result.schedule)


def test_tightest_memory_only_one_microbatch_at_a_time():
    """At the minimum limit each device holds one microbatch: the optimum is GPipe-with-one-in-flight."""
    sg = chain_stage_graph(2, f=1, b=2, w=1, act=1, act_w=0.5)
    assert minimum_memory_limit(sg, 3) == 1.0
    result = solve(sg, 3, memory_limit=1.0, split_backward=False, time_limit=20)
    # one microbatch in flight: F F B B per microbatch, nothing overlaps
    assert result.makespan == pytest.approx(3 * (1 + 1 + 2 + 2))
    validate(result.schedule)


def test_memory_below_minimum_names_it():
    sg = chain_stage_graph(4, devices=2, placement="v", f=1, b=2, w=1, act=1.0, param_bytes=0.5)
    # device 0 hosts stages 0 and 3: parameters 1.0 + activations 2.0 of one microbatch
    assert minimum_memory_limit(sg, 4) == pytest.approx(3.0)
    with pytest.raises(OpschedError, match=r"minimum 3\b"):
        solve(sg, 4, memory_limit=2.9)


def test_bad_solver_and_slot_are_user_errors():
    sg = chain_stage_graph(2)
    with pytest.raises(OpschedError, match="solver"):
        solve(sg, 2, solver="gurobi")
    with pytest.raises(OpschedError, match="slot"):
        solve(sg, 2, slot=-1)


def test_same_input_gives_identical_schedule():
    sg = chain_stage_graph(4, devices=2, placement="v", f=1, b=2, w=1)
    a = solve(sg, 4, memory_limit=3.0, time_limit=20)
    b = solve(sg, 4, memory_limit=3.0, time_limit=20)
    assert a.schedule.events == b.schedule.events
    assert (a.lower_bound, a.status, a.warm_start) == (b.lower_bound, b.status, b.warm_start)


def test_lower_bound_never_above_the_optimum():
    for stages, devices, placement, mb, split, limits in CASES:
        sg = chain_stage_graph(stages, devices=devices, placement=placement, f=1, b=2, w=1)
        for limit in limits:
            js = JobSet(sg, mb, split)
            expected, _ = brute_force(sg, mb, limit, split)
            assert lower_bound(js, activation_budgets(sg, limit)) <= expected + 1e-9


def test_list_scheduler_fits_memory_and_never_deadlocks():
    sg = chain_stage_graph(8, devices=4, placement="v", f=1, b=2, w=1, comm=0.25)
    for limit in (2.0, 3.0, 5.0):
        js = JobSet(sg, 8)
        budgets = activation_budgets(sg, limit)
        order = list_schedule(js, budgets, priority="zb")
        assert order_fits(sg, order, budgets)
        schedule = Schedule(sg, 8, simulate(sg, order, 8), memory_limit=limit)
        validate(schedule)


def test_never_worse_than_a_warm_order_and_valid_with_transfers():
    sg = chain_stage_graph(3, f=[1, 2, 1], b=[2, 3, 2], w=[1, 1, 1], comm=0.5)
    from opsched.baselines import baseline_order

    warm = baseline_order("1f1b", sg, 4)
    warm_span = max(e.end for e in simulate(sg, warm, 4))
    result = solve(sg, 4, memory_limit=3.0, time_limit=10, warm_orders={"mine": warm})
    assert result.makespan <= warm_span + 1e-9
    assert result.lower_bound <= result.makespan + 1e-9
    validate(result.schedule)


def brute_force_span(sg, microbatches, memory_limit, split_backward):
    """The least Zero Bubble cost (longest device span) over every per-device order."""
    from opsched.lower.lns import objective_value

    js = JobSet(sg, microbatches, split_backward)
    budgets = activation_budgets(sg, memory_limit)
    per_device = [device_sequences(js, d, None if budgets is None else budgets[d], None) for d in sorted(js.on_device)]
    best = None
    for combo in itertools.product(*per_device):
        order = {d: [js.jobs[k] for k in seq] for d, seq in zip(sorted(js.on_device), combo)}
        try:
            events = simulate(sg, order, microbatches)
        except OpschedError:
            continue
        value = objective_value(js, events, "zb-span")
        best = value if best is None else min(best, value)
    return best


def test_zb_span_objective_bound_and_result_bracket_the_optimum():
    sg = chain_stage_graph(2, f=1, b=2, w=1, comm=1.0)
    expected = brute_force_span(sg, 3, 2.0, False)
    result = solve(sg, 3, memory_limit=2.0, split_backward=False, objective="zb-span", time_limit=20)
    from opsched.lower.lns import objective_value

    value = objective_value(JobSet(sg, 3, False), result.schedule.events, "zb-span")
    assert result.lower_bound <= expected + 1e-9 <= value + 1e-9
    assert value == pytest.approx(expected)  # small enough for the whole MIP to prove it
    validate(result.schedule)
    with pytest.raises(OpschedError, match="objective"):
        solve(sg, 3, objective="throughput")


def test_highs_gives_the_same_optimum_as_cbc():
    pytest.importorskip("highsbox", reason="HiGHS is the optional highs extra: pip install -e \".[highs]\"")
    sg = chain_stage_graph(2, f=1, b=2, w=1)
    expected, _ = brute_force(sg, 3, 1.5, True)
    result = solve(sg, 3, memory_limit=1.5, solver="highs", time_limit=20)
    assert result.makespan == pytest.approx(expected) and result.solver == "highs"
    validate(result.schedule)


def test_pairs_are_valid_and_never_worse(caplog):
    caplog.set_level("INFO", logger="opsched.lower")
    sg = chain_stage_graph(4, devices=2, placement="v", f=1, b=2, w=1, overlap_gain=1.0)
    plain = solve(sg, 4, split_backward=False, allow_pairs=False, time_limit=10)
    # thinning the pairs at the end only parts pairs (its tests: test_pairs_mip.py); without it the budget decides
    paired = solve(sg, 4, split_backward=False, allow_pairs=True, time_limit=10, thin=False)
    assert paired.makespan < plain.makespan  # a perfect overlap gain shortens the schedule here
    assert any(e.pair is not None for e in paired.schedule.events)
    assert paired.lower_bound <= paired.makespan + 1e-9
    validate(paired.schedule)
    err = caplog.text
    assert "[lower]" in err and "best" in err and "bound" in err


def test_branches_and_device_groups():
    """Two towers joining, one stage on a two-device group: valid, within the bound, memory kept."""
    from opsched.schedule import Edge, Stage, StageGraph

    t = {"F": 1.0, "I": 1.0, "W": 1.0}
    stages = [
        Stage(0, (0,), t), Stage(1, (1,), {"F": 2.0, "I": 2.0, "W": 1.0}),
        Stage(2, (2, 3), t),  # the join runs on a group of two devices
    ]
    sg = StageGraph(stages, [Edge(0, 2, 0.5), Edge(1, 2, 0.5)], num_devices=4)
    assert minimum_memory_limit(sg, 4) == 1.0
    result = solve(sg, 4, memory_limit=2.0, time_limit=10)
    validate(result.schedule)
    assert result.lower_bound <= result.makespan + 1e-9
    group_events = [e for e in result.schedule.events if e.stage == 2]
    assert len(group_events) == 12


def test_byte_sized_memory_gives_the_same_optimum():
    """Activations in bytes (1e9 scale) and a byte limit: the same optimum as in units."""
    small = chain_stage_graph(2, f=1, b=2, w=1, act=1.0, act_w=0.5)
    big = chain_stage_graph(2, f=1, b=2, w=1, act=1e9, act_w=0.5e9, param_bytes=2e9)
    expected, _ = brute_force(small, 3, 1.5, True)
    result = solve(big, 3, memory_limit=3.5e9, time_limit=20)
    assert result.makespan == pytest.approx(expected)
    assert mip_optimum(big, 3, 3.5e9, True) == pytest.approx(expected)
    validate(result.schedule)


def test_neighbourhood_search_is_deterministic_with_a_solve_budget():
    sg = chain_stage_graph(8, devices=4, placement="v", f=1, b=2, w=1)
    runs = [solve(sg, 8, memory_limit=5.0, time_limit=60, search_budget=12) for _ in range(2)]
    # the search accepted at least one neighbour (a log line between the warm start and the end)
    assert len(runs[0].log) > 2
    assert runs[0].schedule.events == runs[1].schedule.events
    assert [x[1:] for x in runs[0].log] == [x[1:] for x in runs[1].log]
    validate(runs[0].schedule)


#: the command line in a fresh process (each run starts from a clean interpreter)
OPSCHED = [sys.executable, "-c", "import sys; from opsched.cli import main; sys.exit(main(sys.argv[1:]))"]


@pytest.mark.slow  # three default-budget solves at once: 20 s of CPU, and it loads the machine on purpose
def test_default_budget_is_work_so_loaded_runs_agree_and_the_clock_only_cuts():
    """Two command-line runs at once and one in-process solve load the machine three times over: work budgets,
    not clocks, decide the result, so all three agree; only a time limit that binds says it cut the search."""
    import json
    import subprocess

    cmd = [*OPSCHED, "compare", "--stages", "3", "--microbatches", "4", "--b", "2.5",
           "--w", "1", "--comm", "0.3", "--memory-limit", "2", "--methods", "mip", "--placement", "chain", "--json",
           "--quiet"]
    runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    sg = chain_stage_graph(3, f=1, b=2.5, w=1, comm=0.3)
    a = solve(sg, 4, memory_limit=2.0)
    outs = []
    for run in runs:
        stdout, _ = run.communicate(timeout=300)
        assert run.returncode == 0
        (row,) = json.loads(stdout)
        row.pop("solve_seconds")
        outs.append(row)
    assert outs[0] == outs[1]
    assert outs[0]["makespan"] == pytest.approx(a.makespan) and outs[0]["status"] == a.status == "feasible"
    assert outs[0]["gap"] > 0  # a case the neighbourhood search works on, not settled by the bound
    # the default run searched (it improved on its warm start) and stopped on its work budget, not the clock
    assert a.log[0][1] > a.makespan and a.search_solves > 0
    cut = solve(sg, 4, memory_limit=2.0, time_limit=1e-6)
    assert cut.status == "time limit reached"
    validate(cut.schedule)


def test_warm_order_with_fused_backward_is_used_when_splitting():
    from opsched.lower.jobs import order_peak_activation
    from opsched.lower.starts import split_fused_backward

    sg = chain_stage_graph(3, f=1, b=2, w=1, comm=0.5)
    fused = list_schedule(JobSet(sg, 4, split_backward=False), budgets=None, priority="forward")
    split = split_fused_backward(fused)
    assert all(j.pass_ != "B" for acts in split.values() for j in acts)
    peaks_fused, peaks_split = order_peak_activation(sg, fused), order_peak_activation(sg, split)
    assert all(peaks_split[d] <= peaks_fused[d] for d in peaks_fused)
    assert max(e.end for e in simulate(sg, split, 4)) <= max(e.end for e in simulate(sg, fused, 4)) + 1e-9
    limit = max(peaks_fused.values())  # the fused order just fits
    result = solve(sg, 4, memory_limit=limit, split_backward=True, warm_orders={"fused-warm": fused})
    assert "fused-warm" in result.candidates
    assert result.makespan <= result.candidates["fused-warm"] + 1e-9


@pytest.mark.slow
def test_plan_twice_gives_the_same_plan(tmp_path):
    import json
    import subprocess

    def strip_times(x):
        if isinstance(x, dict):
            return {k: strip_times(v) for k, v in x.items() if "seconds" not in k}
        if isinstance(x, list):
            return [strip_times(v) for v in x]
        return x

    plans = []
    for k in range(2):
        out = tmp_path / f"run{k}"
        subprocess.run([*OPSCHED, "plan", "models/clip_vit_l14.onnx", "--devices", "4",
                        "--microbatches", "4", "-o", str(out), "--quiet"], check=True, capture_output=True,
                       cwd=Path(__file__).resolve().parents[1])
        plans.append(strip_times(json.loads((out / "plan.json").read_text())))
    assert plans[0] == plans[1]
    assert plans[0]["metrics"]["lower_status"] != "time limit reached"


def test_mip_start_gives_every_variable_a_value_within_bounds():
    from helpers import job_order
    from opsched.lower.lns import neighbourhood, slotted_starts
    from opsched.lower.slot_solve import complete_warm_start
    from opsched.lower.timeindexed import build_model

    sg = chain_stage_graph(3, f=1, b=2, w=1, comm=1)
    js = JobSet(sg, 3)
    budgets = activation_budgets(sg, 2.0)
    starts = slotted_starts(js, job_order(list_schedule(js, budgets)), 1.0)
    horizon = max(starts[k] + js.duration[k] for k in starts)
    base = slot_problem(js, 1.0, budgets)
    sp = neighbourhood(js, base, starts, int(horizon), 4, 12)  # some jobs fixed, some free
    assert sp.fixed and sp.es
    for objective in ("makespan+flow", "span+flow"):
        model, z, _ = build_model(sp, objective=objective)
        start = complete_warm_start(model, sp, z, starts)
        assert {v.name for v, _ in start} == {v.name for v in model.vars}
        assert all(v.lb - 1e-9 <= x <= v.ub + 1e-9 for v, x in start)


def test_measured_fused_backward_time_is_what_the_mip_schedules():
    """B cheaper than I + W (as measured on a runtime): the optimum uses it and equals brute force."""
    from opsched.schedule import Stage, StageGraph

    base = chain_stage_graph(2, f=1, b=3, w=1)
    sg = StageGraph([Stage(s.id, s.devices, {**s.time, "B": 2.0}) for s in base.stages], base.edges,
                    num_devices=base.num_devices)
    for limit in (None, 1.0):
        best, _ = brute_force(sg, 3, limit, split_backward=False)
        result = solve(sg, 3, memory_limit=limit, split_backward=False, time_limit=60)
        validate(result.schedule)
        assert result.makespan == pytest.approx(best)
        assert result.makespan < solve(base, 3, memory_limit=limit, split_backward=False, time_limit=60).makespan


def test_span_bound_counts_the_path_through_the_last_stage():
    """Device 0's span includes reaching the last stage, all its F and I, and the way back (Zero Bubble's p=8, m=24)."""
    from opsched.lower.bounds import span_lower_bound

    f, i, w, c = 18.522, 18.086, 9.337, 0.601
    sg = chain_stage_graph(8, f=f, b=i + w, w=w, comm=c)
    assert span_lower_bound(JobSet(sg, 24)) == pytest.approx(7 * (f + c) + 24 * (f + i) + 7 * (i + c) + w)


@pytest.mark.parametrize("stages,mb,split,limit", [(2, 3, False, 2.0), (3, 2, True, None), (2, 3, True, 1.5)])
def test_span_bound_never_above_the_exhaustive_optimum(stages, mb, split, limit):
    from opsched.lower.bounds import span_lower_bound

    sg = chain_stage_graph(stages, f=1, b=3, w=1, comm=0.5)
    assert span_lower_bound(JobSet(sg, mb, split)) <= brute_force_span(sg, mb, limit, split) + 1e-9


def test_zero_bubble_2p_setting_reaches_the_proven_optimum():
    """Zero Bubble's p = 8, m = 24 chain at 2p·M_B: the published ZB-2p rate 0.0433, proven optimal."""
    from opsched.schedule import zb_bubble_rate

    f, i, w, c = 18.522, 18.086, 9.337, 0.601
    sg = chain_stage_graph(8, f=f, b=i + w, w=w, comm=c)
    result = solve(sg, 24, memory_limit=16.0, objective="zb-span", time_limit=60)
    validate(result.schedule)
    assert result.gap <= 1e-9 and result.lower_bound == pytest.approx(7 * (f + c) + 24 * (f + i) + 7 * (i + c) + w)
    assert round(zb_bubble_rate(result.schedule), 4) <= 0.0433


def test_times_below_a_microsecond_get_a_positive_slot():
    """Times under exact_slot's rounding tolerance once rounded to 0, a slot of 0 and a division by zero."""
    from opsched.lower.timeindexed import auto_slot, exact_slot
    from opsched.schedule import chain_stage_graph

    sg = chain_stage_graph(2, f=1e-7, b=2e-7, w=1e-7)
    assert exact_slot(sg) is None
    slot = auto_slot(sg, horizon=2e-6)
    assert 0 < slot <= 1e-7
