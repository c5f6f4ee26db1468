"""The StageGraph: stages on device groups joined by activation edges, and the placements of a chain on devices."""

from __future__ import annotations

import graphlib
import heapq
import numbers
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence
from opsched.errors import OpschedError
from opsched.cost.overlap import PassStreams
from opsched.schedule.actions import PASSES, Job, PAIRED_BACKWARDS, Pair, PassKind, pair_duration
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opsched.schedule.actions import Action

# The members as globals in what the simulator calls per job: a member's lookup costs 14 globals' on Python 3.11.
_I, _W, _B = PassKind.I, PassKind.W, PassKind.B
#: the passes a stage's ``time`` must give (a fused B is optional: I + W otherwise)
_SPLIT_PASSES = (PassKind.F, PassKind.I, PassKind.W)


@dataclass(frozen=True)
class Stage:
    """A node of the StageGraph.

    ``time`` holds the durations of the F, I and W passes of one microbatch, keyed by their letters or
    :class:`PassKind` (the same keys); a fused backward B lasts ``time["B"]`` when given (a measured fused backward
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

    def duration(self, pass_: PassKind) -> float:
        if pass_ == _B and _B not in self.time:
            return float(self.time[_I]) + float(self.time[_W])
        return float(self.time[pass_])

    def timed_passes(self) -> tuple[PassKind, ...]:
        """The passes ``time`` gives explicitly: F, I, W, and B when measured."""
        return PASSES if PassKind.B in self.time else _SPLIT_PASSES

    def runs(self, microbatch: int) -> bool:
        return self.microbatches is None or microbatch in self.microbatches

    def activation_change(self, pass_: PassKind) -> float:
        """Activation bytes a pass adds to each device of the group (negative: frees).

        An F holds ``act_bytes``; its I frees ``act_bytes - act_w_bytes``, its
        W the remaining ``act_w_bytes``; a fused B frees all of it. When the
        change happens (an F at its start, the others at their end) is the
        caller's convention (see :func:`validate`).

        >>> st = Stage(0, (0,), {"F": 1, "I": 1, "W": 1}, act_bytes=4, act_w_bytes=1)
        >>> [st.activation_change(p) for p in PassKind]
        [4.0, -3.0, -1.0, -4.0]
        """
        if pass_ == PassKind.F:
            return float(self.act_bytes)
        if pass_ == PassKind.I:
            return -float(self.act_bytes - self.act_w_bytes)
        if pass_ == PassKind.W:
            return -float(self.act_w_bytes)
        if pass_ == PassKind.B:
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
        self._dependencies: dict[PassKind, dict[Job, list[tuple[Job, float]]]] = {PassKind.I: {}, PassKind.B: {}}
        self._checked: dict[int, dict[Action, tuple[int, ...]]] = {}

    def __getstate__(self) -> dict:
        # the simulator's caches grow with the jobs simulated; a copy (a result sent back from a child process)
        # starts without them
        return {**self.__dict__, "_dependencies": {PassKind.I: {}, PassKind.B: {}}, "_checked": {}}

    def largest_pair_saving(self, stages: Iterable[int] | None = None) -> float:
        """The largest fraction of its shorter part an overlapped pair of this graph saves, in [0, 1].

        ``overlap_gain`` for stages without ``streams``; for stages with them,
        the largest ``(a + b - pair) / min(a, b)`` over every F and backward
        (I, W or B) of stages on the same devices (of ``stages`` only, when
        given: the pairs one device can run). Every such pair lasts at least
        ``a + b - saving * min(a, b)``: the lower bounds' gain.

        >>> from opsched.schedule import chain_stage_graph
        >>> chain_stage_graph(2, overlap_gain=0.5).largest_pair_saving()
        0.5
        """
        key = None if stages is None else frozenset(stages)
        if key not in self._largest_saving:
            saving = self.overlap_gain
            # W too: the simulator would time such a pair
            for pair in self.stream_pairs(backwards=(PassKind.I, PassKind.W, PassKind.B)):
                if key is not None and not {pair.first.stage, pair.second.stage} <= key:
                    continue
                a = self.stage(pair.first.stage).duration(PassKind.F)
                b = self.stage(pair.second.stage).duration(pair.second.pass_)
                if min(a, b) > 0:
                    saving = max(saving, (a + b - pair_duration(self, pair)) / min(a, b))
            self._largest_saving[key] = min(1.0, saving)
        return self._largest_saving[key]

    def stream_pairs(self, backwards: Sequence[PassKind] = PAIRED_BACKWARDS) -> list["Pair"]:
        """One pair for every F and backward pass of ``backwards`` of stages with stream operations on the same
        devices."""
        on_devices: dict[frozenset, list[Stage]] = {}
        for st in self.stages:
            if st.streams is not None:
                on_devices.setdefault(frozenset(st.devices), []).append(st)
        return [Pair(Job(f.id, 0, PassKind.F), Job(x.id, 1, pass_))
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
        passes = _SPLIT_PASSES if split_backward else (PassKind.F, PassKind.B)
        return [
            Job(sid, m, p)
            for sid in self._topo
            for m in range(microbatches)
            if self.stages[sid].runs(m)
            for p in passes
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
            raise OpschedError(f"stage {s.id}: time['{p}'] must be a finite number >= 0, got {t!r}")
    if not 0 <= s.act_w_bytes <= s.act_bytes or s.param_bytes < 0:
        raise OpschedError(
            f"stage {s.id}: need 0 <= act_w_bytes <= act_bytes and param_bytes >= 0, "
            f"got act_bytes={s.act_bytes}, act_w_bytes={s.act_w_bytes}, param_bytes={s.param_bytes}"
        )
    if s.streams is not None:
        if PassKind.B in s.time:
            raise OpschedError(f"stage {s.id}: a measured B and stream operations cannot both time its backward")
        for p in _SPLIT_PASSES:
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
