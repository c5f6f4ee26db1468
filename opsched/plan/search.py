"""The bi-level search: layouts → upper MIP → lower MIP, and the baselines it is compared with.

:func:`plan_block_graph` takes a BlockGraph, a cluster and training settings:

1. shrinks the BlockGraph to a MIP-sized one (:func:`opsched.upper.reduce.reduce_block_graph`);
2. enumerates group layouts (divisors of the device count, v in {1, 2}) and
   scores each by its contiguous warm start under the upper objective;
3. solves the upper MIP on the most promising layouts and keeps the best few;
4. schedules each of those StageGraphs with the lower MIP (``opsched.lower.solve``);
5. runs every hand-written baseline on the best contiguous split of the same
   model at the same memory (:func:`contiguous_baselines`), and offers the
   best of them to the lower MIP too, so the plan is never slower than it;
6. on two nodes or more, with the time left, plans on the first half of
   the nodes (the same search, recursively) and offers that plan with the
   other nodes idle;
7. when the model has parallel branches, with the time left, plans it as one
   chain too (``branches=False``, :mod:`opsched.plan.branches`) and offers
   that plan, so branches never make the plan slower when time does not bind;
8. returns the candidate with the best simulated step time (makespan plus
   the once-per-step gradient all-reduce), with every candidate's figures.

Step time = schedule makespan + gradient sync (data-parallel all-reduce,
once per step); throughput = microbatches × microbatch size / step time.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import networkx as nx

from opsched.baselines import baseline_orders
from opsched.cost.cluster import Cluster, Training, memory_hint, with_devices
from opsched.plan.branches import chain_only, has_parallel_blocks, has_parallel_towers
from opsched.plan.contiguous import Baseline, contiguous_baselines, fewer_device_baselines
from opsched.cost.blocks import expert_count
from opsched.errors import MemoryTooSmall, NoRunnablePlan
from opsched.export.runtimes import RUNTIMES, layout_fields, refusal, runtime_named
from opsched.model.graph import Block
from opsched.solving.isolate import Call, SolverCrash, run_isolated, run_isolated_all
from opsched.lower import minimum_memory_limit, solve
from opsched.schedule import Order, Schedule, StageGraph, metrics, order_from_schedule, validate
from opsched.solving.solver import Status, require
from opsched.units import bytes_text, plain, plural, seconds_text
from opsched.upper.layouts import describe_layout, layouts
from opsched.upper.mip import (
    CostTable,
    UpperProblem,
    UpperSolution,
    contiguous_start,
    estimate,
    minimum_memory,
    solve_upper,
    upper_problem,
)
from opsched.upper.reduce import reduce_block_graph
from opsched.upper.stages import HeldBlock, StageContents, StagePlan, build_stage_graph, stage_contents

log = logging.getLogger(__name__)


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


@dataclass
class PlanResult:
    """The chosen plan and everything that was tried."""

    schedule: Schedule
    solver_metrics: dict  # plan.json's metrics: LowerOutcome.as_metrics(), or the baseline's solver "none"
    source: str  # what produced the chosen schedule
    layout: str
    step_time: float
    grad_sync: float
    stage_contents: dict[int, StageContents]  # stage id -> its layers, module paths, blocks and modes
    candidates: list[Candidate]
    baselines: list[Baseline]
    blocks: int  # blocks the upper MIP placed
    microbatch_size: int  # samples per microbatch of ``schedule`` (a Megatron-style layout's: one per replica)
    recompute: str  # activation recomputation of ``schedule`` ("none", "selective" or "full")
    seconds: dict[str, float] = field(default_factory=dict)
    refused_baselines: dict[str, str] = field(default_factory=dict)  # method -> why it fits no contiguous split
    #: devices of the cluster that hold no stage of the chosen plan
    idle_devices: tuple[int, ...] = ()
    #: when some are idle: the fastest plan found that gives every device work, if any
    on_every_device: EveryDevicePlan | None = None
    #: on two nodes or more: the plan found on the first half of the nodes, the others idle (None: one node, or
    #: nothing fits there)
    on_half_the_nodes: FewerNodesPlan | None = None
    #: the most devices (the first nodes, the others idle) on which no plan was searched because the time limit
    #: was spent first: a run on that many devices alone may then find a faster plan (None: every half searched)
    fewer_nodes_unsearched: int | None = None
    #: step time of the plan found with the stage graph a chain (``branches=False``), when the model has parallel
    #: branches and it was searched (None: no branches, searched with ``branches=False``, or no time was left)
    chain_step_time: float | None = None


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
class EveryDevicePlan:
    """A plan the search found that gives every device work (reported when the chosen one leaves some idle)."""

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
class Option:
    """A plan the search may return: a scheduled candidate or a baseline itself."""

    step_time: float
    source: str
    layout: str
    schedule: Schedule
    metrics: dict
    grad_sync: float
    stage_blocks: dict[int, list[tuple[int, str]]]  # stage id -> (block id of the reduced graph, mode name)
    contents: dict[int, StageContents] | None = None  # what each stage holds, when known directly
    microbatch_size: int | None = None  # samples per microbatch, when not the planner's (Baseline.microbatch_size)
    recompute: str | None = None  # activation recomputation, when not the planner's (Baseline.recompute)


# --------------------------------------------------------------------------- the search


#: the lower MIP schedules at most this many upper solutions, those whose
#: estimate is within this factor of the best estimate
LOWER_AT_MOST = 10
LOWER_WITHIN = 1.15


def plan_block_graph(
    bg: nx.DiGraph,
    cluster: Cluster,
    training: Training,
    memory_limit: float | None = None,
    time_limit: float = 60.0,
    solver: str = "cbc",
    keep: int = 2,
    target_blocks: int | None = None,
    deadline: float | None = None,
    layouts_run_today: list[Baseline] | None = None,
    workers: int = 1,
    runtime: str | None = None,
    branches: bool = True,
) -> PlanResult:
    """Plan ``bg`` on ``cluster`` (see the module docstring) within ``time_limit`` seconds of wall clock.

    The work is the upper MIP of every layout, a quick lower solve of every
    upper solution and of the best baseline's split, longer lower solves of
    the ``keep`` best, then the plan on half the nodes. Work budgets decide
    each result; the clock is a hard limit, ``deadline`` (a
    :func:`time.monotonic` instant; default now + ``time_limit``), shared out
    by :class:`Clock` (docs/formulation.md, "What `--time-limit` does"): the best
    valid plan found by then is returned, a baseline at worst. ``workers``
    solves run at once, each in its own process and with its own work budget
    (the same plan sooner). Progress, with the time left, goes to the logger.
    ``runtime`` (one of :data:`opsched.export.runtimes.RUNTIMES`): only plans
    it can run are scheduled and returned (:class:`RuntimeFilter`); for one that
    builds stages from whole layers (``Runtime.needs_whole_layers``) the search places whole
    numbered layers, and for one without context parallelism
    (``Runtime.context_parallel``) every replica takes whole sequences. ``branches=False`` plans the model as
    one chain of blocks (:func:`opsched.plan.branches.chain_only`): a sequential pipeline.
    """
    require(solver)
    if not branches:
        bg = chain_only(bg)
    asked = runtime_named(runtime or "any")
    if asked is not None and not asked.context_parallel:  # it splits no sequence: replicas take whole ones
        training = dataclasses.replace(training, whole_sequences=True)
    limit = float(cluster.memory_bytes if memory_limit is None else memory_limit)
    t_start = time.perf_counter()
    full = time.monotonic() + time_limit if deadline is None else deadline
    as_chain_too = branches and has_parallel_blocks(bg)
    # with towers, the search as a chain keeps a part of the clock: the search with branches, whose shares are parts
    # of the clock, would otherwise leave it nothing whenever the time limit binds (and lose to --branches off,
    # 0.74x on 2 towers at 32 devices). Experts alone keep the whole clock for the search with branches.
    reserve = CHAIN_SHARE if as_chain_too and has_parallel_towers(bg) else 0.0
    clock = Clock(time.monotonic() + (1 - reserve) * (full - time.monotonic()))
    all_layouts = layouts(cluster)
    # a runtime that builds its stages from whole layers gets only plans that keep them whole
    small, members = _reduced(bg, all_layouts, target_blocks, whole_layers=asked is not None and asked.needs_whole_layers)
    _log_layouts(all_layouts, bg, small, clock)
    table = CostTable(small, cluster, training)  # each block costed once per group shape, for every layout
    problems = {str(lay): upper_problem(small, lay, cluster, training, limit, table) for lay in all_layouts}
    solutions, candidates = _solve_layouts(problems, clock, solver, workers)
    t_upper = time.perf_counter()
    runnable = RuntimeFilter(runtime, training, members, bg)
    baselines, best_split, refused = runnable.all_baselines(small, cluster, limit, layouts_run_today, table,
                                                            clock.share(BASELINE_SHARE), workers)
    t_base = time.perf_counter()
    if not solutions and not baselines:
        runnable.none_left()
        raise _nothing_fits(problems, solver, clock, limit, cluster)
    jobs, unscheduled = _lower_jobs(solutions, problems, best_split)
    jobs = runnable.jobs(jobs, training.microbatches)
    _schedule_jobs(jobs, training.microbatches, limit, clock, solver, keep, workers)
    options = [_job_option(j) for j in jobs if j.schedule is not None] + [_baseline_option(b) for b in baselines]
    t_lower, (half, unsearched) = time.perf_counter(), _plan_on_half_the_nodes(
        bg, cluster, training, limit, clock, t_base - t_upper, solver=solver, keep=keep, target_blocks=target_blocks,
        workers=workers, runtime=runtime, branches=branches)
    options = runnable.options(options) + ([_half_option(half, cluster)] if half is not None else [])
    t_half = time.perf_counter()
    chain = _plan_as_chain(bg, cluster, training, limit, Clock(full), solver=solver, keep=keep,
                           target_blocks=target_blocks, workers=workers, runtime=runtime) if as_chain_too else None
    options += [_chain_option(chain)] if chain is not None else []
    if not options:
        smallest = min((minimum_memory_limit(j.stage_graph, training.microbatches) for j in jobs), default=math.inf)
        raise _too_small("no candidate could be scheduled within", smallest, limit, cluster)
    best = min(options, key=lambda o: o.step_time)
    validate(best.schedule)
    idle, every = _idle_and_every_device_plan(best, options, cluster.devices)
    return PlanResult(
        schedule=best.schedule,
        solver_metrics=best.metrics,
        source=best.source,
        layout=best.layout,
        step_time=best.step_time,
        grad_sync=best.grad_sync,
        stage_contents=runnable.contents(best),
        candidates=[j.candidate for j in runnable.all_jobs] + candidates + unscheduled,
        baselines=baselines,
        blocks=small.number_of_nodes(),
        microbatch_size=best.microbatch_size or training.microbatch_size,
        recompute=best.recompute or training.recompute,
        seconds={"upper": t_upper - t_start, "baselines": t_base - t_upper, "lower": t_lower - t_base,
                 "half the nodes": t_half - t_lower, "as a chain": time.perf_counter() - t_half},
        refused_baselines=refused,
        idle_devices=idle,
        on_every_device=every,
        on_half_the_nodes=None if half is None else FewerNodesPlan.of(half, chosen=best.schedule is half.schedule),
        fewer_nodes_unsearched=unsearched,
        chain_step_time=None if chain is None else chain.step_time,
    )


def _plan_as_chain(bg: nx.DiGraph, cluster: Cluster, training: Training, limit: float, clock: Clock,
                   **options) -> PlanResult | None:
    """:func:`plan_block_graph` of ``bg`` as one chain (``branches=False``) in the time left, or None (less than
    :data:`LEAST_PART` left, or nothing fits): the plan ``--branches off`` finds, when work budgets decide both."""
    if clock.left() < LEAST_PART:
        log.info("plan: not as a chain: the time limit was spent")
        return None
    log.info("plan: now as a chain (the stage graph a sequence, as --branches off), within %s",
             seconds_text(clock.left()))
    try:
        found = plan_block_graph(bg, cluster, training, memory_limit=limit, deadline=clock.deadline, branches=False,
                                 **options)
    except (MemoryTooSmall, NoRunnablePlan) as exc:
        log.info("plan: nothing as a chain: %s", exc)
        return None
    log.info("plan: as a chain: %s on %s, step time %s", found.source, found.layout, seconds_text(found.step_time))
    return found


def _chain_option(chain: PlanResult) -> Option:
    """The plan as a chain as an option of the plan with branches (its source says so; the layout is left as it
    is, for the readers of layouts); listed last, so a tie keeps the branches'."""
    return Option(chain.step_time, f"{chain.source} as a chain", chain.layout, chain.schedule, chain.solver_metrics,
                  chain.grad_sync, {}, chain.stage_contents, chain.microbatch_size, chain.recompute)


def _plan_on_half_the_nodes(bg: nx.DiGraph, cluster: Cluster, training: Training, limit: float, clock: Clock,
                            baselines_took: float, **options) -> tuple[PlanResult | None, int | None]:
    """(:func:`plan_block_graph` on the first half of the nodes, in the time left, or None; the most devices on
    which the time limit left no search, or None).

    No plan on one node (or an odd number of them), when nothing fits there, or when less than
    :data:`LEAST_PART` is left, or less than half of ``baselines_took`` (the seconds the baselines took on
    every node): the search there could not finish even its first baseline in time (on Megatron-Core's 462B
    over 6,144 H100s it started with 2.2 s left and ran 4.6 s past the time limit for a plan 5 times slower).
    Only that last case leaves fewer nodes unsearched: on the others no plan there could beat this one.

    Those nodes are a cluster of their own, so that plan (and, through its
    own half, the plans on a quarter, an eighth, ... of the nodes) is one
    this cluster can run with the other nodes idle: offering it keeps a plan
    from getting slower as nodes are added, which more stages, longer
    transfers or wider groups can otherwise do. Whole nodes only, as
    :func:`opsched.plan.contiguous.fewer_device_baselines` takes them. It runs
    after the search on every node, which keeps the whole clock: when work
    budgets decide that search, time is left and the plan on half the nodes
    is the very one planned there alone (when its own budgets decide too).
    """
    per_node = cluster.devices_per_node
    if cluster.devices % (2 * per_node) != 0:
        return None, None
    half = with_devices(cluster, cluster.devices // 2)
    # every parameter's weight, gradient and optimizer state is held once at least, however they are sharded: when
    # that alone overflows half the devices, the search there (and on its own halves) cannot fit anything
    state = sum(bg.nodes[n]["block"].param_count for n in bg) * training.bytes_per_param
    if state > limit * half.devices:
        log.info("plan: not on %s devices: the parameters' state alone (%s) needs more", plain(half.devices),
                 bytes_text(state))
        return None, None
    if clock.left() < max(LEAST_PART, baselines_took / 2):
        log.info("plan: not on %s devices: the time limit was spent", plain(half.devices))
        return None, half.devices
    log.info("plan: now on %s of the %s devices (the others idle), within %s", plain(half.devices),
             plain(cluster.devices), seconds_text(clock.left()))
    try:
        found = plan_block_graph(bg, half, training, memory_limit=limit, deadline=clock.deadline, **options)
    except (MemoryTooSmall, NoRunnablePlan) as exc:
        log.info("plan: nothing on %s devices: %s", plain(half.devices), exc)
        return None, None
    log.info("plan: on %s devices: %s on %s, step time %s", plain(half.devices), found.source,
             found.layout, seconds_text(found.step_time))
    return found, found.fewer_nodes_unsearched


#: how a layout on fewer devices than the cluster's ends
ON_FEWER = r", on [\d,]+ of the [\d,]+ devices$"


def _half_option(half: PlanResult, cluster: Cluster) -> Option:
    """The plan on half the nodes as an option of the plan on all of them (its layout says how many it uses).

    Listed last: on a tie the plan on every node is kept (``min`` keeps the first).

    >>> re.sub(ON_FEWER, "", "8x2 contiguous, dp2, on 16 of the 32 devices")
    '8x2 contiguous, dp2'
    """
    layout = FewerNodesPlan.of(half, chosen=False).layout  # the plan on half may be one on fewer nodes still
    return Option(half.step_time, half.source,
                  f"{layout}, on {plain(half.schedule.stage_graph.num_devices)} of the {plain(cluster.devices)} devices",
                  half.schedule, half.solver_metrics, half.grad_sync, {}, half.stage_contents, half.microbatch_size,
                  half.recompute)


def _log_layouts(all_layouts: list, bg: nx.DiGraph, small: nx.DiGraph, clock: Clock) -> None:
    merged = (f"the model's {bg.number_of_nodes()} blocks merged into {small.number_of_nodes()}"
              if small.number_of_nodes() < bg.number_of_nodes() else f"the model's {bg.number_of_nodes()} blocks")
    log.info("upper: %s to try (%s; `opsched plan --help` explains the notation); %s for the placement MIP; %s",
             plural(len(all_layouts), "layout"), ", ".join(map(str, all_layouts)), merged, clock.left_text())


def _idle_and_every_device_plan(best: Option, options: list[Option],
                                devices: int) -> tuple[tuple[int, ...], EveryDevicePlan | None]:
    """The chosen plan's idle devices and, when there are some, the fastest option that keeps every device busy."""
    idle = idle_devices(best.schedule.stage_graph, devices)
    if not idle:
        return idle, None
    busy = [o for o in options if not idle_devices(o.schedule.stage_graph, devices)]
    every = min(busy, key=lambda o: o.step_time, default=None)
    return idle, None if every is None else EveryDevicePlan(every.source, every.layout, every.step_time)


def idle_devices(sg: StageGraph, devices: int) -> tuple[int, ...]:
    """The devices among ``0 .. devices-1`` that hold no stage of ``sg`` (they would do no work).

    >>> from opsched.schedule import chain_stage_graph
    >>> idle_devices(chain_stage_graph(2), 4)
    (2, 3)
    """
    held = {d for stage in sg.stages for d in stage.devices}
    return tuple(d for d in range(devices) if d not in held)


def _too_small(what: str, smallest: float, limit: float, cluster: Cluster) -> MemoryTooSmall:
    """The error for a memory limit nothing fits in (``what`` it, e.g. "no layout fits in"), with the smallest that works."""
    return MemoryTooSmall(f"{what} {bytes_text(limit)} per device; the smallest memory "
                          f"that works is about {bytes_text(smallest)} ({memory_hint(smallest, cluster)})", smallest)


#: the time limit of each layout's least-memory MIP, when nothing fits (the hint of the error)
SMALLEST_MEMORY_SECONDS = 2.0

#: the part of the time left the search as a chain keeps when the model has parallel towers (plus whatever the
#: search with branches leaves; docs/formulation.md, "What `--time-limit` does")
CHAIN_SHARE = 0.4

#: the part of the time limit the upper MIPs share
UPPER_SHARE = 0.4
#: the part of what is left after the upper MIPs that the baselines may use (they take seconds; a loaded machine
#: may stretch them, and then the splits not yet tried are skipped)
BASELINE_SHARE = 0.5
#: the part of what is left after the baselines that the quick lower solves share
QUICK_SHARE = 0.6
#: a step whose part of the clock is below this many seconds is skipped
LEAST_PART = 0.25
#: a lower solve holds its time limit within this factor, plus this many seconds (forking, re-timing)
LOWER_OVERRUN = 1.1
LOWER_SLACK = 0.5


@dataclass
class Clock:
    """The planner's wall-clock budget: a hard deadline, and equal parts of a share of it."""

    deadline: float  # a time.monotonic() instant

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def left_text(self) -> str:
        """How much of the time limit is left, as the progress lines end."""
        return f"{self.left():.0f} s of the time limit left"

    def share(self, fraction: float) -> float:
        """The deadline of a step that may use ``fraction`` of the time left."""
        return time.monotonic() + fraction * self.left()

    @staticmethod
    def part(share_deadline: float, steps_left: int, running: int = 0, jobs: int = 1) -> float:
        """Seconds for the next of ``steps_left`` steps that share a deadline (what earlier ones saved carries over).

        With ``jobs`` workers, ``running`` of them busy, the steps left and
        those running are spread over the workers: each worker has about
        ``(steps_left + running) / jobs`` of them to do in the time left.

        >>> now = time.monotonic()
        >>> round(Clock.part(now + 40, 4)), round(Clock.part(now + 40, 3, running=1, jobs=2))
        (10, 20)
        """
        rounds = math.ceil((max(1, steps_left) + running) / max(1, jobs))
        return max(0.0, share_deadline - time.monotonic()) / rounds

    def timeout(self, part: float) -> float:
        """How long an isolated solve given ``part`` seconds may run before it is stopped: a little grace, never past the deadline."""
        return min(1.25 * part + 1.0, self.left())

    def lower_limit(self, part: float) -> float:
        """The time limit of a lower solve given ``part`` seconds: ``part``, less what keeps its result in time.

        A lower solve holds its limit within :data:`LOWER_OVERRUN` plus
        :data:`LOWER_SLACK` seconds and then returns its best schedule; given
        all that is left (the last step), it would be stopped at the deadline
        as it returns and its schedule lost.
        """
        return min(part, (self.left() - LOWER_SLACK) / LOWER_OVERRUN)


def _solve_layouts(problems: dict[str, UpperProblem], clock: Clock, solver: str,
                   jobs: int = 1) -> tuple[list[UpperSolution], list[Candidate]]:
    """Step 1, the upper MIP on every layout that fits, warm-started from its best contiguous split.

    Runs ``jobs`` layouts at once. Returns the solutions and a candidate row
    for each layout without one.
    """
    names, share = list(problems), clock.share(UPPER_SHARE)
    tried: set[int] = set()  # the layouts whose turn came while time was left

    def call(k: int, running: int) -> Call | None:
        part = clock.part(share, len(names) - k, running, jobs)
        if part < LEAST_PART:
            return None
        tried.add(k)
        return Call(_upper_for_layout, (problems[names[k]], part, solver), timeout=clock.timeout(part))

    def progress(k: int, found) -> None:
        name = names[k]
        if isinstance(found, SolverCrash):
            what = str(found)
        elif found is None:
            what = "no placement fits in the memory limit"
        else:
            what = upper_outcome(*found)
        log.info("upper: layout %s (%s): %s; %s", name, describe_layout(name), what, clock.left_text())

    solutions: list[UpperSolution] = []
    candidates: list[Candidate] = []
    for k, found in enumerate(run_isolated_all(call, len(names), jobs, on_result=progress)):
        name = names[k]
        if k not in tried:
            candidates.append(Candidate("upper", name, "skipped: the time limit was spent"))
        elif isinstance(found, SolverCrash):
            candidates.append(Candidate("upper", name, f"upper failed: {found}"))
        elif found is None:
            candidates.append(Candidate("upper", name, "no fit"))
        else:
            solutions.append(found[1])
    return solutions, candidates


#: layouts of more than this many stages get the placement MIP's window search, blocks moving this many stages a round
WINDOW_ABOVE_SLOTS = 4
UPPER_WINDOW = 2

#: what the words of the progress lines and of report.md's candidates table mean (`plan --help` and report.md show it)
GLOSSARY = f"""\
Words of the progress lines and the report:
  estimate / estimated step time  the placement MIP's step time from the cost model, before
                        the microbatches are scheduled (the lower level's schedule decides)
  contiguous start      the best contiguous split of the layout, where the placement MIP starts
  window search         on layouts of more than {WINDOW_ABOVE_SLOTS} stages the placement MIP moves blocks at most
                        {UPPER_WINDOW} stages from where they are, round after round (a neighbourhood search):
                        as good as its start or better, not proven the best over all placements
  optimal, feasible     the MIP proved its result the best, or its work budget ran out first
  time limit reached    the step's share of --time-limit ran out first; a faster or less loaded
                        machine may find a better result
  estimated only        not scheduled: its estimate is over {round(100 * (LOWER_WITHIN - 1))} % above the best layout's,
                        or {LOWER_AT_MOST} layouts with better estimates were scheduled
  skipped, not scheduled  the time limit was spent before this step's turn
  not scheduled: R cannot run this plan: ...  left out for --runtime: the reason R's export
                        (`opsched export`) gives for these stages
  no fit                no placement on this layout fits in the memory limit
  source                upper: the placement MIP's stages; contiguous: the best baseline's split,
                        rescheduled by the lower MIP; baseline NAME: that schedule as it is
  makespan              one step's pipeline, from the first job's start to the last job's end
  step time             makespan + the gradient all-reduce done once per step
  bubble ratio          the share of device time left idle within the makespan
  lower bound, gap      a proven floor under the makespan, and (makespan - bound) / makespan
"""


def upper_outcome(start_estimate: float, sol: UpperSolution) -> str:
    """What one layout's placement MIP found, as a progress line says it.

    >>> from opsched.upper.layouts import Layout
    >>> sol = UpperSolution(Layout(8, 2), {}, {"step_time": 0.7796}, Status.TIME_LIMIT, 0.0, 1.04, windowed=True)
    >>> upper_outcome(0.7796, sol)
    'estimated step time 779.6 ms, the same as its contiguous start; window search (blocks moved at most 2 stages a round) in 1.04 s, not proven optimal: its share of the time limit ran out first'
    >>> upper_outcome(0.9, UpperSolution(Layout(8, 2), {}, {"step_time": 0.8}, Status.OPTIMAL, 0.8, 0.2))
    'estimated step time 800 ms, down from 900 ms for its contiguous start; MIP in 200 ms, proven optimal'
    """
    if sol.objective < start_estimate * (1 - 1e-6):
        change = f"down from {seconds_text(start_estimate)} for its contiguous start"
    else:
        change = "the same as its contiguous start"
    how = f"window search (blocks moved at most {UPPER_WINDOW} stages a round)" if sol.windowed else "MIP"
    return (f"estimated step time {seconds_text(sol.objective)}, {change}; "
            f"{how} in {seconds_text(sol.solve_seconds)}, {sol.status.meaning}")




def _upper_for_layout(p: UpperProblem, time_limit: float, solver: str) -> tuple[float, UpperSolution] | None:
    """(estimate of the contiguous start, upper solution) for one layout, or None when nothing fits."""
    began = time.monotonic()
    start = contiguous_start(p, solver=solver)
    if start is None:
        return None
    window = UPPER_WINDOW if p.layout.slots > WINDOW_ABOVE_SLOTS else None
    left = max(0.05, time_limit - (time.monotonic() - began))  # the start's own solve counts against the limit
    return estimate(p, start)["step_time"], solve_upper(p, time_limit=left, solver=solver, start=start, window=window)


def _lower_jobs(
    solutions: list[UpperSolution], problems: dict[str, UpperProblem], best_split: Baseline | None
) -> tuple[list[LowerJob], list[Candidate]]:
    """Step 3's jobs: the upper solutions worth scheduling, and the best baseline's split.

    Returns the jobs and a candidate row for each solution left at its estimate.
    """
    jobs: list[LowerJob] = []
    estimated_only: list[Candidate] = []
    ranked = sorted(solutions, key=lambda x: (x.objective, str(x.layout)))
    for rank, sol in enumerate(ranked):
        if rank >= LOWER_AT_MOST or sol.objective > LOWER_WITHIN * ranked[0].objective:
            estimated_only.append(Candidate("upper", str(sol.layout), "estimated only", estimate=sol.objective,
                                            upper_status=sol.status_text, upper_seconds=sol.solve_seconds))
            continue
        plan = build_stage_graph(problems[str(sol.layout)], sol.assignment)
        cand = Candidate("upper", str(sol.layout), "scheduled", estimate=sol.objective, upper_status=sol.status_text,
                         upper_seconds=sol.solve_seconds, stages=len(plan.stage_graph.stages))
        jobs.append(LowerJob(cand, plan.stage_graph, plan.grad_sync_seconds, plan=plan))
    if best_split is not None:
        sg = best_split.schedule.stage_graph
        cand = Candidate("contiguous", best_split.layout, "scheduled", stages=len(sg.stages))
        jobs.append(LowerJob(cand, sg, best_split.grad_sync, split=best_split))
    return jobs, estimated_only


def _schedule_jobs(jobs: list[LowerJob], microbatches: int, limit: float, clock: Clock, solver: str, keep: int,
                   workers: int = 1) -> None:
    """Step 3: a quick lower solve of every job, then longer ones for the ``keep`` best not proven optimal.

    ``workers`` solves run at once.
    """
    _schedule_all(jobs, microbatches, limit, clock, clock.share(QUICK_SHARE), solver, workers, quick=True)
    finalists = sorted((j for j in jobs if j.schedule is not None), key=lambda j: j.candidate.step_time)[:keep]
    finalists = [j for j in finalists if not j.outcome.proven]
    _schedule_all(finalists, microbatches, limit, clock, clock.deadline, solver, workers, quick=False)


def _schedule_all(jobs: list[LowerJob], microbatches: int, limit: float, clock: Clock, share: float, solver: str,
                  workers: int, quick: bool) -> None:
    """Lower-solve every job, ``workers`` at once, sharing the time up to ``share``; keep each better result.

    The quick pass gets a small work budget so that it finishes well inside
    its share of the clock (budgets in work keep plans deterministic; the
    time limit stops a solve that would not); a longer pass starts from the
    job's quick schedule.
    """
    tried: set[int] = set()  # the jobs whose turn came while time was left

    def call(k: int, running: int) -> Call | None:
        job = jobs[k]
        part = clock.part(share, len(jobs) - k, running, workers)
        time_limit = clock.lower_limit(part)
        if part < LEAST_PART or time_limit < LEAST_PART:
            return None
        tried.add(k)
        warm = job.start if quick else job.schedule
        return Call(_lower_solve, (job.stage_graph, microbatches, limit, time_limit, solver, warm,
                                     10 if quick else None), timeout=clock.timeout(part))

    def take(k: int, got) -> None:  # as each solve returns: its candidate's figures and its progress line
        if isinstance(got, SolverCrash):
            _lower_failed(jobs[k], str(got), clock)
        elif isinstance(got, MemoryTooSmall):  # its own message counts in plain numbers; these are bytes
            _lower_failed(jobs[k], f"every schedule of these stages needs at least {bytes_text(got.minimum)} "
                          "per device", clock)
        else:
            _keep_if_better(jobs[k], *got, clock)

    run_isolated_all(call, len(jobs), workers, on_result=take)
    for k, job in enumerate(jobs):
        if k not in tried and job.schedule is None:
            job.candidate.status = "not scheduled: the time limit was spent"


def _lower_failed(job: LowerJob, reason: str, clock: Clock) -> None:
    if job.schedule is None:
        job.candidate.status = f"lower failed: {reason}"
    log.info("lower: %s: %s; %s", _job_name(job.candidate), reason, clock.left_text())


def _keep_if_better(job: LowerJob, schedule: Schedule, outcome: LowerOutcome, clock: Clock) -> None:
    """Keep a lower solve's schedule in ``job`` when it is better than what the job holds."""
    cand = job.candidate
    m = metrics(schedule)
    step = schedule.step_time(job.grad_sync)
    if job.schedule is not None and step >= cand.step_time:
        return
    job.schedule, job.outcome = schedule, outcome
    cand.makespan, cand.step_time = m.makespan, step
    cand.bubble_ratio, cand.peak_memory_bytes = m.bubble_ratio, max(m.peak_memory_bytes, default=0.0)
    cand.lower_bound, cand.gap = outcome.lower_bound, outcome.gap
    cand.solve_seconds = (cand.solve_seconds or 0.0) + outcome.solve_seconds
    log.info("lower: %s: step time %s (makespan %s + gradient sync %s), bubble ratio %.3f, %s; %s",
             _job_name(cand), seconds_text(step), seconds_text(m.makespan), seconds_text(job.grad_sync),
             m.bubble_ratio, _gap_words(outcome.gap), clock.left_text())


def _job_name(cand: Candidate) -> str:
    """Which candidate a lower progress line is about."""
    if cand.source == "contiguous":
        return f"the best baseline's split {cand.layout}"
    return f"layout {cand.layout} as the placement MIP placed it"


def _gap_words(gap: float) -> str:
    """A lower solve's gap as a progress line says it.

    >>> _gap_words(0.0), _gap_words(0.0123), _gap_words(0.0000412)
    ('proven optimal', 'within 1.2 % of the proven lower bound', 'within 0.0041 % of the proven lower bound')
    """
    return "proven optimal" if gap <= 1e-6 else f"within {plain(100 * gap, 2)} % of the proven lower bound"


def lower_schedule(
    sg: StageGraph, microbatches: int, memory_limit: float, time_limit: float, solver: str, warm: Schedule | None = None,
    search_budget: int | None = None,
) -> tuple[Schedule, LowerOutcome]:
    """The lower MIP's schedule of ``sg`` (``opsched.lower.solve``), started from ``warm`` and every baseline that applies.

    ``search_budget``: neighbourhood sub-MIPs (``None``: the lower level's
    default). ``time_limit`` is the solve's wall-clock limit; the outcome's
    status says when it bound. The lower level's own progress lines are left out (the
    planner reports one line per solve).
    """
    kwargs = {} if search_budget is None else {"search_budget": search_budget}
    warm_orders: dict[str, Order] = {}
    if warm is not None:
        warm_orders[warm.name or "warm"] = order_from_schedule(warm)
    for name, order in baseline_orders(sg, microbatches).items():
        warm_orders.setdefault(name, order)  # on a name clash the caller's schedule comes first
    with _quiet("opsched.lower"):
        result = solve(sg, microbatches, memory_limit=memory_limit, time_limit=time_limit, solver=solver,
                       warm_orders=warm_orders, **kwargs)
    outcome = LowerOutcome(result.lower_bound, result.gap, result.solver, result.solve_seconds, result.status,
                           result.pairs_parted)
    return result.schedule, outcome


def _lower_solve(*args) -> tuple[Schedule, LowerOutcome] | MemoryTooSmall:
    """:func:`lower_schedule` in a worker: memory too small for these stages is an answer, not an error."""
    try:
        return lower_schedule(*args)
    except MemoryTooSmall as exc:
        return exc


@contextmanager
def _quiet(logger_name: str):
    """Raise ``logger_name``'s level to WARNING for the duration of the block."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _job_blocks(job: LowerJob) -> dict[int, list[tuple[int, str]]]:
    """Stage id -> (block id of the reduced graph, mode name) of a job's stages."""
    if job.plan is not None:
        return {sid: [(b, job.plan.modes_of_stage[sid][b]) for b in blocks] for sid, blocks in job.plan.blocks_of_stage.items()}
    return job.split.stage_blocks


def _job_option(job: LowerJob) -> Option:
    cand = job.candidate
    return Option(cand.step_time, cand.source, cand.layout, job.schedule, job.outcome.as_metrics(), job.grad_sync,
                  _job_blocks(job))


def _baseline_option(b: Baseline) -> Option:
    """A baseline itself is a plan the search may return."""
    return Option(b.step_time, f"baseline {b.method}", b.layout, b.schedule,
                  {"solver": "none", "solve_seconds": b.solve_seconds}, b.grad_sync, b.stage_blocks, b.contents,
                  b.microbatch_size, b.recompute)


@dataclass
class RuntimeFilter:
    """Keeps only what ``runtime`` can run (every candidate when it is None), asking the export's own checks
    (:func:`opsched.export.runtimes.refusal`) with the plan.json fields the plan would be written with."""

    runtime: str | None
    training: Training
    members: dict[int, list[int]]  # reduced block -> the model's blocks it stands for
    bg: nx.DiGraph
    all_jobs: list[LowerJob] = field(default_factory=list)  # every job, kept or refused, for the candidates table
    reasons: list[str] = field(default_factory=list)  # why each candidate left out cannot run on the runtime

    def all_baselines(self, small: nx.DiGraph, cluster: Cluster, limit: float, today: list[Baseline] | None,
                      table: CostTable | None = None, deadline: float | None = None, workers: int = 1,
                      ) -> tuple[list[Baseline], Baseline | None, dict[str, str]]:
        """:func:`contiguous_baselines` on ``small``, the best of them on fewer devices
        (:func:`fewer_device_baselines`) and the Megatron-style layouts (``today``), those the runtime can run,
        by step time (on a tie, the one using more devices first); the best contiguous one on every device
        (the lower level's split); method -> why refused."""
        rows, best_split, refused = contiguous_baselines(small, cluster, self.training, limit, table, deadline, workers)
        fewer = fewer_device_baselines(small, cluster, self.training, limit, deadline, workers)
        today = list(today or [])
        if self.runtime is not None:
            rows, today = self.baselines(rows, refused), self.baselines(today, refused)
            fewer = self.baselines(fewer, {})  # a method's reason is the one on every device
            best_split = rows[0] if rows else None
        # Megatron-style layouts (opsched.plan.layouts.search_layouts), offered like the hand-written baselines
        return (sorted(rows + fewer + today, key=lambda b: (b.step_time, -b.schedule.stage_graph.num_devices,
                                                            b.method)),
                best_split, refused)

    def contents(self, option: Option) -> dict[int, StageContents]:
        return option.contents or _stage_contents(option.stage_blocks, self.members, self.bg)

    def reason(self, option: Option) -> str | None:
        """Why the runtime cannot run ``option`` as plan.json would have it (None: it can, or no runtime asked)."""
        if self.runtime is None:
            return None
        t = self.training
        doc = layout_fields(self.contents(option), option.microbatch_size or t.microbatch_size, t.zero,
                            option.recompute or t.recompute, t.optimizer_state, t.tp_comm_overlap, t.attention,
                            t.dtype)
        return refusal(self.runtime, option.schedule, doc)

    def baselines(self, rows: list[Baseline], refused: dict[str, str]) -> list[Baseline]:
        """The rows the runtime can run; each other one's reason goes into ``refused`` (method -> reason)."""
        kept = []
        for b in rows:
            why = self.reason(_baseline_option(b))
            if why is None:
                kept.append(b)
            else:
                refused[b.method] = f"{b.layout}: {why}"
                self.reasons.append(refused[b.method])
                log.info("baseline: %s on %s left out for --runtime %s: %s", b.method, b.layout, self.runtime, why)
        return kept

    def jobs(self, jobs: list[LowerJob], microbatches: int) -> list[LowerJob]:
        """The upper solutions' stages the runtime can run, asked before the lower level orders them."""
        self.all_jobs = list(jobs)
        kept = []
        for job in jobs:
            unordered = Option(0.0, job.candidate.source, job.candidate.layout,
                               Schedule(job.stage_graph, microbatches, [], name="mip"), {}, 0.0, _job_blocks(job))
            why = self.reason(unordered) if job.plan else None
            if why is None:
                kept.append(job)
            else:
                job.candidate.status = f"not scheduled: {why}"
                self.reasons.append(f"{job.candidate.source} {job.candidate.layout}: {why}")
                log.info("lower: %s left out for --runtime %s: %s", _job_name(job.candidate), self.runtime, why)
        return kept

    def options(self, options: list[Option]) -> list[Option]:
        """The finished plans the runtime can run, their orders checked too (:meth:`none_left` when none is)."""
        if self.runtime is None:
            return options
        kept = []
        for o in options:
            why = self.reason(o)
            if why is None:
                kept.append(o)
            else:
                self.reasons.append(f"{o.source} {o.layout}: {why}")
        if not kept:
            self.none_left()
        return kept

    def none_left(self) -> None:
        """Raise :class:`NoRunnablePlan` when candidates were left out for the runtime (else the caller says
        that nothing fits)."""
        if self.reasons:
            raise NoRunnablePlan(f"no plan found can run on {self.runtime} (opsched export {RUNTIMES[self.runtime].export_flags}): "
                                 f"{self.reasons[0]}", list(self.reasons))


def _stage_contents(
    held: dict[int, list[tuple[int, str]]], members: dict[int, list[int]], bg: nx.DiGraph
) -> dict[int, StageContents]:
    """Stage id -> what it holds, in the model's own blocks (each reduced block stands for its ``members``)."""
    return {
        sid: stage_contents([_held_block(bg.nodes[m]["block"], mode) for b, mode in blocks for m in members[b]])
        for sid, blocks in held.items()
    }


def _held_block(block: Block, mode: str) -> HeldBlock:
    """A model block in a stage, with what it holds (the stage's configuration counts only blocks with weights)."""
    holds = "experts" if expert_count(block) > 0 else "weights" if block.param_count > 0 else "none"
    return HeldBlock(block.name, mode, holds)


def _reduced(bg: nx.DiGraph, all_layouts: list, target_blocks: int | None,
             whole_layers: bool = False) -> tuple[nx.DiGraph, dict]:
    """``bg`` reduced to the blocks the placement MIP places (default: 3 per pipeline slot of the largest layout,
    at least 24), with the members of each reduced block; with ``whole_layers``, each numbered layer in one."""
    return reduce_block_graph(bg, target_blocks or max(24, 3 * max(lay.slots for lay in all_layouts)),
                              whole_layers=whole_layers)


def smallest_memory(bg: nx.DiGraph, cluster: Cluster, training: Training, solver: str = "cbc",
                    target_blocks: int | None = None, deadline: float | None = None) -> float:
    """The least memory per device any layout of :func:`plan_block_graph` needs for ``bg`` with ``training``, under
    the upper memory model: the figure :class:`MemoryTooSmall` reports, for other training settings (``opsched plan``
    asks it with Adam's state in BF16 when nothing fits in FP32). Past ``deadline`` the layouts not yet tried are
    left out (infinite when none was tried).
    """
    all_layouts = layouts(cluster)
    small, _ = _reduced(bg, all_layouts, target_blocks)
    table = CostTable(small, cluster, training)  # the least memory is its own MIP: no memory limit is needed
    return _smallest_memory({str(lay): upper_problem(small, lay, cluster, training, table=table)
                             for lay in all_layouts}, solver, deadline)[0]


def _smallest_memory(problems: dict[str, UpperProblem], solver: str,
                     deadline: float | None = None) -> tuple[float, int]:
    """(the least memory per device the layouts tried need under the upper memory model, how many were tried):
    every layout, unless ``deadline`` (a :func:`time.monotonic` instant) passes first."""
    best, tried = math.inf, 0
    for p in problems.values():
        left = math.inf if deadline is None else deadline - time.monotonic()
        if left <= 0.0:
            break
        tried += 1
        try:
            best = min(best, run_isolated(minimum_memory, p, solver=solver,
                                          time_limit=min(SMALLEST_MEMORY_SECONDS, left), timeout=min(30.0, left + 5)))
        except SolverCrash:
            continue
    return best, tried


def _nothing_fits(problems: dict[str, UpperProblem], solver: str, clock: Clock, limit: float,
                  cluster: Cluster) -> MemoryTooSmall:
    """The error when no layout fits in ``limit``: with the smallest memory that works, as far as the time limit
    lets the layouts be tried."""
    smallest, tried = _smallest_memory(problems, solver, clock.deadline)
    if tried == len(problems):
        return _too_small("no layout fits in", smallest, limit, cluster)
    if tried == 0 or smallest == math.inf:
        return MemoryTooSmall(f"no layout fits in {bytes_text(limit)} per device (the time limit was spent before "
                              "the least memory that works was found)", math.inf)
    return MemoryTooSmall(f"no layout fits in {bytes_text(limit)} per device; the least memory among the "
                          f"{tried} of {len(problems)} layouts tried before the time limit is about "
                          f"{bytes_text(smallest)} ({memory_hint(smallest, cluster)})", smallest)
