"""What a schedule measures: makespan, bubbles, busy time, memory profile, transferred bytes."""

from __future__ import annotations

from dataclasses import dataclass
from opsched.schedule.actions import Event, Job, PassKind, Schedule, cached_on  # noqa: F401 (names the doctests use)
from opsched.schedule.placement import chain_stage_graph  # noqa: F401 (names the doctests use)
from opsched.schedule.simulate import simulate  # noqa: F401 (names the doctests use)
from opsched.schedule.validate import _device_intervals, _memory_changes, _tolerance, device_param_bytes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opsched.schedule.graph import StageGraph

def memory_profile(schedule: Schedule, *, rel_tol: float = 1e-9) -> dict[int, list[tuple[float, float]]]:
    """device -> step function of activation bytes, as ``[(time, bytes from then on), ...]``.

    Uses the memory convention of :func:`validate` (allocate at the start of
    F, free at the end of I/W/B, frees first at equal times). Each list starts
    at time 0 and has strictly increasing times.

    >>> sg = chain_stage_graph(1, f=1, b=2, w=1, act=1, act_w=0.5)
    >>> ev = [Event(0, 0, PassKind.F, 0, 1), Event(0, 0, PassKind.I, 1, 2), Event(0, 0, PassKind.W, 2, 3)]
    >>> memory_profile(Schedule(sg, 1, ev))
    {0: [(0.0, 1.0), (2.0, 0.5), (3.0, 0.0)]}
    """
    sg = schedule.stage_graph
    eps = _tolerance(schedule.events, rel_tol)
    alike = sg.alike_devices()
    level = {d: 0.0 for d in alike}
    profile = {d: [(0.0, 0.0)] for d in alike}
    for t, _, d, delta, _e in _memory_changes(sg, schedule.events, eps):
        level[d] += delta
        steps = profile[d]
        value = max(level[d], 0.0) if abs(level[d]) > 1e-12 * max(1.0, abs(delta)) else 0.0
        if steps[-1][0] == t or (len(steps) == 1 and t <= 0.0):
            steps[-1] = (float(max(t, 0.0)), value)
        else:
            steps.append((float(t), value))
    return {d: list(profile[first]) for first, devices in sorted(alike.items()) for d in devices}


@dataclass
class Metrics:
    """Figures of one timed schedule; lists are indexed by device.

    ``makespan`` is the end of the last event (a schedule starts at time 0);
    ``busy`` counts the time a device runs something (an overlapped pair
    once); ``idle = makespan - busy``; ``bubble_ratio = sum(idle) / (devices *
    makespan)``. ``peak_memory_bytes = param_bytes + peak_activation_bytes``.
    ``transferred_bytes`` sums edge bytes over the transfers actually made
    between different device groups: each forward over an edge and each
    gradient back over it. ``param_copies`` is the total parameter bytes over
    stages divided by the unique ones (stages with a ``copy_of`` are copies);
    with no parameter bytes at all it counts stages instead.
    """

    makespan: float
    busy: list[float]
    idle: list[float]
    bubble_ratio: float
    peak_activation_bytes: list[float]
    param_bytes: list[float]
    peak_memory_bytes: list[float]
    transferred_bytes: float
    param_copies: float

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (the ``metrics`` object of plan.json)."""
        floats = lambda xs: [float(x) for x in xs]  # noqa: E731 - plain floats even from numpy inputs
        return {
            "makespan": float(self.makespan),
            "busy": floats(self.busy),
            "idle": floats(self.idle),
            "bubble_ratio": float(self.bubble_ratio),
            "peak_activation_bytes": floats(self.peak_activation_bytes),
            "param_bytes": floats(self.param_bytes),
            "peak_memory_bytes": floats(self.peak_memory_bytes),
            "transferred_bytes": float(self.transferred_bytes),
            "param_copies": float(self.param_copies),
        }


def busy_time(schedule: Schedule) -> list[float]:
    """Time each device runs something (the union of its events' intervals)."""
    sg = schedule.stage_graph
    out = [0.0] * (sg.num_devices or 0)
    for first, spans in _device_intervals(sg, schedule.events).items():
        total, cur_start, cur_end = 0.0, None, None
        for start, end, _ in spans:
            if cur_end is None or start > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        if cur_end is not None:
            total += cur_end - cur_start
        for d in sg.alike_devices()[first]:
            out[d] = total
    return out


def metrics(schedule: Schedule) -> Metrics:
    """Makespan, busy/idle time, bubble ratio, memory, transfers and parameter copies.

    >>> sg = chain_stage_graph(2, f=1, b=2, w=1)
    >>> order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
    >>> m = metrics(Schedule(sg, 1, simulate(sg, order, 1)))
    >>> m.makespan, m.idle, m.bubble_ratio
    (6.0, [3.0, 3.0], 0.5)

    Kept on the schedule once computed (the report, the charts, the trace and
    each runtime's check ask for them: at 32,768 events the memory profile
    alone takes a second), and computed again if its events change.
    """
    return cached_on(schedule, "metrics", _metrics)




def _metrics(schedule: Schedule) -> Metrics:
    sg = schedule.stage_graph
    n = sg.num_devices or 0
    makespan = schedule.makespan
    busy = busy_time(schedule)
    idle = [makespan - b for b in busy]
    bubble = sum(idle) / (n * makespan) if n and makespan > 0 else 0.0
    peak_act = [max(v for _, v in steps) for _, steps in sorted(memory_profile(schedule).items())]
    params = device_param_bytes(sg)
    return Metrics(
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_ratio=bubble,
        peak_activation_bytes=peak_act,
        param_bytes=params,
        peak_memory_bytes=[p + a for p, a in zip(params, peak_act)],
        transferred_bytes=transferred_bytes(schedule),
        param_copies=param_copies(sg),
    )


def transferred_bytes(schedule: Schedule) -> float:
    """Edge bytes moved between different device groups: forwards into F, gradients into I/B."""
    sg = schedule.stage_graph
    ran = {(e.stage, e.microbatch, e.pass_) for e in schedule.events}
    F, I, B = PassKind.F, PassKind.I, PassKind.B  # looked up once: a member's lookup costs 14 globals' on 3.11
    total = 0.0
    for edge in sg.edges:
        if set(sg.stage(edge.src).devices) == set(sg.stage(edge.dst).devices):
            continue
        for m in range(schedule.microbatches):
            if not (sg.stage(edge.src).runs(m) and sg.stage(edge.dst).runs(m)):
                continue
            if (edge.dst, m, F) in ran:
                total += edge.bytes
            if (edge.src, m, I) in ran or (edge.src, m, B) in ran:
                total += edge.bytes
    return total


def param_copies(sg: StageGraph) -> float:
    """Total parameter bytes over stages / unique parameter bytes (stage counts if there are none)."""
    total = sum(s.param_bytes for s in sg.stages)
    unique = sum(s.param_bytes for s in sg.stages if s.copy_of is None)
    if total > 0 and unique > 0:
        return total / unique
    originals = sum(1 for s in sg.stages if s.copy_of is None)
    return len(sg.stages) / originals if originals else 1.0


def zb_bubble_rate(schedule: Schedule) -> float:
    """The Zero Bubble paper's bubble rate: ``(cost - work) / cost``.

    ``cost`` is the longest span of a device from the start of its first F to
    the end of its last W or B; ``work`` is the busy time of that device (the
    lowest device id among equal spans). Domain: the paper defines it for
    chains with one stage per device, where ``work = m (T_F + T_B + T_W)``
    exactly; on other stage graphs this per-device reading is an extension.

    >>> sg = chain_stage_graph(2, f=1, b=2, w=1)
    >>> order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
    >>> zb_bubble_rate(Schedule(sg, 1, simulate(sg, order, 1)))
    0.5
    """
    sg = schedule.stage_graph
    busy = busy_time(schedule)
    forward, ends_backward = PassKind.F, (PassKind.W, PassKind.B)  # a device's first pass, what may be its last
    best_span, best_device = 0.0, None
    for d in range(sg.num_devices or 0):
        mine = [e for e in schedule.events if d in sg.stage(e.stage).devices]
        first_f = min((e.start for e in mine if e.pass_ == forward), default=None)
        last_bw = max((e.end for e in mine if e.pass_ in ends_backward), default=None)
        if first_f is None or last_bw is None:
            continue
        span = last_bw - first_f
        if best_device is None or span > best_span * (1 + 1e-12):
            best_span, best_device = span, d
    if best_device is None or best_span <= 0:
        return 0.0
    return (best_span - busy[best_device]) / best_span
