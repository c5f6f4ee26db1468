"""The records of the bi-level search (:mod:`opsched.plan.search`): what it tried and what it returns.

A :class:`Candidate` is one row of plan.json's ``candidates``; a :class:`LowerJob` one StageGraph the lower level
schedules, with its :class:`LowerOutcome`; a :class:`Baseline` one row of plan.json's ``baselines``; an
:class:`Option` a plan the search may return (a scheduled candidate, a baseline, the plan on half the nodes or as a
chain); a :class:`PlanResult` the chosen plan with everything that was tried, and :class:`FewerNodesPlan` /
:class:`OtherPlan` the alternatives it reports. A baseline and an option are both a :class:`ScheduledPlan`:
a schedule with what plan.json and a runtime's check need to write it. docs/architecture.md has the table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from opsched.cost.cluster import Cluster
from opsched.schedule import Schedule, StageGraph
from opsched.solving.solver import Status
from opsched.units import plain
from opsched.upper.stages import StageContents, StagePlan


@dataclass
class ScheduledPlan:
    """A schedule on a layout, with its step time and what plan.json (and so a runtime's check) needs to write it:
    what a :class:`Baseline` row and an :class:`Option` of the search share. The fields after ``grad_sync`` are
    keyword-only; ``None`` in the last three means "as the planner's" (its blocks' contents, its training
    settings)."""

    layout: str
    schedule: Schedule  # on real devices (each pseudo-device of a contiguous split is a device group)
    step_time: float
    grad_sync: float  # seconds per step, added to the makespan
    #: stage id -> (block id of the reduced graph, mode name) of the blocks it holds (empty when a method regrouped
    #: the split, or when ``contents`` says it)
    stage_blocks: dict[int, list[tuple[int, str]]] = field(default_factory=dict, kw_only=True)
    #: what each stage holds, when known directly (a Megatron-style layout: from another import of the model)
    contents: dict[int, StageContents] | None = field(default=None, kw_only=True)
    #: samples per microbatch of ``schedule`` when not the planner's (a Megatron-style layout: one per replica)
    microbatch_size: int | None = field(default=None, kw_only=True)
    #: activation recomputation of ``schedule`` when not the planner's (a Megatron-style layout tries both)
    recompute: str | None = field(default=None, kw_only=True)
    #: Megatron's recompute modules of ``schedule`` when not the planner's (a Megatron-style layout tries them)
    recompute_modules: tuple[str, ...] | None = field(default=None, kw_only=True)


@dataclass
class Baseline(ScheduledPlan):
    """A hand-written schedule on the best contiguous split, or a Megatron-style layout (a row of ``baselines`` in
    plan.json)."""

    method: str
    makespan: float
    bubble_ratio: float
    peak_memory_bytes: float
    solve_seconds: float

    def to_dict(self, samples_per_step: int) -> dict:
        return {
            "method": self.method,
            "layout": self.layout,
            "makespan": self.makespan,
            "step_time": self.step_time,
            "throughput": samples_per_step / self.step_time if self.step_time > 0 else 0.0,
            "bubble_ratio": self.bubble_ratio,
            "peak_memory_bytes": self.peak_memory_bytes,
            "solve_seconds": self.solve_seconds,
        }


#: the status of a :class:`Candidate` for which the upper level found no placement within the memory limit
NO_FIT = "no fit"


@dataclass
class Candidate:
    """One thing the search tried, with its figures (a row of ``candidates`` in plan.json)."""

    source: str  # "upper" or "contiguous"
    layout: str
    status: str  # e.g. "scheduled", "no fit", "estimated only", "lower failed: ..."
    estimate: float | None = None  # upper objective (s)
    upper_status: str | None = None  # UpperSolution.status_text
    upper_seconds: float | None = None
    makespan: float | None = None
    step_time: float | None = None
    bubble_ratio: float | None = None
    peak_memory_bytes: float | None = None
    lower_bound: float | None = None
    gap: float | None = None
    solve_seconds: float | None = None
    stages: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class FewerNodesPlan:
    """The plan :func:`plan_block_graph` found on the first half of the nodes (itself never slower than the one
    on a quarter, and so on): the plan on every node may be it, so adding nodes never makes a plan slower."""

    devices: int
    source: str
    layout: str
    step_time: float
    #: whether it is the plan returned (then every device past ``devices`` is idle)
    chosen: bool

    @classmethod
    def of(cls, half: PlanResult, chosen: bool) -> FewerNodesPlan:
        return cls(half.schedule.stage_graph.num_devices, half.source, re.sub(ON_FEWER, "", half.layout),
                   half.step_time, chosen)


@dataclass(frozen=True)
class OtherPlan:
    """A plan the search found besides the chosen one, which the report names: the fastest that gives every device
    work (when the chosen one leaves some idle), or the fastest whose branches run side by side (when the chosen
    one is a chain)."""

    source: str
    layout: str
    step_time: float


@dataclass
class LowerOutcome:
    """What one lower solve of a candidate gave, besides its schedule."""

    lower_bound: float
    gap: float
    solver: str
    solve_seconds: float
    status: Status
    #: overlapped pairs the search made that the makespan did not need, run one job after the other
    pairs_parted: int = 0

    @property
    def proven(self) -> bool:
        return self.gap <= 1e-6

    def as_metrics(self) -> dict:
        """The fields plan.json's ``metrics`` carries."""
        return {"lower_bound": self.lower_bound, "gap": self.gap, "solver": self.solver,
                "solve_seconds": self.solve_seconds, "lower_status": self.status, "pairs_parted": self.pairs_parted}


@dataclass
class LowerJob:
    """One StageGraph the lower level schedules, and the best schedule it got so far."""

    candidate: Candidate
    stage_graph: StageGraph
    grad_sync: float  # seconds per step, added to the makespan
    plan: StagePlan | None = None  # the upper MIP's stages (None for the best baseline's contiguous split)
    split: Baseline | None = None  # the best baseline, whose split and schedule this job starts from
    schedule: Schedule | None = None
    outcome: LowerOutcome | None = None

    @property
    def start(self) -> Schedule | None:
        """The schedule its first lower solve starts from: the best baseline's, for the contiguous split."""
        return self.split.schedule if self.split is not None else None


@dataclass
class Option(ScheduledPlan):
    """A plan the search may return: a scheduled candidate, a baseline itself, the plan on half the nodes or as a
    chain."""

    source: str  # what produced it, as PlanResult.source says it
    metrics: dict  # plan.json's metrics: LowerOutcome.as_metrics(), or a baseline's solver "none"


@dataclass
class PlanResult(Option):
    """The chosen plan (an :class:`Option`, its ``contents``, ``microbatch_size`` and ``recompute`` always resolved,
    never ``None``) with everything that was tried: one record for the plan level, as :class:`Baseline` is a
    baseline's and :class:`LowerOutcome` a lower solve's."""

    candidates: list[Candidate]
    baselines: list[Baseline]
    blocks: int  # blocks the upper MIP placed
    seconds: dict[str, float] = field(default_factory=dict)
    refused_baselines: dict[str, str] = field(default_factory=dict)  # method -> why it fits no contiguous split
    #: devices of the cluster that hold no stage of the chosen plan
    idle_devices: tuple[int, ...] = ()
    #: when some are idle: the fastest plan found that gives every device work, if any
    on_every_device: OtherPlan | None = None
    #: on two nodes or more: the plan found on the first half of the nodes, the others idle (None: one node, or
    #: nothing fits there)
    on_half_the_nodes: FewerNodesPlan | None = None
    #: the most devices (the first nodes, the others idle) on which no plan was searched because the time limit
    #: was spent first: a run on that many devices alone may then find a faster plan (None: every half searched)
    fewer_nodes_unsearched: int | None = None
    #: step time of the plan found with the stage graph a chain (``branches=False``), when the model has parallel
    #: branches and it was searched (None: no branches, searched with ``branches=False``, or no time was left)
    chain_step_time: float | None = None
    #: why the chosen plan's stages may form one chain: "off" (``--branches off``), "no towers" (the model has no
    #: parallel branches outside its experts), "searched" (it has some, and the search planned them side by side)
    branch_search: str = "no towers"
    #: when the chosen plan is a chain and the search planned branches side by side: the fastest such plan found
    side_by_side: OtherPlan | None = None
    #: with ``branch_search`` "searched": the shares of the model's FLOPs in the two heaviest branches of its fork
    #: with the most work (:func:`opsched.plan.branches.heaviest_fork`)
    fork_shares: tuple[float, float] | None = None

    def as_option(self, **changes) -> Option:
        """This plan as an option of another search (the plan on half the nodes, as a chain): its schedule and
        settings, ``changes`` (e.g. ``source``, ``layout``) applied."""
        fields = {f: getattr(self, f) for f in Option.__dataclass_fields__}
        return Option(**{**fields, **changes})


#: how a layout on fewer devices than the cluster's ends
ON_FEWER = r", on [\d,]+ of the [\d,]+ devices$"


def _half_option(half: PlanResult, cluster: Cluster) -> Option:
    """The plan on half the nodes as an option of the plan on all of them (its layout says how many it uses).

    Listed last: on a tie the plan on every node is kept (``min`` keeps the first).

    >>> re.sub(ON_FEWER, "", "8x2 contiguous, dp2, on 16 of the 32 devices")
    '8x2 contiguous, dp2'
    """
    layout = FewerNodesPlan.of(half, chosen=False).layout  # the plan on half may be one on fewer nodes still
    return half.as_option(
        layout=f"{layout}, on {plain(half.schedule.stage_graph.num_devices)} of the {plain(cluster.devices)} devices")
