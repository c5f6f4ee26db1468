"""The simulator: an order of actions per device becomes as-soon-as-possible timed events.

Resuming (:func:`simulate`'s ``earlier`` and ``since``): ``earlier`` are its events for another order that
runs, on every device, the same actions in the same sequence as ``order``
up to those that started at ``since`` or later. Nothing before ``since``
can change (an action's start depends only on actions that ended by
then), so those events are kept and only the rest of ``order`` is timed
and checked: when an order changes at one point, as a local search's
move does, only the actions after it cost time. Raises
:class:`OpschedError` when the kept events are not the first actions of
``order`` on their devices.

>>> sg = chain_stage_graph(2, f=1, b=2)
>>> F, B = PassKind.F, PassKind.B
>>> order = {0: [Job(0, 0, F), Job(0, 1, F), Job(0, 0, B), Job(0, 1, B)],
...          1: [Job(1, 0, F), Job(1, 0, B), Job(1, 1, F), Job(1, 1, B)]}
>>> events = simulate(sg, order, 2)
>>> max(e.end for e in events)
9.0

Device 1 running both forwards first changes nothing before 2, when its
second action starts:

>>> swapped = {0: order[0], 1: [Job(1, 0, F), Job(1, 1, F), Job(1, 0, B), Job(1, 1, B)]}
>>> resumed = simulate(sg, swapped, 2, earlier=events, since=2.0)
>>> resumed == simulate(sg, swapped, 2), max(e.end for e in resumed)
(True, 9.0)
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence
from opsched.errors import Deadlock, OpschedError
from opsched.schedule.actions import (INPUT_GRADIENT_PASSES, Event, Job, PASSES, Pair, PassKind, _PASS_RANK, jobs_of,
                                      pair_duration)
from opsched.schedule.placement import chain_stage_graph  # noqa: F401 (names the doctests use)
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opsched.schedule.actions import Action, Order
    from opsched.schedule.graph import StageGraph

# The members as globals where they are tested per job: a member's lookup costs 14 times a global's on Python 3.11.
_F, _I, _W = PassKind.F, PassKind.I, PassKind.W


def simulate(sg: StageGraph, order: Order, microbatches: int, earlier: Sequence[Event] = (),
             since: float = 0.0) -> list[Event]:
    """Time an order as soon as possible.

    Each device runs its actions in the given order, one at a time. An action
    starts when every device that must run it (all devices of its stage's
    group) has reached it and finished its previous action, and when its
    dependencies have finished plus their transfer times. Raises
    :class:`OpschedError` naming the first blocked action on each device when
    the order deadlocks, and before timing anything when an action names a
    job that does not exist (stage, pass, or a microbatch outside
    ``0..microbatches-1`` or not run by its stage), sits on a device outside
    its stage's group, is listed twice on a device, or is missing from a
    device of its group. The order is not modified and need not contain every
    job (:func:`validate` checks completeness). Events are returned sorted by
    (start, stage, microbatch, pass); overlapped pairs are numbered 0, 1, ...
    in that order.

    Resuming from ``earlier`` events at ``since``: the module docstring.
    """
    queues = _queues(sg, order)
    heads, device_free, finished, events = _resumed(sg, queues, [e for e in earlier if e.start < since])
    devices_of = _checked_actions(sg, queues, heads, microbatches, finished)
    next_pair = 1 + max((e.pair for e in events if e.pair is not None), default=-1)  # ids apart from the kept ones
    backward = _backward_of([a for acts in queues.values() for a in acts])
    # each job's dependencies: kept on the graph when every stage runs one backward pass (the simulator asks for the
    # same jobs' in every order it times), else for this order only
    needs = sg._dependencies[backward] if isinstance(backward, str) else {}
    remaining = sum(len(q) - heads[d] for d, q in queues.items())
    devices = sorted(queues)
    while remaining:
        progressed = False
        for d in devices:
            queue, head = queues[d], heads[d]
            if head >= len(queue):
                continue
            action = queue[head]
            devs = devices_of[action]
            # every device of the group must have this action at its head (a device's own is)
            if len(devs) > 1 and any(heads[x] >= len(queues[x]) or queues[x][heads[x]] != action for x in devs):
                continue
            jobs = jobs_of(action)
            ready = _ready_time(sg, jobs, finished, needs, backward)
            if ready is None:
                continue
            if len(devs) == 1:
                start = ready if ready > device_free[d] else device_free[d]
            else:
                start = max([ready] + [device_free[x] for x in devs])
            pid = None
            if isinstance(action, Pair):
                end = start + pair_duration(sg, action)
                pid, next_pair = next_pair, next_pair + 1
            else:
                end = start + sg.stage(action.stage).duration(action.pass_)
            for job in jobs:
                finished[job] = end
                events.append(Event(job.stage, job.microbatch, job.pass_, start, end, pid))
            for x in devs:
                device_free[x] = end
                heads[x] += 1
                remaining -= 1
            progressed = True
        if not progressed:
            raise _deadlock(queues, heads)
    return _numbered(events)


def _queues(sg: StageGraph, order: Order) -> dict[int, list[Action]]:
    """Each device's actions (an empty list for a device the order leaves out); a device not in ``sg`` is refused."""
    queues = {d: [] for d in range(sg.num_devices or 0)}
    for d, acts in order.items():
        if d not in queues:
            raise OpschedError(f"the order lists device {d}, but the StageGraph has devices 0..{sg.num_devices - 1}")
        queues[d] = list(acts)
    return queues


def _deadlock(queues: dict[int, list[Action]], heads: dict[int, int]) -> Deadlock:
    """The deadlock of an order stuck at ``heads``, naming where each device waits."""
    blocked = {d: str(queues[d][heads[d]]) for d in sorted(queues) if heads[d] < len(queues[d])}
    return Deadlock("the order deadlocks: " + ", ".join(f"device {d} waits at {a}" for d, a in blocked.items()))


def _resumed(sg: StageGraph, queues: dict[int, list[Action]],
             kept: list[Event]) -> tuple[dict[int, int], dict[int, float], dict[Job, float], list[Event]]:
    """Where :func:`simulate` resumes after the ``kept`` events: each device's position in its queue and the end of
    its last kept action, each kept job's end, and the kept events. They must be the first actions on every
    device of their stages, each pair kept as a pair, in the sequence they ran."""
    heads = {d: 0 for d in queues}
    device_free = {d: 0.0 for d in queues}
    if not kept:
        return heads, device_free, {}, []
    by_job = {(e.stage, e.microbatch, e.pass_): e for e in kept}  # (a Job would be built for each event)
    finished: dict[Job, float] = {}
    matched = 0
    for d, acts in queues.items():
        for action in acts:
            jobs = jobs_of(action)
            timed = [by_job.get((job.stage, job.microbatch, job.pass_)) for job in jobs]
            if None in timed:
                break
            paired = {e.pair for e in timed}
            # the simulator starts an action exactly at its device's previous end or later
            if len(paired) != 1 or (None in paired) == isinstance(action, Pair) or timed[0].start < device_free[d]:
                raise OpschedError(f"the earlier event of {action} on device {d} does not match the order's "
                                   "sequence there; resume only from the events of an order with the same start")
            heads[d] += 1
            device_free[d] = timed[0].end
            matched += len(timed)
            for job in jobs:
                finished[job] = timed[0].end
    if matched != sum(len(sg.stage(e.stage).devices) for e in kept):
        raise OpschedError("some earlier events are not among the order's first actions on their devices; "
                           "resume only from the events of an order with the same start")
    return heads, device_free, finished, kept


def _checked_actions(sg: StageGraph, queues: dict[int, list[Action]], heads: dict[int, int],
                     microbatches: int, kept: Mapping[Job, float]) -> dict[Action, tuple[int, ...]]:
    """The devices of every action of ``queues`` from ``heads`` on, rejecting misplaced actions.

    Every action must name a real job, sit only on devices of its stage's group,
    appear once per device, and appear on every device of the group (else
    the simulation could only deadlock or run a job twice). The actions
    before ``heads`` passed these checks in the simulation that timed their
    jobs, ``kept``; no job of theirs may come again.

    Whether an action names a real job and which devices it runs on depends
    only on the graph and the microbatch count, so each action's devices are
    kept on ``sg`` once checked (a search times orders of the same actions
    hundreds of times); what depends on the order is checked every time.
    """
    known = sg._checked.setdefault(microbatches, {})
    devices_of: dict[Action, tuple[int, ...]] = {}
    placed: dict[Action, list[int]] = {}  # of the actions of a group of devices
    for d, acts in queues.items():
        seen: set[Action] = set()
        for a in acts[heads[d]:]:
            devs = devices_of.get(a)
            if devs is None:
                devs = known.get(a)
                if devs is None:
                    for job in jobs_of(a):
                        _check_job(sg, job, microbatches)
                    devs = known[a] = _action_devices(sg, a)
                if kept and (a.first in kept or a.second in kept if isinstance(a, Pair) else a in kept):
                    raise OpschedError(f"action {a} is listed twice on device {d}; list each action once")
                devices_of[a] = devs
            if d not in devs:
                raise OpschedError(f"action {a} is listed on device {d}, which does not host its stage")
            if a in seen:
                raise OpschedError(f"action {a} is listed twice on device {d}; list each action once")
            seen.add(a)
            if len(devs) > 1:
                placed.setdefault(a, []).append(d)
    for a, devs in placed.items():
        if len(devs) != len(devices_of[a]):
            missing = sorted(set(devices_of[a]) - set(devs))
            raise OpschedError(
                f"action {a} is listed on device(s) {devs} but not on {missing}; "
                "a stage's action must appear on every device of its group"
            )
    return devices_of


def _numbered(events: list[Event]) -> list[Event]:
    """``events`` sorted by (start, stage, microbatch, pass), overlapped pairs numbered 0, 1, ... in that order
    (``pair`` holds any id unique to its pair before), so a resumed simulation numbers them as a whole one does."""
    events.sort(key=lambda e: (e.start, e.stage, e.microbatch, _PASS_RANK[e.pass_]))
    number: dict[int, int] = {}
    return [e if e.pair is None else Event(e.stage, e.microbatch, e.pass_, e.start, e.end,
                                           number.setdefault(e.pair, len(number))) for e in events]


def _check_job(sg: StageGraph, job: Job, microbatches: int) -> None:
    if not 0 <= job.stage < len(sg.stages):
        raise OpschedError(f"action {job} names stage {job.stage}, which does not exist")
    if job.pass_ not in PASSES:  # a plain letter is a pass too (equal to its member)
        raise OpschedError(f"action {job} has pass {job.pass_!r}; passes are F, I, W, B")
    if not 0 <= job.microbatch < microbatches or not sg.stage(job.stage).runs(job.microbatch):
        raise OpschedError(f"action {job}: stage {job.stage} does not run microbatch {job.microbatch}")


def forward_and_backward(first: PassKind, second: PassKind) -> bool:
    """Whether passes ``first`` and ``second`` may form an overlapped pair: one F and one backward (I, W or B).

    The lower bounds count a pair as that (opsched.lower.bounds, "pair shares").
    """
    return (first == _F) != (second == _F)


def _action_devices(sg: StageGraph, action: Action) -> tuple[int, ...]:
    if isinstance(action, Pair):
        if not forward_and_backward(action.first.pass_, action.second.pass_):
            raise OpschedError(f"pair {action} must join a forward and a backward (I, W or B)")
        a = sg.stage(action.first.stage).devices
        b = sg.stage(action.second.stage).devices
        if set(a) != set(b):
            raise OpschedError(f"pair {action} joins stages on different device groups {a} and {b}")
        return a
    return sg.stage(action.stage).devices


def dependencies(
    sg: StageGraph, job: Job, backward: Mapping[tuple[int, int], PassKind] | PassKind = PassKind.I
) -> list[tuple[Job, float]]:
    """The jobs ``job`` waits for, each with the transfer time added after it ends.

    F(s,m) after F(p,m) + edge time for each pred p; the backward (I or B) of
    (s,m) after the backward of each successor for m + edge time, and after
    F(s,m); W after I. ``backward`` says which backward pass a (stage,
    microbatch) runs, I (split) or B (fused): one pass for all, or a
    mapping. Successors that do not run microbatch m are skipped.

    >>> sg = chain_stage_graph(2)
    >>> [(str(job), delay) for job, delay in dependencies(sg, Job(0, 3, PassKind.I))]
    [('0F3', 0.0), ('1I3', 0.0)]
    """
    s, m, p = job.stage, job.microbatch, job.pass_
    kind = (lambda sid: backward) if isinstance(backward, str) else (lambda sid: backward.get((sid, m), _I))
    if p == _F:
        return [(Job(e.src, m, _F), e.time) for e in sg.preds(s) if sg.stage(e.src).runs(m)]
    if p in INPUT_GRADIENT_PASSES:
        deps = [(Job(s, m, _F), 0.0)]
        deps += [(Job(e.dst, m, kind(e.dst)), e.time) for e in sg.succs(s) if sg.stage(e.dst).runs(m)]
        return deps
    if p == _W:
        return [(Job(s, m, _I), 0.0)]
    raise OpschedError(f"unknown pass {p!r}; passes are F, I, W, B")


def backward_kinds(actions: Iterable[Action]) -> dict[tuple[int, int], PassKind]:
    """(stage, microbatch) -> B where the order runs a fused backward, else I."""
    kinds: dict[tuple[int, int], PassKind] = {}
    for a in actions:
        for job in jobs_of(a):
            if job.pass_ in INPUT_GRADIENT_PASSES:
                kinds[(job.stage, job.microbatch)] = job.pass_
    return kinds


def _ready_time(sg: StageGraph, jobs: tuple[Job, ...], finished: dict[Job, float],
                needs: dict[Job, list[tuple[Job, float]]],
                backward: Mapping[tuple[int, int], PassKind] | PassKind) -> float | None:
    """When an action running ``jobs`` may start as far as its dependencies go (``None``: one has not run yet).

    ``needs`` keeps each job's :func:`dependencies` under ``backward`` once asked."""
    ready = 0.0
    for job in jobs:
        deps = needs.get(job)
        if deps is None:
            deps = needs[job] = dependencies(sg, job, backward)
        for dep, delay in deps:
            t = finished.get(dep)
            if t is None:
                return None  # not run yet (a pair never contains its own dependency)
            if t + delay > ready:
                ready = t + delay
    return ready


def _backward_of(actions: list[Action]) -> Mapping[tuple[int, int], PassKind] | PassKind:
    """Which backward pass each (stage, microbatch) of ``actions`` runs: one letter when they all run the same (as
    :func:`dependencies` takes it), else :func:`backward_kinds`."""
    letters = {a.pass_ for a in actions if not isinstance(a, Pair)}
    letters.update(job.pass_ for a in actions if isinstance(a, Pair) for job in (a.first, a.second))
    letters &= set(INPUT_GRADIENT_PASSES)
    return backward_kinds(actions) if len(letters) > 1 else PassKind(letters.pop()) if letters else _I


