"""The action IR: passes, jobs, overlapped pairs, orders, timed events and the Schedule they make."""

from __future__ import annotations

import json  # noqa: F401 (the doctests use it)
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, NamedTuple, Union
from opsched.errors import OpschedError
from opsched.cost.overlap import pair_length
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opsched.schedule.graph import StageGraph



class PassKind(str, Enum):
    """The pass a job runs: a forward, or Zero Bubble's backward split into I and W, or both fused as B.

    A ``str`` enum, as torch.distributed.pipelining's ``_ComputationType``: a member is equal to its letter and
    hashes as it does, so a plain ``"F"`` (a plan.json or CSV read back, a caller's own job) is the same key, and
    ``str``, f-strings and JSON write the bare letter (torch's ``0F1`` notation, plan.json, the CSV). Written out
    here rather than taken from ``enum.StrEnum``, which Python 3.10 lacks, and because ``format`` of a mixed-in
    enum changed between 3.11 and 3.12.

    >>> PassKind("F") is PassKind.F, PassKind.B == "B", hash(PassKind.W) == hash("W")
    (True, True, True)
    >>> str(PassKind.I), f"{PassKind.I}", f"{PassKind.I:>3}", json.dumps([PassKind.W, {PassKind.B: 1}])
    ('I', 'I', '  I', '["W", {"B": 1}]')
    """

    F = "F"  #: forward: the stage's activations for a microbatch
    I = "I"  #: input gradient only: the gradient sent to the stage before (Zero Bubble's first backward half)
    W = "W"  #: weight gradient only: needs no other stage, so it may wait to fill a bubble (Zero Bubble's second)
    B = "B"  #: fused backward: input and weight gradient in one pass (I + W)

    def __str__(self) -> str:
        return self._value_

    def __format__(self, spec: str) -> str:
        return format(self._value_, spec)


#: every pass, in the order events of the same start sort (the simulator's tie rank)
PASSES = tuple(PassKind)
_PASS_RANK = {p: k for k, p in enumerate(PASSES)}  # PASSES.index, as a lookup (the simulator sorts every event)
#: the backward passes an F may pair with (a W has no communication to hide and DualPipe never pairs it)
PAIRED_BACKWARDS = (PassKind.I, PassKind.B)
#: the pass that computes a stage's input gradient and sends it on, one per stage and microbatch: I split, B fused
INPUT_GRADIENT_PASSES = (PassKind.I, PassKind.B)
_F = PassKind.F  # a global's lookup: a member's costs 14 times as much on Python 3.11, and pair_duration is hot


class Job(NamedTuple):
    """One pass of one microbatch on one stage.

    A named tuple, not a dataclass: jobs are the keys of every simulation's
    and search's dictionaries, and a tuple hashes and compares in C (a
    dataclass's ``__hash__`` is a Python call: a fifth of a pair-up's time
    at D=16, M=32, even with the hash kept).
    """

    stage: int
    microbatch: int
    pass_: PassKind  # a plain letter is the same job (equal, same hash): what a caller or a file gives

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

    >>> jobs_of(Job(0, 1, PassKind.F))
    (Job(stage=0, microbatch=1, pass_=<PassKind.F: 'F'>),)
    >>> [str(j) for j in jobs_of(Pair(Job(0, 2, PassKind.F), Job(3, 0, PassKind.B)))]
    ['0F2', '3B0']
    """
    return (action.first, action.second) if isinstance(action, Pair) else (action,)


def pair_duration(sg: StageGraph, pair: Pair) -> float:
    """Duration of an overlapped pair of jobs lasting ``a`` and ``b`` alone.

    When both stages have ``streams``: the shortest time to run the two
    passes' operations at once, one per stream at a time
    (:func:`opsched.cost.overlap.pair_length`). Otherwise the graph's rule
    ``a + b - gain * min(a, b)``: with the default gain 0 a pair costs
    exactly its two parts; gain 1 hides the shorter part entirely. Rounded
    up to whole slots on a slotted graph (``pair_slot``). The forward is
    taken first whatever the pair's order: a large pair's length is a greedy
    schedule's (:func:`opsched.cost.overlap.greedy_pair_length`), which depends on
    the order, and a pair must last the same for every caller.
    """
    if pair.second.pass_ == _F and pair.first.pass_ != _F:
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
    pass_: PassKind
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

    @property
    def makespan(self) -> float:
        """First job to last job: the end of the last event (0 for a schedule without events)."""
        return max((e.end for e in self.events), default=0.0)

    def step_time(self, grad_sync: float) -> float:
        """The step as every level counts it: the makespan plus the gradient all-reduce done once per step, none
        of it hidden under the last backward (the one home of this rule; docs/cost-model.md)."""
        return self.makespan + grad_sync


def _tie_break_key(sg: StageGraph, job: Job) -> tuple:
    """A tie-break between events that start and end together (zero durations) that respects dependencies."""
    topo = sg.topological_order().index(job.stage)
    phase, direction = _TIE_PHASE[job.pass_]
    return (phase, direction * topo, job.microbatch)


#: a pass's place among jobs that tie, and the way its stages go: forwards in topological order, backwards reversed
_TIE_PHASE = {PassKind.F: (0, 1), PassKind.I: (1, -1), PassKind.B: (1, -1), PassKind.W: (2, 1)}


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
            a, b = sorted((h.job for h in halves), key=lambda j: (j.pass_ != _F, j.stage, j.microbatch))
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




def cached_on(schedule: Schedule, name: str, compute: Callable[[Schedule], Any]) -> Any:
    """``compute(schedule)``, kept on the schedule under ``name`` and computed again only if its events (or memory
    limit) change: what every file of a plan asks of the same schedule is worked out once.

    >>> from opsched.schedule import chain_stage_graph
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
