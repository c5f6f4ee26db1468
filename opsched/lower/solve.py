"""The lower level's entry point: :func:`solve` a StageGraph's microbatch schedule.

Pipeline of the solve (each step is anytime; the best order so far is kept):

1. check the memory limit against the minimum any schedule needs;
2. a proven combinatorial lower bound (:mod:`opsched.lower.bounds`);
3. incumbents: the caller's warm orders (the planner and ``opsched compare``
   pass every hand-written baseline that applies, see
   :func:`opsched.baselines.baseline_orders`) and several list-scheduler
   variants, those that fit in memory; the best is the warm start;
4. when the whole time-indexed MIP is small enough, solve it warm-started
   (its bound counts when the slot divides every time exactly and its problem
   holds every schedule of the graph, see ``_mip_covers_every_schedule``);
5. large-neighbourhood search over time windows until the lower bound, its
   budget of sub-MIPs, or no window helps;
6. the final order re-timed in continuous time by the simulator, the overlapped
   pairs it does not need for its makespan parted (:mod:`opsched.lower.parting`),
   and validated.

Steps 3 to 5 run in a watched child process (:func:`opsched.solving.isolate.run_isolated`)
that sends every new best order and every raised bound here as it finds
them. The time limit is a hard limit on the whole solve: at its deadline the
child is stopped, and the result is built from the last order it sent. A
native solver crash costs the same: the search so far is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from opsched.errors import NoScheduleInTime, OpschedError
from opsched.solving.isolate import SolverCrash, TimedOut, run_isolated
from opsched.lower.bounds import lower_bound as combinatorial_bound
from opsched.lower.bounds import own_orders_hold_every_schedule, span_lower_bound
from opsched.lower.jobs import JobSet, activation_budgets, check_memory_limit, noise, order_fits
from opsched.lower.search_state import _News, _proven, _Search, _Watch
from opsched.lower.starts import _best_start, _first_start, _fitting, _pairs_searched, _start_pool
from opsched.lower.listsched import Variant
from opsched.lower.pairing import pair_up
from opsched.lower.parting import part_pairs
from opsched.lower.lns import (
    Incumbent,
    SECONDS_PER_SOLVE,
    SUBMIP_VARIABLES,
    SearchLog,
    SearchOptions,
    better,
    incumbent_of,
    large_neighbourhood_search,
    objective_value,
    pair_count,
    slotted_starts,
)
from opsched.lower.timeindexed import (
    HorizonTooShort,
    auto_slot,
    full_windows,
    model_size,
    slotted_times,
    slot_problem,
)
from opsched.lower.slot_solve import solve_slot_problem, starts_to_order
from opsched.schedule import Order, PassKind, Schedule, StageGraph, jobs_of, simulate, validate
from opsched.solving.solver import Objective, Status, objective_of, require

log = logging.getLogger(__name__)

#: the whole MIP is tried when it has at most this many step variables
FULL_MODEL_VARIABLES = 4000
#: node limit of the whole MIP (a deterministic budget; the time limit only stops it when it binds)
FULL_MODEL_NODES = 2000
#: neighbourhood sub-MIPs with pair options start at about this many variables (SUBMIP_VARIABLES, 800, without):
#: CBC needed 5-14 s for 600-variable windows of paired orders, about 1 s at this size
PAIR_SUBMIP_VARIABLES = 300
#: default number of neighbourhood sub-MIPs (a deterministic budget; see :func:`solve`)
SEARCH_BUDGET = 100
#: sub-MIPs of the search that thins overlapped pairs at the best makespan (:func:`_thin_pairs`; a deterministic
#: budget): on the DualPipe grid's V at D=8, M=16, 2:2:1, gain 1 (144, 124 pairs after the search) 30 of them
#: left 118 pairs, 50 left 113 (3 s) and 100 left 112; each pair parted there is 2 device-time units less idle
THINNING_BUDGET = 50
#: each of its sub-MIPs stops after this many seconds (the search proper's 5 s is for windows that may shorten the
#: step; here the makespan is reached, and CBC's root on a window with pair options can take seconds): a clock cap,
#: so the result then says the clock decided it
THINNING_SECONDS_PER_SOLVE = 1.0
#: and it stops after this many sub-MIPs in a row parted nothing (a tight schedule has no pair to spare: issue 11's
#: first command, 75 proven optimal with 90 pairs, spent 18 s on 50 that parted none, 6 s with this stop; with 10
#: the D=8, M=16, 2:2:1, gain 1 case above stopped before its first window that parts a pair)
THINNING_PATIENCE = 20
#: what a status cut by these clock caps names (:meth:`opsched.lower.search_state._Search.cut`)
SEARCH_CUT = f"a sub-MIP of the neighbourhood search stopped at its {SECONDS_PER_SOLVE:g} s cap"
THINNING_CUT = f"a sub-MIP thinning pairs stopped at its {THINNING_SECONDS_PER_SOLVE:g} s cap"
#: what the end of a solve costs here (re-timing and validating the final order: 0.16-0.38 s for 3,072 jobs with
#: the cores shared three ways, about what building the job set and its bounds took), estimated as this many
#: times that setup, which a loaded machine stretches alike; the search stops that much before the limit, but
#: never more than :data:`RESERVE_SHARE` of it (5 % before: a 1.5 s limit kept 0.075 s, and ran 1.3 s over in CI)
RESERVE_FACTOR = 1.5
#: and, when the order may hold overlapped pairs, parting those it does not need (:mod:`opsched.lower.parting`:
#: one sweep and one more simulation, 0.55 s against a setup of 0.41 s for 4,472 jobs on the DualPipe grid)
PARTING_FACTOR = 1.5
RESERVE_SHARE = 0.25
#: the search stops itself this long before it would be stopped (seconds, and at most this share of the limit)
GRACE = 1.0
GRACE_SHARE = 0.02


@dataclass(frozen=True)
class LowerOptions:
    """How :func:`solve` (and :func:`prospect`, and a search over placements) treat a stage graph: one record for
    the options every layer passes on (a caller changes a field with :func:`dataclasses.replace`)."""

    memory_limit: float | None = None
    """Bytes per device for parameters plus activations (``None``: unlimited); below
    :func:`opsched.lower.jobs.minimum_memory_limit` the solve raises :class:`opsched.lower.jobs.MemoryTooSmall`."""
    split_backward: bool = True
    """Each backward as its input-gradient I and weight-gradient W jobs (Zero Bubble's split); False: fused B."""
    allow_pairs: bool = True
    """Overlapped F&B pairs (DualPipe's) may be searched where the stage graph's pair times allow them."""
    slot: float | None = None
    """The time-indexed MIP's slot (``None``: :func:`opsched.lower.timeindexed.auto_slot`)."""
    time_limit: float = 30.0
    """Seconds of wall clock for the whole solve, a hard limit (see :func:`solve`)."""
    solver: str = "cbc"
    """The MIP solver python-mip drives (``cbc`` or ``highs``)."""
    threads: int = 1
    """Solver threads per sub-MIP."""
    warm_orders: dict[str, Order] | None = None
    """Starting orders, tried in the order given (ties keep the earliest), each kept only when it runs the same
    jobs and fits in memory; with ``split_backward`` a fused B is replaced by its I then its W. The lower level
    knows no hand-written schedule itself: callers pass them (:func:`opsched.baselines.baseline_orders`)."""
    objective: Objective | str = Objective.MAKESPAN
    """:attr:`Objective.MAKESPAN`, or :attr:`Objective.ZB_SPAN`, the Zero Bubble paper's cost (the longest device
    span from its first F to its last W or B); the bound and gap refer to it."""
    search_budget: int | None = SEARCH_BUDGET
    """Neighbourhood sub-MIPs (``None``: until a sweep at full width finds nothing): work, not time, decides."""
    thin: bool = True
    """With pairs (makespan objective), end by thinning the best order's pairs at its makespan while time is left
    (:func:`thin_pairs`, which a search over placements runs on the winner only)."""
    fallback: bool = True
    """When the search sent no order by its stop (a clock or a crash), make the first start that fits after the
    stop; False raises :class:`opsched.errors.NoScheduleInTime` instead, for a caller with a schedule in hand."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "objective", objective_of(self.objective))


@dataclass
class LowerResult:
    """What :func:`solve` returns; times are in the StageGraph's units."""

    schedule: Schedule
    order: Order
    lower_bound: float
    gap: float
    solver: str
    solve_seconds: float
    status: Status
    warm_start: str
    log: list[tuple[float, float, float]] = field(default_factory=list)
    slot: float | None = None
    candidates: dict[str, float] = field(default_factory=dict)
    #: neighbourhood sub-MIPs solved (at most ``search_budget``)
    search_solves: int = 0
    #: what was minimised, and its value for ``schedule`` (``lower_bound`` and ``gap`` refer to it)
    objective: Objective = Objective.MAKESPAN
    value: float = 0.0
    #: overlapped pairs of the search's best order run one job after the other in ``schedule``: the makespan
    #: did not need them (:func:`opsched.lower.parting.part_pairs`)
    pairs_parted: int = 0
    #: with :attr:`Status.TIME_LIMIT`, what stopped the work: the time limit, or the first clock cap inside the
    #: search that bound (its result may vary from machine to machine); else ""
    cut_by: str = ""

    @property
    def makespan(self) -> float:
        return self.schedule.makespan



def solve(sg: StageGraph, microbatches: int, options: LowerOptions | None = None, /, **changes) -> LowerResult:
    """Find a short schedule of every job within the memory limit, with a proven lower bound.

    ``options`` (a :class:`LowerOptions`; keyword ``changes`` replace its fields, so
    ``solve(sg, 4, time_limit=5)`` is ``solve(sg, 4, LowerOptions(time_limit=5))``) say what the fields mean.
    Below :func:`opsched.lower.jobs.minimum_memory_limit` it raises
    :class:`opsched.lower.jobs.MemoryTooSmall` naming that minimum.

    Time: ``time_limit`` (seconds of wall clock) bounds the whole solve: the
    search runs in a child process that sends each better order as it finds
    it, and at the limit the last order sent is the result, re-timed and
    validated here, with :attr:`Status.TIME_LIMIT` (a native crash of the
    child keeps it too, with :attr:`Status.ERROR`). Determinism: the work is
    counted, not timed (list-scheduler variants, :data:`FULL_MODEL_NODES`
    nodes of the whole MIP, ``search_budget`` sub-MIPs; ``None``: until a
    sweep at full width finds nothing), so the result depends on the machine
    only when a clock stopped the work, and then the status says so.
    Otherwise ``status`` is :attr:`Status.OPTIMAL` (the bound is reached) or
    :attr:`Status.FEASIBLE`. The bound reported is always proven.
    docs/formulation.md, "Solution method", has the details. Progress goes
    to this module's logger.

    >>> from opsched.schedule import chain_stage_graph
    >>> r = solve(chain_stage_graph(2, f=1, b=2, w=1), 4, time_limit=5)
    >>> r.makespan, r.lower_bound, r.status
    (13.0, 13.0, <Status.OPTIMAL: 'optimal'>)
    """
    t0 = time.monotonic()
    o = dataclasses.replace(options or LowerOptions(), **changes)
    _check_arguments(o.solver, o.time_limit, o.slot)
    check_memory_limit(sg, microbatches, o.memory_limit)
    js = JobSet(sg, microbatches, o.split_backward)
    budgets = activation_budgets(sg, o.memory_limit)
    bound = _proven_bound(js, budgets, o.objective)
    search_bound = _search_bound(js, budgets, o.objective, bound, o.allow_pairs)
    setup = time.monotonic() - t0
    watch = _Watch(t0, bound)
    stop, deadline = _stop_and_deadline(t0, o.time_limit, setup, _pairs_searched(js, o.allow_pairs))
    crash = _run_search(watch, stop, _search, js, budgets, o, bound, search_bound, deadline)
    # work that ran up to the deadline was cut by it (every loop of the search checks it)
    cut = watch.done is None or watch.done >= deadline
    if watch.order is None:  # nothing came in time: a cheap order, made here
        _fall_back(watch, js, budgets, o, crash)
    return _result(watch, js, o.memory_limit, o.objective, o.solver, o.time_limit if cut else None, crash)



def _fall_back(watch: _Watch, js: JobSet, budgets, o: LowerOptions, crash: str | None) -> None:
    """Put the first start that fits in ``watch`` when the search sent no order by its stop (a clock or a crash), so
    that a solve always returns a schedule; without ``fallback``, raise :class:`NoScheduleInTime` instead."""
    what = "crashed" if crash else "had found nothing by the time limit"
    if not o.fallback:
        raise NoScheduleInTime(f"no schedule: its search {what} ({o.time_limit:.3g} s)")
    watch.start, watch.order = _first_start(js, budgets, o.allow_pairs, o.warm_orders)
    log.info("[lower] the search %s: the result is the first start that fits, %s", what, watch.start)

class Prospect(NamedTuple):
    """What a solve of one stage graph could reach at best, and what it starts from, before any search."""

    #: the proven lower bound (the solve's own) of every schedule of the graph at that memory
    lower_bound: float
    #: the least objective value of a warm order that runs the graph's jobs and fits (``None``: none does), and its
    #: name; the solve's result is never worse, unless a clock cuts it before it has timed its starts
    warm_value: float | None
    warm_name: str | None
    #: wall seconds the prospect took (set by its caller): about what a solve of the graph spends besides its search
    #: (the same job set and bound, and a simulation of its start), so a search over graphs gives none too little time
    seconds: float = 0.0


def prospect(sg: StageGraph, microbatches: int, options: LowerOptions | None = None, /, **changes) -> Prospect:
    """The bound :func:`solve` would report for ``sg`` and the best of ``warm_orders`` it would start from, without
    solving: a search over several stage graphs gives its time to those that can still beat what it has in hand.

    ``options`` as :func:`solve`'s (its time, solver and search fields are not used). Raises
    :class:`opsched.lower.jobs.MemoryTooSmall` as :func:`solve` does.

    >>> from opsched.baselines import baseline_order
    >>> from opsched.schedule import chain_stage_graph
    >>> sg = chain_stage_graph(2, f=1, b=2, w=1)
    >>> p = prospect(sg, 4, warm_orders={"gpipe": baseline_order("gpipe", sg, 4)})
    >>> p.lower_bound, p.warm_value, p.warm_name
    (13.0, 14.0, 'gpipe')
    """
    o = dataclasses.replace(options or LowerOptions(), **changes)
    check_memory_limit(sg, microbatches, o.memory_limit)
    js = JobSet(sg, microbatches, o.split_backward)
    budgets = activation_budgets(sg, o.memory_limit)
    best: tuple[float, str] | None = None
    for name, order in _start_pool(js, budgets, o.allow_pairs, o.warm_orders):
        if isinstance(order, Variant):
            break  # the warm orders come first; list-scheduler variants are the solve's own work
        events = _fitting(js, budgets, o.allow_pairs, order)
        if events is not None:
            value = objective_value(js, events, o.objective)
            if best is None or value < best[0] - noise(best[0]):
                best = (value, name)
    return Prospect(_proven_bound(js, budgets, o.objective), *(best or (None, None)))


def _proven_bound(js: JobSet, budgets, objective: Objective) -> float:
    """The bound a solve reports: proven for every schedule of the graph (pairs, fused or split backwards), not only
    those the solve can make."""
    return combinatorial_bound(js, budgets) if objective == Objective.MAKESPAN else span_lower_bound(js)


def _stop_and_deadline(t0: float, time_limit: float, setup: float, pairs: bool) -> tuple[float, float]:
    """When the search process of a solve that began at ``t0`` is stopped, and when it stops itself.

    It is stopped early enough for the end of the solve (re-timing, parting needless ``pairs``, validating) to fit
    in the limit, estimated from the ``setup`` seconds it took to build the job set and its bounds; it stops itself
    a little earlier still, between pieces of work, so that its last news arrives.
    """
    factor = RESERVE_FACTOR + (PARTING_FACTOR if pairs else 0.0)
    stop = t0 + float(time_limit) - min(RESERVE_SHARE * float(time_limit), factor * setup)
    return stop, stop - min(GRACE_SHARE * float(time_limit), GRACE)


def _run_search(watch: _Watch, stop: float, search: Callable[..., _News], *args) -> str | None:
    """Run ``search(*args)`` in a watched child until ``stop``; its news reach ``watch`` as they come.

    Returns the crash message when native code aborted the child (the
    search so far is kept), else ``None``; at ``stop`` (or a hang until
    then) the child is stopped and the last order it sent is the result.
    """
    if stop <= time.monotonic():
        return None
    try:
        watch.receive(run_isolated(search, *args, timeout=stop - time.monotonic(), on_report=watch.receive))
    except TimedOut:
        pass
    except SolverCrash as exc:
        return str(exc)
    return None


def _search(js: JobSet, budgets, o: LowerOptions, bound: float, search_bound: float, deadline: float,
            report: Callable[[_News], None]) -> _News:
    """Steps 3 to 5 of :func:`solve`, in its search process: every new best order goes to ``report`` at once.

    Returns the last news (``done``). Stops itself at ``deadline`` between
    pieces of work (the solve stops the process there anyway).
    """
    run = _Search(js, budgets, o.objective, o.solver, o.threads, deadline, bound, report, search_bound=search_bound)
    name, start, _ = _best_start(run, o.allow_pairs, o.warm_orders)
    best = incumbent_of(js, start, o.objective)
    pairs = _pairs_searched(js, o.allow_pairs)
    slot = o.slot or auto_slot(js.sg, best.makespan, pairs=pairs)
    run.pairs = pairs  # an inexact slot rounds pair lengths up, as it does every pass (pair_length)
    if pair_count(start) and not run.pairs:  # the MIP cannot move these pairs: the order is kept as it is
        run.send(f"warm start {name}")
        return run.news(done=True)
    run.best = best
    run.send(f"warm start {name}")
    if not run.searched_out():
        run.slot = slot
        _solve_whole_mip(run)
    if not run.searched_out():
        _neighbourhood_search(run, o.search_budget)
    if run.pairs and run.objective == Objective.MAKESPAN and not run.searched_out():
        _pair_up_the_best(run)
    if o.thin and run.pairs and run.objective == Objective.MAKESPAN:
        _thin_pairs(run, slot)
    return run.news(done=True)


def _pair_up_the_best(run: _Search) -> None:
    """The end of phase 5: pairs merged on the best order's critical path (:func:`pair_up`) while time is left,
    kept when they shorten it."""
    if time.monotonic() >= run.deadline:
        return
    paired = pair_up(run.js, run.best.order, run.budgets, deadline=run.deadline)
    run.cut("the deadline stopped pairing up the best order", paired.cut)
    if paired.merges:
        inc = paired.incumbent  # valued by the makespan, the objective here
        # only a shorter schedule is worth more pairs here: a lower sum of job ends alone is not
        if inc.value < run.best.value - noise(run.best.value):
            run.best = inc
            run.improved(inc.order, inc.value)
            run.send(f"{paired.merges} pairs merged on the critical path")


def thin_pairs(sg: StageGraph, microbatches: int, result: LowerResult, *, memory_limit: float | None = None,
               time_limit: float = 30.0, solver: str = "cbc", threads: int = 1) -> LowerResult:
    """``result`` (a makespan solve of ``sg``, made with ``thin=False``) with its overlapped pairs thinned at its
    makespan (:func:`_thin_pairs`) within ``time_limit`` seconds of wall clock, in a watched child as :func:`solve`.

    The makespan and bound stay; the status is the solve's, or :attr:`Status.TIME_LIMIT` when the clock cut the
    thinning of a result that is not proven optimal (its pairs then depend on the machine). A result without
    pairs, or of another objective, comes back as it is.
    """
    if result.objective != Objective.MAKESPAN or not pair_count(result.order) or time_limit <= 0:
        return result
    t0 = time.monotonic()
    split = not any(job.pass_ == PassKind.B for acts in result.order.values() for a in acts for job in jobs_of(a))
    js = JobSet(sg, microbatches, split)
    budgets = activation_budgets(sg, memory_limit)
    stop, deadline = _stop_and_deadline(t0, time_limit, time.monotonic() - t0, pairs=True)
    watch = _Watch(t0, result.lower_bound, order=result.order, value=result.value, start=result.warm_start)
    slot = result.slot or auto_slot(sg, result.makespan, pairs=True)
    crash = _run_search(watch, stop, _thinning, js, budgets, solver, threads, result.order, result.lower_bound,
                        slot, deadline)
    cut = watch.done is None or watch.done >= deadline
    thinned = _result(watch, js, memory_limit, Objective.MAKESPAN, solver, time_limit if cut else None, crash)
    if thinned.value > result.value + noise(result.value):  # pragma: no cover - the thinning keeps the makespan
        raise AssertionError(f"thinning pairs lengthened the schedule: {thinned.value} > {result.value}")
    status, cut_by = result.status, result.cut_by
    if thinned.status not in (Status.OPTIMAL, Status.FEASIBLE):
        status, cut_by = thinned.status, thinned.cut_by
        if cut and status == Status.TIME_LIMIT:  # its limit is the time the solves before it left, not the user's
            cut_by = f"the {time_limit:.3g} s left for thinning pairs"
    return dataclasses.replace(
        result, schedule=thinned.schedule, order=thinned.order, status=status, cut_by=cut_by,
        solve_seconds=result.solve_seconds + thinned.solve_seconds, log=result.log + thinned.log,
        pairs_parted=result.pairs_parted + thinned.pairs_parted,
    )


def _thinning(js: JobSet, budgets, solver: str, threads: int, order: Order, bound: float, slot: float,
              deadline: float, report: Callable[[_News], None]) -> _News:
    """:func:`thin_pairs`'s search process: :func:`_thin_pairs` from ``order``."""
    run = _Search(js, budgets, Objective.MAKESPAN, solver, threads, deadline, bound, report)
    run.best, run.pairs, run.slot = incumbent_of(js, order), True, slot
    run.value = run.best.value
    _thin_pairs(run, slot)
    return run.news(done=True)


def _thin_pairs(run: _Search, slot: float) -> None:
    """Phase 6: the best order's makespan with fewer overlapped pairs, by the neighbourhood search thinning pairs
    (:func:`large_neighbourhood_search` with ``fewer_pairs``) within :data:`THINNING_BUDGET` sub-MIPs, while time
    is left.

    A pair costs what overlap costs in a real run (:mod:`opsched.lower.parting`); the search proper forms pairs
    wherever they let work end earlier, and the solve's parting step can part only those whose two jobs fit one
    after the other where they are. Here a window's jobs move so that more of them fit. Runs on a proven optimum
    too: the makespan stays, the pairs may not have to."""
    if time.monotonic() >= run.deadline or run.best is None or not pair_count(run.best.order):
        return
    thinning = SearchLog()
    before = pair_count(run.best.order)

    def thinned(inc: Incumbent) -> None:  # fewer pairs (or, rarely, a shorter schedule)
        run.improved(inc.order, inc.value)
        run.cut(THINNING_CUT, thinning.timed_out)
        run.send(f"thinning pairs: {pair_count(inc.order)} of {before} left")

    run.best = large_neighbourhood_search(
        run.js, run.best, slot, run.budgets, deadline=run.deadline, log=thinning, on_improve=thinned,
        options=SearchOptions(solver=run.solver, threads=run.threads, objective=run.objective,
                              max_solves=THINNING_BUDGET, pairs=True, fewer_pairs=True,
                              max_variables=PAIR_SUBMIP_VARIABLES, max_seconds_per_solve=THINNING_SECONDS_PER_SOLVE,
                              patience=THINNING_PATIENCE),
    )
    run.cut(THINNING_CUT, thinning.timed_out)



def _search_bound(js: JobSet, budgets, objective: Objective, bound: float, allow_pairs: bool) -> float:
    """A bound on the orders the search reaches, where it may stop.

    ``bound`` itself when every schedule is such an order, or when the search
    may use pairs; else the same combinatorial bounds on ``js`` as it is,
    without pair shares (the search makes ``js``'s jobs one at a time).
    """
    if own_orders_hold_every_schedule(js) or _pairs_searched(js, allow_pairs):
        return bound
    if objective == Objective.MAKESPAN:
        return combinatorial_bound(js, budgets, own_orders=True)
    return span_lower_bound(js, own_orders=True)


def _check_arguments(solver: str, time_limit: float, slot: float | None) -> None:
    require(solver)
    if not time_limit > 0 or math.isinf(time_limit):
        raise OpschedError(f"time limit must be a positive number of seconds, got {time_limit}")
    if slot is not None and slot <= 0:
        raise OpschedError(f"slot must be positive, got {slot}")


def _solve_whole_mip(run: _Search) -> None:
    """Phase 4: the whole time-indexed MIP, warm-started, when it is small enough; may raise the bounds.

    With an exact slot its bound holds for the orders the search can reach
    (``search_bound``: the search stops there), and when its problem holds
    every schedule of the graph it is also reported (``bound``).
    """
    # it has no pair options: where pairs are searched it can neither prove a bound nor move a pair, and on the
    # pairs property tests' 62 instances small enough for it it never improved the start while taking 85 s of CBC
    # (29 s of a 60 s limit on one 1,092-variable span case)
    if run.pairs:
        return
    js, best = run.js, run.best
    exact = _divides(run.slot, js.sg)
    sp = slot_problem(js, run.slot, run.budgets)
    starts = slotted_starts(js, best.order, run.slot)
    horizon = max(s + sp.p[k] for k, s in starts.items())
    try:
        full_windows(sp, horizon)
    except HorizonTooShort:
        return
    if model_size(sp) > FULL_MODEL_VARIABLES:
        return
    if time.monotonic() >= run.deadline:
        run.cut("the deadline came before the whole MIP")
        return
    # the symmetry rows may cut off the incumbent's start slots: then it starts cold
    out = solve_slot_problem(
        sp, incumbent=starts, solver=run.solver, threads=run.threads,
        time_limit=max(0.05, 0.5 * (run.deadline - time.monotonic())), max_nodes=FULL_MODEL_NODES,
        objective=run.objective, flow=run.objective != Objective.MAKESPAN,
    )
    run.cut("the whole MIP stopped at its cap, half the time left", out.timed_out)
    if out.starts is not None:
        cand = incumbent_of(js, starts_to_order(js, out.starts), run.objective)
        if better(cand, best) and order_fits(js.sg, cand.order, run.budgets):
            run.best = cand
            run.improved(cand.order, cand.value)
    proven = out.objective if out.status == Status.OPTIMAL else out.bound
    if exact and proven is not None and out.status in (Status.OPTIMAL, Status.FEASIBLE, Status.NO_SOLUTION):
        # slotted objectives are whole slots; a flow tie-breaker adds less than one slot
        whole = math.ceil(proven - 1e-6) if run.objective == Objective.MAKESPAN else math.floor(proven + 1e-6)
        run.search_bound = max(run.search_bound, whole * run.slot)
        if _mip_covers_every_schedule(js, run.objective):
            run.bound = max(run.bound, whole * run.slot)
    run.send(f"full MIP ({out.variables} variables, {out.status})")


def _neighbourhood_search(run: _Search, search_budget: int | None) -> None:
    """Phase 5: large-neighbourhood search over time windows of the best order."""
    search = SearchLog()

    def improved(inc: Incumbent) -> None:
        run.improved(inc.order, inc.value)
        run.solves = search.solves
        run.cut(SEARCH_CUT, search.timed_out)
        run.send("neighbourhood search")

    def solved(progress: SearchLog) -> None:  # the count of sub-MIPs reaches the solve even when it is stopped
        run.solves = progress.solves
        run.cut(SEARCH_CUT, progress.timed_out)
        run.send()

    run.best = large_neighbourhood_search(
        run.js, run.best, run.slot, run.budgets, deadline=run.deadline, log=search, on_improve=improved,
        on_solve=solved,
        options=SearchOptions(solver=run.solver, threads=run.threads, target=max(run.bound, run.search_bound),
                              objective=run.objective, max_solves=search_budget, pairs=run.pairs,
                              max_variables=PAIR_SUBMIP_VARIABLES if run.pairs else SUBMIP_VARIABLES),
    )
    run.cut(SEARCH_CUT, search.timed_out)
    run.solves = search.solves


def _result(
    watch: _Watch, js: JobSet, memory_limit: float | None, objective: Objective, solver: str,
    cut_at: float | None, crash: str | None,
) -> LowerResult:
    """Phase 6: the last order re-timed in continuous time, its needless pairs parted, validated, with its bound,
    gap and status.

    ``cut_at``: the time limit when it stopped the search (else ``None``);
    ``crash``: what happened to a search process that crashed.
    """
    sg, order = js.sg, watch.order
    events = simulate(sg, order, js.microbatches)
    parted = 0
    if objective == Objective.MAKESPAN and pair_count(order):
        # pairs where a device would wait anyway are parted: the same makespan with fewer pairs (parting.py)
        result = part_pairs(js, order, events=events)
        order, events, parted = result.order, result.events, result.count
        if parted:
            log.info("[lower] %7.2fs  parted %d overlapped pairs the makespan does not need",
                     time.monotonic() - watch.started, parted)
    schedule = Schedule(sg, js.microbatches, events, memory_limit=memory_limit, name="mip")
    validate(schedule)  # the order came from another process: the one validator checks it
    value = objective_value(js, events, objective)
    bound = min(watch.bound, value)  # float noise only: the bound is proven
    gap = (value - bound) / value if value > 0 else 0.0
    if _proven(value, bound):
        status, cut_by, note = Status.OPTIMAL, "", ""
    elif crash:
        status, cut_by, note = Status.ERROR, "", f" ({crash}; the best schedule it had sent is kept)"
    elif cut_at is not None:
        status, cut_by = Status.TIME_LIMIT, f"the {cut_at:g} s limit"
        note = f" ({cut_by} stopped the search; the best schedule found by then)"
    elif watch.clock_cut:
        status, cut_by = Status.TIME_LIMIT, watch.clock_cut
        note = f" ({cut_by}; the result may vary)"
    else:
        status, cut_by, note = Status.FEASIBLE, "", ""
    watch.bound = bound
    watch.line(value, str(status) + note)
    return LowerResult(
        schedule=schedule,
        order=order,
        lower_bound=bound,
        gap=gap,
        solver=solver,
        solve_seconds=time.monotonic() - watch.started,
        status=status,
        warm_start=watch.start,
        log=watch.log,
        slot=watch.slot,
        candidates=watch.candidates,
        search_solves=watch.solves,
        objective=objective,
        value=value,
        pairs_parted=parted,
        cut_by=cut_by,
    )


def _mip_covers_every_schedule(js: JobSet, objective: Objective) -> bool:
    """Whether the slotted MIP's problem holds every schedule any method could make, so its bound is one.

    The MIP schedules ``js``'s jobs one at a time. That misses schedules with
    overlapped pairs (a positive overlap gain), split schedules when ``js`` is
    fused (deferring W can only help), fused ones when a measured B is shorter
    than I + W, and, for the span objective, schedules longer than the MIP's
    horizon (a shorter span may need a longer makespan). Then only the
    combinatorial bounds count.
    """
    return objective == Objective.MAKESPAN and own_orders_hold_every_schedule(js)


def _divides(slot: float, sg) -> bool:
    """Whether ``slot`` divides every pass and transfer time exactly (so slotting loses nothing)."""
    # zero times divide by any slot: the positive ones decide
    return all(abs(v / slot - round(v / slot)) <= 1e-7 * max(1.0, v / slot) for v in slotted_times(sg))


