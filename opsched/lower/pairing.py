"""Pairing up the critical path: overlapped F&B pairs added one at a time where they shorten the step.

The neighbourhood search forms pairs only inside its small windows, and the
list scheduler pairs whenever an F and a backward are at hand, so its
paired orders carry many pairs the makespan does not need. :func:`pair_up`
works the other way round, from an order without pairs (Zero Bubble's V, a
list-scheduler order): it merges an F and a backward that may overlap
(:meth:`opsched.lower.jobs.JobSet.may_pair`), at most :data:`PAIR_REACH`
actions apart on their device, into one :class:`~opsched.schedule.Pair` in
the earlier one's place, only next to the critical path,
and keeps the first merge that shortens the schedule (a lower makespan, or
the same and a lower sum of job ends, as the neighbourhood search accepts);
it stops when no merge helps or its budget of simulations is spent. The result has a short
makespan and few pairs, which the solve's parting step
(:mod:`opsched.lower.parting`) thins further.

Each candidate is timed by the simulator and kept only when it fits the
memory budgets (a pair allocates its F before its backward frees,
:func:`opsched.lower.jobs.order_peak_activation`).

>>> from opsched.schedule import Job as J, chain_stage_graph
>>> from opsched.lower.jobs import JobSet
>>> from opsched.lower.lns import incumbent_of
>>> js = JobSet(chain_stage_graph(2, f=1, b=2, w=1, overlap_gain=1.0), 3)
>>> order = {0: [J(0, 0, "F"), J(0, 1, "F"), J(0, 2, "F"), J(0, 0, "I"), J(0, 0, "W"), J(0, 1, "I"), J(0, 1, "W"),
...              J(0, 2, "I"), J(0, 2, "W")],
...          1: [J(1, 0, "F"), J(1, 0, "I"), J(1, 1, "F"), J(1, 1, "I"), J(1, 0, "W"), J(1, 2, "F"), J(1, 2, "I"),
...              J(1, 1, "W"), J(1, 2, "W")]}
>>> incumbent_of(js, order).makespan
10.0
>>> paired = pair_up(js, order, None)  # the last stage's F of microbatch 1 hides inside the I of microbatch 0
>>> paired.makespan, str(paired.order[1][1])
(9.0, '(1F1;1I0)OVERLAP_F_B')

Then the F of microbatch 2, two actions further on, is pulled into the I of
microbatch 1 (the same makespan, earlier ends):

>>> paired.merges, [str(a) for a in paired.order[1][2:4]]
(2, ['(1F2;1I1)OVERLAP_F_B', '1W0'])
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple

from opsched.lower.jobs import JobSet, noise, order_fits
from opsched.lower.lns import Incumbent, better, timed_incumbent
from opsched.errors import Deadlock
from opsched.schedule import Event, Job, Order, Pair, PassKind, jobs_of, pair_duration, simulate

#: simulations one :func:`pair_up` may run (a deterministic budget); on the DualPipe grid's V it needs about one per
#: merge: from Zero Bubble's V at 2:2:1, gain 0.5, 64 at D=8, M=16 (0.3 s in all on one core), 320 at D=8, M=32
#: (2.7 s), 196 at D=16, M=32 (3.5 s); 1,222 at D=16, M=64, which this budget stops
PAIR_UP_SIMULATIONS = 1000

#: how far after an F (or a backward) on its device the backward (or F) may be that joins it in a pair: on the
#: DualPipe grid's V, 3 paired Zero Bubble's V as far as 8 did (292 at D=8, M=32, 2:2:1, gain 0.5), 1 (the next
#: action only) stopped at 309, since the V's steady state puts a W between an I and the next F
PAIR_REACH = 3


@dataclass(frozen=True)
class PairedUp:
    """What :func:`pair_up` gives: the order as timed (makespan objective), the pairs it merged, the simulations it
    ran and whether a clock cut it."""

    incumbent: Incumbent
    merges: int
    simulations: int
    cut: bool

    @property
    def order(self) -> Order:
        return self.incumbent.order

    @property
    def makespan(self) -> float:
        return self.incumbent.makespan


class _Merge(NamedTuple):
    """One candidate of :func:`_merges`: the order with ``pair`` made of ``earlier`` and ``later`` (``later``
    pulled into ``earlier``'s place) on ``devices``, the devices whose lists changed."""

    order: Order
    devices: tuple[int, ...]
    earlier: Job
    later: Job
    pair: Pair


def pair_up(js: JobSet, order: Order, budgets: Mapping[int, float] | None,
            max_simulations: int = PAIR_UP_SIMULATIONS, deadline: float | None = None,
            together: bool = False) -> PairedUp:
    """``order`` with pairs merged on its critical path while a merge shortens it (see the module's docstring).

    ``budgets``: activation budget per device (``None``: no limit).
    ``max_simulations`` is the work budget; ``deadline`` (a
    :func:`time.monotonic` instant) a clock cap, and ``cut`` says when it
    stopped the work. Merges are tried in device order, then position, so
    the result is deterministic when the clock does not cut it.

    With ``together``, each round first tries every merge that could help
    at once (in that order, each job in one pair at most), and only when
    that does not shorten the order one merge at a time. It ends elsewhere,
    with more pairs: on the DualPipe grid at gain 1, Zero Bubble's V paired
    up together gave 144 and 240 at D=8, M=16 and 32, 2:2:1 (8 simulations
    each), where one at a time ends at 153 (no merge helps) and 275 (its
    1,000 simulations spent); DualPipeV's orders take 151 and 247.
    """
    events = simulate(js.sg, order, js.microbatches)
    best = timed_incumbent(js, order, events)
    timing = _Timing(order, events)
    merges = simulations = 0
    while simulations < max_simulations:
        step: _Step | None = None
        if together:
            if deadline is not None and time.monotonic() >= deadline:
                return PairedUp(best, merges, simulations, True)
            step, simulations = _all_at_once(js, best, events, timing, list(_merges(js, best.order, timing)),
                                             budgets, simulations)
        for merge in ([] if step else _merges(js, best.order, timing)):
            if simulations >= max_simulations:
                break
            if deadline is not None and time.monotonic() >= deadline:
                return PairedUp(best, merges, simulations, True)
            if not _fits_alone(js, merge, budgets):
                continue
            simulations += 1
            since = timing.start[merge.earlier]  # nothing before it changed: only the rest is timed again
            try:
                timed = simulate(js.sg, merge.order, js.microbatches, events, since)
            except Deadlock:  # the backward may wait, through the pipeline, for the F it was merged with
                continue
            inc = timed_incumbent(js, merge.order, timed)
            # the first merge that shortens the order; the one that shortens it most gave the same results on
            # the DualPipe grid, with 5 to 10 times the simulations
            if better(inc, best):
                step = _Step(inc, timed, 1, merge.devices, since)
                break
        if step is None:
            break
        best, events, merges = step.incumbent, step.events, merges + step.merges
        timing.update(best.order, step.devices, events, step.since)
        if deadline is not None and time.monotonic() >= deadline:
            return PairedUp(best, merges, simulations, True)
    return PairedUp(best, merges, simulations, False)


class _Step(NamedTuple):
    """A round of :func:`pair_up` that shortened the order: the order timed, its events, the pairs merged, the
    devices whose lists changed and the earliest start that did."""

    incumbent: Incumbent
    events: list[Event]
    merges: int
    devices: Iterable[int]
    since: float


def _all_at_once(js: JobSet, best: Incumbent, events: list[Event], timing: "_Timing", candidates: list[_Merge],
                 budgets: Mapping[int, float] | None, simulations: int) -> tuple[_Step | None, int]:
    """Every merge of ``candidates`` (``_merges``'s) that fits in memory alone, on ``best``'s order (timed as
    ``events`` and ``timing``) at once, each job in one pair at most: the step when that fits and shortens the
    order, else None; and the simulations run so far (one at most)."""
    together = dict(best.order)  # the merged devices' lists are replaced, not changed
    used: set[Job] = set()
    devices: set[int] = set()
    for merge in candidates:
        if merge.earlier in used or merge.later in used or not _fits_alone(js, merge, budgets):
            continue
        # merges keep the order of the other actions, so ``earlier`` still runs first
        lists = {e: _merged(together[e], merge.earlier, merge.later, merge.pair) for e in merge.devices}
        if any(acts is None for acts in lists.values()):
            continue
        together.update(lists)
        used.update((merge.earlier, merge.later))
        devices.update(merge.devices)
    count = len(used) // 2
    if count < 2 or not order_fits(js.sg, together, budgets):  # one merge alone is tried one at a time anyway
        return None, simulations
    since = min(timing.start[job] for job in used)
    try:
        timed = simulate(js.sg, together, js.microbatches, events, since)
    except Deadlock:
        return None, simulations + 1
    inc = timed_incumbent(js, together, timed)
    return (_Step(inc, timed, count, devices, since) if better(inc, best) else None), simulations + 1


def _fits_alone(js: JobSet, merge: _Merge, budgets: Mapping[int, float] | None) -> bool:
    """Whether ``merge``'s order fits the activation ``budgets``: only the devices of the merge changed, so only
    their memory is checked again."""
    return budgets is None or order_fits(js.sg, {e: merge.order[e] for e in merge.devices},
                                         {e: budgets[e] for e in merge.devices if e in budgets})


def critical_path(js: JobSet, order: Order, events: list[Event]) -> set[Job]:
    """The jobs of one critical path of ``order`` as timed in ``events``: from the job that ends last, back
    through the action that made each start when it did (the device's previous action, else a dependency
    with its transfer), to a job that starts at its earliest."""
    return _Timing(order, events).critical_path(js)


class _Timing:
    """An order as timed: each job's start and end, and the job before each job's action on each of its devices.

    A merge changes the order only on its devices and the times only from its earlier job's start on, so
    :meth:`update` re-reads only those (a pair-up round then costs what changed, not the whole order)."""

    def __init__(self, order: Order, events: list[Event]):
        self.start: dict[Job, float] = {}
        self.end: dict[Job, float] = {}
        self.previous: dict[Job, dict[int, Job]] = {}
        self._read(events)
        for d, acts in order.items():
            self._link(d, acts)

    def update(self, order: Order, devices: Iterable[int], events: list[Event], since: float) -> None:
        """Take ``order``'s ``events``, in which only ``devices``' lists and the times from ``since`` on changed."""
        self._read(events[bisect.bisect_left(events, since, key=lambda e: e.start):])
        for d in devices:
            self._link(d, order[d])

    def _read(self, events: list[Event]) -> None:
        start, end = self.start, self.end
        for e in events:
            job = e.job
            start[job], end[job] = e.start, e.end

    def _link(self, d: int, acts: list) -> None:
        before = None
        for action in acts:
            jobs = jobs_of(action)
            for job in jobs:
                if before is None:
                    self.previous.setdefault(job, {}).pop(d, None)
                else:
                    self.previous.setdefault(job, {})[d] = before
            before = jobs[0]

    def critical_path(self, js: JobSet) -> set[Job]:
        start, end = self.start, self.end
        last = max(end.values())
        job = max((j for j, t in end.items() if t == last), key=str)
        path = set()
        while job is not None and job not in path:
            path.add(job)
            tol = noise(start[job])
            previous = self.previous.get(job, {})
            made = [previous[d] for d in sorted(previous) if abs(end[previous[d]] - start[job]) <= tol]
            made += [js.jobs[i] for i, delay in js.preds[js.index[job]]
                     if abs(end[js.jobs[i]] + delay - start[job]) <= tol]
            job = made[0] if made else None
        return path


def _merges(js: JobSet, order: Order, timing: _Timing):
    """Every :class:`_Merge` of ``order``: a pair merged from an F and a backward that may overlap, ``a`` and a
    later ``b`` at most :data:`PAIR_REACH` actions after it on its device, at least one of them on the critical
    path, that could shorten ``order`` (its jobs' ``start`` and ``end``). The pair takes ``a``'s place, ``b`` pulled forward to
    it, on every device of their stage (where ``b`` follows ``a`` within reach too); the actions between them
    follow the pair.

    The pair starts when ``a`` started or when ``b``'s dependencies allow, whichever is later. Unless it then
    ends before ``b`` did, every job ends no earlier than before (the actions between them now wait for the
    pair, which ends after ``a`` did, and earliest starts only grow with the ends before them), so such a
    merge is not tried. Pushing ``a`` back to ``b``'s place instead never helped on the DualPipe grid and
    cost 5-9 times the simulations (reach 1-3).
    """
    critical = timing.critical_path(js)
    start, end = timing.start, timing.end
    seen: set[tuple[Job, Job]] = set()
    for d in sorted(order):
        acts = order[d]
        for i, a in enumerate(acts):
            if isinstance(a, Pair):
                continue
            for b in acts[i + 1:i + 1 + PAIR_REACH]:
                if isinstance(b, Pair) or (a, b) in seen:
                    continue
                if not (a in critical or b in critical) or not js.may_pair(js.index[a], js.index[b]):
                    continue
                seen.add((a, b))
                pair = Pair(a, b) if a.pass_ == PassKind.F else Pair(b, a)
                ready = max([start[a]] + [end[js.jobs[k]] + delay for k, delay in js.preds[js.index[b]]])
                if ready + pair_duration(js.sg, pair) >= end[b] - noise(end[b]):
                    continue
                devices = js.devices[js.index[a]]
                merged = {e: _merged(order.get(e, []), a, b, pair) for e in devices}
                if any(m is None for m in merged.values()):
                    continue
                yield _Merge({e: merged.get(e, acts_e) for e, acts_e in order.items()}, devices, a, b, pair)


def _merged(acts: list, a: Job, b: Job, pair: Pair) -> list | None:
    """``acts`` with ``pair`` in ``a``'s place and ``b`` left out; None unless ``b`` follows ``a`` within reach."""
    i = acts.index(a) if a in acts else None  # a scan, as the copy below is
    if i is None or b not in acts[i + 1:i + 1 + PAIR_REACH]:
        return None
    j = acts.index(b, i + 1)
    return acts[:i] + [pair] + acts[i + 1:j] + acts[j + 1:]
