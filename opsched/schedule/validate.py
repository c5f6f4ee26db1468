"""The validator: any timed schedule checked against the plan contract (completeness, dependencies, exclusivity, memory)."""

from __future__ import annotations

from typing import Iterable, Sequence
from opsched.errors import OpschedError
from opsched.schedule.actions import INPUT_GRADIENT_PASSES, Event, PASSES, Pair, PassKind, Schedule, pair_duration
from opsched.schedule.placement import chain_stage_graph  # noqa: F401 (names the doctests use)
from opsched.schedule.simulate import dependencies, forward_and_backward
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opsched.schedule.graph import StageGraph

class ScheduleError(OpschedError):
    """A timed schedule breaks a validity rule of the plan contract; the message names the events."""


def _name(e: Event) -> str:
    return f"{e.stage}{e.pass_}{e.microbatch}"


def _g(x: float) -> str:
    return f"{x:.6g}"


def _devices_text(devices: Sequence[int]) -> str:
    return f"device {devices[0]}" if len(devices) == 1 else "devices " + ",".join(map(str, devices))


def _tolerance(events: Sequence[Event], rel_tol: float) -> float:
    """Absolute slack for float comparisons: ``rel_tol`` times the makespan (plan times may be tiny, so no floor)."""
    span = max((abs(e.end) for e in events), default=0.0)
    return rel_tol * span


def _raise(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise ScheduleError(problems[0] + more)


def validate(schedule: Schedule, *, split_backward: bool | None = None, rel_tol: float = 1e-9) -> None:
    """Check a timed schedule against the validity rules of the plan contract.

    Independent of :func:`simulate` (it reads only the events), so it also
    catches simulator bugs. Raises :class:`ScheduleError` naming the offending
    events; returns ``None`` when the schedule is valid. Rules, in the order checked:

    1. every event names a stage that runs its microbatch, a pass F/I/W/B and
       finite times ``0 <= start``; its duration is the stage's pass time (a
       pair: :func:`pair_duration`);
    2. every (stage, microbatch) the stage runs has one F and either one B or
       one I and one W, nothing else (``split_backward`` True demands I+W,
       False demands B, None accepts either per job);
    3. the two halves of a pair are an F and a backward (I, W or B) and share a ``pair`` id, start, end and
       device group;
    4. no two events overlap on any device of their groups, except the two halves of one pair;
    5. dependencies (:func:`dependencies`) hold with the edge transfer times;
    6. memory: parameters of the stages a device hosts plus the activations it
       holds stay within ``schedule.memory_limit`` at every instant (skipped
       when the limit is ``None``). An F allocates ``act_bytes`` at its start;
       an I frees ``act_bytes - act_w_bytes`` at its end, a W the remaining
       ``act_w_bytes`` at its end, a B all of it at its end. At equal times
       frees happen before allocations, so a B ending when an F starts does
       not count both microbatches.

    Times are compared with a slack of ``rel_tol`` times the makespan.

    >>> sg = chain_stage_graph(2, f=1, b=2, w=1)
    >>> F, B = PassKind.F, PassKind.B
    >>> ev = [Event(0, 0, F, 0, 1), Event(1, 0, F, 1, 2), Event(1, 0, B, 2, 4), Event(0, 0, B, 3, 5)]
    >>> try:
    ...     validate(Schedule(sg, 1, ev))
    ... except ScheduleError as exc:
    ...     print(exc)
    0B0 on device 0 starts at 3 before its dependency 1B0 ends at 4
    """
    sg, events = schedule.stage_graph, list(schedule.events)
    eps = _tolerance(events, rel_tol)
    _raise(_check_events(sg, events, schedule.microbatches, eps))
    _raise(_check_complete(sg, events, schedule.microbatches, split_backward))
    _raise(_check_pairs(sg, events, eps))
    _raise(_check_exclusive(sg, events, eps))
    _raise(_check_dependencies(sg, events, eps))
    if schedule.memory_limit is not None:
        _raise(_check_memory(sg, events, schedule.memory_limit, eps))


def _check_events(sg: StageGraph, events: list[Event], microbatches: int, eps: float) -> list[str]:
    problems = []
    for e in events:
        if not (isinstance(e.stage, int) and 0 <= e.stage < len(sg.stages)):
            problems.append(f"event {_name(e)} names stage {e.stage}, which does not exist")
        elif e.pass_ not in PASSES:
            problems.append(f"event {_name(e)} has pass {e.pass_!r}; passes are F, I, W, B")
        elif not (0 <= e.microbatch < microbatches and sg.stage(e.stage).runs(e.microbatch)):
            problems.append(f"event {_name(e)}: stage {e.stage} does not run microbatch {e.microbatch}")
        elif not (-eps <= e.start <= e.end < float("inf")):
            problems.append(f"event {_name(e)} has times start={e.start}, end={e.end}; need 0 <= start <= end")
        elif e.pair is None:
            want = sg.stage(e.stage).duration(e.pass_)
            if abs((e.end - e.start) - want) > eps:
                problems.append(
                    f"{_name(e)} lasts {_g(e.end - e.start)} ({_g(e.start)} to {_g(e.end)}) "
                    f"but stage {e.stage}'s {e.pass_} takes {_g(want)}"
                )
    return problems


_SPLIT, _FUSED = [PassKind.F, PassKind.I, PassKind.W], [PassKind.F, PassKind.B]
#: a (stage, microbatch)'s passes, in PASSES order, that a complete schedule may run: split_backward -> the choices
_COMPLETE_PASSES = {True: [_SPLIT], False: [_FUSED], None: [_SPLIT, _FUSED]}
_F = PassKind.F  # a global's lookup: a member's costs 14 times as much on Python 3.11 (tested per event)


def _check_complete(
    sg: StageGraph, events: list[Event], microbatches: int, split_backward: bool | None
) -> list[str]:
    have: dict[tuple[int, int], list[PassKind]] = {}
    for e in events:
        have.setdefault((e.stage, e.microbatch), []).append(e.pass_)
    problems = []
    for sid in sg.topological_order():
        for m in range(microbatches):
            if not sg.stage(sid).runs(m):
                continue
            passes = sorted(have.get((sid, m), []), key=PASSES.index)
            if passes not in _COMPLETE_PASSES[split_backward]:
                want = " or ".join("+".join(p) for p in _COMPLETE_PASSES[split_backward])
                got = ", ".join(f"{sid}{p}{m}" for p in passes) or "nothing"
                problems.append(f"stage {sid} microbatch {m} has {got}; it needs exactly {want}")
    return problems


def _check_pairs(sg: StageGraph, events: list[Event], eps: float) -> list[str]:
    pairs: dict[int, list[Event]] = {}
    for e in events:
        if e.pair is not None:
            pairs.setdefault(e.pair, []).append(e)
    problems = []
    for pid, halves in sorted(pairs.items()):
        names = ", ".join(_name(e) for e in halves)
        if len(halves) != 2:
            problems.append(f"pair {pid} has {len(halves)} event(s) ({names}); a pair is exactly two events")
            continue
        a, b = halves
        if not forward_and_backward(a.pass_, b.pass_):
            problems.append(f"pair {pid}: {_name(a)} and {_name(b)} must be a forward and a backward (I, W or B)")
        elif abs(a.start - b.start) > eps or abs(a.end - b.end) > eps:
            problems.append(f"pair {pid}: {_name(a)} and {_name(b)} must share start and end times")
        elif set(sg.stage(a.stage).devices) != set(sg.stage(b.stage).devices):
            problems.append(f"pair {pid}: {_name(a)} and {_name(b)} run on different device groups")
        else:
            want = pair_duration(sg, Pair(a.job, b.job))
            if abs((a.end - a.start) - want) > eps:
                problems.append(
                    f"pair {pid} ({_name(a)};{_name(b)}) lasts {_g(a.end - a.start)} but the overlap rule gives {_g(want)}"
                )
    return problems


def _device_intervals(sg: StageGraph, events: Iterable[Event]) -> dict[int, list[tuple[float, float, str]]]:
    """First device of each class of :meth:`StageGraph.alike_devices` -> (start, end, label) of what occupies it
    (every device of the class alike); a pair is one interval."""
    out: dict[int, list[tuple[float, float, str]]] = {d: [] for d in sg.alike_devices()}
    by_pair: dict[int, list[Event]] = {}
    for e in events:
        if e.pair is not None:
            by_pair.setdefault(e.pair, []).append(e)
            continue
        for d in sg.stage(e.stage).devices:
            if d in out:
                out[d].append((e.start, e.end, _name(e)))
    for halves in by_pair.values():
        label = "(" + ";".join(_name(e) for e in halves) + ")"
        for d in sg.stage(halves[0].stage).devices:
            if d in out:
                out[d].append((halves[0].start, max(e.end for e in halves), label))
    for d in out:
        out[d].sort()
    return out


def _check_exclusive(sg: StageGraph, events: list[Event], eps: float) -> list[str]:
    problems = []
    for d, spans in _device_intervals(sg, events).items():
        busy_until, last = float("-inf"), ""
        for start, end, label in spans:
            if start < busy_until - eps and end > start:
                problems.append(
                    f"{label} on device {d} starts at {_g(start)} while {last} runs until {_g(busy_until)}"
                )
            if end > busy_until:
                busy_until, last = end, label
    return problems


def _check_dependencies(sg: StageGraph, events: list[Event], eps: float) -> list[str]:
    by_job = {e.job: e for e in events}
    kinds = {(e.stage, e.microbatch): e.pass_ for e in events if e.pass_ in INPUT_GRADIENT_PASSES}
    problems = []
    for e in sorted(events, key=lambda e: (e.start, e.stage, e.microbatch, PASSES.index(e.pass_))):
        for dep, delay in dependencies(sg, e.job, kinds):
            d = by_job.get(dep)
            if d is None:
                problems.append(f"{_name(e)} depends on {dep}, which the schedule does not run")
            elif e.start < d.end + delay - eps:
                transfer = f" (+ transfer {_g(delay)})" if delay else ""
                problems.append(
                    f"{_name(e)} on {_devices_text(sg.stage(e.stage).devices)} starts at {_g(e.start)} "
                    f"before its dependency {dep} ends at {_g(d.end)}{transfer}"
                )
    return problems


def _memory_changes(sg: StageGraph, events: Iterable[Event], eps: float):
    """Activation changes as (snapped time, order, device, delta, event): frees (order 0) before allocations (1),
    for the first device of each class of :meth:`StageGraph.alike_devices` (its other devices change alike).

    Times within ``eps`` of each other are snapped to one value so that a
    free a rounding error after an allocation still counts as simultaneous.
    """
    raw = []
    for e in events:
        if e.pass_ not in PASSES:
            continue
        delta = sg.stage(e.stage).activation_change(e.pass_)
        raw.append((e.start, 1, delta, e) if e.pass_ == _F else (e.end, 0, delta, e))
    snapped: dict[float, float] = {}
    rep = None
    for t in sorted({r[0] for r in raw}):
        if rep is None or t - rep > eps:
            rep = t
        snapped[t] = rep
    changes = []
    first = sg.alike_devices()  # the other devices of a class see the same changes
    for t, order, delta, e in raw:
        for d in sg.stage(e.stage).devices:
            if d in first:
                changes.append((snapped[t], order, d, delta, e))
    changes.sort(key=lambda c: (c[0], c[1], c[2], c[4].stage, c[4].microbatch, PASSES.index(c[4].pass_)))
    return changes


def device_param_bytes(sg: StageGraph) -> list[float]:
    """Parameter bytes resident on each device: the sum over the stages it hosts."""
    out = [0.0] * (sg.num_devices or 0)
    for first, devices in sg.alike_devices().items():
        held = sum((sg.stage(s).param_bytes for s in sg.stages_on(first)), 0.0)
        for d in devices:
            out[d] = held
    return out


def _check_memory(sg: StageGraph, events: list[Event], limit: float, eps: float) -> list[str]:
    params = device_param_bytes(sg)
    mem_eps = 1e-9 * abs(limit)
    problems = [
        f"device {d} holds {_g(p)} bytes of parameters alone, over the memory limit {_g(limit)}"
        for d, p in enumerate(params)
        if p > limit + mem_eps
    ]
    if problems:
        return problems
    held: dict[int, dict[tuple[int, int], float]] = {d: {} for d in range(sg.num_devices or 0)}
    reported: set[int] = set()
    for t, order, d, delta, e in _memory_changes(sg, events, eps):
        key = (e.stage, e.microbatch)
        held[d][key] = held[d].get(key, 0.0) + delta
        if abs(held[d][key]) <= 1e-9 * sg.stage(e.stage).act_bytes:  # fully freed, up to rounding
            del held[d][key]
        total = params[d] + sum(held[d].values())
        if delta > 0 and total > limit + mem_eps and d not in reported:
            reported.add(d)
            holders = [f"{s}F{m}" for (s, m) in sorted(held[d], key=lambda k: (k[1], k[0]))]
            shown = ", ".join(holders[:6]) + (f", ... ({len(holders)} in all)" if len(holders) > 6 else "")
            problems.append(
                f"device {d} needs {_g(total)} bytes at {_g(t)} when {_name(e)} starts "
                f"(parameters {_g(params[d])} + activations of {shown}), over the memory limit {_g(limit)}"
            )
    return problems


