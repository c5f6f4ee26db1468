"""Parting the overlapped pairs a schedule does not need: the same makespan with fewer pairs.

An overlapped F&B pair (DualPipe's trick) is worth its cost only when it
shortens the step: it runs two microbatches' kernels at once, holds the F's
new activations while the backward still holds its own, and its time rests
on an estimate, the overlap gain. The list scheduler and the neighbourhood
search pair whenever a pair is at hand; many of those pairs sit where the
device would wait anyway. :func:`part_pairs` runs such a pair's two jobs one
after the other instead, whenever that keeps the makespan.

The rule is the critical-path method on the order's own graph: the actions
with the device order and the dependencies (with transfers) as edges, each
action's earliest start from the simulator, its latest start from a
backward sweep. A sweep in reverse topological order decides every pair:
when it reaches a pair, the latest starts after it already count every pair
parted downstream, and its earliest start depends only on actions not yet
reached, none of them changed. So a pair is parted exactly when its two jobs
in sequence still end by their latest ends, and the parted order keeps the
makespan (the simulation after each sweep checks it). A parted pair's first
job may end before the pair did, so sweeps repeat until one parts nothing.

>>> from opsched.schedule import Job, Pair, chain_stage_graph, simulate
>>> from opsched.lower.jobs import JobSet
>>> sg = chain_stage_graph(1, f=1, b=2, w=1, overlap_gain=1.0)
>>> js = JobSet(sg, 2)
>>> f, i, w = Job(0, 1, "F"), Job(0, 0, "I"), Job(0, 0, "W")
>>> order = {0: [Job(0, 0, "F"), Pair(f, i), w, Job(0, 1, "I"), Job(0, 1, "W")]}
>>> max(e.end for e in simulate(sg, order, 2))
5.0
>>> part_pairs(js, order).count  # the W and I after the pair keep the device busy to the end
0
>>> parted = part_pairs(js, order, makespan=6.0)  # one unit more allows it
>>> parted.count, [str(a) for a in parted.order[0]]
(1, ['0F0', '0I0', '0F1', '0W0', '0I1', '0W1'])
"""

from __future__ import annotations

import graphlib
from dataclasses import dataclass
from typing import Sequence

from opsched.lower.jobs import JobSet, noise
from opsched.schedule import Event, Job, Order, PassKind, jobs_of, simulate

#: a node of the order's graph: the jobs of one action (two for an overlapped pair, first as in the pair)
Node = tuple[Job, ...]


@dataclass(frozen=True)
class Parted:
    """What :func:`part_pairs` gives: the order, its events (from the simulator) and how many pairs it parted."""

    order: Order
    events: list[Event]
    count: int


def part_pairs(js: JobSet, order: Order, makespan: float | None = None,
               events: Sequence[Event] | None = None) -> Parted:
    """``order`` with every pair parted that ``makespan`` allows (default: the order's own makespan).

    ``events``: the order's own, from :func:`opsched.schedule.simulate`, when
    the caller has them. A parted pair runs its backward first when both ways
    fit (it frees memory before the F allocates, and the backward chain is
    the longer one), else its F first. The device sequences are otherwise
    unchanged, so the order's peak memory does not grow: a pair allocates
    its F's activations before its backward frees, as the F-first sequence
    does. No pair left can be parted on its own without lengthening the
    schedule beyond ``makespan``: a parted pair's first job may end before
    the pair would have, so work after it may start earlier and a pair the
    sweep kept may fit now; sweeps repeat until one parts nothing.
    """
    if events is None:
        events = simulate(js.sg, order, js.microbatches)
    events = list(events)
    limit = max(e.end for e in events) if makespan is None else float(makespan)
    count = 0
    while True:
        parted = _sweep(js, order, events, limit)
        if not parted:
            return Parted(order, events, count)
        order = {d: [x for a in acts for x in (parted.get(jobs_of(a)) or (a,))] for d, acts in order.items()}
        events = simulate(js.sg, order, js.microbatches)
        new_end = max(e.end for e in events)
        if new_end > limit + noise(limit):  # cannot happen by the rule; the simulator has the last word
            raise AssertionError(f"parting pairs lengthened the schedule: {new_end} > {limit}")
        count += len(parted)


def _sweep(js: JobSet, order: Order, events: list[Event], limit: float) -> dict[Node, tuple[Job, Job]]:
    """One backward sweep over ``order``'s graph: the pairs it parts (by their jobs), each as its new sequence."""
    start = {e.job: e.start for e in events}
    end = {e.job: e.end for e in events}

    # the order's graph: one node per action (a stage on a group is one action on each of its devices)
    node_of: dict[Job, Node] = {}
    next_on_device: dict[Node, set[Node]] = {}
    for acts in order.values():
        previous = None
        for a in acts:
            key = jobs_of(a)
            next_on_device.setdefault(key, set())
            for j in key:
                node_of[j] = key
            if previous is not None:
                next_on_device[previous].add(key)
            previous = key
    preds: dict[Node, set[Node]] = {key: set() for key in next_on_device}
    for key, nexts in next_on_device.items():
        for n in nexts:
            preds[n].add(key)
    for job, key in node_of.items():
        for s, _ in js.succs[js.index[job]]:
            if node_of[js.jobs[s]] != key:
                preds[node_of[js.jobs[s]]].add(key)

    latest_start: dict[Job, float] = {}  # of each job, once the sweep has passed it
    first_latest: dict[Node, float] = {}  # of each action's first job (what the device's previous action sees)
    parted: dict[Node, tuple[Job, Job]] = {}

    def latest_end(job: Job) -> float:
        """The latest ``job`` may end for its dependents (transfers included) to start by their latest starts."""
        out = limit
        for s, delay in js.succs[js.index[job]]:
            out = min(out, latest_start[js.jobs[s]] - delay)
        return out

    for key in reversed(list(graphlib.TopologicalSorter(preds).static_order())):
        device_end = min([limit] + [first_latest[n] for n in next_on_device[key]])
        if len(key) == 2:  # an overlapped pair
            sequence = _parting(js, key, start[key[0]], device_end, latest_end)
            if sequence is not None:
                first, second = sequence
                parted[key] = sequence
                latest_start[second] = min(latest_end(second), device_end) - _duration(js, second)
                latest_start[first] = min(latest_end(first), latest_start[second]) - _duration(js, first)
                first_latest[key] = latest_start[first]
                continue
        latest = min([device_end] + [latest_end(j) for j in key]) - (end[key[0]] - start[key[0]])
        for j in key:
            latest_start[j] = latest
        first_latest[key] = latest
    return parted


def _duration(js: JobSet, job: Job) -> float:
    return js.duration[js.index[job]]


def _parting(js: JobSet, pair: Node, start: float, device_end: float, latest_end) -> tuple[Job, Job] | None:
    """The sequence (backward first, else F first) that runs ``pair``'s two jobs one after the other from
    ``start`` and still ends each by its latest end, or None when neither does."""
    forward, backward = pair if pair[0].pass_ == PassKind.F else pair[::-1]
    tol = noise(device_end)
    for first, second in ((backward, forward), (forward, backward)):
        first_end = start + _duration(js, first)
        second_end = first_end + _duration(js, second)
        if first_end <= latest_end(first) + tol and second_end <= min(latest_end(second), device_end) + tol:
            return first, second
    return None
