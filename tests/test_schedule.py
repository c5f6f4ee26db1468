"""Simulator and metrics: dependencies, transfers, exclusivity, groups, pairs, deadlocks, figures."""

import pytest

from helpers import hand_1f1b as one_f_one_b
from opsched.errors import OpschedError
from opsched.schedule import (
    Edge,
    Event,
    Job,
    PASSES,
    Pair,
    PassKind,
    Schedule,
    Stage,
    StageGraph,
    chain_stage_graph,
    jobs_of,
    memory_profile,
    metrics,
    simulate,
    v_device,
    v_stages,
    validate,
    zb_bubble_rate,
)


def timeline(events):
    return {(str(e.job)): (e.start, e.end) for e in events}


def test_chain_dependencies_and_transfer_times():
    sg = chain_stage_graph(2, f=1, b=3, w=1, comm=0.5)
    order = {0: [Job(0, 0, "F"), Job(0, 0, "I"), Job(0, 0, "W")], 1: [Job(1, 0, "F"), Job(1, 0, "I"), Job(1, 0, "W")]}
    t = timeline(simulate(sg, order, 1))
    assert t["0F0"] == (0, 1)
    assert t["1F0"] == (1.5, 2.5)  # + transfer 0.5
    assert t["1I0"] == (2.5, 4.5)  # I = B - W = 2
    assert t["1W0"] == (4.5, 5.5)
    assert t["0I0"] == (5.0, 7.0)  # gradient transfer 0.5 after 1I0
    assert t["0W0"] == (7.0, 8.0)


def test_transfer_time_is_only_what_the_edge_says():
    # two stages on the same device with an edge time: the simulator does not
    # invent or drop transfers; it uses the given edge time
    stages = [Stage(0, (0,), {"F": 1, "I": 1, "W": 1}), Stage(1, (0,), {"F": 1, "I": 1, "W": 1})]
    sg = StageGraph(stages, [Edge(0, 1, time=0.25)])
    order = {0: [Job(0, 0, "F"), Job(1, 0, "F"), Job(1, 0, "B"), Job(0, 0, "B")]}
    t = timeline(simulate(sg, order, 1))
    assert t["1F0"] == (1.25, 2.25)
    assert t["0B0"] == (4.5, 6.5)


def test_device_exclusivity_follows_the_order():
    sg = chain_stage_graph(1, f=1, b=2, w=1)
    order = {0: [Job(0, 0, "F"), Job(0, 1, "F"), Job(0, 1, "B"), Job(0, 0, "B")]}
    t = timeline(simulate(sg, order, 2))
    assert t["0F1"] == (1, 2) and t["0B1"] == (2, 4) and t["0B0"] == (4, 6)


def test_dag_with_branches_and_multi_device_stage():
    # stage 0 on devices {0,1} feeds two branches (devices 0 and 1) which join in stage 3 on {0,1}
    t3 = {"F": 1.0, "I": 1.0, "W": 1.0}
    stages = [
        Stage(0, (0, 1), t3),
        Stage(1, (0,), {"F": 2.0, "I": 2.0, "W": 1.0}),
        Stage(2, (1,), t3),
        Stage(3, (0, 1), t3),
    ]
    edges = [Edge(0, 1), Edge(0, 2), Edge(1, 3, time=0.5), Edge(2, 3, time=0.5)]
    sg = StageGraph(stages, edges)
    order = {
        0: [Job(0, 0, "F"), Job(1, 0, "F"), Job(3, 0, "F"), Job(3, 0, "B"), Job(1, 0, "B"), Job(0, 0, "B")],
        1: [Job(0, 0, "F"), Job(2, 0, "F"), Job(3, 0, "F"), Job(3, 0, "B"), Job(2, 0, "B"), Job(0, 0, "B")],
    }
    events = simulate(sg, order, 1)
    t = timeline(events)
    assert t["3F0"] == (3.5, 4.5)  # waits for the slower branch 1F0 (ends 3) + 0.5
    assert t["3B0"] == (4.5, 6.5)
    assert t["1B0"] == (7.0, 10.0)
    assert t["2B0"] == (7.0, 9.0)
    assert t["0B0"] == (10.0, 12.0)  # both devices free and both branches done
    validate(Schedule(sg, 1, events))


def test_multi_device_action_waits_for_every_device_of_its_group():
    t = {"F": 1.0, "I": 1.0, "W": 1.0}
    sg = StageGraph([Stage(0, (0,), {"F": 3.0, "I": 1.0, "W": 1.0}), Stage(1, (0, 1), t), Stage(2, (1,), t)])
    order = {0: [Job(0, 0, "F"), Job(1, 0, "F")], 1: [Job(2, 0, "F"), Job(1, 0, "F")]}
    ev = timeline(simulate(sg, order, 1))
    assert ev["1F0"] == (3.0, 4.0)


def test_overlapped_pair_duration_rule():
    for gain, dur in ((0.0, 3.0), (1.0, 2.0), (0.5, 2.5)):
        sg = chain_stage_graph(1, f=1, b=2, w=1, overlap_gain=gain)
        order = {0: [Job(0, 0, "F"), Pair(Job(0, 1, "F"), Job(0, 0, "B")), Job(0, 1, "B")]}
        events = simulate(sg, order, 2)
        pair = [e for e in events if e.pair is not None]
        assert len(pair) == 2 and pair[0].pair == pair[1].pair
        assert all((e.start, e.end) == (1.0, 1.0 + dur) for e in pair)
        validate(Schedule(sg, 2, events))


def test_deadlock_reports_first_blocked_action_on_each_device():
    sg = chain_stage_graph(2)
    order = {0: [Job(0, 0, "F"), Job(0, 1, "B"), Job(0, 1, "F")], 1: [Job(1, 1, "F"), Job(1, 0, "F")]}
    with pytest.raises(OpschedError) as exc:
        simulate(sg, order, 2)
    assert str(exc.value) == "the order deadlocks: device 0 waits at 0B1, device 1 waits at 1F1"


@pytest.mark.parametrize(
    "order, needle",
    [
        ({0: [Job(1, 0, "F")]}, "does not host its stage"),
        ({0: [Job(0, 0, "F"), Job(0, 0, "F")]}, "listed twice"),
        ({0: [Job(0, 5, "F")]}, "does not run microbatch 5"),
        ({7: []}, "lists device 7"),
    ],
)
def test_malformed_orders_are_refused(order, needle):
    sg = chain_stage_graph(2)
    with pytest.raises(OpschedError, match=needle):
        simulate(sg, order, 2)


def test_group_action_missing_on_one_device_is_refused():
    sg = StageGraph([Stage(0, (0, 1), {"F": 1, "I": 1, "W": 1})])
    with pytest.raises(OpschedError, match="not on \\[1\\]"):
        simulate(sg, {0: [Job(0, 0, "F")]}, 1)


def test_simulate_does_not_mutate_the_order():
    sg = chain_stage_graph(2)
    order = {0: [Job(0, 0, "F"), Job(0, 0, "B")]}
    with pytest.raises(OpschedError):
        simulate(sg, order, 1)  # device 1 never runs 1F0/1B0 -> 0B0 blocks
    assert list(order) == [0]


def test_metrics_follow_events_edited_in_place():
    """The figures kept on a schedule are computed again when its event list is edited in place."""
    sg = chain_stage_graph(2, f=1, b=2, w=1)
    order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
    sched = Schedule(sg, 1, simulate(sg, order, 1))
    assert metrics(sched).makespan == 6.0
    last = max(sched.events, key=lambda e: e.end)
    sched.events[sched.events.index(last)] = Event(last.stage, last.microbatch, last.pass_, last.start, last.end + 1)
    assert metrics(sched).makespan == 7.0


def test_bad_stage_graphs_are_refused():
    with pytest.raises(OpschedError, match="outside"):
        StageGraph([Stage(0, (2,), {"F": 1, "I": 1, "W": 1})], num_devices=2)
    with pytest.raises(OpschedError, match="act_w_bytes"):
        StageGraph([Stage(0, (0,), {"F": 1, "I": 1, "W": 1}, act_bytes=1, act_w_bytes=2)])
    with pytest.raises(OpschedError, match="cycle"):
        t = {"F": 1, "I": 1, "W": 1}
        StageGraph([Stage(0, (0,), t), Stage(1, (1,), t)], [Edge(0, 1), Edge(1, 0)])


@pytest.mark.parametrize("pp, m", [(4, 8), (8, 16)])
def test_1f1b_metrics_match_published_formulas(pp, m):
    f, b = 1.0, 2.0
    sg = chain_stage_graph(pp, f=f, b=b, w=1.0, act=1.0, act_w=0.5, param_bytes=3.0)
    sched = Schedule(sg, m, simulate(sg, one_f_one_b(pp, m), m), name="1f1b")
    validate(sched, split_backward=False)
    mt = metrics(sched)
    assert mt.makespan == pytest.approx((m + pp - 1) * (f + b))
    assert mt.idle == pytest.approx([(pp - 1) * (f + b)] * pp)
    assert mt.bubble_ratio == pytest.approx((pp - 1) / (m + pp - 1))
    assert mt.peak_activation_bytes == [float(pp - d) for d in range(pp)]
    assert mt.param_bytes == [3.0] * pp
    assert mt.peak_memory_bytes == [3.0 + pp - d for d in range(pp)]
    assert mt.param_copies == 1.0
    assert zb_bubble_rate(sched) == pytest.approx((pp - 1) / (m + pp - 1))
    d = mt.to_dict()
    assert d["makespan"] == mt.makespan and len(d["idle"]) == pp


def test_memory_profile_split_backward():
    sg = chain_stage_graph(1, f=1, b=2, w=1, act=4, act_w=1)
    order = {0: [Job(0, 0, "F"), Job(0, 1, "F"), Job(0, 0, "I"), Job(0, 1, "I"), Job(0, 0, "W"), Job(0, 1, "W")]}
    sched = Schedule(sg, 2, simulate(sg, order, 2))
    assert memory_profile(sched) == {0: [(0.0, 4.0), (1.0, 8.0), (3.0, 5.0), (4.0, 2.0), (5.0, 1.0), (6.0, 0.0)]}
    assert metrics(sched).peak_activation_bytes == [8.0]


def test_transferred_bytes_and_param_copies():
    t = {"F": 1, "I": 1, "W": 1}
    stages = [
        Stage(0, (0,), t, param_bytes=10),
        Stage(1, (1,), t, param_bytes=10),
        Stage(2, (1,), t, param_bytes=10, copy_of=0),
        Stage(3, (0,), t, param_bytes=10, copy_of=1),
    ]
    sg = StageGraph(stages, [Edge(0, 1, 0.1, bytes=5), Edge(2, 3, 0.1, bytes=7), Edge(1, 2, 0.0, bytes=100)])
    order = {
        0: [Job(0, 0, "F"), Job(3, 0, "F"), Job(3, 0, "B"), Job(0, 0, "B")],
        1: [Job(1, 0, "F"), Job(2, 0, "F"), Job(2, 0, "B"), Job(1, 0, "B")],
    }
    mt = metrics(Schedule(sg, 1, simulate(sg, order, 1)))
    # forward + gradient over each cross-device edge; the same-device edge 1->2 moves nothing
    assert mt.transferred_bytes == 2 * 5 + 2 * 7
    assert mt.param_copies == 2.0
    assert mt.param_bytes == [20, 20]


def test_zb_bubble_rate_ignores_staggered_starts():
    # each device works without a gap from its first F to its last backward:
    # the Zero Bubble rate is 0 although devices idle at the start or the end
    sg = chain_stage_graph(2, f=1, b=1, w=0, act_w=0)
    events = [Event(0, 0, "F", 0, 1), Event(1, 0, "F", 1, 2), Event(1, 0, "B", 2, 3), Event(0, 0, "B", 3, 4)]
    s = Schedule(sg, 1, events)
    validate(s)
    assert metrics(s).bubble_ratio == pytest.approx(0.5)
    assert zb_bubble_rate(s) == pytest.approx(0.5)  # device 0 spans 0..4 with a gap of 2
    events = [Event(0, 0, "F", 0, 1), Event(0, 0, "B", 1, 2), Event(1, 0, "F", 1, 2), Event(1, 0, "B", 2, 3)]
    s = Schedule(sg, 1, events)  # not a valid dependency order; the rate only reads spans
    assert metrics(s).bubble_ratio == pytest.approx(1 / 3)
    assert zb_bubble_rate(s) == 0.0


def test_measured_fused_backward_time_is_used_and_checked():
    """A stage may give B its own (measured) time; without one, B lasts I + W."""
    fast_b = {"F": 1.0, "I": 2.0, "W": 1.0, "B": 2.5}
    sg = StageGraph([Stage(0, (0,), fast_b), Stage(1, (1,), {"F": 1.0, "I": 2.0, "W": 1.0})], [Edge(0, 1)])
    order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
    t = timeline(simulate(sg, order, 1))
    assert t["1B0"] == (2.0, 5.0)  # I + W
    assert t["0B0"] == (5.0, 7.5)  # the measured 2.5
    validate(Schedule(sg, 1, simulate(sg, order, 1)))
    with pytest.raises(OpschedError, match=r"time\['B'\]"):
        StageGraph([Stage(0, (0,), {"F": 1, "I": 1, "W": 1, "B": -1})])


def test_topological_order_takes_the_smallest_ready_stage_first():
    t = {"F": 1.0, "I": 1.0, "W": 1.0}
    sg = StageGraph([Stage(k, (0,), t) for k in range(4)], [Edge(3, 1), Edge(2, 0)])
    assert sg.topological_order() == [2, 0, 3, 1]  # not ready batches [2, 3], [0, 1]
    with pytest.raises(OpschedError, match="cycle"):
        StageGraph([Stage(k, (0,), t) for k in range(2)], [Edge(0, 1), Edge(1, 0)])


def test_activation_change_is_the_memory_rule_of_each_pass():
    st = Stage(0, (0,), {"F": 1.0, "I": 1.0, "W": 1.0}, act_bytes=3.0, act_w_bytes=1.0)
    assert [st.activation_change(p) for p in ("F", "I", "W", "B")] == [3.0, -2.0, -1.0, -3.0]
    assert st.activation_change("F") + st.activation_change("I") + st.activation_change("W") == 0
    with pytest.raises(OpschedError, match="unknown pass"):
        st.activation_change("X")


def test_jobs_of_and_the_v_placement():
    f, b = Job(0, 1, "F"), Job(1, 0, "B")
    assert jobs_of(f) == (f,) and jobs_of(Pair(f, b)) == (f, b)
    assert [v_device(k, 4) for k in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert all(v_device(k, 4) == r for r in range(4) for k in v_stages(r, 4))
    with pytest.raises(OpschedError):
        v_device(8, 4)


def test_a_job_sent_to_another_process_is_found_there_by_its_hash():
    """Job caches its hash; a str's hash differs between processes (PYTHONHASHSEED), so a pickled job must not
    carry it: one sent to a process with another seed is still a key equal to the jobs made there."""
    import os
    import pickle
    import subprocess
    import sys

    sent = pickle.dumps({Job(3, 1, "W"): "found", Pair(Job(0, 2, "F"), Job(1, 0, "I")): "pair"})
    probe = ("import pickle, sys; from opsched.schedule import Job, Pair; d = pickle.loads(sys.stdin.buffer.read()); "
             "print(d[Job(3, 1, 'W')], d[Pair(Job(0, 2, 'F'), Job(1, 0, 'I'))])")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", probe], input=sent, capture_output=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        assert out.decode().split() == ["found", "pair"]
    assert Job(3, 1, "W") == pickle.loads(pickle.dumps(Job(3, 1, "W"))) and "_hash" not in repr(Job(3, 1, "W"))


def test_a_pass_kind_is_its_letter_wherever_the_letter_was_used():
    """PassKind members equal and hash as their letters, so jobs, events and files made with plain strings (plan.json
    or a CSV read back, a caller's order) are the same keys; str, f-strings, JSON and the CSV notation write the
    letter alone, on every Python from 3.10 (StrEnum's and mixed-in enums' str and format differ between them)."""
    import json
    import pickle

    assert PassKind("F") is PassKind.F and [str(p) for p in PASSES] == ["F", "I", "W", "B"]
    assert all(p == p.value and hash(p) == hash(p.value) and isinstance(p, str) for p in PassKind)
    assert Job(0, 0, "F") == Job(0, 0, PassKind.F) and hash(Job(2, 1, "B")) == hash(Job(2, 1, PassKind.B))
    assert {Job(0, 0, PassKind.W): 1}[Job(0, 0, "W")] == 1 and {"I": 2}[PassKind.I] == 2
    assert (str(PassKind.F), f"{PassKind.F}", f"{PassKind.F:>2}", "%s" % PassKind.F) == ("F", "F", " F", "F")
    assert str(Job(3, 7, PassKind.I)) == "3I7" and str(Pair(Job(0, 2, PassKind.F), Job(1, 0, PassKind.B))) == (
        "(0F2;1B0)OVERLAP_F_B")
    event = Event(0, 1, PassKind.W, 0.0, 1.0)
    assert json.dumps([event.pass_, {PassKind.B: 1}]) == '["W", {"B": 1}]'
    assert json.dumps({"pass": PassKind.F}, indent=1) == '{\n "pass": "F"\n}'  # the pure-Python encoder too
    assert pickle.loads(pickle.dumps(PassKind.I)) is PassKind.I
    # a schedule of plain letters and one of members are the same schedule
    sg = chain_stage_graph(3)
    plain = {d: [Job(j.stage, j.microbatch, str(j.pass_)) for j in acts] for d, acts in one_f_one_b(3, 4).items()}
    members = {d: [Job(j.stage, j.microbatch, PassKind(j.pass_)) for j in acts] for d, acts in plain.items()}
    assert simulate(sg, plain, 4) == simulate(sg, members, 4)
