"""A memory-aware greedy list scheduler: the first incumbent of the lower level.

In the spirit of Zero Bubble's automatic scheduler: at every step the device
that can start something earliest starts its most urgent job. Forwards run
while memory allows (the warm-up), backwards for inputs (I) come first once
they are ready, and a weight pass (W) fills a gap or frees memory when nothing
else can run. A few priority variants are tried and the best order is kept
(the makespan of every order is measured by :func:`opsched.schedule.simulate`).

Deadlock freedom under a memory limit (a banker's rule): a forward may start
only if, afterwards, the microbatches in flight could still be finished one
at a time, oldest first, within every device's budget. The oldest microbatch
can therefore always progress, and a new microbatch is admitted only when
that stays true.

>>> from opsched.schedule import chain_stage_graph, simulate
>>> from opsched.lower.jobs import JobSet
>>> sg = chain_stage_graph(2, f=1, b=2, w=1)
>>> order = list_schedule(JobSet(sg, 2), budgets=None, priority="zb")
>>> max(e.end for e in simulate(sg, order, 2))
7.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from opsched.lower.jobs import EPS, JobSet, noise, order_fits
from opsched.lower.list_memory import DeviceMemory
from opsched.schedule import INPUT_GRADIENT_PASSES, Action, Job, Order, Pair, PassKind, pair_duration, simulate

# globals where tested per job: a member lookup costs 14 globals' on Python 3.11
_F, _W = PassKind.F, PassKind.W

#: priority rule name -> sort key of a candidate job (smaller runs first)
PRIORITIES = ("zb", "forward", "critical")
#: how a lazy variant's W wait (:attr:`Variant.lazy_w`; ``None``: they run whenever their device is free)
LAZY_W = (None, "drain", "hold", "first")
#: those :func:`default_variants` tries with Zero Bubble's rounds ("first" is Zero Bubble's own rule; "hold"
#: did no better than it on the peer grid of benchmarks/bench_zb_peer.py)
ROUNDS_LAZY_W = (None, "drain", "first")


@dataclass(frozen=True)
class Variant:
    """One configuration of the list scheduler."""

    priority: str = "zb"
    #: most microbatches in flight at once (``None``: only memory limits it)
    cap: int | None = None
    #: delay a W when another job of the device would become startable before it ends
    patient_w: bool = False
    #: overlap an F with a backward of a stage on the same devices when both can start
    pairs: bool = False
    #: (base, slope): stage at depth k keeps at most max(1, base - slope*k) microbatches between F and I
    #: (1F1B / Zero Bubble warm-up shapes: downstream stages stay free for the returning backwards)
    stage_cap: tuple[int, int] | None = None
    #: delay a W when the backward (I or B) of its stage's last microbatch would become startable before it
    #: ends: that backward chain decides when the pipeline drains
    guard_last_backward: bool = False
    #: (stage, cap) pairs: each stage keeps at most its own cap of microbatches between F and I (warm-up
    #: counts from the timing, :func:`timed_warmup`, where ``stage_cap``'s straight line does not fit)
    warmup: tuple[tuple[int, int], ...] | None = None
    #: hold each W back while its device may keep it for later (Zero Bubble's greedy keeps them for the end):
    #: a W runs when a forward of its device waits for memory, inside an idle gap it fits in whole (placed
    #: there when the gap's next job is dispatched), and otherwise, with ``"drain"``, once its device has no
    #: forward left; with ``"hold"`` once it has no forward or backward left; with ``"first"`` as ``"drain"``
    #: on the devices of the first stages (those without a predecessor), else as ``"hold"``, which is Zero
    #: Bubble's rule: the first stage's last backward ends the pipeline, its W should not wait for it
    lazy_w: str | None = None
    #: with a warm-up cap: after its warm-up a stage alternates forward and backward, as 1F1B and Zero Bubble's
    #: rounds do: its backward waits while the stage may start its next forward under the cap
    alternate: bool = False

    def __post_init__(self):
        if self.lazy_w not in LAZY_W:
            raise ValueError(f"unknown lazy_w {self.lazy_w!r}; choose one of {LAZY_W}")

    @property
    def name(self) -> str:
        parts = [f"list-{self.priority}"]
        if self.cap is not None:
            parts.append(f"cap{self.cap}")
        if self.patient_w:
            parts.append("patientW")
        if self.guard_last_backward:
            parts.append("guardLast")
        if self.pairs:
            parts.append("pairs")
        if self.stage_cap is not None:
            parts.append(f"warmup{self.stage_cap[0]}-{self.stage_cap[1]}")
        if self.warmup is not None:
            parts.append("timed-warmup" + "-".join(str(c) for _, c in self.warmup))
        if self.lazy_w is not None:
            parts.append(f"lazyW-{self.lazy_w}")
        if self.alternate:
            parts.append("alternate")
        return "-".join(parts)


#: the passes' ranks under the "zb" rule (backward first, W last) and the "forward" rule (forward first, W last)
_BACKWARD_FIRST = {PassKind.F: 1, PassKind.I: 0, PassKind.B: 0, PassKind.W: 2}
_FORWARD_FIRST = {PassKind.F: 0, PassKind.I: 1, PassKind.B: 1, PassKind.W: 2}


def _priority_key(js: JobSet, k: int, rule: str) -> tuple:
    job = js.jobs[k]
    rank = _BACKWARD_FIRST[job.pass_]
    if rule == "zb":  # backward first, then forward, W last
        return (rank, job.microbatch, -js.tail[k], k)
    if rule == "forward":  # forward first (GPipe-like warm-up), then backward
        return (_FORWARD_FIRST[job.pass_], job.microbatch, -js.tail[k], k)
    if rule == "critical":  # longest remaining path first
        return (-(js.tail[k] + js.duration[k]), rank, job.microbatch, k)
    raise ValueError(f"unknown priority rule {rule!r}")


def list_schedule(js: JobSet, budgets: Mapping[int, float] | None, variant: Variant | None = None, **kw) -> Order:
    """One greedy order of every job of ``js`` under the activation ``budgets``.

    ``variant`` (or keyword fields of :class:`Variant`) picks the priority rule.
    Forwards of one stage run in microbatch order. The order is complete and
    never deadlocks when every budget is at least one microbatch's requirement.
    """
    return _ListScheduler(js, budgets, variant or Variant(**kw)).run()


class _ListScheduler:
    """The state of one :func:`list_schedule` run: what is dispatched, what may start, when devices free up.

    Each step dispatches, among the candidates that can start earliest, the
    one with the least priority key. What a candidate may do depends on its
    own devices (when they free up, the memory held there, the warm-up cap of
    its stage, the other candidates there for a held-back W) and on a few
    global facts that change only when a microbatch enters or leaves flight
    (the in-flight cap, the banker's order). So the candidates are kept per
    *component* (devices joined by a job that runs on several of them; one
    device each on a chain), each with its startable jobs and their earliest
    start, and a step recomputes only the components it touched (all of them
    when a microbatch entered or left flight): a step costs about one
    component's candidates instead of all of them, with the same choices.
    """

    def __init__(self, js: JobSet, budgets: Mapping[int, float] | None, variant: Variant):
        self.js, self.v = js, variant
        sg = js.sg
        n = len(js)
        self.missing = [len(p) for p in js.preds]  # predecessors not yet dispatched
        self.end: dict[int, float] = {}
        self.free = {d: 0.0 for d in js.on_device}
        self.memory = DeviceMemory(js, budgets)
        self.order: Order = {d: [] for d in js.on_device}
        self.forward = [job.pass_ == _F for job in js.jobs]
        #: candidate forwards of microbatches not yet started: a microbatch's start changes their checks
        self.fresh: set[int] = set()
        self.started_mb: set[int] = set()
        component = _device_components(js)
        self.comp = [component[devs[0]] for devs in js.devices]  # job -> its component
        count = max(component.values(), default=-1) + 1
        self.pending: list[set[int]] = [set() for _ in range(count)]  # candidates per component
        #: a lazy variant's W candidates, apart: most wait, and a step looks at them only when they may run
        self.pending_w: list[set[int]] = [set() for _ in range(count)]
        self.lazy = variant.lazy_w is not None
        self.comp_devices: list[list[int]] = [[] for _ in range(count)]
        for d, c in component.items():
            self.comp_devices[c].append(d)
        self.startable: list[dict[int, float]] = [{} for _ in range(count)]  # ... that may start now -> start
        self.earliest: list[float] = [math.inf] * count  # least start per component
        self.stale: set[int] = set(range(count))
        # forwards of a stage run in microbatch order: only the next one is a candidate
        self.next_forward: dict[int, list[int]] = {}
        for k, job in enumerate(js.jobs):
            if job.pass_ == _F:
                self.next_forward.setdefault(job.stage, []).append(k)
        for ks in self.next_forward.values():
            ks.sort(key=lambda k: js.jobs[k].microbatch, reverse=True)  # pop() gives the smallest
        for k in range(n):
            if self.missing[k] == 0 and js.jobs[k].pass_ != _F:
                self.add(k)
        for ks in self.next_forward.values():
            if ks and self.missing[ks[-1]] == 0:
                self.add(ks.pop())
        self.depth = _stage_depths(sg)
        self.warmup_cap = None if variant.warmup is None else dict(variant.warmup)
        self.between: dict[int, int] = {s.id: 0 for s in sg.stages}  # microbatches between F and I per stage
        self.keys = [_priority_key(js, k, variant.priority) for k in range(n)]
        self.ready_at: dict[int, float] = {}
        last_mb = {st.id: max(st.microbatches) if st.microbatches else js.microbatches - 1 for st in sg.stages}
        self.last_backward = {k for k, job in enumerate(js.jobs)
                              if job.pass_ in INPUT_GRADIENT_PASSES and job.microbatch == last_mb[job.stage]}
        #: per device, forwards and all jobs but W not yet dispatched (when a lazy variant's W may run)
        self.forwards_left = {d: 0 for d in js.on_device}
        self.others_left = {d: 0 for d in js.on_device}
        for k, job in enumerate(js.jobs):
            for d in js.devices[k]:
                self.forwards_left[d] += job.pass_ == _F
                self.others_left[d] += job.pass_ != _W
        #: per component, the backwards an alternating variant holds back (they run when nothing else can, as do
        #: a lazy variant's W)
        self.held: list[list[int]] = [[] for _ in range(count)]
        #: devices whose held-back W run once their forwards are done (:attr:`Variant.lazy_w`)
        sources = [st for st in sg.stages if not sg.preds(st.id)]
        self.drains = {"drain": set(js.on_device), "first": {d for st in sources for d in st.devices}}.get(
            variant.lazy_w, set())
        self.stage_forwards_left = {st.id: 0 for st in sg.stages}
        for job in js.jobs:
            self.stage_forwards_left[job.stage] += job.pass_ == _F

    def add(self, k: int) -> None:
        if self.lazy and self.js.jobs[k].pass_ == _W:
            self.pending_w[self.comp[k]].add(k)
            self.stale.add(self.comp[k])
            return
        self.pending[self.comp[k]].add(k)
        self.stale.add(self.comp[k])
        if self.forward[k] and self.js.jobs[k].microbatch not in self.started_mb:
            self.fresh.add(k)

    def run(self) -> Order:
        done = 0
        while done < len(self.js):
            for c in self.stale:
                self.refresh(c)
            self.stale.clear()
            t = min(self.earliest)
            if t == math.inf and (any(self.held) or any(self.pending_w)):
                t = self.release_held()
            if t == math.inf:  # pragma: no cover - the banker's rule prevents this
                raise RuntimeError("list scheduler stalled; memory budget below one microbatch's requirement")
            limit = t + noise(t)
            now = [k for c, low in enumerate(self.earliest) if low <= limit
                   for k, start in self.startable[c].items() if start <= limit]
            done += self.dispatch_first(t, now)
        return self.order

    def release_held(self) -> float:
        """Nothing else can start: the held-back candidates may (a backward held for its stage's forward, a lazy
        variant's W); returns the earliest start now."""
        for c, held in enumerate(self.held):
            held += self.pending_w[c]
            self.startable[c].update((k, self.start(k, self.ready(k))) for k in held)
            self.earliest[c] = min(self.startable[c].values(), default=math.inf)
            held.clear()
        return min(self.earliest)

    def ready(self, k: int) -> float:
        """When job ``k``'s inputs are there (fixed once every predecessor is dispatched)."""
        r = self.ready_at.get(k)
        if r is None:
            r = self.ready_at[k] = max([0.0] + [self.end[i] + delay for i, delay in self.js.preds[k]])
        return r

    def refresh(self, c: int) -> None:
        """Component ``c``'s candidates that the variant's caps and memory allow now, with their earliest start."""
        js, v = self.js, self.v
        ready_at, forward, lazy = self.ready_at, self.forward, self.lazy
        starts = {}
        waiting: set[int] = set()  # devices where a forward waits for memory
        blocked: set[int] = set()  # ... and their stages
        for k in self.pending[c]:
            if forward[k]:
                job = js.jobs[k]
                if v.cap is not None and job.microbatch not in self.started_mb and len(self.memory.inflight) >= v.cap:
                    continue
                if v.stage_cap is not None:
                    base, slope = v.stage_cap
                    if self.between[job.stage] >= max(1, base - slope * self.depth[job.stage]):
                        continue
                if self.warmup_cap is not None and self.between[job.stage] >= self.warmup_cap[job.stage]:
                    continue
                if not self.memory.allows(k):
                    waiting.update(js.devices[k])
                    blocked.add(job.stage)
                    continue
            r = ready_at.get(k)
            starts[k] = self.start(k, self.ready(k) if r is None else r)
        if v.patient_w or v.guard_last_backward:
            self._hold_back_w(starts)  # what a W waits for runs on its own devices: inside the component
        if lazy:  # once ``waiting`` is known
            self._lazy_w(c, starts, waiting)
        self.held[c] = self._alternate(starts, blocked) if v.alternate else []
        self.startable[c] = starts
        self.earliest[c] = min(starts.values(), default=math.inf)

    def start(self, k: int, ready: float) -> float:
        """When job ``k``, ready at ``ready``, can start on its devices."""
        devs, free = self.js.devices[k], self.free
        if len(devs) == 1:
            f = free[devs[0]]
            return ready if ready >= f else f
        return max([ready] + [free[d] for d in devs])

    def _hold_back_w(self, starts: dict[int, float]) -> None:
        """Drop each W that would still run when a job it must not delay could start on its devices."""
        js, patient, last_backward, devices = self.js, self.v.patient_w, self.last_backward, self.js.devices
        # per device, the earliest start of a job a W must not delay
        earliest: dict[int, float] = {}
        ws = []
        for o, start in starts.items():
            if js.jobs[o].pass_ == _W:
                ws.append(o)
            elif patient or o in last_backward:
                for d in devices[o]:
                    if start < earliest.get(d, math.inf):
                        earliest[d] = start
        if not earliest:
            return
        duration, inf = js.duration, math.inf
        for k in ws:
            ends = starts[k] + duration[k] - EPS
            devs = devices[k]
            if earliest.get(devs[0], inf) < ends or (len(devs) > 1 and any(earliest.get(d, inf) < ends for d in devs)):
                del starts[k]

    def _lazy_w(self, c: int, starts: dict[int, float], waiting: set[int]) -> None:
        """Add to ``starts`` component ``c``'s W whose devices may not keep them for later (:attr:`Variant.lazy_w`)."""
        js, forwards, others, drains = self.js, self.forwards_left, self.others_left, self.drains
        if not waiting and all(forwards[d] if d in drains else others[d] for d in self.comp_devices[c]):
            return
        release: dict[int, bool] = {}  # device -> its W run now
        for k in self.pending_w[c]:
            devs = js.devices[k]
            go = release.get(devs[0]) if len(devs) == 1 else None
            if go is None:
                go = any(d in waiting or (forwards[d] if d in drains else others[d]) == 0 for d in devs)
                if len(devs) == 1:
                    release[devs[0]] = go
            if go:
                starts[k] = self.start(k, self.ready(k))

    def _stage_cap(self, stage: int) -> int | None:
        if self.warmup_cap is not None:
            return self.warmup_cap[stage]
        if self.v.stage_cap is not None:
            base, slope = self.v.stage_cap
            return max(1, base - slope * self.depth[stage])
        return None

    def _alternate(self, starts: dict[int, float], blocked: set[int]) -> list[int]:
        """Move out of ``starts`` each backward whose stage is to start a forward first (:attr:`Variant.alternate`)."""
        js, held = self.js, []
        for k in [k for k in starts if js.jobs[k].pass_ in INPUT_GRADIENT_PASSES]:
            stage = js.jobs[k].stage
            cap = self._stage_cap(stage)
            if (cap is not None and self.between[stage] < cap and self.stage_forwards_left[stage] > 0
                    and stage not in blocked):
                del starts[k]
                held.append(k)
        return held

    def _fill_gaps(self, k: int, t: float) -> int:
        """Place held-back W in the idle time before job ``k`` starts at ``t``, each where it fits whole.

        Nothing else changes: a W has no successor, and it ends before ``k``
        starts. Returns the number of W placed.
        """
        js, free = self.js, self.free
        if all(free[d] >= t for d in js.devices[k]):
            return 0
        placed = 0
        ours = set(js.devices[k])
        for w in sorted(self.pending_w[self.comp[k]], key=lambda w: self.keys[w]):
            devs = js.devices[w]
            if ours.isdisjoint(devs):
                continue
            start = self.start(w, self.ready(w))
            if start + js.duration[w] <= t + noise(t):
                self._place_alone(w, start)
                placed += 1
        return placed

    def _place_alone(self, w: int, start: float) -> None:
        """Dispatch the W ``w`` at ``start`` (a gap in the past of the current step)."""
        js = self.js
        self.pending_w[self.comp[w]].discard(w)
        self.stale.add(self.comp[w])
        if self.memory.dispatch(w) == "left":
            self.stale.update(range(len(self.pending)))
        self.end[w] = start + js.duration[w]
        for d in js.devices[w]:
            self.free[d] = self.end[w]
            self.order[d].append(js.jobs[w])

    def dispatch_first(self, t: float, now: list[int]) -> int:
        """Dispatch the most urgent of the jobs ``now`` that start earliest, at ``t`` (with a pair partner if any).

        Returns the number of jobs dispatched.
        """
        js = self.js
        k = min(now, key=lambda j: self.keys[j])
        action: Action = js.jobs[k]
        dur = js.duration[k]
        partner = None
        if self.v.pairs and js.sg.may_overlap:
            partner = _pair_partner(js, k, now, self.keys)
            if partner is not None:
                f, b = (k, partner) if js.jobs[k].pass_ == _F else (partner, k)
                action = Pair(js.jobs[f], js.jobs[b])
                dur = pair_duration(js.sg, action)
        members = [k] if partner is None else [k, partner]
        placed = self._fill_gaps(k, t) if self.v.lazy_w is not None and js.jobs[k].pass_ != _W else 0
        for j in members:
            self.stage_forwards_left[js.jobs[j].stage] -= js.jobs[j].pass_ == _F
            for d in js.devices[j]:
                self.forwards_left[d] -= js.jobs[j].pass_ == _F
                self.others_left[d] -= js.jobs[j].pass_ != _W
            self.pending[self.comp[j]].discard(j)
            self.pending_w[self.comp[j]].discard(j)
            self.fresh.discard(j)
            if js.jobs[j].pass_ == _F:
                self.started_mb.add(js.jobs[j].microbatch)
                self.between[js.jobs[j].stage] += 1
            elif js.jobs[j].pass_ in INPUT_GRADIENT_PASSES:
                self.between[js.jobs[j].stage] -= 1
        # its devices' times, memory and stage caps changed: its component is recomputed
        self.stale.add(self.comp[k])
        # allocate before freeing: the F of a pair runs while the backward still holds its memory
        for j in sorted(members, key=lambda j: -js.mem[j]):
            change = self.memory.dispatch(j)
            if change == "left":  # the banker's sequence lost a microbatch: every forward's check changes
                self.stale.update(range(len(self.pending)))
            elif change == "entered":
                # it is appended to the sequence, so the checks of forwards in flight stay; those of forwards of
                # microbatches not started see one more in flight (the cap, the memory of a new microbatch)
                mb = js.jobs[j].microbatch
                for f in list(self.fresh):
                    self.stale.add(self.comp[f])
                    if js.jobs[f].microbatch == mb:
                        self.fresh.discard(f)
        for j in members:
            self.end[j] = t + dur
        for d in js.devices[k]:
            self.free[d] = t + dur
            self.order[d].append(action)
        for j in members:
            self.release(j)
        return len(members) + placed

    def release(self, k: int) -> None:
        """Job ``k`` is dispatched: its successors whose predecessors all are become candidates."""
        js, missing = self.js, self.missing
        for s, _ in js.succs[k]:
            missing[s] -= 1
        job = js.jobs[k]
        if job.pass_ == _F:
            ks = self.next_forward[job.stage]
            if ks and missing[ks[-1]] == 0:
                self.add(ks.pop())
        for s, _ in js.succs[k]:
            if missing[s] == 0 and js.jobs[s].pass_ != _F:
                self.add(s)
            elif missing[s] == 0 and js.jobs[s].pass_ == _F:
                ks = self.next_forward[js.jobs[s].stage]
                if ks and ks[-1] == s:
                    self.add(ks.pop())


def _device_components(js: JobSet) -> dict[int, int]:
    """Device -> number of its component: devices are joined when a job runs on several of them.

    >>> from opsched.schedule import chain_stage_graph
    >>> _device_components(JobSet(chain_stage_graph(2), 1))
    {0: 0, 1: 1}
    """
    parent = {d: d for d in js.on_device}

    def root(d: int) -> int:
        while parent[d] != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    for devs in set(js.devices):
        for d in devs[1:]:
            parent[root(d)] = root(devs[0])
    number: dict[int, int] = {}
    return {d: number.setdefault(root(d), len(number)) for d in sorted(js.on_device)}


def _stage_depths(sg) -> dict[int, int]:
    """Number of stages on the longest path from a source to each stage."""
    depth: dict[int, int] = {}
    for sid in sg.topological_order():
        depth[sid] = max([depth[e.src] + 1 for e in sg.preds(sid)] + [0])
    return depth


def _pair_partner(js: JobSet, k: int, now: list[int], keys: list[tuple]) -> int | None:
    """A job startable now that overlaps with ``k``: an F with a backward on the same devices (:meth:`JobSet.may_pair`)."""
    options = [j for j in now if j != k and js.may_pair(k, j)]
    return min(options, key=lambda j: keys[j]) if options else None


def default_variants(js: JobSet, allow_pairs: bool = False,
                     budgets: Mapping[int, float] | None = None) -> list[Variant]:
    """The variants :func:`best_list_schedule` tries: each priority rule, several caps, and Zero Bubble's rounds.

    Zero Bubble's rounds, on graphs with one stage per device, come second, after the plain variant (where a
    clock cuts the start phase short, they are valued): each stage warms up by :func:`memory_warmup` under
    ``budgets`` (the activation budgets) and then alternates forward and backward, its W run at once, or held
    back as the greedy of Zero Bubble's scheduler holds them (:attr:`Variant.lazy_w`). On uneven stages those
    keep the heaviest stage busy with forwards and backwards and its W for the end, which the other variants
    do not. Where devices host several stages, one stage's warm-up and backlog say little about its device's.
    """
    devices = len(js.on_device)
    caps: list[int | None] = [None]
    for c in (devices, devices + 1, 2 * devices, 2 * devices + 1):
        if c not in caps and c < js.microbatches:
            caps.append(c)
    variants = [Variant(p, c, w) for p in PRIORITIES for c in caps for w in (False, True)]
    hosts = [d for st in js.sg.stages for d in st.devices]
    if len(hosts) == len(set(hosts)):  # Zero Bubble's rounds: one stage per device (a budget, a backlog each)
        # after the plain one (the cheapest; the solve's own fallback); Zero Bubble's two ways to count a warm-up
        warmups = dict.fromkeys(memory_warmup(js, budgets, starts) for starts in (False, True))
        variants[1:1] = [Variant("zb", None, warmup=w, alternate=True, lazy_w=lazy)
                         for w in warmups for lazy in ROUNDS_LAZY_W]
    # warm-up shapes of 1F1B / ZB-H1 (p - k), ZB-H2 (2p - 1 - k) and ZB-2p-like (2p - 2k)
    shapes = [(devices, 1), (devices + 1, 1), (2 * devices - 1, 1)]
    shapes += [(2 * devices + k, 2) for k in (-2, -1, 0, 1)]
    for shape in shapes:
        variants += [Variant("zb", None, w, stage_cap=shape) for w in (False, True)]
        variants.append(Variant("zb", None, stage_cap=shape, guard_last_backward=True))
    for extra in (-1, 0, 1):  # Zero Bubble's automatic warm-up: as many forwards as fit before the first backward
        timed = timed_warmup(js, extra)
        variants += [Variant("zb", None, w, warmup=timed) for w in (False, True)]
        variants.append(Variant("zb", None, warmup=timed, guard_last_backward=True))
    if allow_pairs and js.sg.may_overlap:
        variants += [Variant(p, c, w, pairs=True) for p in ("zb", "forward") for c in caps for w in (False, True)]
    if not js.split_backward:
        # patient_w, guard_last_backward and lazy_w only hold back W jobs: a fused backward has none, so each such
        # variant would repeat the order of its plain twin, which comes before it
        variants = [v for v in variants if not (v.patient_w or v.guard_last_backward or v.lazy_w)]
    return variants


def timed_warmup(js: JobSet, extra: int = 0) -> tuple[tuple[int, int], ...]:
    """Each stage's warm-up from the timing: the forwards that fit before its first backward can start, plus ``extra``.

    A stage's first backward cannot start before its earliest start along
    the dependencies (``js.head``); the forwards of the microbatches after
    the first fill that wait on the stage's devices (a count, at least 1).
    Unlike ``stage_cap``'s straight line (1F1B's p - k, Zero Bubble's 2p - 2k)
    this follows uneven stages and transfer times.

    >>> from opsched.schedule import chain_stage_graph
    >>> timed_warmup(JobSet(chain_stage_graph(4, f=1, b=2, w=1), 8))
    ((0, 7), (1, 5), (2, 3), (3, 1))
    """
    caps = []
    for stage in js.sg.stages:
        mbs = stage.microbatches or range(js.microbatches)
        first = min(mbs)
        forward, backward = js.index[Job(stage.id, first, _F)], js.index[Job(stage.id, first, js.backward)]
        wait = js.head[backward] - js.head[forward]
        caps.append((stage.id, max(1, int(wait / max(js.duration[forward], 1e-12) + EPS) + extra)))
    return tuple(caps)


def memory_warmup(js: JobSet, budgets: Mapping[int, float] | None, starts: bool = False) -> tuple[tuple[int, int], ...]:
    """Each stage's warm-up as Zero Bubble's greedy sets it: the forwards that end (with ``starts``: that
    start) before its first backward can, at most what its activation budget holds at once, and fewer than
    each stage upstream of it (at least 1) unless that one warms up with every microbatch.

    The first backwards are timed from the last stage up: a stage's first forward runs at its earliest
    (``js.head``), the warm-up forwards follow it back to back, and its first backward starts when its
    inputs are there and, with ``starts``, the last warm-up forward has ended, which may delay the stages
    upstream. Unlike :func:`timed_warmup` this follows what the warm-up itself costs. Fewer than upstream
    keeps every stage's backlog smaller than its feeder's: with :attr:`Variant.alternate` a stage never
    waits for a forward its upstream stage holds back.

    >>> from opsched.schedule import chain_stage_graph
    >>> memory_warmup(JobSet(chain_stage_graph(4, f=1, b=2, w=1), 8), {d: 4.0 for d in range(4)})
    ((0, 4), (1, 3), (2, 2), (3, 1))
    """
    sg = js.sg
    topo = sg.topological_order()
    every: dict[int, int] = {}
    for sid in topo:
        stage = sg.stage(sid)
        every[sid] = len(stage.microbatches or range(js.microbatches))
    warm: dict[int, int] = {}
    first_backward_end: dict[int, float] = {}  # job -> its end, for each stage's first backward
    for sid in reversed(topo):
        stage = sg.stage(sid)
        fits = every[sid]
        if budgets is not None and stage.act_bytes > 0:
            fits = min([fits] + [max(1, int(budgets[d] / stage.act_bytes + EPS)) for d in stage.devices])
        first = min(stage.microbatches or range(js.microbatches))
        forward, backward = js.index[Job(sid, first, _F)], js.index[Job(sid, first, js.backward)]
        arrival = max(first_backward_end.get(i, js.head[i] + js.duration[i]) + delay for i, delay in js.preds[backward])
        step = js.duration[forward]
        end, count = js.head[forward] + step, 1
        tol = noise(arrival)
        while count < fits and (end < arrival - tol if starts else end + step <= arrival + tol):
            end, count = end + step, count + 1
        first_backward_end[backward] = max(arrival, end) + js.duration[backward]
        warm[sid] = count
    caps: dict[int, int] = {}
    for sid in topo:  # below an upstream stage that warms up with every microbatch, so may this one
        caps[sid] = min([warm[sid]] + [max(1, caps[e.src] - (caps[e.src] < every[sid])) for e in sg.preds(sid)])
    return tuple(sorted(caps.items()))


def best_list_schedule(
    js: JobSet, budgets: Mapping[int, float] | None, variants: list[Variant] | None = None
) -> tuple[Order, float, str, list[tuple[str, float]]]:
    """Run several variants; return (best order, its makespan, its name, all (name, makespan)).

    Orders whose simulated peak exceeds the budgets are skipped (the banker's
    rule makes that impossible; the check guards the rule). Ties keep the first.
    """
    best: tuple[Order, float, str] | None = None
    tried: list[tuple[str, float]] = []
    for v in variants if variants is not None else default_variants(js, budgets=budgets):
        order = list_schedule(js, budgets, v)
        if not order_fits(js.sg, order, budgets):  # pragma: no cover - guarded by the banker's rule
            continue
        span = max(e.end for e in simulate(js.sg, order, js.microbatches))
        tried.append((v.name, span))
        if best is None or span < best[1] - noise(span):
            best = (order, span, v.name)
    assert best is not None
    return best[0], best[1], best[2], tried
