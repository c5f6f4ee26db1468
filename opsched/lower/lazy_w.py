"""Placing the W's lazily: each device's forwards and backwards keep their order, its W wait for an idle gap.

A weight pass (W) has no successor: when it runs decides only its device's
memory and what it delays. A hand-written order fixes each W's place for
the costs its method assumes; Zero Bubble's V runs every W right after its
I in the steady state, which fits F = I = W. With I longer than W the
backwards that drain the pipeline arrive further apart than the device's
own work fills, and the W run earlier would have filled those gaps: the
step waits for W it could have kept (the DualPipe grid of
docs/BENCHMARKS.md at F:I:W = 1:1.5:0.5).

:func:`place_w_lazily` keeps each device's actions other than W (forwards,
backwards, overlapped pairs) in their order and re-places every W by a
greedy, in time order over the devices: a device runs its next action as
soon as it is ready and fits in memory; while it waits, it runs its oldest
released W if that ends before the next action can be ready (a lower bound
on the action's readiness: its inputs' known ends, or a predecessor not yet
started that cannot end before it runs), and whenever the next action is a
forward held back by memory; a device with nothing else left runs its W.
So a W never delays the action after it, and the W's not needed earlier
fill the drain. The order it gives is timed and checked like any other:
the simulator starts each action no later than the greedy did.

It needs split backwards (there is no W otherwise). Stages on groups of
devices are placed too when the groups do not overlap and every device of a
group lists the same actions, as a plan's layouts give: a group then runs
as one device, within the least of its devices' budgets. Otherwise (groups
that share some devices, a group's devices in different orders), or when
the order's memory cannot be kept (a forward waits for memory with no W
left to free it), it returns ``None``.

>>> from opsched.schedule import Job, chain_stage_graph, simulate
>>> from opsched.lower.jobs import JobSet
>>> sg = chain_stage_graph(2, f=1, b=3, w=1)
>>> order = {0: [Job(0, 0, "F"), Job(0, 1, "F"), Job(0, 0, "I"), Job(0, 0, "W"), Job(0, 1, "I"), Job(0, 1, "W")],
...          1: [Job(1, 0, "F"), Job(1, 0, "I"), Job(1, 0, "W"), Job(1, 1, "F"), Job(1, 1, "I"), Job(1, 1, "W")]}
>>> max(e.end for e in simulate(sg, order, 2))
11.0
>>> lazy = place_w_lazily(JobSet(sg, 2), order, budgets=None)
>>> [str(a) for a in lazy[1]]  # stage 1's first W waits: it runs after the second I, where device 1 is free
['1F0', '1I0', '1F1', '1I1', '1W0', '1W1']
>>> max(e.end for e in simulate(sg, lazy, 2))
10.0
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Mapping

from opsched.schedule.placement import on_group_devices
from opsched.errors import Unsupported
from opsched.lower.jobs import JobSet, noise
from opsched.schedule import Action, Job, Order, Pair, PassKind, jobs_of, pair_duration

# globals where tested per job: a member lookup costs 14 globals' on Python 3.11
_I, _W = PassKind.I, PassKind.W


def place_w_lazily(js: JobSet, order: Order, budgets: Mapping[int, float] | None) -> Order | None:
    """``order`` with its actions other than W kept in place and every W placed lazily (see the module's
    docstring), or ``None`` where that does not apply.

    ``budgets``: activation budget per device (``None``: no limit). The
    order is not modified. Deterministic: devices ready at the same time go
    in device order.
    """
    groups = device_groups(js, order)
    if not js.split_backward or groups is None:
        return None
    if budgets is not None:
        budgets = {lead: min(budgets[d] for d in group) for lead, group in groups.items()}
    index, duration, mem = js.index, js.duration, js.mem
    # a group is timed as its first device, which stands for all of them
    skeleton: dict[int, list[Action]] = {lead: [a for a in order.get(lead, ()) if not _is_w(a)] for lead in groups}
    w_of = {index[Job(j.stage, j.microbatch, _I)]: k for k, j in enumerate(js.jobs) if j.pass_ == _W}
    end: dict[int, float] = {}
    free = {d: 0.0 for d in skeleton}
    held = {d: 0.0 for d in skeleton}
    nxt = {d: 0 for d in skeleton}
    released: dict[int, deque[int]] = {d: deque() for d in skeleton}
    placed: Order = {d: [] for d in skeleton}
    waiters: dict[int, list[int]] = {}  # a job not yet started -> the devices whose next action waits for it
    wakeups = [(0.0, d) for d in sorted(skeleton)]
    left = sum(len(jobs_of(a)) for acts in skeleton.values() for a in acts) + len(w_of)

    def run(d: int, action: Action, members: list[int], length: float, t: float) -> None:
        nonlocal left
        for k in members:
            end[k] = t + length
            held[d] += mem[k]
            for waiting in waiters.pop(k, ()):
                heapq.heappush(wakeups, (t, waiting))  # its readiness is known now
        free[d] = t + length
        placed[d].append(action)
        left -= len(members)
        heapq.heappush(wakeups, (t + length, d))

    while wakeups:
        t, d = heapq.heappop(wakeups)
        if free[d] > t + noise(t):
            continue  # busy: woken again when it is free
        acts = skeleton[d]
        if nxt[d] == len(acts):
            if released[d]:
                w = released[d].popleft()
                run(d, js.jobs[w], [w], duration[w], t)
            continue
        action = acts[nxt[d]]
        members = [index[j] for j in jobs_of(action)]
        ready, unknown = _readiness(js, members, end, t)
        # a pair allocates its F before its backward frees (as the simulator's memory count does)
        need = held[d] + sum(mem[k] for k in members if mem[k] > 0)
        fits = budgets is None or need <= budgets[d] + noise(budgets[d])
        if fits and not unknown and ready <= t + noise(t):
            nxt[d] += 1
            length = pair_duration(js.sg, action) if isinstance(action, Pair) else duration[members[0]]
            run(d, action, members, length, t)
            for k in members:
                if k in w_of:
                    released[d].append(w_of[k])
            continue
        if released[d] and (not fits or duration[released[d][0]] <= ready - t + noise(t)):
            w = released[d].popleft()
            run(d, js.jobs[w], [w], duration[w], t)
            continue
        if not fits:
            return None  # a forward waits for memory that only its own device's later work frees
        for k in unknown:
            waiters.setdefault(k, []).append(d)
        if not unknown:
            heapq.heappush(wakeups, (ready, d))
    if left:
        return None
    return {d: list(placed[lead]) for lead, group in groups.items() for d in group}


def device_groups(js: JobSet, order: Order) -> dict[int, tuple[int, ...]] | None:
    """Each group's first device -> the group's devices, for the stages' groups and the order's other devices
    (alone), or ``None`` when two groups share some devices or a group's devices list different actions.

    >>> from opsched.schedule import chain_stage_graph
    >>> from dataclasses import replace
    >>> sg = chain_stage_graph(2, f=1, b=2, w=1)
    >>> paired = replace(sg, stages=[replace(s, devices=(0, 1)) for s in sg.stages], num_devices=2)
    >>> js = JobSet(paired, 1)
    >>> device_groups(js, {0: list(js.jobs), 1: list(js.jobs)})
    {0: (0, 1)}
    >>> device_groups(js, {0: list(js.jobs), 1: list(reversed(js.jobs))}) is None
    True
    """
    try:
        _, stage_groups = on_group_devices(js.sg)
    except Unsupported:
        return None  # groups that share some devices: a device answers to two of them
    groups = {group[0]: group for group in stage_groups}
    covered = {d for group in stage_groups for d in group}
    groups.update({d: (d,) for d in order if d not in covered})
    for lead, group in groups.items():
        if any(list(order.get(d, ())) != list(order.get(lead, ())) for d in group[1:]):
            return None
    return groups


def _is_w(action: Action) -> bool:
    return isinstance(action, Job) and action.pass_ == _W


def _readiness(js: JobSet, members: list[int], end: dict[int, float], t: float) -> tuple[float, list[int]]:
    """(the earliest the action's inputs can be there, its predecessors not yet started) at time ``t``.

    A predecessor not yet started starts at ``t`` at the earliest, so it
    cannot end before ``t`` plus its duration.
    """
    ready, unknown = t, []
    for k in members:
        for p, delay in js.preds[k]:
            if p in members:
                continue
            if p in end:
                ready = max(ready, end[p] + delay)
            else:
                unknown.append(p)
                ready = max(ready, t + js.duration[p] + delay)
    return ready, unknown

