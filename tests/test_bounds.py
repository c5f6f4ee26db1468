"""Lower bounds are bounds: never above what any method achieves on the same StageGraph and memory.

A property test over random chains and branching stage graphs, with and
without overlap gain or with pairs timed from random stream operations
(:mod:`opsched.cost.overlap`), measured fused backwards (shorter or longer than
I + W), tight and loose memory. Every bound ``opsched.lower.solve`` can
report (the makespan bound, the span bound, and what ``solve`` itself
reports, which may include the whole MIP's bound) is checked against:

* every hand-written baseline whose order applies to the graph as placed,
  and every baseline that re-places a chain into exactly the same graph;
* every list-scheduler order (split and fused, with and without pairs);
* the exhaustive optimum over per-device orders, with pairs where the gain
  is positive, split and fused, where the instance is small.

Only orders that fit the memory budget count; every makespan and span comes
from :func:`opsched.schedule.simulate` on the same graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from opsched.baselines import NAMES, baseline_orders, run_baseline
from opsched.errors import Deadlock, OpschedError
from opsched.solving.isolate import Call, SolverCrash, run_isolated_all
from opsched.lower import solve
from opsched.lower.bounds import device_bound, idle_lower_bound, lower_bound, span_lower_bound
from opsched.lower.jobs import JobSet, activation_budgets, minimum_memory_limit, order_fits
from opsched.lower.listsched import default_variants, list_schedule
from opsched.lower.lns import objective_value
from opsched.cost.overlap import COMM, COMPUTE, PassStreams, StreamOp
from opsched.schedule import Edge, Job, Pair, Schedule, Stage, StageGraph, busy_time, simulate, stage_placement

TOL = 1e-9
TIMES = [0.5, 1.0, 1.5, 2.0]


@dataclass
class Instance:
    sg: StageGraph
    microbatches: int
    limit: float | None
    kind: str


# --------------------------------------------------------------------------- instances


def _stage(draw, k: int, devices: tuple[int, ...], measured: bool) -> Stage:
    f, i = draw(st.sampled_from(TIMES)), draw(st.sampled_from(TIMES))
    w = draw(st.sampled_from([0.0] + TIMES))
    time = {"F": f, "I": i, "W": w}
    fused = draw(st.sampled_from(["none", "shorter", "below I", "longer"])) if measured else "none"
    if fused == "shorter":  # a measured fused backward cheaper than its halves
        time["B"] = 0.75 * (i + w)
    elif fused == "below I":
        time["B"] = 0.5 * i
    elif fused == "longer":
        time["B"] = 1.25 * (i + w)
    act = draw(st.sampled_from([1.0, 2.0]))
    return Stage(k, devices, time, param_bytes=draw(st.sampled_from([0.0, 1.0])), act_bytes=act,
                 act_w_bytes=draw(st.sampled_from([0.0, act / 2, act])))


def _devices(draw, d: int) -> tuple[int, ...]:
    if d > 1 and draw(st.integers(0, 5)) == 0:  # now and then a stage on a group of two devices
        first = draw(st.integers(0, d - 2))
        return (first, first + 1)
    return (draw(st.integers(0, d - 1)),)


def _shape(draw, max_stages: int) -> tuple[str, int, int, list[tuple[int, int]], list[int] | None]:
    """(kind, stages, devices, edges, placement of a chain or None)."""
    kind = draw(st.sampled_from(["chain", "v", "interleaved", "towers", "fork", "random"]))
    if kind in ("chain", "v", "interleaved"):
        d = draw(st.integers(1, max(1, max_stages // (1 if kind == "chain" else 2))))
        n = d if kind == "chain" else 2 * d
        return kind, n, d, [(k, k + 1) for k in range(n - 1)], stage_placement(n, d, kind)
    d = draw(st.integers(1, 3))
    if kind == "towers":  # two towers joining into a loss stage
        a, b = draw(st.integers(1, 2)), draw(st.integers(1, 2))
        n = a + b + 1
        edges = [(k, k + 1) for k in range(a - 1)] + [(a + k, a + k + 1) for k in range(b - 1)]
        return kind, n, d, edges + [(a - 1, n - 1), (a + b - 1, n - 1)], None
    if kind == "fork":  # one stage feeding two branches that join again
        return kind, 4, d, [(0, 1), (0, 2), (1, 3), (2, 3)], None
    n = draw(st.integers(2, max_stages))
    edges = [(a, b) for a in range(n) for b in range(a + 1, n) if draw(st.integers(0, 2)) == 0]
    return kind, n, d, edges, None


def _streams(draw, stage: Stage) -> PassStreams:
    """Random compute and communication operations summing to each pass time of ``stage``."""
    chains = []
    for p in ("F", "I", "W"):
        total, ops = stage.duration(p), []
        cuts = sorted(draw(st.lists(st.sampled_from([0.25, 0.5, 0.75]), max_size=2, unique=True)))
        stream = draw(st.sampled_from([COMPUTE, COMM]))
        for lo, hi in zip([0.0] + cuts, cuts + [1.0]):
            ops.append(StreamOp(stream, total * (hi - lo)))
            stream = COMM if stream == COMPUTE else COMPUTE
        chains.append(tuple(ops))
    return PassStreams(*chains)


@st.composite
def instances(draw, max_stages: int = 4, max_microbatches: int = 3) -> Instance:
    kind, n, d, pairs, place = _shape(draw, max_stages)
    rule = draw(st.sampled_from(["gain 0", "gain 0.5", "gain 1", "streams"]))  # how overlapped pairs are timed
    # a third of the other instances have measured fused backwards (stream operations time I + W)
    measured = rule != "streams" and draw(st.integers(0, 2)) == 0
    stages = [_stage(draw, k, (place[k],) if place else _devices(draw, d), measured) for k in range(n)]
    if rule == "streams":
        stages = [replace(s, streams=_streams(draw, s)) for s in stages]
    comm = draw(st.sampled_from([0.0, 0.0, 0.5]))
    edges = [Edge(a, b, time=comm if stages[a].devices != stages[b].devices else 0.0) for a, b in pairs]
    gain = float(rule.split()[1]) if rule.startswith("gain") else 0.0
    sg = StageGraph(stages, edges, num_devices=d, overlap_gain=gain)
    m = draw(st.integers(1, max_microbatches))
    least = minimum_memory_limit(sg, m)
    limit = draw(st.sampled_from([None, least, least + 1.0, least + 3.0]))
    return Instance(sg, m, limit, kind)


# --------------------------------------------------------------------------- what methods achieve

#: (makespan, Zero Bubble span, each device's idle) of one schedule
Figures = tuple[float, float, tuple[float, ...]]


def _values(js: JobSet, order, budgets) -> Figures | None:
    """(makespan, Zero Bubble span, each device's idle) of an order that fits in memory, timed by the simulator;
    None otherwise.

    (``objective_value`` reads only ``js``'s graph, so any job set of it will do.)
    """
    sg = js.sg
    if not order_fits(sg, order, budgets):
        return None
    try:
        events = simulate(sg, {d: list(a) for d, a in order.items()}, js.microbatches)
    except Deadlock:
        return None
    return _figures(js, events)


def _figures(js: JobSet, events) -> Figures:
    """(makespan, Zero Bubble span, each device's idle: the makespan less its busy time) of events timed on
    ``js``'s graph."""
    makespan = max(e.end for e in events)
    idle = tuple(makespan - b for b in busy_time(Schedule(js.sg, js.microbatches, events)))
    return makespan, objective_value(js, events, "zb-span"), idle


def _same_graph(a: StageGraph, b: StageGraph) -> bool:
    key = lambda g: (  # noqa: E731
        [(s.devices, dict(s.time), s.act_bytes, s.act_w_bytes, s.param_bytes, s.microbatches) for s in g.stages],
        sorted((e.src, e.dst, e.time) for e in g.edges), g.num_devices, g.overlap_gain, [s.streams for s in g.stages])
    return key(a) == key(b)


def baseline_values(inst: Instance, budgets) -> dict[str, Figures]:
    """Each baseline that runs on the graph as given (or re-places a chain into the very same graph)."""
    out = {}
    js = JobSet(inst.sg, inst.microbatches)
    for name, order in baseline_orders(inst.sg, inst.microbatches).items():
        v = _values(js, order, budgets)
        if v is not None:
            out[name] = v
    if inst.kind == "chain":
        for name in NAMES:
            try:
                schedule = run_baseline(name, inst.sg, inst.microbatches, memory_limit=inst.limit)
            except OpschedError:
                continue
            if _same_graph(schedule.stage_graph, inst.sg):
                out["run " + name] = _figures(js, schedule.events)
    return out


def list_values(inst: Instance, budgets) -> dict[str, Figures]:
    """Every list-scheduler variant, split and fused, with and without pairs."""
    out = {}
    timed = {}  # most variants give an order another one gave: each distinct order is simulated once
    for split in (True, False):
        js = JobSet(inst.sg, inst.microbatches, split)
        # with a positive gain the pair variants come on top of all the others
        for v in default_variants(js, allow_pairs=True, budgets=budgets):
            order = list_schedule(js, budgets, v)
            key = tuple((d, tuple(actions)) for d, actions in sorted(order.items()))
            if key not in timed:
                timed[key] = _values(js, order, budgets)
            value = timed[key]
            if value is not None:
                out[f"{'split' if split else 'fused'} {v.name}"] = value
    return out


def _before(js: JobSet) -> dict[int, set[int]]:
    """Every job's transitive predecessors."""
    before: dict[int, set[int]] = {}
    for k in js.topo:
        before[k] = set()
        for i, _ in js.preds[k]:
            before[k] |= before[i] | {i}
    return before


def device_actions(js: JobSet, device: int, budget: float | None, pairs: bool, cap: int) -> list[list] | None:
    """Every action sequence of ``device`` that keeps dependencies and fits ``budget`` (None past ``cap``).

    With ``pairs`` an action may overlap an F with a backward pass of a stage
    on the same devices, neither waiting for the other.
    """
    ks = js.on_device[device]
    before = _before(js)
    local = {k: before[k] & set(ks) for k in ks}
    out: list[list] = []

    def actions(placed: set[int]):
        ready = [k for k in ks if k not in placed and local[k] <= placed]
        yield from ((k,) for k in ready)
        if pairs:
            for f in (k for k in ready if js.jobs[k].pass_ == "F"):
                for x in ready:
                    if (js.jobs[x].pass_ != "F" and set(js.devices[x]) == set(js.devices[f])
                            and f not in before[x] and x not in before[f]):
                        yield (f, x)

    def extend(seq: list, placed: set[int], level: float) -> bool:
        if len(placed) == len(ks):
            out.append(list(seq))
            return len(out) <= cap
        for action in actions(placed):
            up = level + sum(max(js.mem[k], 0.0) for k in action)
            if budget is not None and up > budget + 1e-9:
                continue
            seq.append(action)
            placed.update(action)
            ok = extend(seq, placed, level + sum(js.mem[k] for k in action))
            seq.pop()
            placed.difference_update(action)
            if not ok:
                return False
        return True

    return out if extend([], set(), 0.0) else None


def brute_force(inst: Instance, budgets, split: bool, cap: int) -> Figures | None:
    """(least makespan, least span, each device's least idle) over every combination of device orders; None when
    there are over ``cap``."""
    js = JobSet(inst.sg, inst.microbatches, split)
    pairs = inst.sg.may_overlap
    per_device = []
    for d in sorted(js.on_device):
        seqs = device_actions(js, d, None if budgets is None else budgets[d], pairs, cap)
        if seqs is None:
            return None
        per_device.append(seqs)
    total = 1
    for seqs in per_device:
        total *= max(1, len(seqs))
    if total > cap:
        return None
    best = None
    for combo in itertools.product(*per_device):
        order = {d: [js.jobs[a[0]] if len(a) == 1 else Pair(js.jobs[a[0]], js.jobs[a[1]]) for a in seq]
                 for d, seq in zip(sorted(js.on_device), combo)}
        try:
            v = _values(js, order, budgets)
        except OpschedError:  # a stage on a group paired on one device and not on another
            continue
        if v is not None:
            best = v if best is None else (min(best[0], v[0]), min(best[1], v[1]), tuple(map(min, best[2], v[2])))
    return best


# --------------------------------------------------------------------------- the property


def check_bounds(inst: Instance, cap: int, solve_it: bool) -> None:
    sg, m = inst.sg, inst.microbatches
    budgets = activation_budgets(sg, inst.limit)
    achieved = {**baseline_values(inst, budgets), **list_values(inst, budgets)}
    for split in (True, False):
        exact = brute_force(inst, budgets, split, cap)
        if exact is not None:
            achieved[f"brute force {'split' if split else 'fused'}"] = exact
    assert achieved, "the list scheduler always fits"
    least_makespan = min(v[0] for v in achieved.values())
    least_span = min(v[1] for v in achieved.values())
    for split in (True, False):
        js = JobSet(sg, m, split)
        assert lower_bound(js, budgets) <= least_makespan + TOL, (split, achieved)
        assert span_lower_bound(js) <= least_span + TOL, (split, achieved)
        for d, floor in idle_lower_bound(js, budgets).items():
            assert all(floor <= v[2][d] + TOL for v in achieved.values()), (split, d, floor, achieved)
    if solve_it:  # what solve reports, which may include the whole MIP's bound
        makespan, span = _solve_isolated(
            sg, m, dict(memory_limit=inst.limit, search_budget=0, time_limit=2, thin=False),  # thinning keeps the bound
            dict(memory_limit=inst.limit, split_backward=False, objective="zb-span", search_budget=0, time_limit=2))
        assert makespan is None or makespan.lower_bound <= least_makespan + TOL, (makespan.lower_bound, achieved)
        assert span is None or span.lower_bound <= least_span + TOL, (span.lower_bound, achieved)


def _solve_isolated(sg: StageGraph, m: int, *options: dict) -> list:
    """``solve`` with each of ``options``, two at a time, each in a watched child.

    CBC can abort or hang under load, which must cost one check, not the run:
    such a solve's result is None (a solver fault, not a bound to check).
    """
    calls = [Call(solve, (sg, m), timeout=60, kwargs=o) for o in options]
    results = run_isolated_all(lambda k, running: calls[k], len(calls), jobs=2)
    for r in results:
        if isinstance(r, SolverCrash):
            note(f"solver crash skipped: {r}")
    return [None if isinstance(r, SolverCrash) else r for r in results]


def _mip_bound_case(inst: Instance) -> bool:
    """Small, and of the kind where solve may take the whole MIP's bound (no pair gain, no short fused B)."""
    return (len(JobSet(inst.sg, inst.microbatches)) <= 18 and not inst.sg.may_overlap
            and all(s.duration("B") >= s.duration("I") + s.duration("W") for s in inst.sg.stages))


@settings(max_examples=200, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(instances())
def test_every_bound_is_below_what_every_method_achieves(inst):
    check_bounds(inst, cap=400, solve_it=_mip_bound_case(inst))


@pytest.mark.slow
@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(instances(max_stages=6, max_microbatches=4))
def test_every_bound_is_below_what_every_method_achieves_at_scale(inst):
    """Larger graphs, bigger exhaustive searches, and solve's reported bounds on every instance (about 5 min)."""
    check_bounds(inst, cap=2000, solve_it=True)


def test_overlap_bound_sits_below_dualpipev():
    """Issue 11's case: DualPipeV's pairs give 76 on the V at gain 1, so no bound may say 99."""
    from opsched.schedule import chain_stage_graph

    sg = chain_stage_graph(8, f=1, b=2, w=1, devices=4, placement="v", overlap_gain=1.0)
    order = baseline_orders(sg, 16)["dualpipev"]
    events = simulate(sg, order, 16)
    budgets = activation_budgets(sg, 9.0)
    assert order_fits(sg, order, budgets) and max(e.end for e in events) == pytest.approx(76.0)
    assert lower_bound(JobSet(sg, 16), budgets) <= 76.0
    r = solve(sg, 16, memory_limit=9.0, time_limit=20, search_budget=0)
    assert r.lower_bound <= 76.0 and r.status != "optimal"


def test_forwards_before_the_first_backward_count_whole_with_a_gain():
    """The DualPipe grid's D=4, M=8, 1:1:1 case at gain 0.5: with pair shares the device bound gives 43, but a
    device's forwards run before its first backward cannot pair; counted whole, the bound is 47, still at most
    DualPipeV's 49 and every list-scheduler order (pairs or not) that fits DualPipeV's peak memory."""
    from opsched.schedule import chain_stage_graph, metrics

    sg = chain_stage_graph(8, f=1, b=2, w=1, devices=4, placement="v", overlap_gain=0.5)
    dualpipev = baseline_orders(sg, 8)["dualpipev"]
    events = simulate(sg, dualpipev, 8)
    budgets = activation_budgets(sg, max(metrics(Schedule(sg, 8, events)).peak_memory_bytes))
    js = JobSet(sg, 8)
    assert max(device_bound(js, d) for d in js.on_device) == pytest.approx(43.0)
    assert lower_bound(js, budgets) == pytest.approx(47.0)
    assert _values(js, dualpipev, budgets)[0] == pytest.approx(49.0)
    makespans = [v[0] for v in (_values(js, list_schedule(js, budgets, variant), budgets)
                                for variant in default_variants(js, allow_pairs=True, budgets=budgets)) if v]
    assert makespans and min(makespans) >= 47.0 - TOL


def test_measured_fused_backward_below_i_keeps_the_bound_below_a_fused_schedule():
    """A measured B shorter than I: a fused schedule's backward chain is shorter than the split one's."""
    sg = StageGraph([Stage(k, (k,), {"F": 1.0, "I": 2.0, "W": 1.0, "B": 1.0}) for k in range(2)], [Edge(0, 1)])
    order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
    fused = max(e.end for e in simulate(sg, order, 1))
    assert fused == 4.0
    for split in (True, False):
        assert lower_bound(JobSet(sg, 1, split)) <= fused
        assert solve(sg, 1, split_backward=split, time_limit=10).lower_bound <= fused


def test_fused_solve_claims_no_optimum_a_split_schedule_beats():
    """The fused MIP's own optimum is no bound: deferring W (a split schedule) does better."""
    from opsched.schedule import chain_stage_graph

    sg = chain_stage_graph(2, f=1, b=2, w=1)
    r = solve(sg, 3, split_backward=False, time_limit=20)
    split = solve(sg, 3, split_backward=True, time_limit=20)
    assert split.makespan < r.makespan and r.lower_bound <= split.makespan and r.status != "optimal"


def test_pair_memory_allocates_before_freeing():
    """The brute force's memory rule for a pair matches the order's peak (F allocates, then the backward frees)."""
    from opsched.lower.jobs import order_peak_activation

    sg = StageGraph([Stage(0, (0,), {"F": 1.0, "I": 1.0, "W": 1.0})], overlap_gain=1.0)
    order = {0: [Job(0, 0, "F"), Pair(Job(0, 1, "F"), Job(0, 0, "I")), Job(0, 0, "W"), Job(0, 1, "I"),
                 Job(0, 1, "W")]}
    assert order_peak_activation(sg, order)[0] == 2.0 == 2 * sg.stage(0).activation_change("F")
