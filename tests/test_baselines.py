"""The hand-written baselines: published idle-time formulas, memory, placements, refusals.

Idle time and activation peaks are recomputed here from the simulated events
(independently of opsched.schedule's metrics) so the two can disagree.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from opsched import baselines
from opsched.baselines import NAMES, baseline_order, placed_stage_graph, run_baseline
from opsched.errors import OpschedError, Unsupported
from opsched.schedule import Edge, Job, Pair, Stage, StageGraph, chain_stage_graph, simulate

# --------------------------------------------------------------------------- helpers


def device_of(sg, stage):
    return sg.stage(stage).devices[0]


def idle_per_device(schedule):
    """makespan - busy time on each device (an overlapped pair counted once)."""
    sg = schedule.stage_graph
    makespan = max(e.end for e in schedule.events)
    busy = defaultdict(float)
    seen_pairs = set()
    for e in schedule.events:
        if e.pair is not None:
            if e.pair in seen_pairs:
                continue
            seen_pairs.add(e.pair)
        busy[device_of(sg, e.stage)] += e.end - e.start
    return [makespan - busy[d] for d in range(sg.num_devices)]


def peak_activations(schedule):
    """Peak activation bytes per device: F holds act from its start; I frees act-act_w, W act_w, B act."""
    sg = schedule.stage_graph
    changes = defaultdict(list)
    for e in schedule.events:
        s = sg.stage(e.stage)
        d = s.devices[0]
        if e.pass_ == "F":
            changes[d].append((e.start, 1, s.act_bytes))
        elif e.pass_ == "I":
            changes[d].append((e.end, 0, -(s.act_bytes - s.act_w_bytes)))
        elif e.pass_ == "W":
            changes[d].append((e.end, 0, -s.act_w_bytes))
        else:
            changes[d].append((e.end, 0, -s.act_bytes))
    peaks = []
    for d in range(sg.num_devices):
        level = peak = 0.0
        for _, _, delta in sorted(changes[d]):  # frees (0) before allocations (1) at equal times
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return peaks


def assert_complete_and_ordered(schedule):
    """Every job runs once, and every dependency ends (plus its edge time) before its dependant starts."""
    sg, m = schedule.stage_graph, schedule.microbatches
    ends = {}
    starts = {}
    for e in schedule.events:
        assert e.job not in ends, f"{e.job} runs twice"
        ends[e.job], starts[e.job] = e.end, e.start
    for s in sg.stages:
        for mb in range(m):
            if not s.runs(mb):
                continue
            assert Job(s.id, mb, "F") in ends
            assert Job(s.id, mb, "B") in ends or (Job(s.id, mb, "I") in ends and Job(s.id, mb, "W") in ends)
    backward = {(j.stage, j.microbatch): j.pass_ for j in ends if j.pass_ in "IB"}
    for job, start in starts.items():
        s, mb = job.stage, job.microbatch
        if job.pass_ == "F":
            deps = [(Job(e.src, mb, "F"), e.time) for e in sg.preds(s)]
        elif job.pass_ in "IB":
            deps = [(Job(s, mb, "F"), 0.0)] + [
                (Job(e.dst, mb, backward[(e.dst, mb)]), e.time) for e in sg.succs(s) if sg.stage(e.dst).runs(mb)
            ]
        else:
            deps = [(Job(s, mb, "I"), 0.0)]
        for dep, delay in deps:
            assert ends[dep] + delay <= start + 1e-9, f"{job} starts before {dep} (+{delay}) ends"


# Uniform costs where the published formulas are exact: they assume I <= F
# (the papers draw F = I); see docs/baselines.md for what happens otherwise.
UNIFORM = [(1, 2, 1), (2, 3, 1), (1, 1.5, 0.5), (2, 4, 2), (3, 4, 1)]


# --------------------------------------------------------------------------- registry


def test_names_are_the_documented_list_in_order():
    """docs/baselines.md's registry table lists ``NAMES`` as they are (a new method adds its name there)."""
    from helpers import REPO

    doc = (REPO / "docs" / "baselines.md").read_text(encoding="utf-8")
    row = next(line for line in doc.splitlines() if line.startswith("| `NAMES`"))
    assert row == f"| `NAMES` | `{NAMES}` |".replace("'", '"')
    assert NAMES[:8] == ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipe", "dualpipev"]


def test_unknown_method_is_refused_with_the_names():
    with pytest.raises(Unsupported, match="choose from gpipe, 1f1b"):
        run_baseline("pipedream", chain_stage_graph(4), 8)


# --------------------------------------------------------------------------- published formulas


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("f,b,w", UNIFORM)
def test_1f1b_idle_is_pp_minus_1_times_f_plus_b(pp, f, b, w):
    sched = run_baseline("1f1b", chain_stage_graph(pp, f=f, b=b, w=w), 2 * pp)
    assert idle_per_device(sched) == pytest.approx([(pp - 1) * (f + b)] * pp)


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("f,b,w", UNIFORM)
def test_zb_h1_idle_is_pp_minus_1_times_f_plus_b_minus_2w(pp, f, b, w):
    sched = run_baseline("zb-h1", chain_stage_graph(pp, f=f, b=b, w=w), 3 * pp)
    assert idle_per_device(sched) == pytest.approx([(pp - 1) * (f + b - 2 * w)] * pp)


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("f,b,w", UNIFORM)
def test_dualpipe_idle_is_half_pp_minus_1_times_fb_plus_b_minus_3w(pp, f, b, w):
    # default overlap rule: no gain, so an F&B pair lasts F + B
    sched = run_baseline("dualpipe", chain_stage_graph(pp, f=f, b=b, w=w), 2 * pp + 4)
    assert idle_per_device(sched) == pytest.approx([(pp / 2 - 1) * ((f + b) + b - 3 * w)] * pp)


@pytest.mark.parametrize("pp", [4, 8])
def test_peak_activations_1f1b_pp_and_dualpipe_pp_plus_1(pp):
    sg = chain_stage_graph(pp, act=1, act_w=0.5)
    one_f = run_baseline("1f1b", sg, 3 * pp)
    assert max(peak_activations(one_f)) == pytest.approx(pp)
    assert peak_activations(one_f)[0] == pytest.approx(pp)
    dual = run_baseline("dualpipe", sg, 2 * pp + 4)
    assert peak_activations(dual) == pytest.approx([pp + 1] * pp)


def test_dualpipev_idles_twice_zb_v_on_reference_check():
    # REFERENCE.md: 4 devices x 2 stages, 16 microbatches, F = I = W = 1
    sg = chain_stage_graph(8, f=1, b=2, w=1, devices=4, placement="v")
    dv = run_baseline("dualpipev", sg, 16)
    zv = run_baseline("zb-v", sg, 16)
    assert idle_per_device(dv) == pytest.approx([6.0] * 4)
    assert idle_per_device(zv) == pytest.approx([3.0] * 4)
    makespan = max(e.end for e in dv.events)
    assert sum(idle_per_device(dv)) / (4 * makespan) == pytest.approx(0.059, abs=5e-4)


def zb_rate(schedule):
    """The Zero Bubble paper's bubble rate, (cost - m(F+I+W)) / cost with cost the longest device span."""
    sg = schedule.stage_graph
    spans, work = {}, {}
    for d in range(sg.num_devices):
        evs = [e for e in schedule.events if device_of(sg, e.stage) == d]
        spans[d] = max(e.end for e in evs) - min(e.start for e in evs)
        work[d] = sum(e.end - e.start for e in evs)
    d = max(spans, key=lambda k: (spans[k], -k))
    return (spans[d] - work[d]) / spans[d]


def test_zero_bubble_paper_bubble_rates_reproduced():
    # arXiv 2401.10241's measured 1.5B costs (ms), p = 8, m = 24; I = T_B, W = T_W
    f, i, w, comm = 18.522, 18.086, 9.337, 0.601
    sg = chain_stage_graph(8, f=f, b=i + w, w=w, comm=comm)
    rates = {n: zb_rate(run_baseline(n, sg, 24)) for n in ("1f1b", "zb-h1", "zb-h2")}
    assert rates == pytest.approx({"1f1b": 0.2431, "zb-h1": 0.1585, "zb-h2": 0.1083}, abs=5e-5)


def test_zb_h2_holds_2p_minus_1_microbatches_before_i_on_stage_0():
    pp = 4
    sched = run_baseline("zb-h2", chain_stage_graph(pp, act=1, act_w=0), 4 * pp)
    assert peak_activations(sched)[0] == pytest.approx(2 * pp - 1)
    assert idle_per_device(sched) == pytest.approx([pp - 1] * pp)  # F = I = W: only the fill


def test_zb_v_zero_bubble_inside_the_steady_state():
    # F = I = W: each device idles only while the first forwards travel down the V
    sg = chain_stage_graph(8, f=1, b=2, w=1, devices=4, placement="v")
    sched = run_baseline("zb-v", sg, 32)
    assert idle_per_device(sched) == pytest.approx([3.0] * 4)


# --------------------------------------------------------------------------- every method, any costs


def on_devices(sg, devices):
    """The same chain with stage k on device k mod ``devices`` (any input placement will do)."""
    from dataclasses import replace

    stages = [replace(s, devices=(s.id % devices,)) for s in sg.stages]
    return StageGraph(stages, sg.edges, num_devices=devices, overlap_gain=sg.overlap_gain)


def random_chain(rng, stages, devices, comm):
    f = [rng.uniform(0.3, 3) for _ in range(stages)]
    w = [rng.uniform(0.1, 1.5) for _ in range(stages)]
    b = [x + rng.uniform(0.1, 3) for x in w]
    act = [rng.uniform(0.5, 2) for _ in range(stages)]
    sg = chain_stage_graph(stages, f=f, b=b, w=w, act=act, act_w=[a / 3 for a in act], comm=comm)
    return on_devices(sg, devices)


@pytest.mark.parametrize("name", NAMES)
def test_non_uniform_costs_run_without_deadlock(name):
    rng = random.Random(7)
    for stages, devices, m in [(4, 4, 8), (8, 4, 16), (8, 8, 16), (6, 2, 8), (2, 2, 4)]:
        sg = random_chain(rng, stages, devices, comm=rng.uniform(0, 0.5))
        sched = run_baseline(name, sg, m)
        assert sched.name == name
        assert sched.stage_graph.num_devices == devices
        assert_complete_and_ordered(sched)
        # device exclusivity: no two actions overlap on one device
        by_device = defaultdict(list)
        for e in sched.events:
            by_device[device_of(sched.stage_graph, e.stage)].append((e.start, e.end, e.pair))
        for spans in by_device.values():
            spans = sorted(set(spans))
            for (s0, e0, p0), (s1, e1, p1) in zip(spans, spans[1:]):
                assert e0 <= s1 + 1e-9 or (p0 is not None and p0 == p1)


@pytest.mark.parametrize("name", NAMES)
def test_orders_do_not_depend_on_costs(name):
    cheap = chain_stage_graph(8, f=1, b=2, w=1, devices=4, placement="v")
    rng = random.Random(3)
    costly = random_chain(rng, 8, 4, comm=0.3)
    a = baseline_order(name, placed_stage_graph(name, cheap, 16), 16)
    b = baseline_order(name, placed_stage_graph(name, costly, 16), 16)
    assert a == b


def test_dualpipe_runs_overlapped_pairs_and_gain_shortens_them():
    sg = chain_stage_graph(4, f=1, b=2, w=1)
    order = baseline_order("dualpipe", placed_stage_graph("dualpipe", sg, 12), 12)
    pairs = [a for acts in order.values() for a in acts if isinstance(a, Pair)]
    assert pairs and all(p.first.pass_ == "F" and p.second.pass_ == "B" for p in pairs)
    no_gain = max(e.end for e in run_baseline("dualpipe", sg, 12).events)
    gain_sg = chain_stage_graph(4, f=1, b=2, w=1, overlap_gain=1.0)
    full_gain = max(e.end for e in run_baseline("dualpipe", gain_sg, 12).events)
    assert full_gain < no_gain


# --------------------------------------------------------------------------- placements


def test_chain_methods_merge_consecutive_stages_summing_costs():
    sg = chain_stage_graph(
        6, f=[1, 2, 3, 4, 5, 6], b=[2] * 6, w=[1] * 6, act=[1, 1, 2, 2, 3, 3], devices=6, comm=0.25
    )
    sg = on_devices(sg, 4)
    placed = placed_stage_graph("1f1b", sg)
    assert [s.devices for s in placed.stages] == [(0,), (1,), (2,), (3,)]
    assert [s.time["F"] for s in placed.stages] == [3, 7, 5, 6]  # groups 2, 2, 1, 1
    assert [s.act_bytes for s in placed.stages] == [2, 4, 3, 3]
    assert [e.time for e in placed.edges] == [0.25, 0.25, 0.25]


def test_interleaved_places_stage_k_on_device_k_mod_d():
    placed = placed_stage_graph("interleaved-1f1b", on_devices(chain_stage_graph(12), 4))
    assert [s.devices[0] for s in placed.stages] == [k % 4 for k in range(12)]


def test_v_methods_split_one_stage_per_device_into_two_chunks():
    sg = chain_stage_graph(4, f=[2, 4, 6, 8], b=4, w=2, comm=0.5)
    placed = placed_stage_graph("zb-v", sg)
    assert [s.devices[0] for s in placed.stages] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [s.time["F"] for s in placed.stages] == [1, 1, 2, 2, 3, 3, 4, 4]
    # halves of one stage on different devices get the chain's link time; same device costs nothing
    assert [e.time for e in placed.edges] == [0.5, 0.5, 0.5, 0.0, 0.5, 0.5, 0.5]


def test_dualpipe_placement_two_copies_half_the_microbatches_each():
    sg = chain_stage_graph(4, f=[1, 2, 3, 4])
    placed = placed_stage_graph("dualpipe", sg, 8)
    assert [s.devices[0] for s in placed.stages] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [s.copy_of for s in placed.stages] == [None] * 4 + [0, 1, 2, 3]
    assert [s.time["F"] for s in placed.stages] == [1, 2, 3, 4, 1, 2, 3, 4]
    assert {s.microbatches for s in placed.stages[:4]} == {(0, 1, 2, 3)}
    assert {s.microbatches for s in placed.stages[4:]} == {(4, 5, 6, 7)}
    with pytest.raises(Unsupported, match="pass microbatches"):
        placed_stage_graph("dualpipe", sg)


def test_placed_graph_is_returned_unchanged_when_it_already_fits():
    sg = chain_stage_graph(8, devices=4, placement="v", comm=0.5)
    placed = placed_stage_graph("dualpipev", sg)
    assert [s.devices for s in placed.stages] == [s.devices for s in sg.stages]
    assert [e.time for e in placed.edges] == [e.time for e in sg.edges]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("devices", [2, 4])
def test_each_module_states_the_placement_it_builds(name, devices):
    """``stages_per_device`` and ``devices_of`` describe exactly what ``place`` builds."""
    module = baselines.method(name)
    sg = chain_stage_graph(devices)
    placed = placed_stage_graph(name, sg, 4 * devices)
    logical = module.stages_per_device(devices, devices) * devices
    copies = [module.devices_of(k, devices) for k in range(logical)]
    want = [(c[copy],) for copy in range(len(copies[0])) for c in copies]
    assert [s.devices for s in placed.stages] == want
    baseline_order(name, placed, 4 * devices)  # and its order accepts that placement


def test_interleaved_stages_per_device_follows_the_chain():
    module = baselines.method("interleaved-1f1b")
    assert [module.stages_per_device(4, p) for p in (4, 8, 12, 13)] == [2, 2, 3, 3]


def test_contiguous_split_sizes_and_syncs_come_from_the_placement():
    from opsched.plan.contiguous import _device_sync, method_stage_count

    # the published methods (a new one adds its own case)
    want = {"gpipe": 3, "1f1b": 3, "interleaved-1f1b": 6, "zb-h1": 3, "zb-h2": 3, "zb-v": 6, "dualpipe": 3,
            "dualpipev": 6}
    assert {n: method_stage_count(n, 3) for n in want} == want
    syncs = [1.0, 2.0, 4.0, 8.0]
    assert _device_sync("1f1b", syncs, 4) == 8.0
    assert _device_sync("interleaved-1f1b", syncs, 2) == 10.0  # devices 0: 1+4, 1: 2+8
    assert _device_sync("zb-v", syncs, 2) == 9.0  # V: device 0: 1+8, device 1: 2+4
    assert _device_sync("dualpipe", syncs, 4) == 9.0  # device r holds stages r and 3-r
    assert _device_sync("gpipe", [], 4) == 0.0


# --------------------------------------------------------------------------- refusals


def refused(name, sg, m, match):
    with pytest.raises(Unsupported, match=match) as info:
        run_baseline(name, sg, m)
    assert "\n" not in str(info.value)


def test_dualpipe_refuses_odd_pp_odd_or_too_few_microbatches():
    refused("dualpipe", chain_stage_graph(3), 12, "even number of stages per direction.*PP=3")
    refused("dualpipe", chain_stage_graph(4), 9, "microbatches >= 2\\*PP and even.*microbatches=9")
    refused("dualpipe", chain_stage_graph(4), 6, "microbatches=6")


def test_dualpipe_order_refuses_a_graph_without_the_two_copies():
    with pytest.raises(Unsupported, match="two copies"):
        baseline_order("dualpipe", chain_stage_graph(4), 8)


def test_dualpipe_order_refuses_copies_with_the_wrong_microbatches():
    placed = placed_stage_graph("dualpipe", chain_stage_graph(4), 8)
    with pytest.raises(Unsupported, match="must run microbatches 0..4"):
        baseline_order("dualpipe", placed, 10)


def test_dualpipev_refuses_fewer_than_2d_microbatches():
    refused("dualpipev", chain_stage_graph(8, devices=4, placement="v"), 7, "microbatches >= 8.*got 7")


def test_interleaved_refuses_microbatches_not_a_multiple_of_the_rounds():
    refused("interleaved-1f1b", chain_stage_graph(8, devices=4, placement="interleaved"), 9,
            r"9 is not a multiple of 2; use a multiple of 4 microbatches \(e.g. 12\)")


def test_interleaved_order_refuses_one_chunk_per_device():
    with pytest.raises(Unsupported, match="v >= 2 chunks"):
        baseline_order("interleaved-1f1b", chain_stage_graph(4), 8)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_chain_methods_refuse_a_v_placement_as_given(name):
    with pytest.raises(Unsupported, match="stages on 2 devices"):
        baseline_order(name, chain_stage_graph(4, devices=2, placement="v"), 8)


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_v_methods_refuse_a_chain_placement_as_given(name):
    with pytest.raises(Unsupported, match="in a V"):
        baseline_order(name, chain_stage_graph(4), 8)


@pytest.mark.parametrize("name", NAMES)
def test_every_method_refuses_a_branching_graph(name):
    stages = [Stage(k, (k,), {"F": 1, "I": 1, "W": 1}) for k in range(4)]
    sg = StageGraph(stages, [Edge(0, 1), Edge(0, 2), Edge(1, 3), Edge(2, 3)])
    refused(name, sg, 8, "chain of stages")


@pytest.mark.parametrize("name", NAMES)
def test_every_method_refuses_a_chain_it_cannot_split(name):
    sg = chain_stage_graph(3)
    refused(name, StageGraph(sg.stages, sg.edges, num_devices=4), 16, f"^{name}: cannot turn 3 stages into")


@pytest.mark.parametrize("name", NAMES)
def test_every_method_refuses_zero_microbatches(name):
    with pytest.raises(Unsupported, match="microbatches"):
        run_baseline(name, chain_stage_graph(4), 0)


def test_memory_limit_refuses_a_schedule_over_it():
    sg = chain_stage_graph(4, act=1, act_w=0.5)
    run_baseline("1f1b", sg, 8, memory_limit=4)
    refused_limit = pytest.raises(Unsupported, match="gpipe needs 8 per device, over the memory limit 4")
    with refused_limit:
        run_baseline("gpipe", sg, 8, memory_limit=4)


def test_unsupported_is_an_opsched_error():
    assert issubclass(Unsupported, OpschedError)
    assert baselines.placement_of("dualpipe") == "bidirectional"


def test_orders_simulate_on_exactly_the_placed_graph():
    sg = placed_stage_graph("zb-h1", chain_stage_graph(4))
    order = baseline_order("zb-h1", sg, 6)
    events = simulate(sg, order, 6)
    assert len(events) == 4 * 6 * 3


# --------------------------------------------------------------------------- property


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from opsched.schedule import validate  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    stages=st.integers(1, 8),
    devices=st.integers(1, 6),
    microbatches=st.integers(1, 14),
    seed=st.integers(0, 10**6),
)
def test_any_chain_either_refuses_or_gives_a_valid_schedule(name, stages, devices, microbatches, seed):
    rng = random.Random(seed)
    sg = random_chain(rng, stages, devices, comm=rng.choice([0.0, 0.2]))
    try:
        sched = run_baseline(name, sg, microbatches)
    except Unsupported as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    validate(sched)
    assert_complete_and_ordered(sched)
    assert sched.stage_graph.num_devices == devices


def test_linearize_runs_towers_one_after_another():
    from opsched.schedule.placement import is_chain, linearize
    from opsched.schedule import metrics

    t = {"F": 1.0, "I": 1.0, "W": 1.0}
    links = [(0, 1), (1, 2), (2, 5), (3, 4), (4, 5), (5, 6), (6, 7)]
    sg = StageGraph([Stage(k, (k,), {p: (0.5 if k in (3, 4) else 1.0) * v for p, v in t.items()}, name=f"s{k}")
                     for k in range(8)], [Edge(a, b, 0.1 * (a + 1)) for a, b in links], num_devices=8)
    chain = linearize(sg)
    assert is_chain(chain) and not is_chain(sg)
    assert [s.name for s in chain.stages] == [f"s{k}" for k in (0, 1, 2, 3, 4, 5, 6, 7)]
    # the second tower's first stage had no input: its new edge takes the widest link (7 -> ... 0.7)
    assert [round(e.time, 9) for e in chain.edges] == [0.1, 0.2, 0.7, 0.4, 0.5, 0.6, 0.7]
    assert chain.stages[3].time["F"] == 0.5
    with pytest.raises(Unsupported, match="chain"):
        run_baseline("1f1b", sg, 8)
    assert metrics(run_baseline("1f1b", chain, 8)).makespan > 0


# --------------------------------------------------------------------------- on fewer devices (issue 13, item 4)


def test_the_planner_offers_the_best_baseline_on_fewer_nodes_when_more_are_slower():
    """Four nodes of 2 devices joined by a slow link: every split over all 8 devices sends the large activations
    between nodes (0.2 s a step), while 2 devices of one node run the model in under 3 ms. The planner's
    baselines must include that plan (devices 2-7 idle), and be no slower than the best on any halving."""
    import networkx as nx

    from helpers import SLOW_LINK_CLUSTER
    from opsched.cost.cluster import Training, cluster_from_dict, with_devices
    from opsched.plan.contiguous import contiguous_baselines
    from opsched.model.graph import Block
    from opsched.plan.runtime_filter import RuntimeFilter
    from opsched.plan.alternatives import idle_devices

    bg = nx.DiGraph(kind="BlockGraph")
    for i in range(4):
        bg.add_node(i, block=Block(i, f"layers.{i}", (), (), flops=1e9, param_count=10**6, output_bytes=1e8, saved_bytes=1e8))
    bg.add_edges_from([(i, i + 1) for i in range(3)], bytes=1e8)
    cluster = cluster_from_dict({**SLOW_LINK_CLUSTER, "devices": 8, "devices_per_node": 2,
                                 "inter_node_bandwidth": 1e9})
    training = Training(microbatches=4)
    offered, _, _ = RuntimeFilter(None, training, {b: [b] for b in bg}, bg).all_baselines(bg, cluster, 8e10, None)
    on_all, _, _ = contiguous_baselines(bg, cluster, training, 8e10)
    best = offered[0]
    assert best.layout.endswith(", on 2 of the 8 devices")
    assert idle_devices(best.schedule.stage_graph, 8) == (2, 3, 4, 5, 6, 7)
    assert best.step_time < on_all[0].step_time / 10
    for n in (4, 2):
        fewer, _, _ = contiguous_baselines(bg, with_devices(cluster, n), training, 8e10)
        assert best.step_time <= fewer[0].step_time


def test_baselines_are_the_same_for_any_number_of_workers():
    """Issue 13 item 2: the pipeline depths are tried in a process pool; merged in depth order, the rows, the best
    split and the refusals do not depend on how many run at once."""
    import networkx as nx

    from helpers import SLOW_LINK_CLUSTER
    from opsched.cost.cluster import Training, cluster_from_dict
    from opsched.plan.contiguous import contiguous_baselines
    from opsched.model.graph import Block

    bg = nx.DiGraph(kind="BlockGraph")
    for i in range(8):
        bg.add_node(i, block=Block(i, f"layers.{i}", (), (), flops=1e12 * (1 + i % 3), param_count=10**8,
                                   output_bytes=1e8, saved_bytes=1e8, tp_comm_bytes=1e7))
    bg.add_edges_from([(i, i + 1) for i in range(7)], bytes=1e8)
    cluster = cluster_from_dict({**SLOW_LINK_CLUSTER, "devices": 8, "devices_per_node": 4})
    key = lambda found: ([(b.method, b.layout, b.step_time, b.schedule.events) for b in found[0]],  # noqa: E731
                         found[1].layout, found[2])
    one, two = (contiguous_baselines(bg, cluster, Training(microbatches=8), 2e9, workers=w) for w in (1, 2))
    assert key(one) == key(two)
    # rows from one depth, and refusals merged from every depth
    assert one[0] and any("at 2" in why and "at 8 groups" in why for why in one[2].values())
