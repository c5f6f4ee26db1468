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

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import networkx as nx

from opsched.cluster import Cluster, Training
from opsched.errors import OpschedError, Unsupported
from opsched.schedule import Edge, Schedule, Stage, StageGraph, metrics, order_from_schedule, validate
from opsched.upper.layouts import Layout, layouts
from opsched.upper.mip import (
    UpperProblem,
    UpperSolution,
    contiguous_start,
    estimate,
    minimum_memory,
    solve_upper,
    uniform_start,
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
class Baseline:
    """A hand-written schedule on the best contiguous split (a row of ``baselines`` in plan.json)."""

    method: str
    layout: str
    schedule: Schedule  # on real devices (each pseudo-device of the split is a device group)
    makespan: float
    step_time: float
    bubble_ratio: float
    peak_memory_bytes: float
    grad_sync: float
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


#: text a native solver prints when it aborts (glibc heap checks, CBC's signal handler)
CRASH_MARKERS = (b"Signal SIGABRT caught", b"double free", b"corruption", b"Segmentation fault", b"SIGSEGV")


def run_isolated(fn, *args, timeout: float, **kwargs):
    """Run ``fn(*args, **kwargs)`` in a forked child process and return its result.

    The MIP solvers are native code: CBC has been seen to abort with a heap
    corruption at the end of a time-limited search and then hang in its own
    crash handler, which would hang the whole planner. In a child it costs
    one solve: the child's output is watched, and a crash message, a child
    that dies, or one running past ``timeout`` seconds raises
    :class:`OpschedError` at once; an exception in ``fn`` is re-raised here.
    Other output of the child is passed on to stderr. Falls back to a direct
    call where fork is unavailable.
    """
    import multiprocessing as mp
    import os
    import sys
    from multiprocessing.connection import wait

    try:
        ctx = mp.get_context("fork")
    except ValueError:  # no fork (Windows, some macOS setups)
        return fn(*args, **kwargs)
    receive, send = ctx.Pipe(duplex=False)
    out_read, out_write = os.pipe()
    child = ctx.Process(target=_isolated_child, args=(send, out_write, fn, args, kwargs), daemon=True)
    child.start()
    send.close()
    os.close(out_write)
    deadline = time.monotonic() + timeout
    watched: list = [receive, out_read]
    output = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OpschedError(f"the solver did not return within {timeout:.0f} s and was stopped")
            ready = wait(watched, timeout=left)
            if out_read in ready:
                chunk = os.read(out_read, 65536)
                if not chunk:
                    watched.remove(out_read)
                else:
                    output += chunk
                    if any(marker in output for marker in CRASH_MARKERS):
                        raise OpschedError("the solver crashed (native abort); this candidate is skipped")
                    sys.stderr.write(chunk.decode("utf-8", "replace"))
            if receive in ready:
                try:
                    ok, value = receive.recv()
                except EOFError:
                    raise OpschedError(f"the solver process died (exit code {child.exitcode}); this candidate is skipped") from None
                break
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
        os.close(out_read)
    if ok:
        return value
    raise value


def _isolated_child(send, out_write, fn, args, kwargs) -> None:
    import os

    os.dup2(out_write, 1)  # the parent watches what native code prints
    os.dup2(out_write, 2)
    try:
        result = (True, fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent as is
        result = (False, exc)
    try:
        send.send(result)
    finally:
        send.close()
        os._exit(0)  # skip interpreter teardown: the parent owns every resource


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


# --------------------------------------------------------------------------- baselines on contiguous splits


def method_stage_count(method: str, groups: int) -> int:
    """Logical stages a hand-written method uses on ``groups`` pipeline ranks."""
    from opsched.baselines import placement_of

    return 2 * groups if placement_of(method) in ("v", "interleaved") else groups


def contiguous_chain(p: UpperProblem, uniform: bool = True) -> tuple[StageGraph, list[float], str] | None:
    """A contiguous split of ``p`` as a chain on pseudo-devices, one per group.

    ``uniform``: one parallel configuration for every block, as users set it
    (:func:`opsched.upper.mip.uniform_start`); else per-block modes chosen by
    the mode MIP (:func:`opsched.upper.mip.contiguous_start`).

    Stage k runs on pseudo-device ``k mod G`` (so a baseline can re-place the
    chain); a stage's figures are its blocks' under their modes; the edge
    k -> k+1 carries every block edge that crosses the cut after stage k.
    Returns the chain, each stage's gradient sync and the configuration's
    name, or None when no contiguous split fits in memory. Empty slots are dropped.
    """
    if uniform:
        found = uniform_start(p)
        if found is None:
            return None
        config, start = found
    else:
        config, start = "per-block modes", contiguous_start(p)
        if start is None:
            return None
    used = sorted({s for s, _ in start.values()})
    index = {s: i for i, s in enumerate(used)}
    G = p.layout.groups
    stages, syncs = [], []
    for s in used:
        k = index[s]
        costs = [p.cost[(b, p.group(s), m)] for b, (slot, m) in start.items() if slot == s]
        stages.append(
            Stage(
                id=k,
                devices=(k % G,),
                time={"F": sum(c.F for c in costs), "I": sum(c.I for c in costs), "W": sum(c.W for c in costs)},
                param_bytes=sum(c.param_bytes for c in costs),
                act_bytes=sum(c.act_bytes for c in costs),
                act_w_bytes=sum(c.act_w_bytes for c in costs),
                name=f"part{k}",
            )
        )
        syncs.append(sum(c.grad_sync for c in costs))
    edges = []
    for k in range(len(used) - 1):
        crossing = sum(n for (u, v), n in p.edges.items() if index[start[u][0]] <= k < index[start[v][0]])
        a, c = used[k], used[k + 1]
        time_ = 0.0 if p.group(a) == p.group(c) else p.transfer_latency[(a, c)] + crossing * p.transfer_rate[(a, c)]
        edges.append(Edge(k, k + 1, time=time_, bytes=crossing))
    return StageGraph(stages, edges, num_devices=G), syncs, config


def _device_sync(placement: str, syncs: list[float], groups: int) -> float:
    """The largest per-pseudo-device gradient sync when a method places the chain its way."""
    per = [0.0] * groups
    n = len(syncs)
    for k, s in enumerate(syncs):
        if placement == "chain":
            per[min(k, groups - 1)] += s
        elif placement == "interleaved":
            per[k % groups] += s
        elif placement == "v":
            per[k if k < groups else max(0, 2 * groups - 1 - k)] += s
        else:  # dual: both directions' copies of stage k live on devices k and G-1-k
            per[k % groups] += s
            per[(groups - 1 - k) % groups] += s
    return max(per) if n else 0.0


def on_real_devices(schedule: Schedule, layout: Layout) -> Schedule:
    """A schedule on pseudo-devices (one per group) moved onto the groups' real devices."""
    from opsched.baselines.placement import onto_groups

    groups = [tuple(layout.devices_of_group(g)) for g in range(layout.groups)]
    return onto_groups(schedule, groups, layout.devices)


#: the contiguous split is cut for these fractions of the memory limit (a tighter
#: cut balances memory more evenly, which some methods need to fit at all)
SPLIT_MEMORY_SCALES = (1.0, 0.9, 0.8, 0.7, 0.6)


def contiguous_baselines(
    bg: nx.DiGraph, cluster: Cluster, training: Training, memory_limit: float, say: Progress | None = None
) -> tuple[list[Baseline], Baseline | None]:
    """Every hand-written method on its best contiguous split at the same memory.

    For each method and each pipeline depth G ≥ 2 (G divides the devices,
    groups of N/G devices with the upper level's cost model and per-block
    modes), the topological order is cut into the method's stage count
    (:func:`contiguous_chain`, cut for each of :data:`SPLIT_MEMORY_SCALES` of
    the limit); the method runs on it with the full memory limit, and the
    split with the best step time is kept. Returns one :class:`Baseline` per method that fits
    anywhere (sorted by step time) and the overall best.
    """
    from opsched.baselines import NAMES, placement_of, run_baseline

    say = say or (lambda msg: None)
    M = training.microbatches
    best: dict[str, Baseline] = {}
    chains: dict[tuple[int, int, float], tuple | None] = {}
    for lay, method, scale in itertools.product(layouts(cluster, max_virtual=1), NAMES, SPLIT_MEMORY_SCALES):
        G = lay.groups
        if G < 2:
            continue
        count = method_stage_count(method, G)
        key = (G, count, scale)
        if key not in chains:
            shape = Layout(lay.devices, G) if count == G else Layout(lay.devices, G, count // G, "interleaved")
            chains[key] = contiguous_chain(upper_problem(bg, shape, cluster, training, memory_limit * scale))
        if chains[key] is None:
            continue
        chain, syncs, config = chains[key]
        t0 = time.perf_counter()
        try:
            sched = run_baseline(method, chain, M, memory_limit=memory_limit)
        except Unsupported:
            continue
        seconds = time.perf_counter() - t0
        m = metrics(sched)
        sync = _device_sync(placement_of(method), syncs, G)
        cand = Baseline(
            method=method,
            layout=f"{G}x{lay.group_size} contiguous, {config}",
            schedule=on_real_devices(sched, lay),
            makespan=m.makespan,
            step_time=m.makespan + sync,
            bubble_ratio=m.bubble_ratio,
            peak_memory_bytes=max(m.peak_memory_bytes, default=0.0),
            grad_sync=sync,
            solve_seconds=seconds,
        )
        if method not in best or cand.step_time < best[method].step_time:
            best[method] = cand
    rows = sorted(best.values(), key=lambda b: (b.step_time, b.method))
    for b in rows:
        say(f"baseline: {b.method} on {b.layout}: step {b.step_time:.4g} s, bubbles {b.bubble_ratio:.3f}")
    return rows, (rows[0] if rows else None)
