"""The list scheduler's memory check: per-device activation accounting with the oldest-first banker's check, so a
forward is dispatched only when every microbatch in flight can still finish (:mod:`opsched.lower.listsched`)."""

from __future__ import annotations

import math
from typing import Mapping

from opsched.lower.jobs import JobSet, noise
from opsched.schedule import PassKind

# globals where tested per job: a member lookup costs 14 globals' on Python 3.11
_F = PassKind.F


class DeviceMemory:
    """Per-device activation accounting with the oldest-first banker's check.

    The check asks, for a forward ``k`` of microbatch ``m`` adding ``a`` on
    its devices, whether the microbatches in flight could still finish one at
    a time, oldest first. Microbatch ``i`` of that sequence can finish when
    what it still needs fits what is free once the ones before it gave back
    what they hold: its *margin* on device ``d`` is ``budget - held +
    (held by those before it) - (still needed by it)``. Dispatching ``k``
    lowers the margins of the microbatches before ``m`` by ``a`` on ``k``'s
    devices and leaves every other margin as it was (``m``'s own need falls
    by what it gets). Every margin is within tolerance in every state the
    scheduler reaches (each forward was checked, and a backward only raises
    margins), so the check reduces to: the least margin before ``m`` on each
    of ``k``'s devices is at least ``a``, and, for a new microbatch, its whole
    need fits what the finished ones left over. The least margins are kept
    per device and recomputed only when that device's accounting changes, so
    a check costs O(devices of the job) instead of O(in flight x devices)
    (the scheduler asks once per candidate forward per step).
    """

    def __init__(self, js: JobSet, budgets: Mapping[int, float] | None):
        self.js = js
        self.budgets = budgets
        self.held = {d: 0.0 for d in js.on_device}
        self.tolerance = {d: noise(budgets[d]) for d in js.on_device} if budgets is not None else {}
        self.inflight: list[int] = []  # microbatches in admission order
        self.position: dict[int, int] = {}  # microbatch -> its index in ``inflight``
        self.held_by: dict[int, dict[int, float]] = {}
        self.remaining: dict[int, dict[int, float]] = {}
        self.left: dict[int, int] = {}  # jobs of the microbatch not yet dispatched
        #: activation still held by finished microbatches (float residue; what a new microbatch cannot use)
        self.residue = {d: 0.0 for d in js.on_device}
        #: device -> least margin of the first i microbatches in flight, i = 0..len(inflight) (None: stale)
        self.least: dict[int, list[float] | None] = {d: None for d in js.on_device}
        #: device -> what is free there once every microbatch in flight gave back what it holds (with ``least``)
        self.avail_end: dict[int, float] = {}
        self.new_fits: dict[int, bool] = {}  # microbatch not yet in flight -> its need fits (until residue changes)
        need: dict[int, dict[int, float]] = {}
        count: dict[int, int] = {}
        for k, job in enumerate(js.jobs):
            count[job.microbatch] = count.get(job.microbatch, 0) + 1
            if job.pass_ == _F:
                per = need.setdefault(job.microbatch, {})
                for d in js.devices[k]:
                    per[d] = per.get(d, 0.0) + js.mem[k]
        self.need = need
        self.count = count

    def allows(self, k: int) -> bool:
        """Whether dispatching job ``k`` keeps the in-flight microbatches finishable."""
        if self.budgets is None or self.js.mem[k] <= 0:
            return True
        js = self.js
        m = js.jobs[k].microbatch
        a = js.mem[k]
        before = self.position.get(m, len(self.inflight)) if m in self.held_by else len(self.inflight)
        tol = self.tolerance
        for d in js.devices[k]:
            if self._least(d)[before] < a - tol[d]:
                return False
        if m not in self.held_by:
            fits = self.new_fits.get(m)
            if fits is None:
                budgets, residue = self.budgets, self.residue
                fits = self.new_fits[m] = all(
                    r <= budgets[d] - residue[d] + tol[d] for d, r in self.need.get(m, {}).items()
                )
            return fits
        return True

    def _least(self, d: int) -> list[float]:
        """Device ``d``'s least margins of the first i microbatches in flight (recomputed when stale)."""
        least = self.least[d]
        if least is None:
            avail = self.budgets[d] - self.held[d]
            low = math.inf
            least = [low]
            for mb in self.inflight:
                r = self.remaining[mb].get(d)
                if r is not None and avail - r < low:
                    low = avail - r
                least.append(low)
                avail += self.held_by[mb].get(d, 0.0)
            self.least[d] = least
            self.avail_end[d] = avail
        return least

    def dispatch(self, k: int) -> str:
        """Account for job ``k``; returns ``"entered"`` or ``"left"`` when its microbatch entered or left flight."""
        js = self.js
        m = js.jobs[k].microbatch
        entered = m not in self.held_by
        if entered:
            self.position[m] = len(self.inflight)
            self.inflight.append(m)
            self.held_by[m] = {}
            self.remaining[m] = dict(self.need.get(m, {}))
            self.left[m] = self.count[m]
            self.new_fits.pop(m, None)
            # every sequence gets a last entry: the new microbatch holds nothing yet, so its margin is what the
            # others leave free less its whole need (the same arithmetic as a recomputation; job k's own
            # devices are recomputed below anyway)
            for d, least in self.least.items():
                if least is not None:
                    r = self.remaining[m].get(d)
                    low = least[-1]
                    if r is not None and self.avail_end[d] - r < low:
                        low = self.avail_end[d] - r
                    least.append(low)
        for d in js.devices[k]:
            self.held[d] += js.mem[k]
            self.held_by[m][d] = self.held_by[m].get(d, 0.0) + js.mem[k]
            if js.mem[k] > 0:
                self.remaining[m][d] -= js.mem[k]
        if js.mem[k] != 0:
            self._stale(js.devices[k])
        self.left[m] -= 1
        if self.left[m] == 0:
            self.inflight.remove(m)
            self.position = {mb: i for i, mb in enumerate(self.inflight)}
            for d, h in self.held_by[m].items():
                self.residue[d] += h
            self.new_fits.clear()
            self._stale(self.least)  # every sequence lost an entry
            return "left"
        return "entered" if entered else ""

    def _stale(self, devices) -> None:
        for d in devices:
            self.least[d] = None
