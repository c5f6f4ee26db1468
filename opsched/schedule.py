"""Pipeline schedules: the StageGraph, the action IR, the simulator, the validator, metrics.

Vocabulary (see ``docs/`` and DESIGN.md):

* a **stage** runs on a device group; the **StageGraph** is a DAG of stages
  whose edges carry forward activations (and, backwards, their gradients);
* a **job** is (stage, microbatch, pass) with pass F, I, W or B (= I + W fused);
* a **pair** is two jobs of stages on the same devices run overlapped
  (DualPipe's F&B), one action whose duration follows :func:`pair_duration`;
* an **order** gives each device its ordered list of actions; an action of a
  stage whose group has several devices appears in the list of each of them;
* the **simulator** turns an order into as-soon-as-possible timed events;
* the **validator** checks any timed schedule against the plan contract.

This module is the single simulator, validator and metric set every schedule
in opsched goes through, baselines and MIP plans alike.

>>> sg = chain_stage_graph(2, f=1, b=2, w=1)
>>> order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
>>> events = simulate(sg, order, microbatches=1)
>>> [(e.stage, e.pass_, e.start, e.end) for e in events]
[(0, 'F', 0.0, 1.0), (1, 'F', 1.0, 2.0), (1, 'B', 2.0, 4.0), (0, 'B', 4.0, 6.0)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence, Union

from opsched.errors import OpschedError

PASSES = ("F", "I", "W", "B")


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Stage:
    """A node of the StageGraph.

    ``time`` holds the durations of the F, I and W passes of one microbatch; a
    fused backward B lasts I + W. Memory: the F of a microbatch holds
    ``act_bytes`` on every device of the group until its I frees
    ``act_bytes - act_w_bytes``; its W frees the remaining ``act_w_bytes`` (a B
    frees all). ``param_bytes`` (parameters with gradients and optimizer state)
    is resident on every device of the group for the whole step.

    ``microbatches`` restricts the stage to a subset of microbatches (``None``:
    all). Bidirectional DualPipe needs it: each direction's copy of the model
    processes half the microbatches. ``copy_of`` names the stage whose
    parameters this stage replicates (DualPipe's second copy), so metrics can
    count parameter copies.
    """

    id: int
    devices: tuple[int, ...]
    time: Mapping[str, float]
    param_bytes: float = 0.0
    act_bytes: float = 1.0
    act_w_bytes: float = 0.5
    name: str = ""
    microbatches: tuple[int, ...] | None = None
    copy_of: int | None = None

    def duration(self, pass_: str) -> float:
        if pass_ == "B":
            return float(self.time["I"]) + float(self.time["W"])
        return float(self.time[pass_])

    def runs(self, microbatch: int) -> bool:
        return self.microbatches is None or microbatch in self.microbatches


@dataclass(frozen=True)
class Edge:
    """Stage ``src`` feeds stage ``dst``; ``time`` is the transfer time (0 on shared devices)."""

    src: int
    dst: int
    time: float = 0.0
    bytes: float = 0.0


@dataclass
class StageGraph:
    """A DAG of stages on devices ``0 .. num_devices-1``.

    ``overlap_gain`` is the overlap rule for F&B pairs, see :func:`pair_duration`.
    """

    stages: list[Stage]
    edges: list[Edge] = field(default_factory=list)
    num_devices: int | None = None
    overlap_gain: float = 0.0

    def __post_init__(self) -> None:
        ids = [s.id for s in self.stages]
        if ids != list(range(len(ids))):
            raise OpschedError(f"stage ids must be 0..{len(ids) - 1} in order, got {ids}")
        if self.num_devices is None:
            self.num_devices = 1 + max((d for s in self.stages for d in s.devices), default=-1)
        self._preds: dict[int, list[Edge]] = {s.id: [] for s in self.stages}
        self._succs: dict[int, list[Edge]] = {s.id: [] for s in self.stages}
        for e in self.edges:
            if e.src not in self._succs or e.dst not in self._preds:
                raise OpschedError(f"edge {e.src}->{e.dst} names a stage that does not exist")
            self._succs[e.src].append(e)
            self._preds[e.dst].append(e)
        self._topo = _topological_order(self)

    def stage(self, sid: int) -> Stage:
        return self.stages[sid]

    def preds(self, sid: int) -> list[Edge]:
        return self._preds[sid]

    def succs(self, sid: int) -> list[Edge]:
        return self._succs[sid]

    def topological_order(self) -> list[int]:
        return list(self._topo)

    def stages_on(self, device: int) -> list[int]:
        return [s.id for s in self.stages if device in s.devices]

    def jobs(self, microbatches: int, split_backward: bool = True) -> list["Job"]:
        """Every job the schedule must contain, stage by stage in topological order."""
        backward = ("I", "W") if split_backward else ("B",)
        return [
            Job(sid, m, p)
            for sid in self._topo
            for m in range(microbatches)
            if self.stages[sid].runs(m)
            for p in ("F",) + backward
        ]


def _topological_order(sg: StageGraph) -> list[int]:
    indeg = {s.id: len(sg.preds(s.id)) for s in sg.stages}
    ready = [sid for sid, k in indeg.items() if k == 0]
    order: list[int] = []
    while ready:
        sid = min(ready)
        ready.remove(sid)
        order.append(sid)
        for e in sg.succs(sid):
            indeg[e.dst] -= 1
            if indeg[e.dst] == 0:
                ready.append(e.dst)
    if len(order) != len(sg.stages):
        raise OpschedError("the StageGraph has a cycle; stages must form a DAG")
    return order


def chain_stage_graph(
    stages: int,
    f: float | Sequence[float] = 1.0,
    b: float | Sequence[float] = 2.0,
    w: float | Sequence[float] = 1.0,
    *,
    devices: int | None = None,
    placement: str = "chain",
    comm: float = 0.0,
    act: float | Sequence[float] = 1.0,
    act_w: float | Sequence[float] = 0.5,
    param_bytes: float | Sequence[float] = 0.0,
    overlap_gain: float = 0.0,
) -> StageGraph:
    """A synthetic chain of ``stages`` stages (B is the full backward, so I = B - W).

    ``placement`` maps stage k to a device: ``chain`` (k, needs devices == stages),
    ``interleaved`` (k mod D) or ``v`` (k for k < D, else 2D-1-k; needs stages == 2D).
    ``comm`` is the transfer time of an edge between different devices.

    >>> sg = chain_stage_graph(4, devices=2, placement="v")
    >>> [s.devices for s in sg.stages]
    [(0,), (1,), (1,), (0,)]
    """
    d = stages if devices is None else devices
    per = lambda x: _per_stage(x, stages)  # noqa: E731
    fs, bs, ws, acts, act_ws, params = map(per, (f, b, w, act, act_w, param_bytes))
    for k in range(stages):
        if ws[k] > bs[k]:
            raise OpschedError(f"stage {k}: W={ws[k]} exceeds the full backward B={bs[k]}; B includes W")
    place = stage_placement(stages, d, placement)
    stage_list = [
        Stage(
            id=k,
            devices=(place[k],),
            time={"F": fs[k], "I": bs[k] - ws[k], "W": ws[k]},
            param_bytes=params[k],
            act_bytes=acts[k],
            act_w_bytes=act_ws[k],
            name=f"stage{k}",
        )
        for k in range(stages)
    ]
    edges = [
        Edge(k, k + 1, time=(comm if place[k] != place[k + 1] else 0.0)) for k in range(stages - 1)
    ]
    return StageGraph(stage_list, edges, num_devices=d, overlap_gain=overlap_gain)


def stage_placement(stages: int, devices: int, placement: str) -> list[int]:
    """Device of each stage under a named placement (see :func:`chain_stage_graph`)."""
    if devices < 1 or stages < 1:
        raise OpschedError("stages and devices must be at least 1")
    if placement == "chain":
        if stages != devices:
            raise OpschedError(
                f"placement chain puts one stage per device: {stages} stages on {devices} devices; "
                "use --placement interleaved or v"
            )
        return list(range(stages))
    if placement == "interleaved":
        if stages % devices:
            raise OpschedError(f"placement interleaved needs stages ({stages}) divisible by devices ({devices})")
        return [k % devices for k in range(stages)]
    if placement == "v":
        if stages != 2 * devices:
            raise OpschedError(f"placement v needs stages = 2 x devices, got {stages} stages on {devices} devices")
        return [k if k < devices else 2 * devices - 1 - k for k in range(stages)]
    raise OpschedError(f"unknown placement {placement!r}; choose chain, interleaved or v")


def _per_stage(value, stages: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * stages
    values = [float(v) for v in value]
    if len(values) == 1:
        return values * stages
    if len(values) != stages:
        raise OpschedError(f"expected 1 or {stages} per-stage values, got {len(values)}: {values}")
    return values


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True, order=True)
class Job:
    """One pass of one microbatch on one stage."""

    stage: int
    microbatch: int
    pass_: str

    def __str__(self) -> str:  # torch's action notation
        return f"{self.stage}{self.pass_}{self.microbatch}"


@dataclass(frozen=True)
class Pair:
    """Two jobs run overlapped as one action (DualPipe's F&B): ``first`` is usually an F."""

    first: Job
    second: Job

    def __str__(self) -> str:
        return f"({self.first};{self.second})OVERLAP_F_B"


Action = Union[Job, Pair]
#: device -> its actions in execution order
Order = dict[int, list[Action]]


def pair_duration(sg: StageGraph, pair: Pair) -> float:
    """Duration of an overlapped pair: ``a + b - gain * min(a, b)``.

    With the default gain 0 an overlapped pair costs exactly its two parts (no
    gain); gain 1 hides the shorter part entirely (perfect overlap).
    """
    a = sg.stage(pair.first.stage).duration(pair.first.pass_)
    b = sg.stage(pair.second.stage).duration(pair.second.pass_)
    return a + b - sg.overlap_gain * min(a, b)


@dataclass(frozen=True)
class Event:
    """A timed job. The two halves of an overlapped pair share ``pair`` (an id) and their times."""

    stage: int
    microbatch: int
    pass_: str
    start: float
    end: float
    pair: int | None = None

    @property
    def job(self) -> Job:
        return Job(self.stage, self.microbatch, self.pass_)


@dataclass
class Schedule:
    """A timed schedule of a StageGraph: what plan.json stores under ``schedule``."""

    stage_graph: StageGraph
    microbatches: int
    events: list[Event]
    memory_limit: float | None = None
    name: str = ""


# --------------------------------------------------------------------------- simulator


def simulate(sg: StageGraph, order: Order, microbatches: int) -> list[Event]:
    """Time an order as soon as possible.

    Each device runs its actions in the given order, one at a time. An action
    starts when every device that must run it (all devices of its stage's
    group) has reached it and finished its previous action, and when its
    dependencies have finished plus their transfer times. Raises
    :class:`OpschedError` naming the first blocked action on each device when
    the order deadlocks. Events are returned sorted by (start, stage, microbatch, pass).
    """
    _check_order_devices(sg, order)
    queues = {d: list(acts) for d, acts in order.items()}
    heads = {d: 0 for d in queues}
    device_free = {d: 0.0 for d in queues}
    finished: dict[Job, float] = {}
    events: list[Event] = []
    pair_id = 0
    backward = backward_kinds(a for acts in queues.values() for a in acts)
    remaining = sum(len(q) for q in queues.values())
    while remaining:
        progressed = False
        for d in sorted(queues):
            if heads[d] >= len(queues[d]):
                continue
            action = queues[d][heads[d]]
            devs = _action_devices(sg, action)
            # every device of the group must have this action at its head
            if any(heads.get(x, 0) >= len(queues.get(x, ())) or queues[x][heads[x]] != action for x in devs):
                continue
            ready = _ready_time(sg, action, finished, backward)
            if ready is None:
                continue
            start = max([ready] + [device_free[x] for x in devs])
            jobs = (action.first, action.second) if isinstance(action, Pair) else (action,)
            dur = pair_duration(sg, action) if isinstance(action, Pair) else sg.stage(action.stage).duration(action.pass_)
            end = start + dur
            pid = None
            if isinstance(action, Pair):
                pid, pair_id = pair_id, pair_id + 1
            for job in jobs:
                finished[job] = end
                events.append(Event(job.stage, job.microbatch, job.pass_, start, end, pid))
            for x in devs:
                device_free[x] = end
                heads[x] += 1
                remaining -= 1
            progressed = True
        if not progressed:
            blocked = {
                d: str(queues[d][heads[d]]) for d in sorted(queues) if heads[d] < len(queues[d])
            }
            detail = ", ".join(f"device {d} waits at {a}" for d, a in blocked.items())
            raise OpschedError(f"the order deadlocks: {detail}")
    events.sort(key=lambda e: (e.start, e.stage, e.microbatch, PASSES.index(e.pass_)))
    return events


def _check_order_devices(sg: StageGraph, order: Order) -> None:
    for d, acts in order.items():
        for a in acts:
            if d not in _action_devices(sg, a):
                raise OpschedError(f"action {a} is listed on device {d}, which does not host its stage")
    for d in range(sg.num_devices or 0):
        order.setdefault(d, [])


def _action_devices(sg: StageGraph, action: Action) -> tuple[int, ...]:
    if isinstance(action, Pair):
        a = sg.stage(action.first.stage).devices
        b = sg.stage(action.second.stage).devices
        if set(a) != set(b):
            raise OpschedError(f"pair {action} joins stages on different device groups {a} and {b}")
        return a
    return sg.stage(action.stage).devices


def dependencies(
    sg: StageGraph, job: Job, backward: Mapping[tuple[int, int], str] | str = "I"
) -> list[tuple[Job, float]]:
    """The jobs ``job`` waits for, each with the transfer time added after it ends.

    F(s,m) after F(p,m) + edge time for each pred p; the backward (I or B) of
    (s,m) after the backward of each successor for m + edge time, and after
    F(s,m); W after I. ``backward`` says which backward pass a (stage,
    microbatch) runs, "I" (split) or "B" (fused): one letter for all, or a
    mapping. Successors that do not run microbatch m are skipped.

    >>> sg = chain_stage_graph(2)
    >>> dependencies(sg, Job(0, 3, "I"))
    [(Job(stage=0, microbatch=3, pass_='F'), 0.0), (Job(stage=1, microbatch=3, pass_='I'), 0.0)]
    """
    s, m, p = job.stage, job.microbatch, job.pass_
    kind = (lambda sid: backward) if isinstance(backward, str) else (lambda sid: backward.get((sid, m), "I"))
    if p == "F":
        return [(Job(e.src, m, "F"), e.time) for e in sg.preds(s) if sg.stage(e.src).runs(m)]
    if p in ("I", "B"):
        deps = [(Job(s, m, "F"), 0.0)]
        deps += [(Job(e.dst, m, kind(e.dst)), e.time) for e in sg.succs(s) if sg.stage(e.dst).runs(m)]
        return deps
    if p == "W":
        return [(Job(s, m, "I"), 0.0)]
    raise OpschedError(f"unknown pass {p!r}; passes are F, I, W, B")


def backward_kinds(actions: Iterable[Action]) -> dict[tuple[int, int], str]:
    """(stage, microbatch) -> "B" where the order runs a fused backward, else "I"."""
    kinds: dict[tuple[int, int], str] = {}
    for a in actions:
        for job in (a.first, a.second) if isinstance(a, Pair) else (a,):
            if job.pass_ in ("I", "B"):
                kinds[(job.stage, job.microbatch)] = job.pass_
    return kinds


def _ready_time(
    sg: StageGraph, action: Action, finished: dict[Job, float], backward: Mapping[tuple[int, int], str]
) -> float | None:
    jobs = (action.first, action.second) if isinstance(action, Pair) else (action,)
    ready = 0.0
    for job in jobs:
        for dep, delay in dependencies(sg, job, backward):
            t = finished.get(dep)
            if t is None:
                return None  # not run yet (a pair never contains its own dependency)
            ready = max(ready, t + delay)
    return ready
