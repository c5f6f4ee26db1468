"""Pairing up the critical path (opsched.lower.pairing).

The property test tries to break every claim of :func:`pair_up` on random
graphs with a positive overlap gain (chains, V and bidirectional placements,
DAGs, device groups, transfers, fused and split backwards), from every order
without pairs that the list scheduler and the baselines give: the result
never ends later than its start, never leaves the memory budgets, runs
exactly the same jobs, validates, holds exactly the pairs it counts, and is
the same when run again. The critical path it follows is checked too: it
reaches back to a job that starts at 0, every step of it tight.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from test_pairs_mip import overlap_instances
from test_parting import makespan, pairs_in, start_orders

from opsched.baselines import baseline_orders
from opsched.lower import solve
from opsched.lower.jobs import JobSet, activation_budgets, order_fits
from opsched.lower import pairing
from opsched.lower.lns import timed_incumbent
from opsched.lower.pairing import critical_path, pair_up
from opsched.lower.starts import _same_jobs, split_fused_backward
from opsched.schedule import Schedule, chain_stage_graph, jobs_of, simulate, validate

TOL = 1e-9


def check_critical_path(js: JobSet, order) -> None:
    events = simulate(js.sg, order, js.microbatches)
    path = critical_path(js, order, events)
    start = {e.job: e.start for e in events}
    end = {e.job: e.end for e in events}
    assert max(end[j] for j in path) == max(end.values())
    assert min(start[j] for j in path) == 0.0  # nothing held the path's first job back


def check_pair_up(js: JobSet, budgets, order, together: bool) -> None:
    before = makespan(js, order)
    paired = pair_up(js, order, budgets, max_simulations=150, together=together)
    after = makespan(js, paired.order)
    assert after == paired.makespan
    assert after <= before + TOL * max(1.0, before), (after, before)
    assert paired.merges == pairs_in(paired.order)
    assert _same_jobs(js, paired.order)
    if order_fits(js.sg, order, budgets):
        assert order_fits(js.sg, paired.order, budgets)
    validate(Schedule(js.sg, js.microbatches, simulate(js.sg, paired.order, js.microbatches)))
    assert not paired.cut
    assert pair_up(js, order, budgets, max_simulations=150, together=together).order == paired.order  # deterministic


@settings(max_examples=40, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(overlap_instances())
def test_pair_up_never_lengthens_a_start_nor_leaves_its_memory(inst):
    budgets = activation_budgets(inst.sg, inst.limit)
    for split in (True, False):
        js = JobSet(inst.sg, inst.microbatches, split)
        for order in start_orders(js, budgets, paired=False):
            check_critical_path(js, order)
            for together in (False, True):
                check_pair_up(js, budgets, order, together)


def test_pair_up_shortens_zero_bubble_v_with_few_pairs():
    # issue 11's DualPipe grid, D = 4, M = 8, F:I:W 2:2:1, gain 0.5, V placement at DualPipeV's memory
    sg = chain_stage_graph(8, f=2, b=3, w=1, devices=4, placement="v", overlap_gain=0.5)
    js = JobSet(sg, 8)
    budgets = activation_budgets(sg, 9)
    zbv = split_fused_backward(baseline_orders(sg, 8)["zb-v"])
    paired = pair_up(js, zbv, budgets)
    assert paired.makespan < makespan(js, zbv)
    assert 0 < paired.merges < sum(1 for acts in zbv.values() for a in acts if a.pass_ == "F")
    assert order_fits(sg, paired.order, budgets)
    check_critical_path(js, paired.order)


def test_pairs_reach_past_the_next_action(monkeypatch):
    # D = 4, M = 16, 2:2:1, gain 0.5: the V's steady state puts a W between an I and the next F, so adjacent
    # merges alone stop above DualPipeV's order (146 with split backwards); a reach of 3 goes below it
    sg = chain_stage_graph(8, f=2, b=3, w=1, devices=4, placement="v", overlap_gain=0.5)
    js = JobSet(sg, 16)
    budgets = activation_budgets(sg, 9)
    orders = baseline_orders(sg, 16)
    zbv, dualpipev = (split_fused_backward(orders[name]) for name in ("zb-v", "dualpipev"))
    assert pairing.PAIR_REACH == 3
    reaching = pair_up(js, zbv, budgets)
    monkeypatch.setattr(pairing, "PAIR_REACH", 1)
    adjacent = pair_up(js, zbv, budgets)
    assert reaching.makespan < makespan(js, dualpipev) < adjacent.makespan
    assert order_fits(sg, reaching.order, budgets)


def test_pairing_up_together_ends_elsewhere():
    # D = 4, M = 8, 2:2:1, gain 1: every merge that could help at once each round ends below one at a time,
    # and below DualPipeV's order, with more pairs
    sg = chain_stage_graph(8, f=2, b=3, w=1, devices=4, placement="v", overlap_gain=1.0)
    js = JobSet(sg, 8)
    budgets = activation_budgets(sg, 9)
    orders = baseline_orders(sg, 8)
    zbv, dualpipev = (split_fused_backward(orders[name]) for name in ("zb-v", "dualpipev"))
    single, together = (pair_up(js, zbv, budgets, together=t) for t in (False, True))
    assert together.makespan < min(single.makespan, makespan(js, dualpipev))
    assert together.merges == pairs_in(together.order) > single.merges
    assert together.simulations < single.simulations
    assert order_fits(sg, together.order, budgets)
    validate(Schedule(sg, 8, simulate(sg, together.order, 8)))


def test_pairing_up_together_leaves_out_what_does_not_fit_alone():
    # D = 4, M = 8, 2:2:1, gain 1, at ZB-V's own peak (8): 8 of the first round's 17 merges overflow a device on
    # their own; batching the 9 others still shortens ZB-V (86 -> 85), where a batch of all 17 overflows and the
    # round falls back to one merge at a time (that ended at 76, as one at a time does)
    sg = chain_stage_graph(8, f=2, b=3, w=1, devices=4, placement="v", overlap_gain=1.0)
    js = JobSet(sg, 8)
    budgets = activation_budgets(sg, 8)
    zbv = split_fused_backward(baseline_orders(sg, 8)["zb-v"])
    events = simulate(sg, zbv, 8)
    timing = pairing._Timing(zbv, events)
    candidates = list(pairing._merges(js, zbv, timing))
    fitting = [m for m in candidates if pairing._fits_alone(js, m, budgets)]
    assert 0 < len(fitting) < len(candidates)
    batched, simulations = pairing._all_at_once(js, timed_incumbent(js, zbv, events), events, timing, candidates,
                                                budgets, 0)
    assert simulations == 1 and batched is not None
    incumbent, count = batched.incumbent, batched.merges
    assert incumbent.makespan < makespan(js, zbv) and 1 < count <= len(fitting)
    assert order_fits(sg, incumbent.order, budgets)
    single, together = (pair_up(js, zbv, budgets, together=t) for t in (False, True))
    assert together.makespan < single.makespan and together.simulations < single.simulations
    assert order_fits(sg, together.order, budgets)


@pytest.mark.slow
def test_solve_starts_from_the_paired_up_order_when_it_is_best():
    # D = 8, M = 16, 2:2:1, gain 0.5: ZB-V paired up (165) beats DualPipeV's order (166) and every list order
    sg = chain_stage_graph(16, f=2, b=3, w=1, devices=8, placement="v", overlap_gain=0.5)
    r = solve(sg, 16, memory_limit=17, time_limit=60, search_budget=0, warm_orders=baseline_orders(sg, 16))
    validate(r.schedule)
    assert r.warm_start.startswith("zb-v paired up"), r.warm_start
    assert r.makespan <= r.candidates["dualpipev"] - 1
    assert all(len(jobs_of(a)) in (1, 2) for acts in r.order.values() for a in acts)
