"""Parting the overlapped pairs a schedule does not need (opsched.lower.parting).

The property test tries to break every claim of :func:`part_pairs` on
random graphs with a positive overlap gain (chains, V and bidirectional
placements, DAGs, device groups, transfers, fused and split backwards), over
every paired order the list scheduler and the baselines give, at the order's
own makespan and with room to spare: the parted order never ends later than
allowed, never needs more memory, stays valid, parts exactly the pairs it
counts, and leaves no pair that could be parted on its own.
"""

from __future__ import annotations

import importlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pairs_mip import overlap_instances

from opsched.baselines import baseline_orders
from opsched.errors import OpschedError
from opsched.lower import solve
from opsched.lower.jobs import JobSet, activation_budgets, order_fits, order_peak_activation
from opsched.lower.listsched import default_variants, list_schedule
from opsched.lower.lns import incumbent_of
from opsched.lower.parting import part_pairs
from opsched.lower.starts import _same_jobs, split_fused_backward
from opsched.schedule import Job, Pair, Schedule, chain_stage_graph, validate

solve_module = importlib.import_module("opsched.lower.solve")  # the package exports the function as solve

TOL = 1e-9


def makespan(js: JobSet, order) -> float:
    return incumbent_of(js, order).makespan


def pairs_in(order) -> int:
    """Distinct pairs (a stage on a device group lists its pair on each of its devices)."""
    return len({a for acts in order.values() for a in acts if isinstance(a, Pair)})


def paired_orders(js: JobSet, budgets) -> list[dict]:
    """Every distinct order with a pair that the list scheduler (with pairs) and the baselines give for ``js``."""
    return start_orders(js, budgets, paired=True)


def start_orders(js: JobSet, budgets, paired: bool) -> list[dict]:
    """Every distinct order with pairs (``paired``) or without that the list scheduler (with pairs allowed when
    ``paired``) and the baselines give for ``js``, each a start the solve would take."""
    orders = [list_schedule(js, budgets, v) for v in default_variants(js, allow_pairs=paired, budgets=budgets)]
    for order in baseline_orders(js.sg, js.microbatches).values():
        orders.append(split_fused_backward(order) if js.split_backward else order)
    out, seen = [], set()
    for order in orders:
        key = tuple((d, tuple(acts)) for d, acts in sorted(order.items()))
        if key in seen or any(isinstance(a, Pair) for acts in order.values() for a in acts) != paired:
            continue
        seen.add(key)
        try:
            makespan(js, order)
        except OpschedError:  # a baseline that does not run on this graph
            continue
        if _same_jobs(js, order):  # the solve's own rule for a start: exactly the job set, on every device
            out.append(order)
    return out


def alone(order, device_pair: tuple[int, int], sequence: tuple[Job, Job]) -> dict:
    """``order`` with one pair (device, position) parted into ``sequence`` on every device that runs it."""
    d, i = device_pair
    pair = order[d][i]
    return {e: [x for a in acts for x in (sequence if a == pair else (a,))] for e, acts in order.items()}


def check_parting(js: JobSet, budgets, order, slack: float) -> None:
    before = makespan(js, order)
    limit = before + slack
    parted = part_pairs(js, order, makespan=limit if slack else None)
    after = makespan(js, parted.order)
    assert after <= limit + TOL * max(1.0, limit), (after, limit)
    assert parted.count == pairs_in(order) - pairs_in(parted.order)
    assert max(e.end for e in parted.events) == after
    peaks_before, peaks_after = order_peak_activation(js.sg, order), order_peak_activation(js.sg, parted.order)
    assert all(peaks_after[d] <= peaks_before[d] + TOL for d in peaks_before), (peaks_before, peaks_after)
    if order_fits(js.sg, order, budgets):
        assert order_fits(js.sg, parted.order, budgets)
    validate(Schedule(js.sg, js.microbatches, parted.events))
    # maximal: no pair left can be parted on its own, either way round, within the limit
    for d, acts in parted.order.items():
        for i, a in enumerate(acts):
            if isinstance(a, Pair):
                for sequence in ((a.first, a.second), (a.second, a.first)):
                    try:
                        longer = makespan(js, alone(parted.order, (d, i), sequence))
                    except OpschedError:  # the other way round waits for itself: not a schedule
                        continue
                    assert longer > limit + TOL * max(1.0, limit), (d, str(a), sequence, longer, limit)


def check_instance(inst, slack: float) -> None:
    budgets = activation_budgets(inst.sg, inst.limit)
    for split in (True, False):
        js = JobSet(inst.sg, inst.microbatches, split)
        for order in paired_orders(js, budgets):
            check_parting(js, budgets, order, slack)


@settings(max_examples=60, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(overlap_instances(), st.sampled_from([0.0, 0.5, 2.0]))
def test_parting_keeps_the_makespan_and_memory_and_leaves_no_pair_it_could_part(inst, slack):
    check_instance(inst, slack)


@pytest.mark.slow
@settings(max_examples=400, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(overlap_instances(), st.sampled_from([0.0, 0.5, 2.0]))
def test_parting_holds_on_400_more_instances(inst, slack):
    check_instance(inst, slack)


def test_a_pair_where_the_device_waits_anyway_is_parted():
    # one stage, F 1, I 1, W 1, gain 1: the pair (F1; I0) lasts 1, parted it lasts 2
    sg = chain_stage_graph(1, f=1, b=2, w=1, overlap_gain=1.0)
    js = JobSet(sg, 2)
    order = {0: [Job(0, 0, "F"), Pair(Job(0, 1, "F"), Job(0, 0, "I")), Job(0, 0, "W"), Job(0, 1, "I"), Job(0, 1, "W")]}
    assert part_pairs(js, order).count == 0  # every unit of the device is needed for 5
    parted = part_pairs(js, order, makespan=6.0)
    assert parted.count == 1
    assert [str(a) for a in parted.order[0]] == ["0F0", "0I0", "0F1", "0W0", "0I1", "0W1"]  # backward first


def test_solve_parts_the_pairs_its_makespan_does_not_need(monkeypatch):
    # issue 11's DualPipe grid, D = 4, M = 8, F:I:W 1:1:1, gain 0.5, V placement at DualPipeV's memory; without
    # the search that thins pairs first (tests/test_pairs_mip.py), which left the parting step nothing here
    monkeypatch.setattr(solve_module, "THINNING_BUDGET", 0)  # the search's child process is forked with it
    sg = chain_stage_graph(8, f=1, b=2, w=1, devices=4, placement="v", overlap_gain=0.5)
    warm = baseline_orders(sg, 8)
    r = solve(sg, 8, memory_limit=9, time_limit=20, search_budget=10, warm_orders=warm)
    validate(r.schedule)
    assert r.pairs_parted > 0
    js = JobSet(sg, 8)
    again = part_pairs(js, r.order)
    assert again.count == 0  # what the solve returns has no pair left to part
