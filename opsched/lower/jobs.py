"""The job set of a lower-level problem: durations, dependencies, memory, heads and tails.

A :class:`JobSet` indexes every job (stage, microbatch, pass) of a StageGraph
for a number of microbatches, with everything the list scheduler, the bounds
and the MIP need as plain lists indexed by job number:

* ``duration[j]`` and ``devices[j]`` (a stage on a group occupies every device of it);
* ``preds[j]`` / ``succs[j]``: ``(other job, transfer delay)`` from
  :func:`opsched.schedule.dependencies`, so the one dependency rule is reused;
* ``mem[j]``: the signed activation change of the job on each of its devices
  (:meth:`opsched.schedule.Stage.activation_change` is the rule);
* ``head[j]``: earliest start ignoring devices and memory (longest path of
  predecessors with transfers); ``tail[j]``: least time that must pass after
  ``j`` ends before the last job ends.

Memory rule: ``memory_limit`` covers resident parameters plus activations on
each device, so the activation budget of device ``d`` is the limit minus the
parameters of the stages it hosts.

>>> from opsched.schedule import chain_stage_graph
>>> js = JobSet(chain_stage_graph(2, f=1, b=2, w=1), microbatches=1)
>>> [str(j) for j in js.jobs]
['0F0', '0I0', '0W0', '1F0', '1I0', '1W0']
>>> js.head[js.index[js.jobs[4]]], js.tail[js.index[js.jobs[0]]]
(2.0, 4.0)
"""

from __future__ import annotations

import graphlib
from typing import Iterable, Mapping, Sequence

from opsched.errors import MemoryTooSmall, OpschedError
from opsched.schedule import (PAIRED_BACKWARDS, Job, Order, PassKind, StageGraph, dependencies,
                              device_param_bytes, jobs_of)

# globals where tested per job: a member lookup costs 14 globals' on Python 3.11
_F = PassKind.F

#: relative tolerance for comparing times and memory
EPS = 1e-9


def noise(x: float) -> float:
    """The float noise allowed around ``x``: :data:`EPS` relative to it, and at least :data:`EPS`.

    >>> noise(0.5), noise(-4.0)
    (1e-09, 4e-09)
    """
    return EPS * max(1.0, abs(x))


class JobSet:
    """Every job of ``sg`` for ``microbatches`` microbatches, indexed 0..n-1."""

    def __init__(self, sg: StageGraph, microbatches: int, split_backward: bool = True):
        if microbatches < 1:
            raise OpschedError(f"microbatches must be at least 1, got {microbatches}")
        self.sg = sg
        self.microbatches = microbatches
        self.split_backward = split_backward
        self.backward = PassKind.I if split_backward else PassKind.B
        self.jobs: list[Job] = sg.jobs(microbatches, split_backward)
        if not self.jobs:
            raise OpschedError("the StageGraph has no jobs: no stage runs any microbatch")
        self.index: dict[Job, int] = {job: k for k, job in enumerate(self.jobs)}
        self.duration = [sg.stage(j.stage).duration(j.pass_) for j in self.jobs]
        self.devices = [tuple(sg.stage(j.stage).devices) for j in self.jobs]
        self.mem = [sg.stage(j.stage).activation_change(j.pass_) for j in self.jobs]
        self.preds: list[list[tuple[int, float]]] = [[] for _ in self.jobs]
        self.succs: list[list[tuple[int, float]]] = [[] for _ in self.jobs]
        for k, job in enumerate(self.jobs):
            for dep, delay in dependencies(sg, job, self.backward):
                i = self.index[dep]
                self.preds[k].append((i, float(delay)))
                self.succs[i].append((k, float(delay)))
        self.topo = topological_order([[i for i, _ in ps] for ps in self.preds])
        self.head = self._heads()
        self.tail = self._tails()
        self.on_device: dict[int, list[int]] = {d: [] for d in range(sg.num_devices or 0)}
        for k, devs in enumerate(self.devices):
            for d in devs:
                self.on_device[d].append(k)

    def __len__(self) -> int:
        return len(self.jobs)

    def _heads(self) -> list[float]:
        head = [0.0] * len(self.jobs)
        for k in self.topo:
            for i, delay in self.preds[k]:
                head[k] = max(head[k], head[i] + self.duration[i] + delay)
        return head

    def _tails(self) -> list[float]:
        tail = [0.0] * len(self.jobs)
        for k in reversed(self.topo):
            for s, delay in self.succs[k]:
                tail[k] = max(tail[k], delay + self.duration[s] + tail[s])
        return tail

    def sinks(self) -> list[int]:
        """Jobs with no successor: the makespan is the latest end among them."""
        return [k for k in range(len(self.jobs)) if not self.succs[k]]

    def may_pair(self, a: int, b: int) -> bool:
        """Whether jobs ``a`` and ``b`` may run as one overlapped pair: an F and an I or B of stages on the same
        devices, not a stage's own backward of the same microbatch (that waits for the F)."""
        x, y = self.jobs[a], self.jobs[b]
        if x.pass_ != _F:
            x, y = y, x
        return (x.pass_ == _F and y.pass_ in PAIRED_BACKWARDS and (x.stage, x.microbatch) != (y.stage, y.microbatch)
                and set(self.devices[a]) == set(self.devices[b]))


def topological_order(preds: Sequence[Iterable[int]]) -> list[int]:
    """Job numbers ordered so that each comes after every job in its ``preds`` entry.

    Callers use it for longest-path sweeps (heads, tails, start windows),
    whose results do not depend on which topological order they get.

    >>> topological_order([[1], [], [0, 1]])
    [1, 0, 2]
    """
    return list(graphlib.TopologicalSorter(dict(enumerate(preds))).static_order())


# --------------------------------------------------------------------------- memory


def activation_budgets(sg: StageGraph, memory_limit: float | None) -> dict[int, float] | None:
    """Activation budget per device: the limit minus resident parameters (``None``: no limit)."""
    if memory_limit is None:
        return None
    return {d: float(memory_limit) - params for d, params in enumerate(device_param_bytes(sg))}


def microbatch_requirement(sg: StageGraph, microbatch: int) -> dict[int, float]:
    """Activation that one microbatch holds on each device at once (the sum over its stages there).

    Every stage's activation is held from its F until its backward, which
    waits for the F of the stages downstream; when the loss stage has run the
    forward, every stage upstream of it still holds its activation. So a
    device that hosts several stages of the same microbatch must hold all of
    them together.
    """
    need = {d: 0.0 for d in range(sg.num_devices or 0)}
    for st in sg.stages:
        if st.runs(microbatch):
            for d in st.devices:
                need[d] += st.act_bytes
    return need


def minimum_memory_limit(sg: StageGraph, microbatches: int) -> float:
    """The least per-device memory limit any schedule can meet.

    Rule: resident parameters plus the activations one microbatch holds on the
    device at once (:func:`microbatch_requirement`), maximised over devices and
    microbatches. Exact when every stage feeds a single loss stage (pipelines,
    towers that join): running one microbatch at a time needs exactly this.
    """
    params = device_param_bytes(sg)
    worst = 0.0
    for m in range(microbatches):
        need = microbatch_requirement(sg, m)
        worst = max([worst] + [params[d] + need[d] for d in need])
    return worst


def check_memory_limit(sg: StageGraph, microbatches: int, memory_limit: float | None) -> None:
    """Raise :class:`~opsched.errors.MemoryTooSmall` naming the minimum when ``memory_limit`` is below it."""
    if memory_limit is None:
        return
    least = minimum_memory_limit(sg, microbatches)
    if memory_limit < least * (1 - EPS) - EPS:
        raise MemoryTooSmall(
            f"memory limit {memory_limit:g} is below the minimum {least:g} any schedule needs "
            "(parameters plus one microbatch's activations on the fullest device); "
            f"raise the limit to at least {least:g}",
            least,
        )


def order_peak_activation(sg: StageGraph, order: Order) -> dict[int, float]:
    """Peak activation per device of an order, which does not depend on timing.

    Jobs on one device never overlap, an F allocates at its start and a
    backward frees at its end, so the activation a device holds at any instant
    is fixed by the sequence of its actions (an overlapped pair allocates its F
    before its backward frees).
    """
    changes: dict[tuple[int, str], float] = {}  # per (stage, pass), looked up once: orders are checked by the thousand

    def change(job: Job) -> float:
        key = (job.stage, job.pass_)
        if key not in changes:
            changes[key] = sg.stage(job.stage).activation_change(job.pass_)
        return changes[key]

    peaks: dict[int, float] = {}
    for d, actions in order.items():
        level = peak = 0.0
        for action in actions:
            if isinstance(action, Job):  # one job: the level rises, or it falls, at once
                level += change(action)
                peak = max(peak, level)
                continue
            both = [change(j) for j in jobs_of(action)]
            level += sum(c for c in both if c > 0)
            peak = max(peak, level)
            level += sum(c for c in both if c < 0)
        peaks[d] = peak
    return peaks


def order_fits(sg: StageGraph, order: Order, budgets: Mapping[int, float] | None) -> bool:
    """True when the order's peak activation fits every device's budget."""
    if budgets is None:
        return True
    peaks = order_peak_activation(sg, order)
    return all(peaks.get(d, 0.0) <= b + noise(b) for d, b in budgets.items())
