"""The validator: each broken rule is caught with a message naming the events; property tests."""

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opsched.schedule import (
    Edge,
    Event,
    Job,
    Pair,
    Schedule,
    ScheduleError,
    Stage,
    StageGraph,
    chain_stage_graph,
    dependencies,
    metrics,
    simulate,
    validate,
)

T = {"F": 1.0, "I": 1.0, "W": 1.0}


def two_stage_schedule(**kw):
    """0F0 [0,1], 1F0 [1.5,2.5], 1B0 [2.5,4.5], 0B0 [5,7] with transfers of 0.5."""
    sg = chain_stage_graph(2, f=1, b=2, w=1, comm=0.5, act=2, act_w=1, param_bytes=1)
    order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
    return Schedule(sg, 1, simulate(sg, order, 1), **kw)


def replace_event(sched, name, **changes):
    events = [e._replace(**changes) if str(e.job) == name else e for e in sched.events]
    return dataclasses.replace(sched, events=events)


def test_valid_schedule_passes():
    validate(two_stage_schedule(memory_limit=3.0))
    validate(two_stage_schedule(), split_backward=False)


def test_dependency_violation_names_both_events_and_transfer():
    bad = replace_event(two_stage_schedule(), "1F0", start=1.2, end=2.2)
    with pytest.raises(ScheduleError) as exc:
        validate(bad)
    assert str(exc.value) == "1F0 on device 1 starts at 1.2 before its dependency 0F0 ends at 1 (+ transfer 0.5)"


def test_backward_dependency_violation():
    bad = replace_event(two_stage_schedule(), "0B0", start=4.5, end=6.5)
    with pytest.raises(ScheduleError, match=r"0B0 on device 0 starts at 4.5 before its dependency 1B0 ends at 4.5 \(\+ transfer 0.5\)"):
        validate(bad)


def test_overlap_on_a_device_names_both_events():
    sg = chain_stage_graph(1, f=1, b=2, w=1)
    events = [Event(0, 0, "F", 0, 1), Event(0, 1, "F", 0.5, 1.5), Event(0, 0, "B", 1.5, 3.5), Event(0, 1, "B", 3.5, 5.5)]
    with pytest.raises(ScheduleError) as exc:
        validate(Schedule(sg, 2, events))
    assert str(exc.value) == "0F1 on device 0 starts at 0.5 while 0F0 runs until 1"


def test_overlap_on_a_shared_device_of_a_group():
    sg = StageGraph([Stage(0, (0, 1), T), Stage(1, (1,), T)])
    events = [Event(0, 0, "F", 0, 1), Event(1, 0, "F", 0.5, 1.5), Event(0, 0, "B", 1.5, 3.5), Event(1, 0, "B", 3.5, 5.5)]
    with pytest.raises(ScheduleError, match="1F0 on device 1 starts at 0.5 while 0F0 runs until 1"):
        validate(Schedule(sg, 1, events))


def test_memory_violation_names_device_time_and_holders():
    sched = two_stage_schedule(memory_limit=2.5)  # device 0 needs 1 (params) + 2 (act of 0F0)
    with pytest.raises(ScheduleError) as exc:
        validate(sched)
    msg = str(exc.value)
    assert msg.startswith("device 0 needs 3 bytes at 0 when 0F0 starts (parameters 1 + activations of 0F0)")
    assert "memory limit 2.5" in msg


def test_free_before_allocate_at_equal_times():
    # B of mb 0 ends at 3 exactly when F of mb 1 starts: one microbatch held at a time
    sg = chain_stage_graph(1, f=1, b=2, w=1, act=1, act_w=0.5)
    order = {0: [Job(0, 0, "F"), Job(0, 0, "B"), Job(0, 1, "F"), Job(0, 1, "B")]}
    validate(Schedule(sg, 2, simulate(sg, order, 2), memory_limit=1.0))
    order = {0: [Job(0, 0, "F"), Job(0, 1, "F"), Job(0, 0, "B"), Job(0, 1, "B")]}
    with pytest.raises(ScheduleError, match="0F1 starts"):
        validate(Schedule(sg, 2, simulate(sg, order, 2), memory_limit=1.0))


def test_parameters_alone_over_the_limit():
    with pytest.raises(ScheduleError, match="device 0 holds 1 bytes of parameters alone"):
        validate(two_stage_schedule(memory_limit=0.5))


def test_missing_and_duplicate_jobs():
    sched = two_stage_schedule()
    missing = dataclasses.replace(sched, events=[e for e in sched.events if str(e.job) != "1B0"])
    with pytest.raises(ScheduleError, match=r"stage 1 microbatch 0 has 1F0; it needs exactly F\+I\+W or F\+B"):
        validate(missing)
    dup = dataclasses.replace(sched, events=sched.events + [sched.events[0]])
    with pytest.raises(ScheduleError, match="stage 0 microbatch 0 has 0F0, 0F0, 0B0"):
        validate(dup)


def test_split_backward_requirement():
    with pytest.raises(ScheduleError, match=r"needs exactly F\+I\+W"):
        validate(two_stage_schedule(), split_backward=True)


def test_mixed_backward_is_rejected():
    sg = chain_stage_graph(1, f=1, b=2, w=1)
    events = [Event(0, 0, "F", 0, 1), Event(0, 0, "B", 1, 3), Event(0, 0, "W", 3, 4)]
    with pytest.raises(ScheduleError, match="has 0F0, 0W0, 0B0"):
        validate(Schedule(sg, 1, events))


def test_wrong_duration_and_unknown_stage():
    with pytest.raises(ScheduleError, match="1F0 lasts 2 .* but stage 1's F takes 1"):
        validate(replace_event(two_stage_schedule(), "1F0", end=3.5))
    with pytest.raises(ScheduleError, match="names stage 9"):
        validate(replace_event(two_stage_schedule(), "1F0", stage=9))


def test_pair_rules():
    sg = chain_stage_graph(1, f=1, b=2, w=1, overlap_gain=1.0)
    good = [Event(0, 0, "F", 0, 1), Event(0, 1, "F", 1, 3, pair=0), Event(0, 0, "B", 1, 3, pair=0), Event(0, 1, "B", 3, 5)]
    validate(Schedule(sg, 2, good))
    unpaired = [e._replace(pair=None) if e.pass_ == "B" else e for e in good]
    with pytest.raises(ScheduleError, match="pair 0 has 1 event"):
        validate(Schedule(sg, 2, unpaired))
    shifted = [e._replace(start=1.5, end=3.5) if e.pair == 0 and e.pass_ == "B" else e for e in good]
    with pytest.raises(ScheduleError, match="must share start and end"):
        validate(Schedule(sg, 2, shifted))
    long = [e._replace(end=4) if e.pair == 0 else e for e in good]
    with pytest.raises(ScheduleError, match=r"pair 0 \(0F1;0B0\) lasts 3 but the overlap rule gives 2"):
        validate(Schedule(sg, 2, long))


# ----------------------------------------------------------------- property tests


@st.composite
def stage_dags(draw):
    """A random small StageGraph: stages on random device groups, random forward edges."""
    devices = draw(st.integers(1, 3))
    n = draw(st.integers(1, 5))
    stages = []
    for k in range(n):
        group = draw(st.sets(st.integers(0, devices - 1), min_size=1, max_size=devices))
        f, i, w = (draw(st.sampled_from([0.5, 1.0, 1.5, 2.0])) for _ in range(3))
        act = draw(st.sampled_from([1.0, 2.0, 3.0]))
        stages.append(
            Stage(k, tuple(sorted(group)), {"F": f, "I": i, "W": w}, param_bytes=draw(st.sampled_from([0.0, 1.0])),
                  act_bytes=act, act_w_bytes=act / 2)
        )
    edges = [
        Edge(a, b, time=draw(st.sampled_from([0.0, 0.25, 1.0])), bytes=1.0)
        for a in range(n)
        for b in range(a + 1, n)
        if draw(st.booleans())
    ]
    return StageGraph(stages, edges, num_devices=devices, overlap_gain=draw(st.sampled_from([0.0, 0.5])))


def random_order(sg, microbatches, rng, fused):
    """A random topological interleaving of all jobs, split per device, with random pairs."""
    kinds = {(s.id, m): ("B" if fused[(s.id, m)] else "I") for s in sg.stages for m in range(microbatches)}
    jobs = [
        Job(s.id, m, p)
        for s in sg.stages
        for m in range(microbatches)
        for p in (("F", "B") if fused[(s.id, m)] else ("F", "I", "W"))
    ]
    done, sequence = set(), []
    pending = list(jobs)
    while pending:
        ready = [j for j in pending if all(d in done for d, _ in dependencies(sg, j, kinds))]
        job = rng.choice(ready)
        pending.remove(job)
        done.add(job)
        sequence.append(job)
    actions, k = [], 0
    while k < len(sequence):
        a = sequence[k]
        b = sequence[k + 1] if k + 1 < len(sequence) else None
        if (
            b is not None
            and rng.random() < 0.3
            and set(sg.stage(a.stage).devices) == set(sg.stage(b.stage).devices)
            and (a.pass_ == "F") != (b.pass_ == "F")
            and a not in [d for d, _ in dependencies(sg, b, kinds)]
        ):
            actions.append(Pair(a, b))
            k += 2
        else:
            actions.append(a)
            k += 1
    order = {d: [] for d in range(sg.num_devices)}
    for act in actions:
        first = act.first if isinstance(act, Pair) else act
        for d in sg.stage(first.stage).devices:
            order[d].append(act)
    return order


@st.composite
def simulated_schedules(draw):
    sg = draw(stage_dags())
    m = draw(st.integers(1, 3))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    fused = {(s.id, mb): draw(st.booleans()) for s in sg.stages for mb in range(m)}
    events = simulate(sg, random_order(sg, m, rng, fused), m)
    return Schedule(sg, m, events)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(simulated_schedules())
def test_simulated_schedules_always_validate(sched):
    validate(sched)
    mt = metrics(sched)
    # the tightest memory limit is the measured peak: it passes there ...
    limited = dataclasses.replace(sched, memory_limit=max(mt.peak_memory_bytes))
    validate(limited)
    assert 0 <= mt.bubble_ratio < 1
    assert all(b <= mt.makespan + 1e-9 for b in mt.busy)
    # ... and fails just below it, naming a device
    below = dataclasses.replace(sched, memory_limit=max(mt.peak_memory_bytes) - 0.25)
    with pytest.raises(ScheduleError, match="device"):
        validate(below)


@SETTINGS
@given(simulated_schedules(), st.data())
def test_moving_an_event_earlier_is_caught(sched, data):
    # in an as-soon-as-possible schedule every event that starts after 0 is
    # pinned by a dependency or by the end of the previous event on a device.
    # Moving it earlier by less than the shortest event breaks that rule (a
    # larger move may land in an earlier idle gap, which is a valid schedule
    # with another order), and the message names the moved event.
    movable = [e for e in sched.events if e.start > 0]
    if not movable:
        return
    e = data.draw(st.sampled_from(movable))
    shortest = min(x.end - x.start for x in sched.events)
    delta = data.draw(st.sampled_from([0.25, 0.5, 0.9])) * min(shortest, e.start)
    moved = {e.job} if e.pair is None else {x.job for x in sched.events if x.pair == e.pair}
    events = [
        x._replace(start=x.start - delta, end=x.end - delta) if x.job in moved else x
        for x in sched.events
    ]
    with pytest.raises(ScheduleError) as exc:
        validate(dataclasses.replace(sched, events=events))
    assert any(str(j) in str(exc.value) for j in moved)


@SETTINGS
@given(simulated_schedules(), st.data())
def test_dropping_or_duplicating_an_event_is_caught(sched, data):
    k = data.draw(st.integers(0, len(sched.events) - 1))
    e = sched.events[k]
    dropped = dataclasses.replace(sched, events=sched.events[:k] + sched.events[k + 1:])
    with pytest.raises(ScheduleError, match=f"stage {e.stage} microbatch {e.microbatch}|pair"):
        validate(dropped)
    doubled = dataclasses.replace(sched, events=sched.events + [e])
    with pytest.raises(ScheduleError):
        validate(doubled)


def test_tiny_time_units_keep_a_relative_tolerance():
    # microsecond-scale plan times: a 1 ns overlap is 1e-4 of the makespan and must be caught
    sg = chain_stage_graph(1, f=1e-6, b=2e-6, w=1e-6)
    good = [Event(0, 0, "F", 0.0, 1e-6), Event(0, 0, "B", 1e-6, 3e-6)]
    validate(Schedule(sg, 1, good))
    bad = [Event(0, 0, "F", 0.0, 1e-6), Event(0, 0, "B", 1e-6 - 1e-9, 3e-6 - 1e-9)]
    with pytest.raises(ScheduleError, match="0B0"):
        validate(Schedule(sg, 1, bad))
    # a rounding error far below 1e-9 x makespan is accepted
    rounded = [Event(0, 0, "F", 0.0, 1e-6), Event(0, 0, "B", 1e-6 * (1 - 1e-13), 3e-6 * (1 - 1e-13) + 1e-19)]
    validate(Schedule(sg, 1, rounded))


def test_catches_a_simulator_that_forgets_transfer_times():
    # time the order on a copy of the graph without edge times (a simulator
    # bug), then check the events against the real graph: the validator reads
    # only the events and the real edges, so it notices
    real = chain_stage_graph(3, f=1, b=2, w=1, comm=0.5)
    no_comm = chain_stage_graph(3, f=1, b=2, w=1, comm=0.0)
    order = {s: [Job(s, 0, "F"), Job(s, 0, "B")] for s in range(3)}
    wrong = simulate(no_comm, order, 1)
    with pytest.raises(ScheduleError, match=r"1F0 on device 1 starts at 1 before its dependency 0F0 ends at 1 \(\+ transfer 0.5\)"):
        validate(Schedule(real, 1, wrong))
    validate(Schedule(real, 1, simulate(real, order, 1)))
