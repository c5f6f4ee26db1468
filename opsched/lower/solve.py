"""The lower level's entry point: :func:`solve` a StageGraph's microbatch schedule.

Pipeline of the solve (each step is anytime; the best order so far is kept):

1. check the memory limit against the minimum any schedule needs;
2. a proven combinatorial lower bound (:mod:`opsched.lower.bounds`);
3. incumbents: the given warm orders, every hand-written baseline that fits
   in memory and several list-scheduler variants; the best is the warm start;
4. when the whole time-indexed MIP is small enough, solve it warm-started
   (its bound is proven when the slot divides every time exactly);
5. large-neighbourhood search over time windows until the lower bound, its
   budget of sub-MIPs, or no window helps (the time limit is a safety cap);
6. the final order re-timed in continuous time by the simulator.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

from opsched.errors import OpschedError
from opsched.lower.bounds import lower_bound as combinatorial_bound
from opsched.lower.bounds import span_lower_bound
from opsched.lower.jobs import JobSet, activation_budgets, check_memory_limit, order_fits
from opsched.lower.listsched import default_variants, job_order, list_schedule
from opsched.lower.lns import (
    OBJECTIVES,
    Incumbent,
    SearchLog,
    better,
    evaluate,
    large_neighbourhood_search,
    objective_value,
    slotted_starts,
)
from opsched.lower.timeindexed import (
    SOLVERS,
    auto_slot,
    full_windows,
    model_size,
    slot_problem,
    solve_slot_problem,
    starts_to_order,
)
from opsched.schedule import Job, Order, Pair, Schedule, simulate

#: the whole MIP is tried when it has at most this many step variables
FULL_MODEL_VARIABLES = 4000
#: node limit of the whole MIP (a deterministic budget; the time limit is only a safety net)
FULL_MODEL_NODES = 2000
#: default number of neighbourhood sub-MIPs (a deterministic budget; see :func:`solve`)
SEARCH_BUDGET = 100
#: what ``status`` says when a clock limit cut the work short
TIME_LIMIT_REACHED = "time limit reached"


@dataclass
class LowerResult:
    """What :func:`solve` returns; times are in the StageGraph's units."""

    schedule: Schedule
    order: Order
    lower_bound: float
    gap: float
    solver: str
    solve_seconds: float
    status: str
    warm_start: str
    log: list[tuple[float, float, float]] = field(default_factory=list)
    slot: float | None = None
    candidates: dict[str, float] = field(default_factory=dict)
    #: neighbourhood sub-MIPs solved (at most ``search_budget``)
    search_solves: int = 0

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.schedule.events), default=0.0)


def solve(
    sg,
    microbatches: int,
    *,
    memory_limit: float | None = None,
    split_backward: bool = True,
    allow_pairs: bool = False,
    slot: float | None = None,
    time_limit: float = 30.0,
    solver: str = "cbc",
    threads: int = 1,
    progress: bool = False,
    warm_orders: dict[str, Order] | None = None,
    objective: str = "makespan",
    search_budget: int | None = SEARCH_BUDGET,
) -> LowerResult:
    """Find a short schedule of every job within the memory limit, with a proven lower bound.

    ``memory_limit`` is per device for parameters plus activations (``None``:
    unlimited); below :func:`opsched.lower.jobs.minimum_memory_limit` it
    raises :class:`OpschedError` naming that minimum. ``slot`` is the MIP's
    time slot (default: :func:`opsched.lower.timeindexed.auto_slot`).

    Determinism: the work is counted, not timed. Every list-scheduler variant
    runs, the whole MIP (when small enough) stops after
    :data:`FULL_MODEL_NODES` nodes, and the neighbourhood search after
    ``search_budget`` sub-MIPs of at most 500 nodes each (``None``: until a
    sweep at full width finds nothing). So the same input, solver and
    threads give the same schedule. ``time_limit`` (seconds) is only a safety
    cap, as is a 5 s cap per sub-MIP (CBC's root is not bounded by nodes):
    when either stops the work, the result may depend on the machine and
    ``status`` is ``"time limit reached"`` (the progress line says so too);
    otherwise ``status`` is ``"optimal"`` (the bound is reached) or
    ``"feasible"``.

    ``warm_orders`` are extra starting orders (kept only when they run the
    same jobs and fit in memory); with ``split_backward`` a warm order with
    fused B jobs is used with each B replaced by its I then its W.

    ``objective`` is ``makespan`` (default) or ``zb-span``, the Zero Bubble
    paper's cost (the longest device span from its first F to its last W or
    B); ``lower_bound`` and ``gap`` then refer to that objective.

    >>> from opsched.schedule import chain_stage_graph
    >>> r = solve(chain_stage_graph(2, f=1, b=2, w=1), 4, time_limit=5)
    >>> r.makespan, r.lower_bound, r.status
    (13.0, 13.0, 'optimal')
    """
    t0 = time.monotonic()
    deadline = t0 + float(time_limit)
    if objective not in OBJECTIVES:
        raise OpschedError(f"unknown objective {objective!r}; choose {' or '.join(OBJECTIVES)}")
    if solver not in SOLVERS:
        raise OpschedError(f"unknown solver {solver!r}; choose cbc or highs")
    if time_limit <= 0:
        raise OpschedError(f"time limit must be positive, got {time_limit}")
    if slot is not None and slot <= 0:
        raise OpschedError(f"slot must be positive, got {slot}")
    check_memory_limit(sg, microbatches, memory_limit)
    js = JobSet(sg, microbatches, split_backward)
    budgets = activation_budgets(sg, memory_limit)
    log: list[tuple[float, float, float]] = []
    timed_out = False

    def report(best: float, bound: float, what: str) -> None:
        elapsed = time.monotonic() - t0
        log.append((elapsed, best, bound))
        if progress:
            print(f"[lower] {elapsed:7.2f}s  best {best:.6g}  bound {bound:.6g}  {what}", file=sys.stderr)

    lb = combinatorial_bound(js, budgets, allow_pairs) if objective == "makespan" else span_lower_bound(js)
    name, best_order, candidates, cut = _best_start(js, budgets, allow_pairs, warm_orders, objective, stop_at=deadline)
    timed_out = timed_out or cut
    best = evaluate(js, job_order(best_order), objective) if not _has_pairs(best_order) else None
    value = best.value if best is not None else candidates[name]
    makespan = best.makespan if best is not None else _makespan(js, best_order)
    report(value, lb, f"warm start {name}")
    final_order: Order = best_order
    used_slot = None
    solves = 0
    if best is not None and not _proven(value, lb):
        used_slot = slot or auto_slot(sg, makespan)
        slot_is_exact = _divides(used_slot, sg)  # then the MIP bound holds in continuous time
        sp = slot_problem(js, used_slot, budgets)
        horizon = max(s + sp.p[k] for k, s in slotted_starts(js, best.order, used_slot).items())
        try:
            full_windows(sp, horizon)
            size = model_size(sp)
        except OpschedError:
            size = None
        if size is not None and size <= FULL_MODEL_VARIABLES and time.monotonic() >= deadline:
            timed_out = True
        elif size is not None and size <= FULL_MODEL_VARIABLES:
            starts = slotted_starts(js, best.order, used_slot)
            # the symmetry rows may cut off the incumbent's start slots: then it starts cold
            out = solve_slot_problem(
                sp, incumbent=starts, solver=solver, threads=threads,
                time_limit=max(0.05, 0.5 * (deadline - time.monotonic())), max_nodes=FULL_MODEL_NODES,
                objective="makespan" if objective == "makespan" else "span+flow",
            )
            timed_out = timed_out or out.timed_out
            if out.starts is not None:
                cand = evaluate(js, starts_to_order(js, out.starts), objective)
                if better(cand, best) and order_fits(sg, cand.order, budgets):
                    best = cand
            if slot_is_exact:
                proven = out.objective if out.status == "optimal" else out.bound
                if proven is not None and out.status in ("optimal", "feasible", "no_solution"):
                    # slotted objectives are whole slots; a flow tie-breaker adds less than one slot
                    whole = math.ceil(proven - 1e-6) if objective == "makespan" else math.floor(proven + 1e-6)
                    lb = max(lb, whole * used_slot)
            report(best.value, lb, f"full MIP ({out.variables} variables, {out.status})")
        if not _proven(best.value, lb):
            search = SearchLog()
            best = large_neighbourhood_search(
                js, best, used_slot, budgets, deadline=deadline, solver=solver, threads=threads,
                target=lb, log=search, objective=objective, max_solves=search_budget,
                on_improve=lambda inc: report(inc.value, lb, "neighbourhood search"),
            )
            timed_out = timed_out or search.timed_out
            solves = search.solves
        final_order = {d: list(jobs) for d, jobs in best.order.items()}
    events = simulate(sg, {d: list(a) for d, a in final_order.items()}, microbatches)
    value = objective_value(js, events, objective)
    lb = min(lb, value)  # float noise only: the bound is proven
    gap = (value - lb) / value if value > 0 else 0.0
    status = "optimal" if _proven(value, lb) else TIME_LIMIT_REACHED if timed_out else "feasible"
    report(value, lb, status + (f" (safety cap {time_limit:g} s or 5 s per sub-MIP; the result may vary)" if status == TIME_LIMIT_REACHED else ""))
    schedule = Schedule(sg, microbatches, events, memory_limit=memory_limit, name="mip")
    return LowerResult(
        schedule=schedule,
        order=final_order,
        lower_bound=lb,
        gap=gap,
        solver=solver,
        solve_seconds=time.monotonic() - t0,
        status=status,
        warm_start=name,
        log=log,
        slot=used_slot,
        candidates=candidates,
        search_solves=solves,
    )


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
            for j in (a.first, a.second) if isinstance(a, Pair) else (a,):
                seen[j] = seen.get(j, 0) + 1
    if set(seen) != set(js.index):
        return False
    return all(seen[j] == len(js.devices[js.index[j]]) for j in seen)


def baseline_orders(sg, microbatches: int) -> dict[str, Order]:
    """Every hand-written baseline's order that applies to ``sg`` (none if baselines are missing)."""
    try:
        from opsched import baselines
    except ImportError:  # pragma: no cover - baselines not installed
        return {}
    make = getattr(baselines, "baseline_order", None)
    names = getattr(baselines, "NAMES", ())
    if make is None:
        return {}
    out: dict[str, Order] = {}
    for name in names:
        try:
            out[name] = make(name, sg, microbatches)
        except OpschedError:
            continue
    return out


def _best_start(
    js: JobSet, budgets, allow_pairs: bool, warm_orders: dict[str, Order] | None,
    objective: str = "makespan", stop_at: float | None = None,
):
    """The best order among warm orders, baselines and list-scheduler variants that fit in memory.

    Every variant runs and ties keep the earliest candidate in that order, so
    the result is deterministic. Only the safety cap ``stop_at`` (the clock)
    may skip variants after the first; the last value returned says whether it did.
    Returns (name, order, {name: objective value of every candidate that fits}, cut short).
    """
    sg = js.sg
    pool: list[tuple[str, Order]] = []
    warm = {name: split_fused_backward(order) if js.split_backward else order for name, order in (warm_orders or {}).items()}
    pool += sorted(warm.items())
    pool += sorted(baseline_orders(sg, js.microbatches).items())
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
        except OpschedError:
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
