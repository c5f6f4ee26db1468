"""Resuming a simulation from an earlier one (``simulate(..., earlier, since)``): the same events as a whole one."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from test_pairs_mip import overlap_instances
from test_parting import start_orders

from opsched.errors import Deadlock, OpschedError
from opsched.lower import pairing
from opsched.lower.jobs import JobSet, activation_budgets
from opsched.schedule import Job, chain_stage_graph, simulate


def swapped(order: dict, device: int, i: int) -> dict:
    """``order`` with the actions at ``i`` and ``i + 1`` of ``device`` swapped (on that device only)."""
    acts = list(order[device])
    acts[i], acts[i + 1] = acts[i + 1], acts[i]
    return {**order, device: acts}


def timed(sg, order, microbatches, *resume):
    """The events, or the kind of error the simulation raised."""
    try:
        return simulate(sg, order, microbatches, *resume)
    except Deadlock:
        return Deadlock
    except OpschedError:
        return OpschedError


def check_resumed(js: JobSet, order: dict, changed: dict, since: float) -> None:
    events = simulate(js.sg, order, js.microbatches)
    whole = timed(js.sg, changed, js.microbatches)
    assert timed(js.sg, changed, js.microbatches, events, since) == whole


@settings(max_examples=30, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(overlap_instances())
def test_resuming_gives_the_whole_simulation(inst):
    # every swap of two neighbours and every pair-up merge, resumed from the first changed action's old start,
    # gives exactly the events (pair numbers too) or the error of simulating the changed order whole
    budgets = activation_budgets(inst.sg, inst.limit)
    js = JobSet(inst.sg, inst.microbatches)
    for order in start_orders(js, budgets, paired=False) + start_orders(js, budgets, paired=True):
        events = simulate(js.sg, order, js.microbatches)
        start = {e.job: e.start for e in events}
        for d, acts in order.items():
            for i in range(len(acts) - 1):
                first = min(start[j] for a in acts[i:i + 2] for j in pairing.jobs_of(a))
                check_resumed(js, order, swapped(order, d, i), first)
        for merge in pairing._merges(js, order, pairing._Timing(order, events)):
            check_resumed(js, order, merge.order, start[merge.earlier])
            check_timing_update(js, order, events, merge)


def check_timing_update(js: JobSet, order: dict, events: list, merge) -> None:
    """The pair-up's timing, updated for a merge from what changed, equals one read from the whole order."""
    changed = timed(js.sg, merge.order, js.microbatches)
    if not isinstance(changed, list):
        return
    updated = pairing._Timing(order, events)
    updated.update(merge.order, merge.devices, changed, updated.start[merge.earlier])
    whole = pairing._Timing(merge.order, changed)
    assert (updated.start, updated.end) == (whole.start, whole.end)
    links = lambda t: {job: before for job, before in t.previous.items() if before}  # noqa: E731
    assert links(updated) == links(whole)
    assert updated.critical_path(js) == whole.critical_path(js)


def test_resuming_past_a_change_is_refused():
    sg = chain_stage_graph(2, f=1, b=2)
    order = {0: [Job(0, 0, "F"), Job(0, 1, "F"), Job(0, 0, "B"), Job(0, 1, "B")],
             1: [Job(1, 0, "F"), Job(1, 0, "B"), Job(1, 1, "F"), Job(1, 1, "B")]}
    events = simulate(sg, order, 2)
    changed = {0: order[0], 1: [Job(1, 0, "F"), Job(1, 1, "F"), Job(1, 0, "B"), Job(1, 1, "B")]}
    assert simulate(sg, changed, 2, events, 2.0) == simulate(sg, changed, 2)
    with pytest.raises(OpschedError, match="resume only from the events of an order with the same start"):
        simulate(sg, changed, 2, events, 2.5)  # device 1's B0 started at 2 and now comes later
    with pytest.raises(OpschedError, match="listed twice"):
        simulate(sg, {0: order[0], 1: order[1] + [Job(1, 0, "F")]}, 2, events, 2.0)


def test_a_copied_stage_graph_leaves_the_dependency_cache_behind():
    import pickle

    sg = chain_stage_graph(2, f=1, b=2)
    order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
    events = simulate(sg, order, 1)
    assert sg._dependencies["B"]  # the fused backwards' dependencies were kept
    copy = pickle.loads(pickle.dumps(sg))
    assert copy._dependencies == {"I": {}, "B": {}}
    assert simulate(copy, order, 1) == events
