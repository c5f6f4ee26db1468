"""Combinatorial lower bounds on the makespan of a lower-level problem.

Every bound here is proven for the continuous-time problem (any schedule,
any order), so it can be reported next to a heuristic or MIP makespan:

* **critical path**: ``head[j] + duration[j] + tail[j]`` for every job;
* **one device, heads and tails** (Jackson's preemptive rule): a device runs
  its jobs one at a time, none before its head, and after job ``j`` ends at
  least ``tail[j]`` must pass. Scheduling the device preemptively, always the
  available job with the longest tail, minimises ``max(end + tail)``; that
  value bounds the makespan. It contains the simpler "unavoidable idle before
  the first job + total work + unavoidable idle after the last job";
* **memory warm-up**: before the first backward of a device can start (its
  head), the device can only run forwards, and only as many as its
  activation budget holds, so it idles at least the rest of that time.

With overlapped F&B pairs (``allow_pairs`` and a positive overlap gain) a
device's work can shrink, so the device bounds use durations reduced by the
largest possible overlap saving instead.

>>> from opsched.schedule import chain_stage_graph
>>> from opsched.lower.jobs import JobSet
>>> lower_bound(JobSet(chain_stage_graph(2, f=1, b=2, w=1), 4))
13.0
"""

from __future__ import annotations

import heapq
from typing import Mapping

from opsched.lower.jobs import JobSet


def critical_path_bound(js: JobSet) -> float:
    """Longest dependency chain (with transfers) through any job."""
    return max(js.head[k] + js.duration[k] + js.tail[k] for k in range(len(js)))


def jackson_bound(heads: list[float], durations: list[float], tails: list[float]) -> float:
    """Optimal ``max(end + tail)`` of a preemptive one-machine schedule with release dates.

    >>> jackson_bound([0, 0], [1, 1], [5, 0])
    6.0
    """
    jobs = sorted(range(len(heads)), key=lambda k: (heads[k], -tails[k], k))
    left = [float(d) for d in durations]
    ready: list[tuple[float, int]] = []
    t = 0.0
    best = 0.0
    i = 0
    n = len(jobs)
    while i < n or ready:
        if not ready:
            t = max(t, heads[jobs[i]])
        while i < n and heads[jobs[i]] <= t:
            k = jobs[i]
            heapq.heappush(ready, (-tails[k], k))
            i += 1
        neg_tail, k = ready[0]
        next_release = heads[jobs[i]] if i < n else float("inf")
        run = min(left[k], next_release - t)
        t += run
        left[k] -= run
        if left[k] <= 1e-12:
            heapq.heappop(ready)
            best = max(best, t - neg_tail)
    return best


def device_bound(js: JobSet, device: int, allow_pairs: bool = False) -> float:
    """Jackson's bound for one device (with pair savings folded into the work when allowed)."""
    ks = js.on_device[device]
    if not ks:
        return 0.0
    heads = [js.head[k] for k in ks]
    tails = [js.tail[k] for k in ks]
    durations = [js.duration[k] for k in ks]
    gain = js.sg.overlap_gain
    if allow_pairs and gain > 0:
        # pairs may overlap work: only unavoidable idle + work - the largest saving is safe
        forward = sum(d for k, d in zip(ks, durations) if js.jobs[k].pass_ == "F")
        backward = sum(d for k, d in zip(ks, durations) if js.jobs[k].pass_ in ("I", "B"))
        saving = gain * min(forward, backward)
        return min(heads) + sum(durations) - saving + min(tails)
    return jackson_bound(heads, durations, tails)


def warmup_bound(js: JobSet, device: int, budget: float | None) -> float:
    """Idle forced by memory before the first backward of ``device``, plus its work and least tail.

    Before ``h``, the earliest head of any backward on the device, only
    forwards can run; their activations sum to at most ``budget``, so at most
    a fractional knapsack of them (by duration per byte) fits. The device is
    idle for the rest of ``[min forward head, h)``.
    """
    ks = js.on_device[device]
    if budget is None or not ks:
        return 0.0
    backward = [k for k in ks if js.jobs[k].pass_ in ("I", "B")]
    forward = [k for k in ks if js.jobs[k].pass_ == "F"]
    if not backward or not forward:
        return 0.0
    h = min(js.head[k] for k in backward)
    start = min(js.head[k] for k in forward)
    usable = sorted(
        (k for k in forward if js.head[k] < h), key=lambda k: (-js.duration[k] / max(js.mem[k], 1e-300), k)
    )
    room, work = budget, 0.0
    for k in usable:
        if js.mem[k] <= room:
            room -= js.mem[k]
            work += js.duration[k]
        else:
            work += js.duration[k] * max(room, 0.0) / js.mem[k]
            break
    idle = max(0.0, (h - start) - work)
    total = sum(js.duration[k] for k in ks)
    if js.sg.overlap_gain > 0:  # pairs could hide part of the work; stay safe
        return 0.0
    return start + idle + total + min(js.tail[k] for k in ks)


def lower_bound(
    js: JobSet, budgets: Mapping[int, float] | None = None, allow_pairs: bool = False
) -> float:
    """The best of the combinatorial bounds above (a proven makespan lower bound)."""
    best = critical_path_bound(js)
    for d in js.on_device:
        best = max(best, device_bound(js, d, allow_pairs))
        if budgets is not None:
            best = max(best, warmup_bound(js, d, budgets.get(d)))
    return best


def span_lower_bound(js: JobSet) -> float:
    """A bound on the Zero Bubble paper's cost: the longest device span, first F to last W or B.

    For device ``d``, a job's *relative head* is the longest dependency path
    from the start of any F on ``d`` to its start (the device's first F is no
    later than that F), and its *relative tail* the longest path from its end
    to the end of a W or B on ``d``. Every device ``e`` runs its jobs one at a
    time, so Jackson's bound over the jobs of ``e`` that have both (with those
    heads and tails) bounds the span of ``d``. With ``e = d`` that is ``d``'s
    own work; with ``e`` the last stage of a chain it is the path to the last
    stage, all of that stage's F and I, and the way back: on Zero Bubble's
    p = 8, m = 24 setting, 7(F + c) + 24(F + I) + 7(I + c) + W = 1152.60 ms
    for device 0, a bubble rate of at least 0.04331.
    """
    best = 0.0
    n = len(js)
    for d, ks in js.on_device.items():
        mine = set(ks)
        head = [float("-inf")] * n
        for k in js.topo:
            if k in mine and js.jobs[k].pass_ == "F":
                head[k] = 0.0
            for i, delay in js.preds[k]:
                if head[i] > float("-inf"):
                    head[k] = max(head[k], head[i] + js.duration[i] + delay)
        tail = [float("-inf")] * n
        for k in reversed(js.topo):
            if k in mine and js.jobs[k].pass_ in ("W", "B"):
                tail[k] = 0.0
            for s, delay in js.succs[k]:
                if tail[s] > float("-inf"):
                    tail[k] = max(tail[k], delay + js.duration[s] + tail[s])
        for other in js.on_device.values():
            inside = [k for k in other if head[k] > float("-inf") and tail[k] > float("-inf")]
            if inside:
                best = max(best, jackson_bound([head[k] for k in inside], [js.duration[k] for k in inside],
                                               [tail[k] for k in inside]))
    return best
