"""The job set's memory rule: an order's peak activation, read from its sequence alone, is what it holds when timed."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bounds import instances

from opsched.lower.jobs import JobSet, activation_budgets, order_peak_activation
from opsched.lower.listsched import default_variants, list_schedule
from opsched.schedule import Schedule, memory_profile, simulate


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(instances(), st.booleans(), st.data())
def test_an_orders_peak_is_the_peak_of_its_timed_memory_profile(inst, split, data):
    """Over random instances (chains and DAGs, groups of devices, split or fused, with and without overlapped
    pairs), the peak :func:`order_peak_activation` reads from a list-scheduler order is, on every device, the peak
    of the memory profile of that order as the simulator times it (the validator's convention)."""
    js = JobSet(inst.sg, inst.microbatches, split)
    budgets = activation_budgets(inst.sg, inst.limit)
    variant = data.draw(st.sampled_from(default_variants(js, True, budgets)))
    order = list_schedule(js, budgets, variant)
    timed = memory_profile(Schedule(inst.sg, inst.microbatches, simulate(inst.sg, order, inst.microbatches)))
    peaks = order_peak_activation(inst.sg, order)
    assert all(abs(peaks[d] - max(level for _, level in timed[d])) <= 1e-9 for d in order)
