"""Pipeline schedules: the StageGraph, the action IR, the simulator, the validator, metrics.

Vocabulary (see ``docs/``; the plan file's fields are in docs/plan.schema.json):

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

import graphlib
import heapq
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence, Union

from opsched.errors import Deadlock, OpschedError
from opsched.overlap import PassStreams, pair_length

PASSES = ("F", "I", "W", "B")
_PASS_RANK = {p: k for k, p in enumerate(PASSES)}  # PASSES.index, as a lookup (the simulator sorts every event)
#: the backward passes an F may pair with (a W has no communication to hide and DualPipe never pairs it)
PAIRED_BACKWARDS = ("I", "B")


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Stage:
    """A node of the StageGraph.

    ``time`` holds the durations of the F, I and W passes of one microbatch; a
    fused backward B lasts ``time["B"]`` when given (a measured fused backward
    can be cheaper than its halves run apart) and I + W otherwise. Memory: the F of a microbatch holds
    ``act_bytes`` on every device of the group, which its backward frees
    (:meth:`activation_change` is the rule). ``param_bytes`` (parameters with
    gradients and optimizer state) is resident on every device of the group
    for the whole step (:func:`device_param_bytes` sums it per device).

    ``microbatches`` restricts the stage to a subset of microbatches (``None``:
    all). Bidirectional DualPipe needs it: each direction's copy of the model
    processes half the microbatches. ``copy_of`` names the stage whose
    parameters this stage replicates (DualPipe's second copy), so metrics can
    count parameter copies.

    ``streams`` (optional) lays each pass out as compute and communication
    operations summing to its time; when both stages of an overlapped pair
    have them, the pair's length is derived from them (:func:`pair_duration`).
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
    streams: PassStreams | None = None

    def duration(self, pass_: str) -> float:
        if pass_ == "B" and "B" not in self.time:
            return float(self.time["I"]) + float(self.time["W"])
        return float(self.time[pass_])

    def timed_passes(self) -> tuple[str, ...]:
        """The passes ``time`` gives explicitly: F, I, W, and B when measured."""
        return ("F", "I", "W", "B") if "B" in self.time else ("F", "I", "W")

    def runs(self, microbatch: int) -> bool:
        return self.microbatches is None or microbatch in self.microbatches

    def activation_change(self, pass_: str) -> float:
        """Activation bytes a pass adds to each device of the group (negative: frees).

        An F holds ``act_bytes``; its I frees ``act_bytes - act_w_bytes``, its
        W the remaining ``act_w_bytes``; a fused B frees all of it. When the
        change happens (an F at its start, the others at their end) is the
        caller's convention (see :func:`validate`).

        >>> st = Stage(0, (0,), {"F": 1, "I": 1, "W": 1}, act_bytes=4, act_w_bytes=1)
        >>> [st.activation_change(p) for p in ("F", "I", "W", "B")]
        [4.0, -3.0, -1.0, -4.0]
        """
        if pass_ == "F":
            return float(self.act_bytes)
        if pass_ == "I":
            return -float(self.act_bytes - self.act_w_bytes)
        if pass_ == "W":
            return -float(self.act_w_bytes)
        if pass_ == "B":
            return -float(self.act_bytes)
        raise OpschedError(f"unknown pass {pass_!r}; passes are F, I, W, B")


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

    ``overlap_gain`` is the overlap rule for F&B pairs of stages without
    ``streams``, see :func:`pair_duration`. ``pair_slot`` marks a slotted
    graph: its times are whole slots of ``pair_slot`` seconds, its stages keep
    their stream operations in seconds, and every pair length is rounded up
    to whole slots.
    """

    stages: list[Stage]
    edges: list[Edge] = field(default_factory=list)
    num_devices: int | None = None
    overlap_gain: float = 0.0
    pair_slot: float | None = None

    def __post_init__(self) -> None:
        ids = [s.id for s in self.stages]
        if ids != list(range(len(ids))):
            raise OpschedError(f"stage ids must be 0..{len(ids) - 1} in order, got {ids}")
        if self.num_devices is None:
            self.num_devices = 1 + max((d for s in self.stages for d in s.devices), default=-1)
        if not 0 <= self.overlap_gain <= 1:  # pair_duration and the lower bounds need a pair >= its longer part
            raise OpschedError(f"overlap_gain must be between 0 and 1, got {self.overlap_gain}")
        for s in self.stages:
            _check_stage(s, self.num_devices, self.pair_slot or 1.0)
        for e in self.edges:
            if not e.time >= 0 or not e.bytes >= 0:
                raise OpschedError(f"edge {e.src}->{e.dst}: time and bytes must be >= 0, got {e.time}, {e.bytes}")
        self._preds: dict[int, list[Edge]] = {s.id: [] for s in self.stages}
        self._succs: dict[int, list[Edge]] = {s.id: [] for s in self.stages}
        for e in self.edges:
            if e.src not in self._succs or e.dst not in self._preds:
                raise OpschedError(f"edge {e.src}->{e.dst} names a stage that does not exist")
            self._succs[e.src].append(e)
            self._preds[e.dst].append(e)
        self._topo = _topological_order(self)
        self._on_device: dict[int, list[int]] | None = None  # device -> its stages, when first asked
        self._alike: dict[int, tuple[int, ...]] | None = None  # see alike_devices, when first asked
        self._pair_lengths: dict[tuple[int, str, int, str], float] = {}  # pair_duration's, per pair of passes
        self._largest_saving: dict[frozenset | None, float] = {}  # largest_pair_saving's, per set of stages
        # the simulator's caches: each job's dependencies per backward pass (see simulate), each action's devices
        # per microbatch count (see _checked_actions)
        self._dependencies: dict[str, dict[Job, list[tuple[Job, float]]]] = {"I": {}, "B": {}}
        self._checked: dict[int, dict[Action, tuple[int, ...]]] = {}

    def __getstate__(self) -> dict:
        # the simulator's caches grow with the jobs simulated; a copy (a result sent back from a child process)
        # starts without them
        return {**self.__dict__, "_dependencies": {"I": {}, "B": {}}, "_checked": {}}

    def largest_pair_saving(self, stages: Iterable[int] | None = None) -> float:
        """The largest fraction of its shorter part an overlapped pair of this graph saves, in [0, 1].

        ``overlap_gain`` for stages without ``streams``; for stages with them,
        the largest ``(a + b - pair) / min(a, b)`` over every F and backward
        (I, W or B) of stages on the same devices (of ``stages`` only, when
        given: the pairs one device can run). Every such pair lasts at least
        ``a + b - saving * min(a, b)``: the lower bounds' gain.

        >>> chain_stage_graph(2, overlap_gain=0.5).largest_pair_saving()
        0.5
        """
        key = None if stages is None else frozenset(stages)
        if key not in self._largest_saving:
            saving = self.overlap_gain
            for pair in self.stream_pairs(backwards=("I", "W", "B")):  # W too: the simulator would time such a pair
                if key is not None and not {pair.first.stage, pair.second.stage} <= key:
                    continue
                a = self.stage(pair.first.stage).duration("F")
                b = self.stage(pair.second.stage).duration(pair.second.pass_)
                if min(a, b) > 0:
                    saving = max(saving, (a + b - pair_duration(self, pair)) / min(a, b))
            self._largest_saving[key] = min(1.0, saving)
        return self._largest_saving[key]

    def stream_pairs(self, backwards: Sequence[str] = PAIRED_BACKWARDS) -> list["Pair"]:
        """One pair for every F and backward pass of ``backwards`` of stages with stream operations on the same
        devices."""
        on_devices: dict[frozenset, list[Stage]] = {}
        for st in self.stages:
            if st.streams is not None:
                on_devices.setdefault(frozenset(st.devices), []).append(st)
        return [Pair(Job(f.id, 0, "F"), Job(x.id, 1, pass_))
                for group in on_devices.values() for f in group for x in group for pass_ in backwards]

    @property
    def may_overlap(self) -> bool:
        """Whether some overlapped pair is shorter than its two parts run one after the other."""
        return self.largest_pair_saving() > 0

    def stage(self, sid: int) -> Stage:
        return self.stages[sid]

    def preds(self, sid: int) -> list[Edge]:
        return self._preds[sid]

    def succs(self, sid: int) -> list[Edge]:
        return self._succs[sid]

    def topological_order(self) -> list[int]:
        return list(self._topo)

    def stages_on(self, device: int) -> list[int]:
        """The ids of the stages ``device`` hosts, increasing."""
        if self._on_device is None:  # built once: a scan per device is quadratic at thousands of devices
            self._on_device = {}
            for s in self.stages:
                for d in s.devices:
                    self._on_device.setdefault(d, []).append(s.id)
        return list(self._on_device.get(device, ()))

    def alike_devices(self) -> dict[int, tuple[int, ...]]:
        """First device -> every device hosting exactly the same stages (so running exactly the same events).

        What is timed per device (busy time, memory, overlap checks) is timed
        once per class: a plan on 3,072 devices in two groups has two classes.

        >>> sg = StageGraph([Stage(0, (0, 1), {"F": 1, "I": 1, "W": 1}), Stage(1, (2, 3), {"F": 1, "I": 1, "W": 1})],
        ...                 [Edge(0, 1)], num_devices=5)
        >>> sg.alike_devices()
        {0: (0, 1), 2: (2, 3), 4: (4,)}
        """
        if self._alike is None:
            classes: dict[tuple[int, ...], list[int]] = {}
            for d in range(self.num_devices or 0):
                classes.setdefault(tuple(self.stages_on(d)), []).append(d)
            self._alike = {devs[0]: tuple(devs) for devs in classes.values()}
        return self._alike

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


def _check_stage(s: Stage, num_devices: int, unit: float = 1.0) -> None:
    """Reject a stage the simulator and validator could only misread."""
    if not s.devices or len(set(s.devices)) != len(s.devices):
        raise OpschedError(f"stage {s.id}: its device group must list distinct devices, got {s.devices}")
    bad = [d for d in s.devices if not 0 <= d < num_devices]
    if bad:
        raise OpschedError(f"stage {s.id}: devices {bad} are outside 0..{num_devices - 1}; raise num_devices")
    for p in s.timed_passes():
        t = s.time.get(p)
        if t is None or isinstance(t, bool) or not (isinstance(t, numbers.Real) and 0 <= t < float("inf")):
            raise OpschedError(f"stage {s.id}: time[{p!r}] must be a finite number >= 0, got {t!r}")
    if not 0 <= s.act_w_bytes <= s.act_bytes or s.param_bytes < 0:
        raise OpschedError(
            f"stage {s.id}: need 0 <= act_w_bytes <= act_bytes and param_bytes >= 0, "
            f"got act_bytes={s.act_bytes}, act_w_bytes={s.act_w_bytes}, param_bytes={s.param_bytes}"
        )
    if s.streams is not None:
        if "B" in s.time:
            raise OpschedError(f"stage {s.id}: a measured B and stream operations cannot both time its backward")
        for p in ("F", "I", "W"):
            t, total = s.duration(p) * unit, s.streams.total(p)
            # on a slotted graph (unit: the slot) the time is the operations' total rounded up to whole slots
            short = total - t if unit == 1.0 else max(0.0, total - t)
            if abs(short) > 1e-6 * max(t, 1e-9) or any(not op.seconds >= 0 for op in s.streams.chain(p)):
                raise OpschedError(f"stage {s.id}: its {p} stream operations sum to {total}, its {p} time is {t}")


def _topological_order(sg: StageGraph) -> list[int]:
    """The stages in topological order, the smallest ready stage id first (reproducible schedules rely on it).

    ``graphlib`` finds what is ready; a heap picks the smallest id among it
    (``static_order`` alone would take whole ready batches at a time).
    """
    sorter = graphlib.TopologicalSorter({s.id: [e.src for e in sg.preds(s.id)] for s in sg.stages})
    try:
        sorter.prepare()
    except graphlib.CycleError:
        raise OpschedError("the StageGraph has a cycle; stages must form a DAG") from None
    ready = list(sorter.get_ready())
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        sid = heapq.heappop(ready)
        order.append(sid)
        sorter.done(sid)
        for nxt in sorter.get_ready():
            heapq.heappush(ready, nxt)
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
    ``interleaved`` (k mod D) or ``v`` (:func:`v_device`; needs stages == 2D).
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
        return [v_device(k, devices) for k in range(stages)]
    raise OpschedError(f"unknown placement {placement!r}; choose chain, interleaved or v")


def v_device(stage: int, devices: int) -> int:
    """The device of ``stage`` when 2D stages sit on D devices in a V: k for k < D, else 2D-1-k.

    The V goes down the devices and back up, so device i holds stages i and
    2D-1-i, and the first and last stage share device 0 (Zero Bubble V,
    DualPipeV).

    >>> [v_device(k, 3) for k in range(6)]
    [0, 1, 2, 2, 1, 0]
    """
    if not 0 <= stage < 2 * devices:
        raise OpschedError(f"a V on {devices} devices has stages 0..{2 * devices - 1}, not {stage}")
    return stage if stage < devices else 2 * devices - 1 - stage


def v_stages(device: int, devices: int) -> tuple[int, int]:
    """The two stages a device holds in a V (:func:`v_device` read backwards): down i, up 2D-1-i.

    >>> v_stages(1, 3), [v_device(k, 3) for k in v_stages(1, 3)]
    ((1, 4), [1, 1])
    """
    if not 0 <= device < devices:
        raise OpschedError(f"a V on {devices} devices has devices 0..{devices - 1}, not {device}")
    return device, 2 * devices - 1 - device


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


class Job(NamedTuple):
    """One pass of one microbatch on one stage.

    A named tuple, not a dataclass: jobs are the keys of every simulation's
    and search's dictionaries, and a tuple hashes and compares in C (a
    dataclass's ``__hash__`` is a Python call: a fifth of a pair-up's time
    at D=16, M=32, even with the hash kept).
    """

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


def jobs_of(action: Action) -> tuple[Job, ...]:
    """The jobs an action runs: both halves of a pair (first, second), else the job itself.

    >>> jobs_of(Job(0, 1, "F"))
    (Job(stage=0, microbatch=1, pass_='F'),)
    >>> [str(j) for j in jobs_of(Pair(Job(0, 2, "F"), Job(3, 0, "B")))]
    ['0F2', '3B0']
    """
    return (action.first, action.second) if isinstance(action, Pair) else (action,)


def pair_duration(sg: StageGraph, pair: Pair) -> float:
    """Duration of an overlapped pair of jobs lasting ``a`` and ``b`` alone.

    When both stages have ``streams``: the shortest time to run the two
    passes' operations at once, one per stream at a time
    (:func:`opsched.overlap.pair_length`). Otherwise the graph's rule
    ``a + b - gain * min(a, b)``: with the default gain 0 a pair costs
    exactly its two parts; gain 1 hides the shorter part entirely. Rounded
    up to whole slots on a slotted graph (``pair_slot``). The forward is
    taken first whatever the pair's order: a large pair's length is a greedy
    schedule's (:func:`opsched.overlap.greedy_pair_length`), which depends on
    the order, and a pair must last the same for every caller.
    """
    if pair.second.pass_ == "F" and pair.first.pass_ != "F":
        pair = Pair(pair.second, pair.first)
    first, second = sg.stage(pair.first.stage), sg.stage(pair.second.stage)
    key = (first.id, pair.first.pass_, second.id, pair.second.pass_)
    length = sg._pair_lengths.get(key)
    if length is None:
        a, b = first.duration(pair.first.pass_), second.duration(pair.second.pass_)
        if first.streams is None or second.streams is None:
            length = a + b - sg.overlap_gain * min(a, b)
        else:
            derived = pair_length(first.streams.chain(pair.first.pass_), second.streams.chain(pair.second.pass_))
            derived /= sg.pair_slot or 1.0  # a slotted graph's stages keep their operations in seconds
            # float sums kept within the two bounds; a saving of rounding error is none (no pair made for it)
            length = a + b if derived >= (a + b) * (1 - 1e-9) else max(a, b, derived)
        if sg.pair_slot:  # never shorter than the pair it stands for: what the slotted schedule holds is enough
            length = float(math.ceil(length - 1e-9 * max(1.0, length)))
        sg._pair_lengths[key] = length
    return length


class Event(NamedTuple):
    """A timed job. The two halves of an overlapped pair share ``pair`` (an id) and their times.

    A named tuple, as :class:`Job` is: a simulation makes one per job.
    """

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


def _tie_break_key(sg: StageGraph, job: Job) -> tuple:
    """A tie-break between events that start and end together (zero durations) that respects dependencies."""
    topo = sg.topological_order().index(job.stage)
    phase = {"F": (0, topo), "I": (1, -topo), "B": (1, -topo), "W": (2, topo)}[job.pass_]
    return phase + (job.microbatch,)


def order_from_schedule(schedule: Schedule) -> Order:
    """The order of a timed schedule: each device's events by start time, pairs joined.

    The two halves of an overlapped pair (events with the same ``pair`` id)
    become one :class:`~opsched.schedule.Pair`, its F first as PyTorch writes it.
    The caller gets its own copy (computed once per schedule, :func:`cached_on`).
    """
    order = cached_on(schedule, "order", _order_from_schedule)
    return {d: list(actions) for d, actions in order.items()}


def _order_from_schedule(schedule: Schedule) -> Order:
    sg = schedule.stage_graph
    by_pair: dict[int, list] = {}
    for e in schedule.events:
        if e.pair is not None:
            by_pair.setdefault(e.pair, []).append(e)
    items: list[tuple[tuple, Action, tuple[int, ...]]] = []
    seen_pairs: set[int] = set()
    for e in schedule.events:
        if e.pair is not None:
            if e.pair in seen_pairs:
                continue
            seen_pairs.add(e.pair)
            halves = by_pair[e.pair]
            if len(halves) != 2:
                raise OpschedError(f"pair id {e.pair} has {len(halves)} events; a pair joins exactly two jobs")
            a, b = sorted((h.job for h in halves), key=lambda j: (j.pass_ != "F", j.stage, j.microbatch))
            action: Action = Pair(a, b)
            key = (e.start, e.end) + _tie_break_key(sg, a)
            devices = sg.stage(a.stage).devices
        else:
            action = e.job
            key = (e.start, e.end) + _tie_break_key(sg, e.job)
            devices = sg.stage(e.stage).devices
        items.append((key, action, devices))
    order: Order = {d: [] for d in range(sg.num_devices or 0)}
    for key, action, devices in sorted(items, key=lambda it: it[0]):
        for d in devices:
            order[d].append(action)
    return order


# --------------------------------------------------------------------------- simulator


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

    Resuming: ``earlier`` are this function's events for another order that
    runs, on every device, the same actions in the same sequence as ``order``
    up to those that started at ``since`` or later. Nothing before ``since``
    can change (an action's start depends only on actions that ended by
    then), so those events are kept and only the rest of ``order`` is timed
    and checked: when an order changes at one point, as a local search's
    move does, only the actions after it cost time. Raises
    :class:`OpschedError` when the kept events are not the first actions of
    ``order`` on their devices.

    >>> sg = chain_stage_graph(2, f=1, b=2)
    >>> order = {0: [Job(0, 0, "F"), Job(0, 1, "F"), Job(0, 0, "B"), Job(0, 1, "B")],
    ...          1: [Job(1, 0, "F"), Job(1, 0, "B"), Job(1, 1, "F"), Job(1, 1, "B")]}
    >>> events = simulate(sg, order, 2)
    >>> max(e.end for e in events)
    9.0

    Device 1 running both forwards first changes nothing before 2, when its
    second action starts:

    >>> swapped = {0: order[0], 1: [Job(1, 0, "F"), Job(1, 1, "F"), Job(1, 0, "B"), Job(1, 1, "B")]}
    >>> resumed = simulate(sg, swapped, 2, earlier=events, since=2.0)
    >>> resumed == simulate(sg, swapped, 2), max(e.end for e in resumed)
    (True, 9.0)
    """
    queues = {d: [] for d in range(sg.num_devices or 0)}
    for d, acts in order.items():
        if d not in queues:
            raise OpschedError(f"the order lists device {d}, but the StageGraph has devices 0..{sg.num_devices - 1}")
        queues[d] = list(acts)
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
            blocked = {
                d: str(queues[d][heads[d]]) for d in sorted(queues) if heads[d] < len(queues[d])
            }
            detail = ", ".join(f"device {d} waits at {a}" for d, a in blocked.items())
            raise Deadlock(f"the order deadlocks: {detail}")
    return _numbered(events)


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
    if job.pass_ not in PASSES:
        raise OpschedError(f"action {job} has pass {job.pass_!r}; passes are F, I, W, B")
    if not 0 <= job.microbatch < microbatches or not sg.stage(job.stage).runs(job.microbatch):
        raise OpschedError(f"action {job}: stage {job.stage} does not run microbatch {job.microbatch}")


def forward_and_backward(first: str, second: str) -> bool:
    """Whether passes ``first`` and ``second`` may form an overlapped pair: one F and one backward (I, W or B).

    The lower bounds count a pair as that (opsched.lower.bounds, "pair shares").
    """
    return (first == "F") != (second == "F")


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
        for job in jobs_of(a):
            if job.pass_ in ("I", "B"):
                kinds[(job.stage, job.microbatch)] = job.pass_
    return kinds


def _ready_time(sg: StageGraph, jobs: tuple[Job, ...], finished: dict[Job, float],
                needs: dict[Job, list[tuple[Job, float]]], backward: Mapping[tuple[int, int], str] | str) -> float | None:
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


def _backward_of(actions: list[Action]) -> Mapping[tuple[int, int], str] | str:
    """Which backward pass each (stage, microbatch) of ``actions`` runs: one letter when they all run the same (as
    :func:`dependencies` takes it), else :func:`backward_kinds`."""
    letters = {a.pass_ for a in actions if not isinstance(a, Pair)}
    letters.update(job.pass_ for a in actions if isinstance(a, Pair) for job in (a.first, a.second))
    letters &= {"I", "B"}
    return backward_kinds(actions) if len(letters) > 1 else letters.pop() if letters else "I"


# --------------------------------------------------------------------------- validator


class ScheduleError(OpschedError):
    """A timed schedule breaks a validity rule of the plan contract; the message names the events."""


def _name(e: Event) -> str:
    return f"{e.stage}{e.pass_}{e.microbatch}"


def _g(x: float) -> str:
    return f"{x:.6g}"


def _devices_text(devices: Sequence[int]) -> str:
    return f"device {devices[0]}" if len(devices) == 1 else "devices " + ",".join(map(str, devices))


def _tolerance(events: Sequence[Event], rel_tol: float) -> float:
    """Absolute slack for float comparisons: ``rel_tol`` times the makespan (plan times may be tiny, so no floor)."""
    span = max((abs(e.end) for e in events), default=0.0)
    return rel_tol * span


def _raise(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise ScheduleError(problems[0] + more)


def validate(schedule: Schedule, *, split_backward: bool | None = None, rel_tol: float = 1e-9) -> None:
    """Check a timed schedule against the validity rules of the plan contract.

    Independent of :func:`simulate` (it reads only the events), so it also
    catches simulator bugs. Raises :class:`ScheduleError` naming the offending
    events; returns ``None`` when the schedule is valid. Rules, in the order checked:

    1. every event names a stage that runs its microbatch, a pass F/I/W/B and
       finite times ``0 <= start``; its duration is the stage's pass time (a
       pair: :func:`pair_duration`);
    2. every (stage, microbatch) the stage runs has one F and either one B or
       one I and one W, nothing else (``split_backward`` True demands I+W,
       False demands B, None accepts either per job);
    3. the two halves of a pair are an F and a backward (I, W or B) and share a ``pair`` id, start, end and
       device group;
    4. no two events overlap on any device of their groups, except the two halves of one pair;
    5. dependencies (:func:`dependencies`) hold with the edge transfer times;
    6. memory: parameters of the stages a device hosts plus the activations it
       holds stay within ``schedule.memory_limit`` at every instant (skipped
       when the limit is ``None``). An F allocates ``act_bytes`` at its start;
       an I frees ``act_bytes - act_w_bytes`` at its end, a W the remaining
       ``act_w_bytes`` at its end, a B all of it at its end. At equal times
       frees happen before allocations, so a B ending when an F starts does
       not count both microbatches.

    Times are compared with a slack of ``rel_tol`` times the makespan.

    >>> sg = chain_stage_graph(2, f=1, b=2, w=1)
    >>> ev = [Event(0, 0, "F", 0, 1), Event(1, 0, "F", 1, 2), Event(1, 0, "B", 2, 4), Event(0, 0, "B", 3, 5)]
    >>> try:
    ...     validate(Schedule(sg, 1, ev))
    ... except ScheduleError as exc:
    ...     print(exc)
    0B0 on device 0 starts at 3 before its dependency 1B0 ends at 4
    """
    sg, events = schedule.stage_graph, list(schedule.events)
    eps = _tolerance(events, rel_tol)
    _raise(_check_events(sg, events, schedule.microbatches, eps))
    _raise(_check_complete(sg, events, schedule.microbatches, split_backward))
    _raise(_check_pairs(sg, events, eps))
    _raise(_check_exclusive(sg, events, eps))
    _raise(_check_dependencies(sg, events, eps))
    if schedule.memory_limit is not None:
        _raise(_check_memory(sg, events, schedule.memory_limit, eps))


def _check_events(sg: StageGraph, events: list[Event], microbatches: int, eps: float) -> list[str]:
    problems = []
    for e in events:
        if not (isinstance(e.stage, int) and 0 <= e.stage < len(sg.stages)):
            problems.append(f"event {_name(e)} names stage {e.stage}, which does not exist")
        elif e.pass_ not in PASSES:
            problems.append(f"event {_name(e)} has pass {e.pass_!r}; passes are F, I, W, B")
        elif not (0 <= e.microbatch < microbatches and sg.stage(e.stage).runs(e.microbatch)):
            problems.append(f"event {_name(e)}: stage {e.stage} does not run microbatch {e.microbatch}")
        elif not (-eps <= e.start <= e.end < float("inf")):
            problems.append(f"event {_name(e)} has times start={e.start}, end={e.end}; need 0 <= start <= end")
        elif e.pair is None:
            want = sg.stage(e.stage).duration(e.pass_)
            if abs((e.end - e.start) - want) > eps:
                problems.append(
                    f"{_name(e)} lasts {_g(e.end - e.start)} ({_g(e.start)} to {_g(e.end)}) "
                    f"but stage {e.stage}'s {e.pass_} takes {_g(want)}"
                )
    return problems


def _check_complete(
    sg: StageGraph, events: list[Event], microbatches: int, split_backward: bool | None
) -> list[str]:
    have: dict[tuple[int, int], list[str]] = {}
    for e in events:
        have.setdefault((e.stage, e.microbatch), []).append(e.pass_)
    problems = []
    for sid in sg.topological_order():
        for m in range(microbatches):
            if not sg.stage(sid).runs(m):
                continue
            passes = sorted(have.get((sid, m), []), key=PASSES.index)
            allowed = {True: [["F", "I", "W"]], False: [["F", "B"]], None: [["F", "I", "W"], ["F", "B"]]}
            if passes not in allowed[split_backward]:
                want = " or ".join("+".join(p) for p in allowed[split_backward])
                got = ", ".join(f"{sid}{p}{m}" for p in passes) or "nothing"
                problems.append(f"stage {sid} microbatch {m} has {got}; it needs exactly {want}")
    return problems


def _check_pairs(sg: StageGraph, events: list[Event], eps: float) -> list[str]:
    pairs: dict[int, list[Event]] = {}
    for e in events:
        if e.pair is not None:
            pairs.setdefault(e.pair, []).append(e)
    problems = []
    for pid, halves in sorted(pairs.items()):
        names = ", ".join(_name(e) for e in halves)
        if len(halves) != 2:
            problems.append(f"pair {pid} has {len(halves)} event(s) ({names}); a pair is exactly two events")
            continue
        a, b = halves
        if not forward_and_backward(a.pass_, b.pass_):
            problems.append(f"pair {pid}: {_name(a)} and {_name(b)} must be a forward and a backward (I, W or B)")
        elif abs(a.start - b.start) > eps or abs(a.end - b.end) > eps:
            problems.append(f"pair {pid}: {_name(a)} and {_name(b)} must share start and end times")
        elif set(sg.stage(a.stage).devices) != set(sg.stage(b.stage).devices):
            problems.append(f"pair {pid}: {_name(a)} and {_name(b)} run on different device groups")
        else:
            want = pair_duration(sg, Pair(a.job, b.job))
            if abs((a.end - a.start) - want) > eps:
                problems.append(
                    f"pair {pid} ({_name(a)};{_name(b)}) lasts {_g(a.end - a.start)} but the overlap rule gives {_g(want)}"
                )
    return problems


def _device_intervals(sg: StageGraph, events: Iterable[Event]) -> dict[int, list[tuple[float, float, str]]]:
    """First device of each class of :meth:`StageGraph.alike_devices` -> (start, end, label) of what occupies it
    (every device of the class alike); a pair is one interval."""
    out: dict[int, list[tuple[float, float, str]]] = {d: [] for d in sg.alike_devices()}
    by_pair: dict[int, list[Event]] = {}
    for e in events:
        if e.pair is not None:
            by_pair.setdefault(e.pair, []).append(e)
            continue
        for d in sg.stage(e.stage).devices:
            if d in out:
                out[d].append((e.start, e.end, _name(e)))
    for halves in by_pair.values():
        label = "(" + ";".join(_name(e) for e in halves) + ")"
        for d in sg.stage(halves[0].stage).devices:
            if d in out:
                out[d].append((halves[0].start, max(e.end for e in halves), label))
    for d in out:
        out[d].sort()
    return out


def _check_exclusive(sg: StageGraph, events: list[Event], eps: float) -> list[str]:
    problems = []
    for d, spans in _device_intervals(sg, events).items():
        busy_until, last = float("-inf"), ""
        for start, end, label in spans:
            if start < busy_until - eps and end > start:
                problems.append(
                    f"{label} on device {d} starts at {_g(start)} while {last} runs until {_g(busy_until)}"
                )
            if end > busy_until:
                busy_until, last = end, label
    return problems


def _check_dependencies(sg: StageGraph, events: list[Event], eps: float) -> list[str]:
    by_job = {e.job: e for e in events}
    kinds = {(e.stage, e.microbatch): e.pass_ for e in events if e.pass_ in ("I", "B")}
    problems = []
    for e in sorted(events, key=lambda e: (e.start, e.stage, e.microbatch, PASSES.index(e.pass_))):
        for dep, delay in dependencies(sg, e.job, kinds):
            d = by_job.get(dep)
            if d is None:
                problems.append(f"{_name(e)} depends on {dep}, which the schedule does not run")
            elif e.start < d.end + delay - eps:
                transfer = f" (+ transfer {_g(delay)})" if delay else ""
                problems.append(
                    f"{_name(e)} on {_devices_text(sg.stage(e.stage).devices)} starts at {_g(e.start)} "
                    f"before its dependency {dep} ends at {_g(d.end)}{transfer}"
                )
    return problems


def _memory_changes(sg: StageGraph, events: Iterable[Event], eps: float):
    """Activation changes as (snapped time, order, device, delta, event): frees (order 0) before allocations (1),
    for the first device of each class of :meth:`StageGraph.alike_devices` (its other devices change alike).

    Times within ``eps`` of each other are snapped to one value so that a
    free a rounding error after an allocation still counts as simultaneous.
    """
    raw = []
    for e in events:
        if e.pass_ not in PASSES:
            continue
        delta = sg.stage(e.stage).activation_change(e.pass_)
        raw.append((e.start, 1, delta, e) if e.pass_ == "F" else (e.end, 0, delta, e))
    snapped: dict[float, float] = {}
    rep = None
    for t in sorted({r[0] for r in raw}):
        if rep is None or t - rep > eps:
            rep = t
        snapped[t] = rep
    changes = []
    first = sg.alike_devices()  # the other devices of a class see the same changes
    for t, order, delta, e in raw:
        for d in sg.stage(e.stage).devices:
            if d in first:
                changes.append((snapped[t], order, d, delta, e))
    changes.sort(key=lambda c: (c[0], c[1], c[2], c[4].stage, c[4].microbatch, PASSES.index(c[4].pass_)))
    return changes


def device_param_bytes(sg: StageGraph) -> list[float]:
    """Parameter bytes resident on each device: the sum over the stages it hosts."""
    out = [0.0] * (sg.num_devices or 0)
    for first, devices in sg.alike_devices().items():
        held = sum((sg.stage(s).param_bytes for s in sg.stages_on(first)), 0.0)
        for d in devices:
            out[d] = held
    return out


def _check_memory(sg: StageGraph, events: list[Event], limit: float, eps: float) -> list[str]:
    params = device_param_bytes(sg)
    mem_eps = 1e-9 * abs(limit)
    problems = [
        f"device {d} holds {_g(p)} bytes of parameters alone, over the memory limit {_g(limit)}"
        for d, p in enumerate(params)
        if p > limit + mem_eps
    ]
    if problems:
        return problems
    held: dict[int, dict[tuple[int, int], float]] = {d: {} for d in range(sg.num_devices or 0)}
    reported: set[int] = set()
    for t, order, d, delta, e in _memory_changes(sg, events, eps):
        key = (e.stage, e.microbatch)
        held[d][key] = held[d].get(key, 0.0) + delta
        if abs(held[d][key]) <= 1e-9 * sg.stage(e.stage).act_bytes:  # fully freed, up to rounding
            del held[d][key]
        total = params[d] + sum(held[d].values())
        if delta > 0 and total > limit + mem_eps and d not in reported:
            reported.add(d)
            holders = [f"{s}F{m}" for (s, m) in sorted(held[d], key=lambda k: (k[1], k[0]))]
            shown = ", ".join(holders[:6]) + (f", ... ({len(holders)} in all)" if len(holders) > 6 else "")
            problems.append(
                f"device {d} needs {_g(total)} bytes at {_g(t)} when {_name(e)} starts "
                f"(parameters {_g(params[d])} + activations of {shown}), over the memory limit {_g(limit)}"
            )
    return problems


# --------------------------------------------------------------------------- metrics


def memory_profile(schedule: Schedule, *, rel_tol: float = 1e-9) -> dict[int, list[tuple[float, float]]]:
    """device -> step function of activation bytes, as ``[(time, bytes from then on), ...]``.

    Uses the memory convention of :func:`validate` (allocate at the start of
    F, free at the end of I/W/B, frees first at equal times). Each list starts
    at time 0 and has strictly increasing times.

    >>> sg = chain_stage_graph(1, f=1, b=2, w=1, act=1, act_w=0.5)
    >>> ev = [Event(0, 0, "F", 0, 1), Event(0, 0, "I", 1, 2), Event(0, 0, "W", 2, 3)]
    >>> memory_profile(Schedule(sg, 1, ev))
    {0: [(0.0, 1.0), (2.0, 0.5), (3.0, 0.0)]}
    """
    sg = schedule.stage_graph
    eps = _tolerance(schedule.events, rel_tol)
    alike = sg.alike_devices()
    level = {d: 0.0 for d in alike}
    profile = {d: [(0.0, 0.0)] for d in alike}
    for t, _, d, delta, _e in _memory_changes(sg, schedule.events, eps):
        level[d] += delta
        steps = profile[d]
        value = max(level[d], 0.0) if abs(level[d]) > 1e-12 * max(1.0, abs(delta)) else 0.0
        if steps[-1][0] == t or (len(steps) == 1 and t <= 0.0):
            steps[-1] = (float(max(t, 0.0)), value)
        else:
            steps.append((float(t), value))
    return {d: list(profile[first]) for first, devices in sorted(alike.items()) for d in devices}


@dataclass
class Metrics:
    """Figures of one timed schedule; lists are indexed by device.

    ``makespan`` is the end of the last event (a schedule starts at time 0);
    ``busy`` counts the time a device runs something (an overlapped pair
    once); ``idle = makespan - busy``; ``bubble_ratio = sum(idle) / (devices *
    makespan)``. ``peak_memory_bytes = param_bytes + peak_activation_bytes``.
    ``transferred_bytes`` sums edge bytes over the transfers actually made
    between different device groups: each forward over an edge and each
    gradient back over it. ``param_copies`` is the total parameter bytes over
    stages divided by the unique ones (stages with a ``copy_of`` are copies);
    with no parameter bytes at all it counts stages instead.
    """

    makespan: float
    busy: list[float]
    idle: list[float]
    bubble_ratio: float
    peak_activation_bytes: list[float]
    param_bytes: list[float]
    peak_memory_bytes: list[float]
    transferred_bytes: float
    param_copies: float

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (the ``metrics`` object of plan.json)."""
        floats = lambda xs: [float(x) for x in xs]  # noqa: E731 - plain floats even from numpy inputs
        return {
            "makespan": float(self.makespan),
            "busy": floats(self.busy),
            "idle": floats(self.idle),
            "bubble_ratio": float(self.bubble_ratio),
            "peak_activation_bytes": floats(self.peak_activation_bytes),
            "param_bytes": floats(self.param_bytes),
            "peak_memory_bytes": floats(self.peak_memory_bytes),
            "transferred_bytes": float(self.transferred_bytes),
            "param_copies": float(self.param_copies),
        }


def busy_time(schedule: Schedule) -> list[float]:
    """Time each device runs something (the union of its events' intervals)."""
    sg = schedule.stage_graph
    out = [0.0] * (sg.num_devices or 0)
    for first, spans in _device_intervals(sg, schedule.events).items():
        total, cur_start, cur_end = 0.0, None, None
        for start, end, _ in spans:
            if cur_end is None or start > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        if cur_end is not None:
            total += cur_end - cur_start
        for d in sg.alike_devices()[first]:
            out[d] = total
    return out


def metrics(schedule: Schedule) -> Metrics:
    """Makespan, busy/idle time, bubble ratio, memory, transfers and parameter copies.

    >>> sg = chain_stage_graph(2, f=1, b=2, w=1)
    >>> order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
    >>> m = metrics(Schedule(sg, 1, simulate(sg, order, 1)))
    >>> m.makespan, m.idle, m.bubble_ratio
    (6.0, [3.0, 3.0], 0.5)

    Kept on the schedule once computed (the report, the charts, the trace and
    each runtime's check ask for them: at 32,768 events the memory profile
    alone takes a second), and computed again if its events change.
    """
    return cached_on(schedule, "metrics", _metrics)


def cached_on(schedule: Schedule, name: str, compute: Callable[[Schedule], Any]) -> Any:
    """``compute(schedule)``, kept on the schedule under ``name`` and computed again only if its events (or memory
    limit) change: what every file of a plan asks of the same schedule is worked out once.

    >>> s = Schedule(chain_stage_graph(1), 1, [])
    >>> calls = []
    >>> _ = [cached_on(s, "n", lambda sched: calls.append(1) or len(sched.events)) for _ in range(3)]
    >>> len(calls)
    1
    """
    # The events' contents, not the list's identity: a list edited in place must not return stale figures.
    # Hashing 32,768 frozen events takes about 15 ms, against seconds for what is cached.
    key = (hash(tuple(schedule.events)), schedule.memory_limit)
    kept = schedule.__dict__.setdefault("_cached", {}).get(name)
    if kept is not None and kept[0] == key:
        return kept[1]
    value = compute(schedule)
    schedule.__dict__["_cached"][name] = (key, value)
    return value


def _metrics(schedule: Schedule) -> Metrics:
    sg = schedule.stage_graph
    n = sg.num_devices or 0
    makespan = max((e.end for e in schedule.events), default=0.0)
    busy = busy_time(schedule)
    idle = [makespan - b for b in busy]
    bubble = sum(idle) / (n * makespan) if n and makespan > 0 else 0.0
    peak_act = [max(v for _, v in steps) for _, steps in sorted(memory_profile(schedule).items())]
    params = device_param_bytes(sg)
    return Metrics(
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_ratio=bubble,
        peak_activation_bytes=peak_act,
        param_bytes=params,
        peak_memory_bytes=[p + a for p, a in zip(params, peak_act)],
        transferred_bytes=transferred_bytes(schedule),
        param_copies=param_copies(sg),
    )


def transferred_bytes(schedule: Schedule) -> float:
    """Edge bytes moved between different device groups: forwards into F, gradients into I/B."""
    sg = schedule.stage_graph
    ran = {(e.stage, e.microbatch, e.pass_) for e in schedule.events}
    total = 0.0
    for edge in sg.edges:
        if set(sg.stage(edge.src).devices) == set(sg.stage(edge.dst).devices):
            continue
        for m in range(schedule.microbatches):
            if not (sg.stage(edge.src).runs(m) and sg.stage(edge.dst).runs(m)):
                continue
            if (edge.dst, m, "F") in ran:
                total += edge.bytes
            if (edge.src, m, "I") in ran or (edge.src, m, "B") in ran:
                total += edge.bytes
    return total


def param_copies(sg: StageGraph) -> float:
    """Total parameter bytes over stages / unique parameter bytes (stage counts if there are none)."""
    total = sum(s.param_bytes for s in sg.stages)
    unique = sum(s.param_bytes for s in sg.stages if s.copy_of is None)
    if total > 0 and unique > 0:
        return total / unique
    originals = sum(1 for s in sg.stages if s.copy_of is None)
    return len(sg.stages) / originals if originals else 1.0


def zb_bubble_rate(schedule: Schedule) -> float:
    """The Zero Bubble paper's bubble rate: ``(cost - work) / cost``.

    ``cost`` is the longest span of a device from the start of its first F to
    the end of its last W or B; ``work`` is the busy time of that device (the
    lowest device id among equal spans). Domain: the paper defines it for
    chains with one stage per device, where ``work = m (T_F + T_B + T_W)``
    exactly; on other stage graphs this per-device reading is an extension.

    >>> sg = chain_stage_graph(2, f=1, b=2, w=1)
    >>> order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
    >>> zb_bubble_rate(Schedule(sg, 1, simulate(sg, order, 1)))
    0.5
    """
    sg = schedule.stage_graph
    busy = busy_time(schedule)
    best_span, best_device = 0.0, None
    for d in range(sg.num_devices or 0):
        mine = [e for e in schedule.events if d in sg.stage(e.stage).devices]
        first_f = min((e.start for e in mine if e.pass_ == "F"), default=None)
        last_bw = max((e.end for e in mine if e.pass_ in ("W", "B")), default=None)
        if first_f is None or last_bw is None:
            continue
        span = last_bw - first_f
        if best_device is None or span > best_span * (1 + 1e-12):
            best_span, best_device = span, d
    if best_device is None or best_span <= 0:
        return 0.0
    return (best_span - busy[best_device]) / best_span
