"""Placing the W's lazily (opsched.lower.lazy_w).

The property test tries to break every claim of :func:`place_w_lazily` on
the bounds' random instances (chains, V and bidirectional placements, DAGs,
device groups, transfers, tight and loose memory, with and without overlap
gain), from every start the solve would take, pairs included: it applies
exactly where its docstring says (split backwards, one device per stage);
the result runs the same actions with every device's other actions in
their order, fits the memory, validates and is the same when run again;
and a W never delays anything: where the order with every W at its
device's end fits the memory, every other action starts exactly when it
starts there and the step is no longer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from test_bounds import instances
from test_parting import start_orders

from opsched.baselines import baseline_orders
from opsched.lower.jobs import JobSet, activation_budgets, noise, order_fits
from opsched.lower.lazy_w import place_w_lazily
from opsched.lower.lns import evaluate
from opsched.lower.solve import solve, split_fused_backward
from opsched.lower.warmup import deepen_warmup
from opsched.schedule import Schedule, chain_stage_graph, jobs_of, simulate, validate


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
    applies = js.split_backward and all(len(devs) == 1 for devs in js.devices)
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
        assert evaluate(js, lazy).makespan <= evaluate(js, last).makespan + noise(evaluate(js, last).makespan)


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


def grid_v(devices: int):
    """Issue 11's DualPipe grid at F:I:W = 1:1.5:0.5, no gain: the V at DualPipeV's peak (2D + 1 activations)."""
    sg = chain_stage_graph(2 * devices, f=1, b=2, w=0.5, devices=devices, placement="v")
    return sg, activation_budgets(sg, 2 * devices + 1)


@pytest.mark.parametrize("devices, microbatches, lazy, deepened", [(8, 16, 108.5, 107.5), (8, 32, 204.5, 203.5)])
def test_zero_bubble_v_gains_from_lazy_w_and_then_a_deeper_warm_up(devices, microbatches, lazy, deepened):
    sg, budgets = grid_v(devices)
    js = JobSet(sg, microbatches)
    zbv = split_fused_backward(baseline_orders(sg, microbatches)["zb-v"])
    assert evaluate(js, zbv).makespan == lazy + 1.5
    placed = place_w_lazily(js, zbv, budgets)
    assert evaluate(js, placed).makespan == lazy
    # the deeper warm-up gains only once the W wait: deepening ZB-V as it is gives one F less than both
    assert deepen_warmup(js, zbv, budgets).incumbent.makespan == lazy + 0.5
    again = place_w_lazily(js, deepen_warmup(js, placed, budgets).order, budgets)
    assert evaluate(js, again).makespan == deepened and order_fits(sg, again, budgets)


def test_the_solve_starts_from_it():
    # D=8, M=16: the start phase alone reaches 107.5 (issue 11's target for the row: at most 107.75)
    sg, budgets = grid_v(8)
    result = solve(sg, 16, memory_limit=17, time_limit=60, warm_orders=baseline_orders(sg, 16), search_budget=0)
    assert result.makespan == 107.5
    assert "W placed lazily" in result.warm_start


def test_fused_backwards_and_device_groups_are_left_alone():
    sg, budgets = grid_v(4)
    fused = JobSet(sg, 8, split_backward=False)
    assert place_w_lazily(fused, baseline_orders(sg, 8)["zb-v"], budgets) is None
    chain = chain_stage_graph(2, f=1, b=2, w=1)
    group = replace(chain, stages=[replace(s, devices=(0, 1)) for s in chain.stages], num_devices=2)
    js = JobSet(group, 2)
    order = {d: list(js.jobs) for d in (0, 1)}
    assert place_w_lazily(js, order, None) is None
