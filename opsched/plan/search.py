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
import time
from contextlib import contextmanager
from dataclasses import dataclass

import networkx as nx

from opsched.baselines import baseline_orders
from opsched.cost.cluster import Cluster, Training, with_devices
from opsched.plan.branches import chain_only, has_parallel_blocks, has_parallel_towers, heaviest_fork
from opsched.plan.alternatives import idle_and_every_device_plan, side_by_side_plan
from opsched.plan.plan_records import (NO_FIT, Baseline, Candidate, FewerNodesPlan, LowerJob, LowerOutcome, Option,
                                       PlanResult, _half_option)
from opsched.plan.runtime_filter import RuntimeFilter, _baseline_option, _job_blocks, _job_name
from opsched.plan.smallest_memory import _nothing_fits, _reduced, _too_small
from opsched.errors import MemoryTooSmall, NoRunnablePlan
from opsched.export.runtimes import Runtime, runtime_named
from opsched.solving.isolate import Call, SolverCrash, run_isolated_all
from opsched.lower import LowerOptions, minimum_memory_limit, solve
from opsched.schedule import Order, Schedule, StageGraph, metrics, order_from_schedule, validate
from opsched.solving.solver import require
from opsched.units import bytes_text, plain, plural, seconds_text
from opsched.upper.layouts import describe_layout, layouts
from opsched.upper.mip import (
    CostTable,
    UpperProblem,
    UpperSolution,
    contiguous_start,
    estimate,
    solve_upper,
    towers_start,
    upper_problem,
)
from opsched.upper.constraints import floor_over
from opsched.upper.stages import build_stage_graph

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the search


#: the lower MIP schedules at most this many upper solutions, those whose
#: estimate is within this factor of the best estimate
LOWER_AT_MOST = 10
LOWER_WITHIN = 1.15


@dataclass(frozen=True)
class PlanOptions:
    """How :func:`plan_block_graph` searches: ``opsched plan``'s search flags, typed (the model, the cluster and the
    training settings are its arguments)."""

    memory_limit: float | None = None
    """Bytes per device for parameters, gradients, optimizer state and activations; None: the cluster's memory."""
    time_limit: float = 60.0
    """Seconds of wall clock for the whole search (used when ``deadline`` is None)."""
    deadline: float | None = None
    """A :func:`time.monotonic` instant the search ends by; None: now + ``time_limit``."""
    solver: str = "cbc"
    """The MIP solver (:data:`opsched.solving.solver.SOLVERS`)."""
    keep: int = 2
    """How many of the best lower-level candidates get the longer solves."""
    target_blocks: int | None = None
    """The reduced block graph's size for the upper MIP; None: chosen from the layouts."""
    workers: int = 1
    """Solves run at once, each in its own process with its own work budget (the same plan sooner)."""
    runtime: str | None = None
    """Only plans this runtime (:data:`opsched.export.runtimes.RUNTIMES`) can run; None: any."""
    branches: bool = True
    """False: the model as one chain of blocks (``plan --branches off``)."""
    layouts_run_today: list[Baseline] | None = None
    """Megatron-style layouts found before the search (``plan_with_optimizer_state``), offered as baselines."""
    found_elsewhere: bool = False
    """The caller holds a plan already (the search on half the nodes, or as a chain): past the deadline no step
    runs on to find one to fall back on."""
    least_memory_if_none_fits: bool = True
    """When nothing fits, the refusal names the least memory that works (least-memory MIPs, in the time left);
    False for a caller that plans again on less memory (recomputation) and would rather have that time."""


def plan_block_graph(bg: nx.DiGraph, cluster: Cluster, training: Training,
                     options: PlanOptions = PlanOptions()) -> PlanResult:
    """Plan ``bg`` on ``cluster`` (see the module docstring) within ``options.time_limit`` seconds of wall clock.

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
    one chain of blocks (:func:`opsched.plan.branches.chain_only`): a sequential pipeline. ``found_elsewhere``:
    the caller holds a plan already (this is the search on half the nodes, or as a chain), so past the deadline
    no step runs on to find one to fall back on.
    """
    o = options
    require(o.solver)
    if not o.branches:
        bg = chain_only(bg)
    asked, training = _for_runtime(o.runtime, training)
    limit = float(cluster.memory_bytes if o.memory_limit is None else o.memory_limit)
    t_start = time.perf_counter()
    full = time.monotonic() + o.time_limit if o.deadline is None else o.deadline
    as_chain_too = o.branches and has_parallel_blocks(bg)
    clock = _clock_with_branches(bg, full, as_chain_too)
    all_layouts = layouts(cluster)
    # a runtime that builds its stages from whole layers gets only plans that keep them whole
    small, members = _reduced(bg, all_layouts, o.target_blocks, whole_layers=asked is not None and asked.needs_whole_layers)
    _log_layouts(all_layouts, bg, small, clock)
    table = CostTable(small, cluster, training)  # each block costed once per group shape, for every layout
    problems, skipped = _upper_problems(small, all_layouts, cluster, training, limit, table, clock)
    t_prepared, (solutions, candidates) = time.perf_counter(), _solve_layouts(problems, clock, o.solver, o.workers)
    t_upper = time.perf_counter()
    runnable = RuntimeFilter(o.runtime, training, members, bg)
    baselines, best_split, refused = runnable.all_baselines(small, cluster, limit, o.layouts_run_today, table,
                                                            clock.share(BASELINE_SHARE), o.workers,
                                                            o.found_elsewhere)
    t_base = time.perf_counter()
    if not solutions and not baselines:
        runnable.none_left()
        if not o.least_memory_if_none_fits:
            raise MemoryTooSmall(f"no layout fits in {bytes_text(limit)} per device", math.inf)
        raise _nothing_fits(problems, o.solver, clock, limit, cluster)
    jobs, unscheduled = _lower_jobs(solutions, problems, best_split)
    jobs = runnable.jobs(jobs, training.microbatches)
    _schedule_jobs(jobs, training.microbatches, limit, clock, o.solver, o.keep, o.workers)
    found = [_job_option(j) for j in jobs if j.schedule is not None] + [_baseline_option(b) for b in baselines]
    # the searches below are this one's again, on other terms: with no layouts of their own (those are this
    # cluster's), the memory limit resolved, and the clock's deadline
    again = dataclasses.replace(o, memory_limit=limit, layouts_run_today=None)
    t_lower, (half, unsearched) = time.perf_counter(), _plan_on_half_the_nodes(
        bg, cluster, training, limit, clock, t_base - t_upper,
        dataclasses.replace(again, found_elsewhere=o.found_elsewhere or bool(found)))
    found = runnable.options(found) + ([_half_option(half, cluster)] if half is not None else [])
    t_half = time.perf_counter()
    chain = _plan_as_chain(bg, cluster, training, Clock(full), t_prepared - t_start,
                           dataclasses.replace(again, found_elsewhere=o.found_elsewhere or bool(found))
                           ) if as_chain_too else None
    found += [_chain_option(chain)] if chain is not None else []
    if not found:
        smallest = min((minimum_memory_limit(j.stage_graph, training.microbatches) for j in jobs), default=math.inf)
        raise _too_small("no candidate could be scheduled within", smallest, limit, cluster)
    seconds = {"upper": t_upper - t_start, "baselines": t_base - t_upper, "lower": t_lower - t_base,
               "half the nodes": t_half - t_lower, "as a chain": time.perf_counter() - t_half}
    branch_search = "off" if not o.branches else "searched" if has_parallel_towers(bg) else "no towers"
    return _plan_result(found, cluster, training, runnable, candidates + skipped + unscheduled, baselines, refused,
                        blocks=small.number_of_nodes(), seconds=seconds, half=half, unsearched=unsearched, chain=chain,
                        branch_search=branch_search, fork=heaviest_fork(bg) if branch_search == "searched" else None)


def _for_runtime(runtime: str | None, training: Training) -> tuple[Runtime | None, Training]:
    """(the runtime asked for, if any; ``training`` as the search plans it for that runtime): one without context
    parallelism splits no sequence, so its replicas take whole ones, and the search must cost them so."""
    asked = None if runtime is None else runtime_named(runtime)
    if asked is not None and not asked.context_parallel:  # it splits no sequence: replicas take whole ones
        training = dataclasses.replace(training, whole_sequences=True)
    return asked, training


def _plan_result(options: list[Option], cluster: Cluster, training: Training, runnable: RuntimeFilter,
                 candidates: list[Candidate], baselines: list[Baseline], refused: dict[str, str], *, blocks: int,
                 seconds: dict[str, float], half: PlanResult | None, unsearched: int | None,
                 chain: PlanResult | None, branch_search: str,
                 fork: tuple[float, float] | None) -> PlanResult:
    """The fastest of ``options``, validated, as :func:`plan_block_graph` returns it: with every candidate tried
    (``candidates``: those not scheduled, after the runtime's jobs), the idle devices and the alternatives the
    report names (the plan on every device, on half the nodes, as a chain). Kept apart so the search reads as
    its steps."""
    best = min(options, key=lambda o: o.step_time)
    validate(best.schedule)
    idle, every = idle_and_every_device_plan(best, options, cluster.devices)
    return PlanResult(
        schedule=best.schedule,
        metrics=best.metrics,
        source=best.source,
        layout=best.layout,
        step_time=best.step_time,
        grad_sync=best.grad_sync,
        contents=runnable.contents(best),
        candidates=[j.candidate for j in runnable.all_jobs] + candidates,
        baselines=baselines,
        blocks=blocks,
        microbatch_size=best.microbatch_size or training.microbatch_size,
        recompute=best.recompute or training.recompute,
        recompute_modules=training.recompute_modules if best.recompute_modules is None else best.recompute_modules,
        seconds=seconds,
        refused_baselines=refused,
        idle_devices=idle,
        on_every_device=every,
        on_half_the_nodes=None if half is None else FewerNodesPlan.of(half, chosen=best.schedule is half.schedule),
        fewer_nodes_unsearched=unsearched,
        chain_step_time=None if chain is None else chain.step_time,
        branch_search=branch_search,
        side_by_side=side_by_side_plan(best, options) if branch_search == "searched" else None,
        fork_shares=fork,
    )


def _plan_as_chain(bg: nx.DiGraph, cluster: Cluster, training: Training, clock: Clock, prepared: float,
                   options: PlanOptions) -> PlanResult | None:
    """:func:`plan_block_graph` of ``bg`` as one chain (``branches=False``) in the time left, or None (less than
    :data:`LEAST_PART` left, or less than ``prepared``, the seconds the search with branches took to reduce and
    cost the model before its first MIP, which the search as a chain takes again with no clock to stop it; or
    nothing fits): the plan ``--branches off`` finds, when work budgets decide both."""
    if clock.left() < max(LEAST_PART, prepared):
        log.info("plan: not as a chain: the time limit was spent")
        return None
    log.info("plan: now as a chain (the stage graph a sequence, as --branches off), within %s",
             seconds_text(clock.left()))
    try:
        found = plan_block_graph(bg, cluster, training,
                                 dataclasses.replace(options, deadline=clock.deadline, branches=False))
    except (MemoryTooSmall, NoRunnablePlan) as exc:
        log.info("plan: nothing as a chain: %s", exc)
        return None
    log.info("plan: as a chain: %s on %s, step time %s", found.source, found.layout, seconds_text(found.step_time))
    return found


def _clock_with_branches(bg: nx.DiGraph, full: float, as_chain_too: bool) -> Clock:
    """The clock of the search with branches, up to ``full`` (a :func:`time.monotonic` instant)."""
    # with towers, the search as a chain keeps a part of the clock: the search with branches, whose shares are parts
    # of the clock, would otherwise leave it nothing whenever the time limit binds (and lose to --branches off,
    # 0.74x on 2 towers at 32 devices). Experts alone keep the whole clock for the search with branches.
    reserve = CHAIN_SHARE if as_chain_too and has_parallel_towers(bg) else 0.0
    return Clock(time.monotonic() + (1 - reserve) * (full - time.monotonic()))


def _upper_problems(small: nx.DiGraph, all_layouts: list, cluster: Cluster, training: Training, limit: float,
                    table: CostTable, clock: Clock) -> tuple[dict[str, UpperProblem], list[Candidate]]:
    """(layout name -> its placement problem, for the layouts of ``all_layouts`` costed before the deadline (a
    MoE model of 15,000 blocks on 1,024 devices takes about a second each); a candidate row for each other one)."""
    problems = {}
    for lay in all_layouts:
        if clock.left() <= 0.0:  # one problem can take 20 s on 2,048 devices: none is costed past the deadline
            log.info("upper: the time limit was spent: %s not costed", plural(len(all_layouts) - len(problems), "layout"))
            break
        problems[str(lay)] = upper_problem(small, lay, cluster, training, limit, table)
    return problems, [Candidate("upper", str(lay), "skipped: the time limit was spent") for lay in all_layouts
                      if str(lay) not in problems]


def _chain_option(chain: PlanResult) -> Option:
    """The plan as a chain as an option of the plan with branches (its source says so; the layout is left as it
    is, for the readers of layouts); listed last, so a tie keeps the branches'."""
    return chain.as_option(source=f"{chain.source} as a chain")


def _plan_on_half_the_nodes(bg: nx.DiGraph, cluster: Cluster, training: Training, limit: float, clock: Clock,
                            baselines_took: float, options: PlanOptions) -> tuple[PlanResult | None, int | None]:
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
        found = plan_block_graph(bg, half, training, dataclasses.replace(options, deadline=clock.deadline))
    except (MemoryTooSmall, NoRunnablePlan) as exc:
        log.info("plan: nothing on %s devices: %s", plain(half.devices), exc)
        return None, None
    log.info("plan: on %s devices: %s on %s, step time %s", plain(half.devices), found.source,
             found.layout, seconds_text(found.step_time))
    return found, found.fewer_nodes_unsearched


def _log_layouts(all_layouts: list, bg: nx.DiGraph, small: nx.DiGraph, clock: Clock) -> None:
    merged = (f"the model's {bg.number_of_nodes()} blocks merged into {small.number_of_nodes()}"
              if small.number_of_nodes() < bg.number_of_nodes() else f"the model's {bg.number_of_nodes()} blocks")
    log.info("upper: %s to try (%s; `opsched plan --help` explains the notation); %s for the placement MIP; %s",
             plural(len(all_layouts), "layout"), ", ".join(map(str, all_layouts)), merged, clock.left_text())


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
            candidates.append(Candidate("upper", name, NO_FIT))
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
  start with the towers side by side  for a model with parallel towers, each tower on groups of its
                        own; the placement MIP starts from it when its estimate is the better
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


def upper_outcome(start_estimate: float, sol: UpperSolution, start: str = "contiguous start") -> str:
    """What one layout's placement MIP found, as a progress line says it.

    >>> from opsched.solving.solver import Status
    >>> from opsched.upper.layouts import Layout
    >>> sol = UpperSolution(Layout(8, 2), {}, {"step_time": 0.7796}, Status.TIME_LIMIT, 0.0, 1.04, windowed=True)
    >>> upper_outcome(0.7796, sol)
    'estimated step time 779.6 ms, the same as its contiguous start; window search (blocks moved at most 2 stages a round) in 1.04 s, not proven optimal: its share of the time limit ran out first'
    >>> upper_outcome(0.9, UpperSolution(Layout(8, 2), {}, {"step_time": 0.8}, Status.OPTIMAL, 0.8, 0.2))
    'estimated step time 800 ms, down from 900 ms for its contiguous start; MIP in 200 ms, proven optimal'
    """
    if sol.objective < start_estimate * (1 - 1e-6):
        change = f"down from {seconds_text(start_estimate)} for its {start}"
    else:
        change = f"the same as its {start}"
    how = f"window search (blocks moved at most {UPPER_WINDOW} stages a round)" if sol.windowed else "MIP"
    return (f"estimated step time {seconds_text(sol.objective)}, {change}; "
            f"{how} in {seconds_text(sol.solve_seconds)}, {sol.status.meaning}")




def _upper_for_layout(p: UpperProblem, time_limit: float,
                      solver: str) -> tuple[float, UpperSolution, str] | None:
    """(estimate of the start, upper solution, which start) for one layout, or None when nothing fits.

    The start is the better under :func:`estimate` of the contiguous start and, for a model with parallel
    towers, the start with the towers side by side (:func:`opsched.upper.mip.towers_start`): the window search
    moves blocks a few slots a round, so it keeps the shape of its start (towers one after another, or side by
    side), and only a start of each shape lets the estimate choose between them (issue 44: on MMT at 32 devices
    the contiguous starts' estimates were 1.2-4x the side-by-side ones). Ties keep the contiguous start.
    """
    began = time.monotonic()
    if floor_over(p, p.memory_limit):
        return None  # proven: no assignment fits (no start need be built to know it)
    starts = [(CONTIGUOUS_START, contiguous_start(p, solver=solver)), (TOWERS_START, towers_start(p, solver=solver))]
    scored = [(estimate(p, a), name, a) for name, a in starts if a is not None]
    scored = [(est["step_time"], name, a) for est, name, a in scored if est["feasible"]]
    if not scored:
        return None
    first, name, start = min(scored, key=lambda x: x[0])  # min keeps the first of equals: the contiguous start
    window = UPPER_WINDOW if p.layout.slots > WINDOW_ABOVE_SLOTS else None
    left = max(0.05, time_limit - (time.monotonic() - began))  # the start's own solve counts against the limit
    return first, solve_upper(p, time_limit=left, solver=solver, start=start, window=window), name


#: what a progress line calls the start of a layout's placement MIP (see :func:`_upper_for_layout`)
CONTIGUOUS_START = "contiguous start"
TOWERS_START = "start with the towers side by side"


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
    warm_orders: dict[str, Order] = {}
    if warm is not None:
        warm_orders[warm.name or "warm"] = order_from_schedule(warm)
    for name, order in baseline_orders(sg, microbatches).items():
        warm_orders.setdefault(name, order)  # on a name clash the caller's schedule comes first
    with _quiet("opsched.lower"):
        options = LowerOptions(memory_limit=memory_limit, time_limit=time_limit, solver=solver, warm_orders=warm_orders)
        result = solve(sg, microbatches, options if search_budget is None else
                       dataclasses.replace(options, search_budget=search_budget))
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


def _job_option(job: LowerJob) -> Option:
    cand = job.candidate
    return Option(layout=cand.layout, schedule=job.schedule, step_time=cand.step_time, grad_sync=job.grad_sync,
                  source=cand.source, metrics=job.outcome.as_metrics(), stage_blocks=_job_blocks(job))
