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
   budget of sub-MIPs, or no window helps (the time limit is a safety cap);
6. the final order re-timed in continuous time by the simulator.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from opsched.errors import Deadlock, OpschedError
from opsched.lower.bounds import lower_bound as combinatorial_bound
from opsched.lower.bounds import own_orders_hold_every_schedule, span_lower_bound
from opsched.lower.jobs import JobSet, activation_budgets, check_memory_limit, order_fits
from opsched.lower.listsched import default_variants, job_order, list_schedule
from opsched.lower.lns import (
    Incumbent,
    SearchLog,
    better,
    evaluate,
    large_neighbourhood_search,
    objective_value,
    slotted_starts,
)
from opsched.lower.timeindexed import (
    HorizonTooShort,
    auto_slot,
    full_windows,
    model_size,
    slot_problem,
    solve_slot_problem,
    starts_to_order,
)
from opsched.schedule import Job, Order, Pair, Schedule, StageGraph, jobs_of, simulate
from opsched.solver import Objective, Status, objective_of, require

log = logging.getLogger(__name__)

#: the whole MIP is tried when it has at most this many step variables
FULL_MODEL_VARIABLES = 4000
#: node limit of the whole MIP (a deterministic budget; the time limit is only a safety net)
FULL_MODEL_NODES = 2000
#: default number of neighbourhood sub-MIPs (a deterministic budget; see :func:`solve`)
SEARCH_BUDGET = 100


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

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.schedule.events), default=0.0)


@dataclass
class _Search:
    """The state of one :func:`solve`: the problem, the best order so far, its bound and what the work cost."""

    js: JobSet
    budgets: dict[int, float] | None
    objective: Objective
    solver: str
    threads: int
    started: float  # time.monotonic() at the start
    deadline: float  # the safety cap on the clock
    bound: float  # holds for every schedule of the graph (what is reported)
    best: Incumbent | None = None  # None while the best order has overlapped pairs (not searched)
    #: holds for the orders this search can reach (its job set, no pairs): may be above ``bound``
    search_bound: float = -math.inf
    timed_out: bool = False
    slot: float | None = None
    solves: int = 0
    log: list[tuple[float, float, float]] = field(default_factory=list)

    def report(self, value: float, what: str) -> None:
        elapsed = time.monotonic() - self.started
        self.log.append((elapsed, value, self.bound))
        log.info("[lower] %7.2fs  best %.6g  bound %.6g  %s", elapsed, value, self.bound, what)

    def proven(self) -> bool:
        return self.best is not None and _proven(self.best.value, self.bound)

    def searched_out(self) -> bool:
        """Whether no order this search can reach beats the best: proven, or at the search's own bound."""
        return self.proven() or (self.best is not None and _proven(self.best.value, self.search_bound))


def solve(
    sg: StageGraph,
    microbatches: int,
    *,
    memory_limit: float | None = None,
    split_backward: bool = True,
    allow_pairs: bool = False,
    slot: float | None = None,
    time_limit: float = 30.0,
    solver: str = "cbc",
    threads: int = 1,
    warm_orders: dict[str, Order] | None = None,
    objective: Objective | str = Objective.MAKESPAN,
    search_budget: int | None = SEARCH_BUDGET,
) -> LowerResult:
    """Find a short schedule of every job within the memory limit, with a proven lower bound.

    ``memory_limit`` is per device for parameters plus activations (``None``:
    unlimited); below :func:`opsched.lower.jobs.minimum_memory_limit` it
    raises :class:`opsched.lower.jobs.MemoryTooSmall` naming that minimum.
    ``slot`` is the MIP's time slot (default:
    :func:`opsched.lower.timeindexed.auto_slot`).

    Determinism: the work is counted, not timed. Every list-scheduler variant
    runs, the whole MIP (when small enough) stops after
    :data:`FULL_MODEL_NODES` nodes, and the neighbourhood search after
    ``search_budget`` sub-MIPs of at most 500 nodes each (``None``: until a
    sweep at full width finds nothing). So the same input, solver and
    threads give the same schedule. ``time_limit`` (seconds) is only a safety
    cap, as is a 5 s cap per sub-MIP (CBC's root is not bounded by nodes):
    when either stops the work, the result may depend on the machine and
    ``status`` is :attr:`Status.TIME_LIMIT` (the progress line says so too);
    otherwise ``status`` is :attr:`Status.OPTIMAL` (the bound is reached) or
    :attr:`Status.FEASIBLE`. Progress goes to this module's logger.

    ``warm_orders`` are starting orders, tried in the order given (ties keep
    the earliest), each kept only when it runs the same jobs and fits in
    memory; with ``split_backward`` a warm order with fused B jobs is used
    with each B replaced by its I then its W. The lower level knows no
    hand-written schedule itself: callers pass them here
    (:func:`opsched.baselines.baseline_orders`).

    ``objective`` is :attr:`Objective.MAKESPAN` (default) or
    :attr:`Objective.ZB_SPAN`, the Zero Bubble paper's cost (the longest
    device span from its first F to its last W or B); ``lower_bound`` and
    ``gap`` then refer to that objective.

    >>> from opsched.schedule import chain_stage_graph
    >>> r = solve(chain_stage_graph(2, f=1, b=2, w=1), 4, time_limit=5)
    >>> r.makespan, r.lower_bound, r.status
    (13.0, 13.0, <Status.OPTIMAL: 'optimal'>)
    """
    t0 = time.monotonic()
    objective = objective_of(objective)
    _check_arguments(solver, time_limit, slot)
    check_memory_limit(sg, microbatches, memory_limit)
    js = JobSet(sg, microbatches, split_backward)
    budgets = activation_budgets(sg, memory_limit)
    # proven for every schedule of sg (pairs, fused or split backwards), not only those this solve can make
    bound = combinatorial_bound(js, budgets) if objective == Objective.MAKESPAN else span_lower_bound(js)
    run = _Search(js, budgets, objective, solver, threads, t0, t0 + float(time_limit), bound)
    run.search_bound = _search_bound(js, budgets, objective, bound)

    name, start, candidates, run.timed_out = _best_start(
        js, budgets, allow_pairs, warm_orders, objective, stop_at=run.deadline
    )
    final_order: Order = start
    if _has_pairs(start):  # the slotted MIP has no pairs: the order is kept as it is
        run.report(candidates[name], f"warm start {name}")
    else:
        run.best = evaluate(js, job_order(start), objective)
        run.report(run.best.value, f"warm start {name}")
        if not run.searched_out():
            run.slot = slot or auto_slot(sg, run.best.makespan)
            _solve_whole_mip(run)
        if not run.searched_out():
            _neighbourhood_search(run, search_budget)
        final_order = {d: list(jobs) for d, jobs in run.best.order.items()}
    return _result(run, sg, memory_limit, final_order, name, candidates, time_limit)


def _search_bound(js: JobSet, budgets, objective: Objective, bound: float) -> float:
    """A bound on the orders the MIP search reaches (``js``'s own jobs, no pairs), where the search may stop.

    ``bound`` itself when every schedule is such an order; else the same
    combinatorial bounds on ``js`` as it is, without pair shares.
    """
    if own_orders_hold_every_schedule(js):
        return bound
    if objective == Objective.MAKESPAN:
        return combinatorial_bound(js, budgets, own_orders=True)
    return span_lower_bound(js, own_orders=True)


def _check_arguments(solver: str, time_limit: float, slot: float | None) -> None:
    require(solver)
    if time_limit <= 0:
        raise OpschedError(f"time limit must be positive, got {time_limit}")
    if slot is not None and slot <= 0:
        raise OpschedError(f"slot must be positive, got {slot}")


def _solve_whole_mip(run: _Search) -> None:
    """Phase 4: the whole time-indexed MIP, warm-started, when it is small enough; may raise the bounds.

    With an exact slot its bound holds for the orders the search can reach
    (``search_bound``: the search stops there), and when its problem holds
    every schedule of the graph it is also reported (``bound``).
    """
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
        run.timed_out = True
        return
    # the symmetry rows may cut off the incumbent's start slots: then it starts cold
    out = solve_slot_problem(
        sp, incumbent=starts, solver=run.solver, threads=run.threads,
        time_limit=max(0.05, 0.5 * (run.deadline - time.monotonic())), max_nodes=FULL_MODEL_NODES,
        objective=run.objective, flow=run.objective != Objective.MAKESPAN,
    )
    run.timed_out = run.timed_out or out.timed_out
    if out.starts is not None:
        cand = evaluate(js, starts_to_order(js, out.starts), run.objective)
        if better(cand, best) and order_fits(js.sg, cand.order, run.budgets):
            run.best = cand
    proven = out.objective if out.status == Status.OPTIMAL else out.bound
    if exact and proven is not None and out.status in (Status.OPTIMAL, Status.FEASIBLE, Status.NO_SOLUTION):
        # slotted objectives are whole slots; a flow tie-breaker adds less than one slot
        whole = math.ceil(proven - 1e-6) if run.objective == Objective.MAKESPAN else math.floor(proven + 1e-6)
        run.search_bound = max(run.search_bound, whole * run.slot)
        if _mip_covers_every_schedule(js, run.objective):
            run.bound = max(run.bound, whole * run.slot)
    run.report(run.best.value, f"full MIP ({out.variables} variables, {out.status})")


def _neighbourhood_search(run: _Search, search_budget: int | None) -> None:
    """Phase 5: large-neighbourhood search over time windows of the best order."""
    search = SearchLog()
    run.best = large_neighbourhood_search(
        run.js, run.best, run.slot, run.budgets, deadline=run.deadline, solver=run.solver, threads=run.threads,
        target=max(run.bound, run.search_bound), log=search, objective=run.objective, max_solves=search_budget,
        on_improve=lambda inc: run.report(inc.value, "neighbourhood search"),
    )
    run.timed_out = run.timed_out or search.timed_out
    run.solves = search.solves


def _result(
    run: _Search, sg: StageGraph, memory_limit: float | None, order: Order, warm_start: str,
    candidates: dict[str, float], time_limit: float,
) -> LowerResult:
    """Phase 6: ``order`` re-timed in continuous time, with its bound, gap and status."""
    events = simulate(sg, {d: list(a) for d, a in order.items()}, run.js.microbatches)
    value = objective_value(run.js, events, run.objective)
    bound = min(run.bound, value)  # float noise only: the bound is proven
    gap = (value - bound) / value if value > 0 else 0.0
    status = Status.OPTIMAL if _proven(value, bound) else Status.TIME_LIMIT if run.timed_out else Status.FEASIBLE
    run.bound = bound
    run.report(value, str(status) + (
        f" (safety cap {time_limit:g} s or 5 s per sub-MIP; the result may vary)" if status == Status.TIME_LIMIT else ""
    ))
    return LowerResult(
        schedule=Schedule(sg, run.js.microbatches, events, memory_limit=memory_limit, name="mip"),
        order=order,
        lower_bound=bound,
        gap=gap,
        solver=run.solver,
        solve_seconds=time.monotonic() - run.started,
        status=status,
        warm_start=warm_start,
        log=run.log,
        slot=run.slot,
        candidates=candidates,
        search_solves=run.solves,
        objective=run.objective,
        value=value,
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
    values = [float(s.time[p]) for s in sg.stages for p in s.timed_passes()] + [e.time for e in sg.edges]
    return all(abs(v / slot - round(v / slot)) <= 1e-7 * max(1.0, v / slot) for v in values)


def _proven(makespan: float, bound: float) -> bool:
    return makespan <= bound + 1e-9 * max(1.0, abs(bound))


def _has_pairs(order: Order) -> bool:
    return any(isinstance(a, Pair) for acts in order.values() for a in acts)


def _makespan(js: JobSet, order: Order) -> float:
    return max(e.end for e in simulate(js.sg, {d: list(a) for d, a in order.items()}, js.microbatches))


def _same_jobs(js: JobSet, order: Order) -> bool:
    """Whether the order runs exactly the job set (pairs split), each job once per device of its stage."""
    seen: dict[Job, int] = {}
    for acts in order.values():
        for a in acts:
            for j in jobs_of(a):
                seen[j] = seen.get(j, 0) + 1
    if set(seen) != set(js.index):
        return False
    return all(seen[j] == len(js.devices[js.index[j]]) for j in seen)


def _best_start(
    js: JobSet, budgets, allow_pairs: bool, warm_orders: dict[str, Order] | None,
    objective: Objective = Objective.MAKESPAN, stop_at: float | None = None,
) -> tuple[str, Order, dict[str, float], bool]:
    """The best order among warm orders, baselines and list-scheduler variants that fit in memory.

    Every variant runs and ties keep the earliest candidate in that order, so
    the result is deterministic. Only the safety cap ``stop_at`` (the clock)
    may skip variants after the first; the last value returned says whether it did.
    Returns (name, order, {name: objective value of every candidate that fits}, cut short).
    """
    sg = js.sg
    pool: list[tuple[str, Order]] = [
        (name, split_fused_backward(order) if js.split_backward else order) for name, order in (warm_orders or {}).items()
    ]
    cut = False
    for k, v in enumerate(default_variants(js, allow_pairs)):
        if k > 0 and stop_at is not None and time.monotonic() > stop_at:
            cut = True
            break
        pool.append((v.name, list_schedule(js, budgets, v)))
    best: tuple[str, Order, Incumbent] | None = None
    spans: dict[str, float] = {}
    for name, order in pool:
        if not _same_jobs(js, order) or (_has_pairs(order) and not allow_pairs):
            continue
        if not order_fits(sg, order, budgets):
            continue
        try:
            events = simulate(sg, {d: list(a) for d, a in order.items()}, js.microbatches)
        except Deadlock:  # a warm order may deadlock on this graph
            continue
        inc = Incumbent({}, objective_value(js, events, objective), max(e.end for e in events), sum(e.end for e in events))
        spans[name] = inc.value
        if best is None or better(inc, best[2]):
            best = (name, order, inc)
    assert best is not None, "the list scheduler always gives an order"
    return best[0], best[1], spans, cut


def split_fused_backward(order: Order) -> Order:
    """``order`` with every fused backward B replaced by its I then its W, in place of the B.

    The result has the same dependencies (the I waits for what the B waited
    for; the W follows the I on the same device) and never more memory at any
    point (the I frees part of the activation as the B would free all of it,
    and the W frees the rest right after). A B inside an overlapped pair
    becomes the pair's backward I, followed by the W.

    >>> from opsched.schedule import Job
    >>> [str(j) for j in split_fused_backward({0: [Job(0, 0, "F"), Job(0, 0, "B")]})[0]]
    ['0F0', '0I0', '0W0']
    """
    out: Order = {}
    for d, actions in order.items():
        acts = []
        for a in actions:
            if isinstance(a, Pair) and "B" in (a.first.pass_, a.second.pass_):
                fused = [j for j in (a.first, a.second) if j.pass_ == "B"]
                acts.append(Pair(_input_part(a.first), _input_part(a.second)))
                acts += [Job(j.stage, j.microbatch, "W") for j in fused]
            elif isinstance(a, Job) and a.pass_ == "B":
                acts += [Job(a.stage, a.microbatch, "I"), Job(a.stage, a.microbatch, "W")]
            else:
                acts.append(a)
        out[d] = acts
    return out


def _input_part(job: Job) -> Job:
    """The I of a fused backward B; any other job unchanged."""
    return Job(job.stage, job.microbatch, "I") if job.pass_ == "B" else job
