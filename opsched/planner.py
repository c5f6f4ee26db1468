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
6. returns the candidate with the best simulated step time (makespan plus
   the once-per-step gradient all-reduce), with every candidate's figures.

Step time = schedule makespan + gradient sync (data-parallel all-reduce,
once per step); throughput = microbatches × microbatch size / step time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import networkx as nx

from opsched.cluster import Cluster, Training
from opsched.contiguous import Baseline, contiguous_baselines
from opsched.errors import OpschedError
from opsched.isolate import run_isolated
from opsched.schedule import Schedule, StageGraph, metrics, order_from_schedule, validate
from opsched.upper.layouts import layouts
from opsched.upper.mip import (
    UpperProblem,
    UpperSolution,
    contiguous_start,
    estimate,
    minimum_memory,
    solve_upper,
    upper_problem,
)
from opsched.upper.reduce import reduce_block_graph
from opsched.upper.stages import build_stage_graph

Progress = Callable[[str], None]


@dataclass
class Candidate:
    """One thing the search tried, with its figures (a row of ``candidates`` in plan.json)."""

    source: str  # "upper" or "contiguous"
    layout: str
    status: str  # e.g. "scheduled", "no fit", "estimated only", "lower failed: ..."
    estimate: float | None = None  # upper objective (s)
    upper_status: str | None = None
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
    solver_metrics: dict  # lower_bound, gap, solver, solve_seconds
    source: str  # what produced the chosen schedule
    layout: str
    step_time: float
    grad_sync: float
    stage_blocks: dict[int, list[str]]  # stage id -> names of the blocks it holds, with modes
    candidates: list[Candidate]
    baselines: list[Baseline]
    blocks: int  # blocks the upper MIP placed
    seconds: dict[str, float] = field(default_factory=dict)


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
    progress: Progress | None = None,
    keep: int = 2,
    target_blocks: int | None = None,
) -> PlanResult:
    """Plan ``bg`` on ``cluster`` (see the module docstring); ``time_limit`` is the total solver budget in seconds.

    What is solved is fixed by work budgets, so the same input, solver and
    threads give the same plan: the upper MIP of every layout (node and round
    limits, :mod:`opsched.upper.mip`), a quick lower solve of every upper
    solution and of the best baseline's split (10 neighbourhood MIPs), then a
    longer lower solve of the ``keep`` best of those not yet proven optimal
    (warm-started from their quick schedules). ``time_limit`` shares the clock
    among these as safety caps (at least 10 s per upper layout and per quick
    solve, 5 s per longer one); a cap that binds is reported in the
    candidate's status.
    """
    say = progress or (lambda msg: None)
    limit = float(cluster.memory_bytes if memory_limit is None else memory_limit)
    M = training.microbatches
    t_start = time.perf_counter()
    deadline = t_start + time_limit
    all_layouts = layouts(cluster)
    target = target_blocks or max(24, 3 * max(lay.slots for lay in all_layouts))
    small, _ = reduce_block_graph(bg, target)
    say(f"upper: {bg.number_of_nodes()} blocks reduced to {small.number_of_nodes()} for the MIP; {len(all_layouts)} layouts")

    # 1. upper: every layout that fits, warm-started from its best contiguous split
    problems: dict[str, UpperProblem] = {}
    candidates: list[Candidate] = []
    solutions: list[UpperSolution] = []
    # Work budgets (nodes, rounds) decide the result; the clock is only a safety
    # cap per layout, generous so that it does not bind on a loaded machine.
    share = max(10.0, 0.5 * time_limit / max(1, len(all_layouts)))
    for lay in all_layouts:
        name = str(lay)
        p = upper_problem(small, lay, cluster, training, limit)
        problems[name] = p
        try:
            found = run_isolated(_upper_for_layout, p, share, solver, timeout=3 * share + 30)
        except OpschedError as exc:
            candidates.append(Candidate("upper", name, f"upper failed: {exc}"))
            say(f"upper: layout {name}: {exc}")
            continue
        if found is None:
            candidates.append(Candidate("upper", name, "no fit"))
            continue
        start_estimate, sol = found
        say(f"upper: layout {name}: estimate {start_estimate:.4g} s -> {sol.objective:.4g} s ({sol.status}, {sol.solve_seconds:.1f} s)")
        solutions.append(sol)
    t_upper = time.perf_counter()

    # 2. the baselines, each on its best contiguous split at the same memory
    baselines, best_split = contiguous_baselines(small, cluster, training, limit, say)
    t_base = time.perf_counter()
    if not solutions and not baselines:
        smallest = _smallest_memory(problems, solver)
        raise OpschedError(
            f"no layout fits in {limit / 2**30:.1f} GiB per device; the smallest memory that works is about "
            f"{smallest / 2**30:.1f} GiB (pass --memory-limit {math.ceil(smallest / 2**30)}GiB or use more devices)"
        )

    # 3. a quick lower solve of every StageGraph, then longer ones for the best few
    jobs = []
    ranked_solutions = sorted(solutions, key=lambda x: (x.objective, str(x.layout)))
    for rank, sol in enumerate(ranked_solutions):
        if rank >= LOWER_AT_MOST or sol.objective > LOWER_WITHIN * ranked_solutions[0].objective:
            candidates.append(Candidate("upper", str(sol.layout), "estimated only", estimate=sol.objective,
                                        upper_status=sol.status, upper_seconds=sol.solve_seconds))
            continue
        plan = build_stage_graph(problems[str(sol.layout)], sol.assignment)
        cand = Candidate("upper", str(sol.layout), "scheduled", estimate=sol.objective, upper_status=sol.status,
                         upper_seconds=sol.solve_seconds, stages=len(plan.stage_graph.stages))
        jobs.append({"cand": cand, "sg": plan.stage_graph, "sync": plan.grad_sync_seconds, "plan": plan, "warm": None})
    if best_split is not None:
        cand = Candidate("contiguous", best_split.layout, "scheduled", stages=len(best_split.schedule.stage_graph.stages))
        jobs.append({"cand": cand, "sg": best_split.schedule.stage_graph, "sync": best_split.grad_sync,
                     "plan": None, "warm": best_split.schedule})
    quick_deadline = time.perf_counter() + 0.35 * time_limit
    for k, job in enumerate(jobs):
        budget = max(10.0, (quick_deadline - time.perf_counter()) / (len(jobs) - k))
        _schedule_job(job, M, limit, budget, solver, say)
    ranked = sorted((j for j in jobs if "schedule" in j), key=lambda j: j["cand"].step_time)
    finalists = ranked[:keep]
    for k, job in enumerate(finalists):
        # whether a finalist gets its longer solve depends on its result, never on the clock
        budget = max(5.0, (deadline - time.perf_counter()) / (len(finalists) - k))
        proven = job["extra"].get("gap") is not None and job["extra"]["gap"] <= 1e-6
        if not proven:
            _schedule_job(job, M, limit, budget, solver, say, warm=job["schedule"])
    candidates = [j["cand"] for j in jobs] + candidates

    # 4. the best simulated step time wins; a baseline itself is a plan the search may return
    options = [(j["cand"].step_time, j["cand"].source, j["cand"].layout, j["schedule"], j["extra"], j["sync"], j["plan"])
               for j in jobs if "schedule" in j]
    options += [(b.step_time, f"baseline {b.method}", b.layout, b.schedule,
                 {"solver": "none", "solve_seconds": b.solve_seconds}, b.grad_sync, None) for b in baselines]
    if not options:
        smallest = _smallest_schedulable(jobs, M)
        raise OpschedError(
            f"no candidate could be scheduled within {limit / 2**30:.1f} GiB per device; the smallest memory that works "
            f"is about {smallest / 2**30:.1f} GiB (pass --memory-limit {math.ceil(smallest / 2**30)}GiB)"
        )
    step, source, lay_name, schedule, extra, sync, plan = min(options, key=lambda o: o[0])
    validate(schedule)
    stage_blocks: dict[int, list[str]] = {}
    if plan is not None:
        names = problems[lay_name].names
        stage_blocks = {
            sid: [f"{names[b]} [{plan.modes_of_stage[sid][b]}]" for b in blocks]
            for sid, blocks in plan.blocks_of_stage.items()
        }
    return PlanResult(
        schedule=schedule,
        solver_metrics=extra,
        source=source,
        layout=lay_name,
        step_time=step,
        grad_sync=sync,
        stage_blocks=stage_blocks,
        candidates=candidates,
        baselines=baselines,
        blocks=small.number_of_nodes(),
        seconds={"upper": t_upper - t_start, "baselines": t_base - t_upper, "lower": time.perf_counter() - t_base},
    )


def _upper_for_layout(p: UpperProblem, time_limit: float, solver: str) -> tuple[float, UpperSolution] | None:
    """(estimate of the contiguous start, upper solution) for one layout, or None when nothing fits."""
    start = contiguous_start(p, solver=solver)
    if start is None:
        return None
    window = 2 if p.layout.slots > 4 else None
    return estimate(p, start)["step_time"], solve_upper(p, time_limit=time_limit, solver=solver, start=start, window=window)


def _schedule_job(job: dict, microbatches: int, limit: float, budget: float, solver: str, say: Progress,
                  warm: Schedule | None = None) -> None:
    """Run the lower MIP on ``job["sg"]``; keep the result in ``job`` when it is better than what it holds."""
    cand: Candidate = job["cand"]
    # the quick pass gets a small work budget so that it finishes well inside its share of the clock
    # (budgets in work keep plans deterministic; the clock is only a safety cap)
    search = 10 if warm is None else None
    try:
        schedule, extra = run_isolated(lower_schedule, job["sg"], microbatches, limit, budget, solver,
                                       warm or job["warm"], search, timeout=3 * budget + 60)
    except OpschedError as exc:
        if "schedule" not in job:
            cand.status = f"lower failed: {exc}"
        say(f"lower: {cand.source} {cand.layout}: {exc}")
        return
    m = metrics(schedule)
    step = m.makespan + job["sync"]
    if "schedule" in job and step >= cand.step_time:
        return
    job["schedule"], job["extra"] = schedule, extra
    cand.makespan, cand.step_time = m.makespan, step
    cand.bubble_ratio, cand.peak_memory_bytes = m.bubble_ratio, max(m.peak_memory_bytes, default=0.0)
    cand.lower_bound, cand.gap = extra.get("lower_bound"), extra.get("gap")
    cand.solve_seconds = (cand.solve_seconds or 0.0) + (extra.get("solve_seconds") or 0.0)
    say(f"lower: {cand.source} {cand.layout}: makespan {m.makespan:.4g} s, step {step:.4g} s, "
        f"bubbles {m.bubble_ratio:.3f}, gap {extra.get('gap', float('nan')):.3f}")


def lower_schedule(
    sg: StageGraph, microbatches: int, memory_limit: float, time_limit: float, solver: str, warm: Schedule | None = None,
    search_budget: int | None = None,
):
    """(schedule, solver metrics) from the lower MIP, ``opsched.lower.solve``; ``warm`` is a schedule to start from.

    ``search_budget``: neighbourhood sub-MIPs (``None``: the lower level's
    default). ``time_limit`` is a safety cap; ``lower_status`` says when it bound.
    """
    try:
        from opsched.lower import solve
    except ImportError:
        raise OpschedError("the lower level (opsched.lower.solve) is not available in this installation") from None
    kwargs = {} if search_budget is None else {"search_budget": search_budget}
    if warm is not None:
        kwargs["warm_orders"] = {warm.name or "warm": order_from_schedule(warm)}
    result = solve(
        sg, microbatches, memory_limit=memory_limit, time_limit=time_limit, solver=solver, progress=False, **kwargs
    )
    extra = {
        "lower_bound": result.lower_bound,
        "gap": result.gap,
        "solver": result.solver,
        "solve_seconds": result.solve_seconds,
        "lower_status": result.status,
    }
    return result.schedule, extra


def _smallest_schedulable(jobs: list[dict], microbatches: int) -> float:
    """The least memory limit under which the lower level can schedule one of the candidates' StageGraphs."""
    from opsched.lower import minimum_memory_limit

    return min((minimum_memory_limit(j["sg"], microbatches) for j in jobs), default=math.inf)


def _smallest_memory(problems: dict[str, UpperProblem], solver: str) -> float:
    """The least memory per device any layout needs under the upper memory model."""
    best = math.inf
    for p in problems.values():
        try:
            best = min(best, run_isolated(minimum_memory, p, solver=solver, time_limit=2.0, timeout=30))
        except OpschedError:
            continue
    return best


