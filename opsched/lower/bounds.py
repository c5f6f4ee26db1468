"""Combinatorial lower bounds on the makespan of a lower-level problem.

Every bound here holds for every schedule of the StageGraph under the same
memory, whatever made it: any order, split (I, W) or fused (B) backwards,
and overlapped F&B pairs whenever the overlap gain is positive, whether or
not the solve at hand uses them. Two relaxations make that so:

* **the bound job set** (:func:`bound_jobs`): the backward of every stage
  is split into ``I' = min(I, B)`` and ``W' = min(I + W, B) - I'``. A split
  schedule only shrinks its jobs to get there; a fused B starting at ``t``
  becomes I' then W' inside ``[t, t + B]``. Nothing starts earlier or frees
  later, so every schedule maps to a schedule of the bound job set with the
  same makespan (a span no longer), and a bound on it is a bound on all;
* **pair shares** (:func:`pair_shares`): an overlapped pair of an F lasting
  ``f`` and a backward pass (I, W or B) lasting ``x`` takes
  ``f + x - gain * min(f, x)``, at least ``max(f, x)`` (gain <= 1). For any
  threshold ``theta``, the F's share of the saving is ``min(f, theta)`` and
  a backward's ``max(0, c - theta)`` with ``c`` its whole length (I' + W',
  taken by I' first; W' alone takes ``max(0, W' - theta)``), since
  ``min(f, x) <= min(f, theta) + max(0, x - theta)``. Each job shortened by
  the gain times its share, a pair can be laid out as its jobs one after the
  other within the pair's time. The device bounds take the best threshold
  among ``0``, ``inf`` and the device's lengths.

The bounds, on the bound job set:

* **critical path**: ``head[j] + duration[j] + tail[j]`` for every job (a
  job inside a pair lasts at least its own duration, so pairs do not shorten
  paths);
* **one device, heads and tails** (Jackson's preemptive rule): a device runs
  its jobs one at a time, none before its head, and after job ``j`` ends at
  least ``tail[j]`` must pass. Scheduling the device preemptively, always the
  available job with the longest tail, minimises ``max(end + tail)``; that
  value bounds the makespan. It contains the simpler "unavoidable idle before
  the first job + total work + unavoidable idle after the last job";
* **memory warm-up**: before the first backward of a device can start (its
  head), the device can only run forwards (a pair needs a backward, so none
  start earlier), and only as many as its activation budget holds, so it
  idles at least the rest of that time.

>>> from opsched.schedule import chain_stage_graph
>>> lower_bound(JobSet(chain_stage_graph(2, f=1, b=2, w=1), 4))
13.0

With a perfect overlap gain an F may hide entirely inside a backward pass,
so the bound drops, whether or not the solve at hand makes pairs:

>>> lower_bound(JobSet(chain_stage_graph(2, f=1, b=2, w=1, overlap_gain=1.0), 4))
11.0
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Mapping

from opsched.lower.jobs import JobSet
from opsched.schedule import INPUT_GRADIENT_PASSES, Job, PassKind, StageGraph

# globals where tested per job: a member lookup costs 14 globals' on Python 3.11
_F, _I, _W, _B = PassKind.F, PassKind.I, PassKind.W, PassKind.B
_LAST_PASSES = (PassKind.W, PassKind.B)  # the pass ending a stage's work on a microbatch, split or fused


def relaxed_stage_graph(sg: StageGraph) -> StageGraph:
    """``sg`` with each stage's backward as ``I' = min(I, B)`` and ``W' = min(I + W, B) - I'`` (no measured B)."""
    stages = []
    for st in sg.stages:
        i, fused = st.duration(PassKind.I), st.duration(PassKind.B)
        first = min(i, fused)
        rest = max(0.0, min(i + st.duration(PassKind.W), fused) - first)
        stages.append(dataclasses.replace(st, time={PassKind.F: st.duration(PassKind.F), PassKind.I: first,
                                                    PassKind.W: rest}))
    return StageGraph(stages, list(sg.edges), num_devices=sg.num_devices, overlap_gain=sg.overlap_gain)


def bound_jobs(js: JobSet) -> JobSet:
    """The job set the bounds are computed on: split, with a measured B shorter than I + W folded in.

    ``js`` itself when it is already that (split backwards, no B shorter than I + W).
    """
    if js.split_backward and not _short_fused_backward(js.sg):
        return js
    return JobSet(relaxed_stage_graph(js.sg), js.microbatches, split_backward=True)


def own_orders_hold_every_schedule(js: JobSet) -> bool:
    """Whether every schedule of the graph maps to an order of ``js``'s own jobs without pairs.

    True for split jobs, no overlap gain and no measured B shorter than I + W:
    then a bound on those orders (the MIP's) bounds every schedule.
    """
    return js.split_backward and not js.sg.may_overlap and not _short_fused_backward(js.sg)


def _short_fused_backward(sg: StageGraph) -> bool:
    return any(st.duration(PassKind.B) < st.duration(PassKind.I) + st.duration(PassKind.W) for st in sg.stages)


def pair_shares(js: JobSet, ks: list[int], pairs: bool = True) -> list[list[float]]:
    """Durations of the jobs ``ks`` of one device, one list per threshold (see the module notes).

    Just the durations when the overlap gain is 0 or without ``pairs`` (no pair saves time).
    """
    durations = [js.duration[k] for k in ks]
    gain = js.sg.largest_pair_saving({js.jobs[k].stage for k in ks}) if pairs else 0.0
    if gain <= 0:
        return [durations]
    whole = [_backward_length(js, k) for k in ks]
    thresholds = sorted({0.0, math.inf, *durations, *(c for c in whole if c is not None)})
    return [[d - gain * _saving(js.jobs[k].pass_, d, c, theta) for k, d, c in zip(ks, durations, whole)]
            for theta in thresholds]


def _backward_length(js: JobSet, k: int) -> float | None:
    """I + W of the job's (stage, microbatch) for an I, B for a B, None for an F or a W."""
    job = js.jobs[k]
    if job.pass_ == _B:
        return js.duration[k]
    if job.pass_ == _I:
        w = js.index.get(Job(job.stage, job.microbatch, _W))
        return js.duration[k] + (js.duration[w] if w is not None else 0.0)
    return None


def _saving(pass_: PassKind, duration: float, whole: float | None, theta: float) -> float:
    """The share of a pair's saving (over the gain) a job takes at threshold ``theta``.

    An F takes ``min(f, theta)``. A backward run fused (B of length ``c``) or
    split (I then W, ``c = I + W``) takes ``max(0, c - theta)`` in all, the I
    first: then an F with either half, or with the whole B, saves no more
    than its two shares (``min(f, x) <= min(f, theta) + max(0, x - theta)``).
    """
    if pass_ == _F:
        return min(duration, theta)
    if pass_ == _W:
        return max(0.0, duration - theta)
    return min(duration, max(0.0, whole - theta))


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


def device_bound(js: JobSet, device: int, pairs: bool = True) -> float:
    """Jackson's bound for one device, with each job's pair share when pairs could save time."""
    ks = js.on_device[device]
    if not ks:
        return 0.0
    heads = [js.head[k] for k in ks]
    tails = [js.tail[k] for k in ks]
    return max(jackson_bound(heads, durations, tails) for durations in pair_shares(js, ks, pairs))


def warmup_bound(js: JobSet, device: int, budget: float | None, pairs: bool = True) -> float:
    """Memory and pairs in the warm-up: a bound on the makespan from the time before ``device``'s first backward.

    Before ``h``, the earliest head of any backward on the device, only
    forwards run on it, one at a time and unpaired (a pair starts with its
    backward, so not before ``h``): from the earliest forward head to ``h``
    the device is idle or runs forwards whole. After ``h`` it runs the rest
    of its work, each job at least at its pair share, and then its least
    tail passes. So the makespan is at least ``h`` plus all its pair shares,
    less the shares of the forward work done before ``h``: forwards with a
    head before ``h``, in that much time, their activations (all held at
    ``h``) within ``budget``; a fractional knapsack on either limit bounds
    those shares (:func:`_warmup_shares`). With gain 0 the shares are the
    durations and this is the idle memory forces before the first backward
    (:func:`warmup_idle`) plus all the work; with a gain, the forwards run
    before ``h`` count whole, where the device bound takes their pair share.

    Two stages at gain 0.5: stage 0's first I can start at 3, so device 0
    runs at most three forwards before it, unpaired. The bound is 3, plus the
    four forwards at half (2) and the backwards (8), less the shares of the
    three forwards already run (1.5); the device bound alone gives 11:

    >>> from opsched.schedule import chain_stage_graph
    >>> js = JobSet(chain_stage_graph(2, f=1, b=2, w=1, overlap_gain=0.5), 4)
    >>> warmup_bound(js, 0, None), device_bound(js, 0)
    (11.5, 11.0)
    """
    window = _warmup_window(js, device)
    if window is None:
        return 0.0
    h, start, early = window
    ks = js.on_device[device]
    at = {k: i for i, k in enumerate(ks)}
    least_tail = min(js.tail[k] for k in ks)
    best = 0.0
    for durations in pair_shares(js, ks, pairs):
        before = [(durations[at[k]], js.duration[k], js.mem[k]) for k in early]
        shares_before = _warmup_shares(before, h - start, budget)
        best = max(best, h - shares_before + sum(durations) + least_tail)
    return best


def _warmup_window(js: JobSet, device: int) -> tuple[float, float, list[int]] | None:
    """(``h``, the earliest head of a backward on ``device``; the earliest head of a forward on it; its forwards
    with a head before ``h``, the only jobs it can run before ``h``), or None without a forward or a backward."""
    ks = js.on_device[device]
    forward = [k for k in ks if js.jobs[k].pass_ == _F]
    backward = [k for k in ks if js.jobs[k].pass_ in INPUT_GRADIENT_PASSES]
    if not forward or not backward:
        return None
    h = min(js.head[k] for k in backward)
    return h, min(js.head[k] for k in forward), [k for k in forward if js.head[k] < h]


def _fractional_knapsack(items: list[tuple[float, float]], room: float) -> float:
    """The most value (value, weight) ``items`` give within ``room`` of weight, any fraction of an item allowed:
    the best value per weight first (ties in the order given).

    >>> _fractional_knapsack([(1.0, 1.0), (3.0, 1.0), (1.0, 2.0)], 2.5)
    4.25
    """
    value = 0.0
    for v, w in sorted(items, key=lambda item: -item[0] / max(item[1], 1e-300)):
        if w <= room:
            room -= w
            value += v
        else:
            value += v * max(room, 0.0) / w
            break
    return value


def _warmup_shares(forwards: list[tuple[float, float, float]], time: float, budget: float | None) -> float:
    """The most pair share a device can run as forwards in ``time`` with at most ``budget`` of activations.

    ``forwards``: (share, duration, activation bytes) of each forward that may
    run before the first backward. Two fractional knapsacks, one on time (the
    durations) and one on memory, each an upper bound; the smaller counts.

    >>> _warmup_shares([(0.5, 1.0, 1.0)] * 4, 3.0, None)
    1.5
    >>> _warmup_shares([(0.5, 1.0, 1.0)] * 4, 3.0, 2.0)
    1.0
    """
    by_time = _fractional_knapsack([(share, duration) for share, duration, _ in forwards], max(time, 0.0))
    if budget is None:
        return by_time
    return min(by_time, _fractional_knapsack([(share, mem) for share, _, mem in forwards], budget))


def warmup_idle(js: JobSet, device: int, budget: float | None) -> tuple[float, float | None]:
    """(the earliest head of a forward on ``device``, the idle memory forces on it before its first backward).

    Before ``h``, the earliest head of any backward on the device, only
    forwards can run, one at a time (a pair needs a backward); their
    activations sum to at most ``budget``, so at most a fractional knapsack of
    them (by duration per byte) fits. The device is idle for the rest of
    ``[min forward head, h)``. The idle is None when the device has no forward
    or no backward; 0 without a budget.
    """
    window = _warmup_window(js, device)
    if window is None:
        forward = [js.head[k] for k in js.on_device[device] if js.jobs[k].pass_ == _F]
        return min(forward, default=0.0), None
    h, start, early = window
    if budget is None:
        return start, 0.0
    work = _fractional_knapsack([(js.duration[k], js.mem[k]) for k in early], budget)
    return start, max(0.0, (h - start) - work)


def idle_lower_bound(js: JobSet, budgets: Mapping[int, float] | None = None) -> dict[int, float]:
    """Per device, a floor on its idle time (makespan minus busy time) in every schedule of ``js``'s StageGraph.

    Two floors, each holding for every schedule, pairs or not, split or fused:

    * before its first job the device idles at least the earliest head of its
      jobs, and memory may force more idle before its first backward
      (:func:`warmup_idle`; pairs need a backward, so they do not hide it).
      Heads on the bound job set are no later than in any schedule, and its
      forwards are the schedule's own;
    * the makespan is at least :func:`lower_bound`, and the device is busy at
      most the longest its jobs can take (each backward as the longer of
      ``I + W`` and ``B``; pairs only shorten that), so it idles at least the
      difference.

    >>> from opsched.schedule import chain_stage_graph
    >>> idle_lower_bound(JobSet(chain_stage_graph(2, f=1, b=2, w=1), 4))
    {0: 1.0, 1: 1.0}
    """
    rel = bound_jobs(js)
    makespan = lower_bound(rel, budgets)  # the bound job set of rel is rel itself: it is not relaxed twice
    out = {}
    for d, ks in rel.on_device.items():
        first, forced = warmup_idle(rel, d, None if budgets is None else budgets.get(d))
        before_first = first + (forced or 0.0) if ks else makespan
        out[d] = max(before_first, makespan - _longest_busy(js, js.on_device[d]))
    return out


def _longest_busy(js: JobSet, ks: list[int]) -> float:
    """The longest the jobs ``ks`` of ``js`` can keep their device busy, each backward split or fused."""
    busy = 0.0
    for k in ks:
        job = js.jobs[k]
        if job.pass_ == _F:
            busy += js.duration[k]
        elif job.pass_ in INPUT_GRADIENT_PASSES:  # the whole backward of that stage and microbatch, in its longer form
            stage = js.sg.stage(job.stage)
            busy += max(stage.duration(_I) + stage.duration(_W), stage.duration(_B))
    return busy


def lower_bound(js: JobSet, budgets: Mapping[int, float] | None = None, own_orders: bool = False) -> float:
    """The best of the bounds above on the makespan of any schedule of ``js``'s StageGraph (proven).

    With ``own_orders``, only on orders of ``js``'s own jobs without pairs
    (what the MIP search reaches): a search may stop there, but that bound
    is not one to report.
    """
    rel = js if own_orders else bound_jobs(js)
    best = critical_path_bound(rel)
    for d in rel.on_device:
        best = max(best, device_bound(rel, d, not own_orders))
        best = max(best, warmup_bound(rel, d, None if budgets is None else budgets.get(d), not own_orders))
    return best


def span_lower_bound(js: JobSet, own_orders: bool = False) -> float:
    """A bound on the Zero Bubble paper's cost: the longest device span, first F to last W or B.

    For device ``d``, a job's *relative head* is the longest dependency path
    from the start of any F on ``d`` to its start (the device's first F is no
    later than that F), and its *relative tail* the longest path from its end
    to the end of a W or B on ``d``. Every device ``e`` runs its jobs one at a
    time, so Jackson's bound over the jobs of ``e`` that have both (with those
    heads and tails, and pair shares) bounds the span of ``d``. With ``e = d`` that is ``d``'s
    own work; with ``e`` the last stage of a chain it is the path to the last
    stage, all of that stage's F and I, and the way back: on Zero Bubble's
    p = 8, m = 24 setting, 7(F + c) + 24(F + I) + 7(I + c) + W = 1152.60 ms
    for device 0, a bubble rate of at least 0.04331. Computed on the bound job
    set, so it holds for fused backwards and pairs too (a schedule's span
    there is no longer). ``own_orders`` as for :func:`lower_bound`.
    """
    js = js if own_orders else bound_jobs(js)
    best = 0.0
    shares = {e: pair_shares(js, ks, not own_orders) for e, ks in js.on_device.items()}
    for d, ks in js.on_device.items():
        head, tail = _relative_paths(js, set(ks))
        for e, other in js.on_device.items():
            inside = [i for i, k in enumerate(other) if head[k] > -math.inf and tail[k] > -math.inf]
            if not inside:
                continue
            heads = [head[other[i]] for i in inside]
            tails = [tail[other[i]] for i in inside]
            for durations in shares[e]:
                best = max(best, jackson_bound(heads, [durations[i] for i in inside], tails))
    return best


def _relative_paths(js: JobSet, mine: set[int]) -> tuple[list[float], list[float]]:
    """Longest paths from the start of any F in ``mine`` to each job, and from each job's end to a W/B in ``mine``."""
    n = len(js)
    head = [-math.inf] * n
    for k in js.topo:
        if k in mine and js.jobs[k].pass_ == _F:
            head[k] = 0.0
        for i, delay in js.preds[k]:
            if head[i] > -math.inf:
                head[k] = max(head[k], head[i] + js.duration[i] + delay)
    tail = [-math.inf] * n
    for k in reversed(js.topo):
        if k in mine and js.jobs[k].pass_ in _LAST_PASSES:
            tail[k] = 0.0
        for s, delay in js.succs[k]:
            if tail[s] > -math.inf:
                tail[k] = max(tail[k], delay + js.duration[s] + tail[s])
    return head, tail
