"""Deepening the warm-up (opsched.lower.warmup).

The property test tries to break every claim of :func:`deepen_warmup` on the
bounds' random instances (chains, V and bidirectional placements, DAGs,
device groups, transfers, tight and loose memory, with and without overlap
gain), from every start the solve would take, pairs included: the result
never times worse than its start (objective, then sum of job ends), never
leaves the memory budgets, runs the same actions (only forwards move, only
on their own device), validates, counts its moves, and is the same when run
again.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bounds import instances
from test_parting import start_orders

from opsched.baselines import baseline_orders
from opsched.lower.jobs import JobSet, activation_budgets, order_fits
from opsched.lower.lns import better, incumbent_of
from opsched.lower.starts import split_fused_backward
from opsched.lower.warmup import deepen_warmup
from opsched.schedule import Job, Schedule, chain_stage_graph, jobs_of, simulate, validate
from opsched.solving.solver import Objective


def check_deepen(js: JobSet, budgets, order, objective: Objective) -> None:
    start = incumbent_of(js, order, objective)
    deepened = deepen_warmup(js, order, budgets, objective, max_simulations=40)
    again = incumbent_of(js, deepened.order, objective)
    assert (again.value, again.total_end) == (deepened.incumbent.value, deepened.incumbent.total_end)
    assert deepened.moves == 0 or better(deepened.incumbent, start)
    assert not better(start, deepened.incumbent)
    if order_fits(js.sg, order, budgets):
        assert order_fits(js.sg, deepened.order, budgets)
    moved = 0
    for d, acts in order.items():
        after = deepened.order[d]
        assert Counter(after) == Counter(acts)  # the same actions on every device
        # apart from forwards, every device keeps its sequence
        assert [a for a in after if jobs_of(a)[0].pass_ != "F" or len(jobs_of(a)) > 1] == \
               [a for a in acts if jobs_of(a)[0].pass_ != "F" or len(jobs_of(a)) > 1]
        moved += after != acts
    assert (deepened.moves == 0) == (moved == 0)
    validate(Schedule(js.sg, js.microbatches, simulate(js.sg, deepened.order, js.microbatches)))
    assert not deepened.cut
    assert deepen_warmup(js, order, budgets, objective, max_simulations=40).order == deepened.order
    assert deepen_warmup(js, order, budgets, objective, max_simulations=40, start=start).order == deepened.order


@settings(max_examples=100, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(instances(), st.sampled_from(list(Objective)))
def test_deepening_never_times_worse_nor_leaves_its_memory(inst, objective):
    budgets = activation_budgets(inst.sg, inst.limit)
    js = JobSet(inst.sg, inst.microbatches)
    for paired in (False, True) if inst.sg.may_overlap else (False,):
        for order in start_orders(js, budgets, paired=paired):
            check_deepen(js, budgets, order, objective)


@pytest.mark.parametrize("devices, microbatches, before, after", [(8, 16, 110.0, 109.0), (4, 8, 54.0, 53.0)])
def test_one_more_forward_at_the_tip_shortens_zero_bubble_v(devices, microbatches, before, after):
    # issue 11's DualPipe grid, F:I:W 1:1.5:0.5, no gain, V placement at DualPipeV's peak (DualPipeV holds
    # 2D + 1 F's activations per device, ZB-V 2D)
    sg = chain_stage_graph(2 * devices, f=1, b=2, w=0.5, devices=devices, placement="v")
    js = JobSet(sg, microbatches)
    budgets = activation_budgets(sg, 2 * devices + 1)
    zbv = split_fused_backward(baseline_orders(sg, microbatches)["zb-v"])
    assert incumbent_of(js, zbv).makespan == before
    deepened = deepen_warmup(js, zbv, budgets)
    assert deepened.incumbent.makespan == after and deepened.moves >= 1
    tip = devices - 1  # the device that waits longest for its first backward moved a forward before it
    first_backward = next(k for k, a in enumerate(deepened.order[tip]) if a.pass_ != "F")
    assert first_backward == next(k for k, a in enumerate(zbv[tip]) if a.pass_ != "F") + 1
    assert isinstance(deepened.order[tip][first_backward - 1], Job)
    assert order_fits(sg, deepened.order, budgets) and not order_fits(sg, deepened.order, {
        d: b - 1 for d, b in budgets.items()})


def test_a_deadline_in_the_past_cuts_it_and_keeps_the_order():
    sg = chain_stage_graph(8, f=1, b=2, w=0.5, devices=4, placement="v")
    js = JobSet(sg, 8)
    zbv = split_fused_backward(baseline_orders(sg, 8)["zb-v"])
    deepened = deepen_warmup(js, zbv, activation_budgets(sg, 9), deadline=0.0)
    assert deepened.cut and deepened.moves == 0 and deepened.order == zbv
