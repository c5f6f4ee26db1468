"""Placing the W's lazily (opsched.lower.lazy_w).

The property test tries to break every claim of :func:`place_w_lazily` on
the bounds' random instances (chains, V and bidirectional placements, DAGs,
device groups, transfers, tight and loose memory, with and without overlap
gain), from every start the solve would take, pairs included: it applies
exactly where its docstring says (split backwards; groups of devices that
do not overlap, each device of a group listing the same actions);
the result runs the same actions with every device's other actions in
their order, fits the memory, validates and is the same when run again;
and a W never delays anything: where the order with every W at its
device's end fits the memory, every other action starts exactly when it
starts there and the step is no longer.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from test_bounds import instances
from test_parting import start_orders

from opsched.baselines import baseline_orders
from opsched.lower.jobs import JobSet, activation_budgets, noise, order_fits
from opsched.lower.lazy_w import device_groups, place_w_lazily
from opsched.lower.lns import incumbent_of
from opsched.lower.search_state import _Search
from opsched.lower.solve import solve
from opsched.lower.starts import _reshape_start, split_fused_backward
from opsched.lower.warmup import deepen_warmup
from opsched.schedule import Schedule, chain_stage_graph, jobs_of, simulate, validate
from opsched.solving.solver import Objective


def _is_w(action) -> bool:
    return len(jobs_of(action)) == 1 and jobs_of(action)[0].pass_ == "W"


def w_at_the_end(order) -> dict:
    """``order`` with every W moved, in its order, after its device's other actions."""
    return {d: [a for a in acts if not _is_w(a)] + [a for a in acts if _is_w(a)] for d, acts in order.items()}


def starts_of_others(js: JobSet, order) -> dict:
    return {(e.stage, e.microbatch, e.pass_): e.start for e in simulate(js.sg, order, js.microbatches)
            if e.pass_ != "W"}


def check_lazy(js: JobSet, budgets, order) -> None:
    lazy = place_w_lazily(js, order, budgets)
    shared = any(set(a) & set(b) and a != b for a in js.devices for b in js.devices)
    in_step = all(order.get(d, []) == order.get(devs[0], []) for devs in js.devices for d in devs)
    applies = js.split_backward and not shared and in_step
    assert (device_groups(js, order) is not None) == (not shared and in_step)
    if not applies:
        assert lazy is None
        return
    if lazy is None:  # only where the memory cannot be kept: a forward waits for memory with no W to free it
        assert budgets is not None
        return
    for d, acts in order.items():
        assert Counter(lazy[d]) == Counter(acts)
        assert [a for a in lazy[d] if not _is_w(a)] == [a for a in acts if not _is_w(a)]
    assert order_fits(js.sg, lazy, budgets)
    validate(Schedule(js.sg, js.microbatches, simulate(js.sg, lazy, js.microbatches)))
    assert place_w_lazily(js, order, budgets) == lazy
    last = w_at_the_end(order)
    if order_fits(js.sg, last, budgets):
        ours, theirs = starts_of_others(js, lazy), starts_of_others(js, last)
        assert all(abs(ours[k] - theirs[k]) <= noise(theirs[k]) for k in theirs)
        assert incumbent_of(js, lazy).makespan <= incumbent_of(js, last).makespan + noise(incumbent_of(js, last).makespan)


@settings(max_examples=100, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(instances())
def test_lazy_w_keep_the_other_actions_and_the_memory_and_delay_nothing(inst):
    budgets = activation_budgets(inst.sg, inst.limit)
    js = JobSet(inst.sg, inst.microbatches)
    for paired in (False, True) if inst.sg.may_overlap else (False,):
        for order in start_orders(js, budgets, paired=paired):
            check_lazy(js, budgets, order)
            check_lazy(js, None, order)


def on_pairs_of_devices(sg, order, budgets):
    """The same pipeline with every device d replaced by the group (2d, 2d + 1), each listing d's actions."""
    wide = replace(sg, stages=[replace(s, devices=tuple(x for d in s.devices for x in (2 * d, 2 * d + 1)))
                               for s in sg.stages], num_devices=2 * sg.num_devices)
    widen = (lambda per_device: {x: per_device[d] for d in per_device for x in (2 * d, 2 * d + 1)})
    return wide, widen(order), budgets and widen(budgets), widen


@settings(max_examples=40, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(instances())
def test_groups_of_devices_are_placed_as_their_single_devices_would_be(inst):
    if any(len(s.devices) > 1 for s in inst.sg.stages):
        return  # groups that overlap: left alone (the test above)
    budgets = activation_budgets(inst.sg, inst.limit)
    js = JobSet(inst.sg, inst.microbatches)
    for paired in (False, True) if inst.sg.may_overlap else (False,):
        for order in start_orders(js, budgets, paired=paired):
            wide, wide_order, wide_budgets, widen = on_pairs_of_devices(inst.sg, order, budgets)
            alone = place_w_lazily(js, order, budgets)
            grouped = place_w_lazily(JobSet(wide, inst.microbatches), wide_order, wide_budgets)
            assert grouped == (alone and widen(alone))
            if grouped is not None:
                check_lazy(JobSet(wide, inst.microbatches), wide_budgets, wide_order)


def grid_v(devices: int):
    """Issue 11's DualPipe grid at F:I:W = 1:1.5:0.5, no gain: the V at DualPipeV's peak (2D + 1 activations)."""
    sg = chain_stage_graph(2 * devices, f=1, b=2, w=0.5, devices=devices, placement="v")
    return sg, activation_budgets(sg, 2 * devices + 1)


@pytest.mark.parametrize("devices, microbatches, lazy, deepened", [(8, 16, 108.5, 107.5), (8, 32, 204.5, 203.5)])
def test_zero_bubble_v_gains_from_lazy_w_and_then_a_deeper_warm_up(devices, microbatches, lazy, deepened):
    sg, budgets = grid_v(devices)
    js = JobSet(sg, microbatches)
    zbv = split_fused_backward(baseline_orders(sg, microbatches)["zb-v"])
    assert incumbent_of(js, zbv).makespan == lazy + 1.5
    placed = place_w_lazily(js, zbv, budgets)
    assert incumbent_of(js, placed).makespan == lazy
    # the deeper warm-up gains only once the W wait: deepening ZB-V as it is gives one F less than both
    assert deepen_warmup(js, zbv, budgets).incumbent.makespan == lazy + 0.5
    again = place_w_lazily(js, deepen_warmup(js, placed, budgets).order, budgets)
    assert incumbent_of(js, again).makespan == deepened and order_fits(sg, again, budgets)


def test_the_solve_starts_from_it():
    # D=8, M=16: the start phase alone reaches 107.5 (issue 11's target for the row: at most 107.75)
    sg, budgets = grid_v(8)
    result = solve(sg, 16, memory_limit=17, time_limit=60, warm_orders=baseline_orders(sg, 16), search_budget=0)
    assert result.makespan == 107.5
    assert "W placed lazily" in result.warm_start


def test_fused_backwards_and_overlapping_groups_are_left_alone():
    sg, budgets = grid_v(4)
    fused = JobSet(sg, 8, split_backward=False)
    assert place_w_lazily(fused, baseline_orders(sg, 8)["zb-v"], budgets) is None
    chain = chain_stage_graph(2, f=1, b=2, w=1)
    overlapping = replace(chain, stages=[replace(chain.stages[0], devices=(0, 1)), replace(chain.stages[1], devices=(1, 2))],
                          num_devices=3)
    js = JobSet(overlapping, 2)
    order = {0: [j for j in js.jobs if j.stage == 0], 1: list(js.jobs), 2: [j for j in js.jobs if j.stage == 1]}
    assert place_w_lazily(js, order, None) is None


def test_a_chain_on_groups_runs_as_on_single_devices():
    # four stages on two devices each (a plan's layout), 1F1B's order on each device of a group: the W wait as on
    # one device per stage, within the budget
    single = chain_stage_graph(4, f=1, b=2, w=0.5)
    grouped = replace(single, stages=[replace(s, devices=(2 * k, 2 * k + 1)) for k, s in enumerate(single.stages)],
                      num_devices=8)
    one_f_one_b = split_fused_backward(baseline_orders(single, 8)["1f1b"])
    on_groups = {d: one_f_one_b[d // 2] for d in range(8)}
    for limit, makespan in ((4, 30.0), (8, 28.5)):  # 1F1B: 31.5
        lazy = place_w_lazily(JobSet(single, 8), one_f_one_b, activation_budgets(single, limit))
        grouped_lazy = place_w_lazily(JobSet(grouped, 8), on_groups, activation_budgets(grouped, limit))
        assert grouped_lazy == {d: lazy[d // 2] for d in range(8)}
        assert incumbent_of(JobSet(grouped, 8), grouped_lazy).makespan == makespan
        assert order_fits(grouped, grouped_lazy, activation_budgets(grouped, limit))
    # a group's devices in different orders: left alone
    on_groups[1] = list(reversed(on_groups[1]))
    assert place_w_lazily(JobSet(grouped, 8), on_groups, None) is None


def test_a_passed_deadline_leaves_the_start_as_it_is():
    # the reshaping is clock-capped like the rest of the start phase: past the deadline it changes nothing and says so
    sg, budgets = grid_v(8)
    js = JobSet(sg, 16)
    zbv = split_fused_backward(baseline_orders(sg, 16)["zb-v"])
    best = ("zb-v", zbv, incumbent_of(js, zbv))
    late = _Search(js, budgets, Objective.MAKESPAN, "cbc", 1, time.monotonic() - 1.0, 0.0, lambda news: None)
    assert _reshape_start(late, best, set()) is best
    assert late.clock_cut == "the deadline came before reshaping the start"
    in_time = _Search(js, budgets, Objective.MAKESPAN, "cbc", 1, time.monotonic() + 60.0, 0.0, lambda news: None)
    assert _reshape_start(in_time, best, set())[2].makespan == 107.5 and not in_time.clock_cut
