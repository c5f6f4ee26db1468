"""A peer solver on the DualPipe grid: OR-Tools' CP-SAT on the same job set, to tell a weak search from a weak bound.

Where `mip` stops above its lower bound, either a better schedule exists
(the search is the weak side) or the bound is (no schedule reaches it).
This script asks a different kind of solver, Google OR-Tools' CP-SAT, for a
schedule of one DualPipe-grid case (``bench_dualpipe_grid.py``: 2D stages
in the V, F:I:W, memory = DualPipeV's peak) with a makespan of at most
``--horizon``, within ``--time-limit``:

* the job set is opsched's own (:class:`opsched.lower.jobs.JobSet`: the
  jobs, their durations, dependencies with transfer delays, and each job's
  activation change); each device runs one job at a time; an F allocates its
  activations at its start and a backward frees at its end, within the
  device's activation budget (a reservoir per device); microbatches are
  renamed to start the first stage in order, as the MIP does;
* no overlapped pairs (gain 0 only); no start from opsched unless
  ``--hint`` names a plan.json of the same case (``opsched compare ...
  --methods mip -o DIR`` writes DIR/mip/plan.json): its start times are
  CP-SAT's solution hint, and CP-SAT then minimises the makespan from there
  (the horizon defaults to the hint's makespan);
* the schedule it returns is turned into an order, re-timed by opsched's
  simulator and validated with the memory limit: the makespan printed is
  opsched's, not the peer's.

"INFEASIBLE" proves that no schedule of the V at that memory ends by the
horizon; "UNKNOWN" proves nothing. CP-SAT runs ``--workers`` threads and is
not deterministic: this is a check, not a product path. OR-Tools is not a
dependency of opsched; install it for this script with ``pip install
ortools``.

Usage::

    python benchmarks/bench_cpsat_peer.py --devices 8 --microbatches 16 --ratio 1:1.5:0.5 --horizon 107.5 \\
        [--time-limit 600] [--workers 2] [--json out.json]
    python benchmarks/bench_cpsat_peer.py --devices 16 --microbatches 32 --ratio 1:1.5:0.5 \\
        --hint out/mip/plan.json [--horizon H] [--time-limit 1500]

CBC and OR-Tools load clashing builds of the same COIN-OR libraries, so the
hint comes from a file written by another process, not from a solve here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from fractions import Fraction

from bench_dualpipe_grid import RATIOS, grid_case  # the grid's cases have one home

from opsched.export.plan_json import read_plan_schedule
from opsched.lower.bounds import lower_bound
from opsched.lower.jobs import JobSet, activation_budgets
from opsched.lower.slot_solve import starts_to_order
from opsched.lower.timeindexed import symmetric_forward_chains
from opsched.schedule import Schedule, simulate, validate


def _unit(values: list[float]) -> Fraction:
    """The largest time unit every value is a whole multiple of (times here are multiples of 1/1000 at most)."""
    return Fraction(1, math.lcm(1, *(Fraction(v).limit_denominator(1000).denominator for v in values if v)))


def peer_schedule(js: JobSet, budgets: dict[int, float], horizon: float, time_limit: float, workers: int,
                  hint: dict[int, float] | None = None):
    """(CP-SAT's status name, its start times in StageGraph units or None, seconds).

    Without ``hint``, any schedule ending by ``horizon``; with it (start time by job number), the shortest CP-SAT
    finds from there, within ``horizon``.
    """
    from ortools.sat.python import cp_model

    unit = _unit(js.duration + [d for ps in js.preds for _, d in ps] + [horizon])
    scale = int(1 / unit)

    def ticks(x: float) -> int:
        return int(round(x * scale))

    model = cp_model.CpModel()
    last = ticks(horizon)
    start, interval = [], []
    for k in range(len(js)):
        p = ticks(js.duration[k])
        s = model.new_int_var(ticks(js.head[k]), last - p - ticks(js.tail[k]), f"s{k}")
        start.append(s)
        interval.append(model.new_fixed_size_interval_var(s, p, f"job{k}"))
    for k in range(len(js)):  # dependencies with their transfer delays
        for i, delay in js.preds[k]:
            model.add(start[k] >= start[i] + ticks(js.duration[i]) + ticks(delay))
    for d, ks in js.on_device.items():  # one job at a time; activations within the budget
        model.add_no_overlap([interval[k] for k in ks])
        times, changes = [], []
        for k in ks:
            change = int(round(js.mem[k] * 1000))
            if change > 0:
                times.append(start[k])  # an F allocates at its start
            elif change < 0:
                times.append(start[k] + ticks(js.duration[k]))  # a backward frees at its end
            else:
                continue
            changes.append(change)
        model.add_reservoir_constraint(times, changes, 0, int(round(budgets[d] * 1000)))
    if hint is None:
        for chain in symmetric_forward_chains(js):  # interchangeable microbatches start the first stage in order
            for a, b in zip(chain, chain[1:]):
                model.add(start[a] <= start[b])
        # every job ends by the horizon (its start domain above); no objective: a search for any such schedule
        # found one where minimising the makespan found none in the same time
    else:  # from the hinted schedule (whose microbatches need not start in order), the shortest found
        makespan = model.new_int_var(0, last, "makespan")
        for k, s in enumerate(start):
            model.add_hint(s, ticks(hint[k]))
            model.add(makespan >= s + ticks(js.duration[k]))
        model.minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    t0 = time.monotonic()
    status = solver.solve(model)
    seconds = time.monotonic() - t0
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return solver.status_name(status), {k: solver.value(start[k]) / scale for k in range(len(js))}, seconds
    return solver.status_name(status), None, seconds


def main_(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--ratio", choices=sorted(RATIOS), required=True)
    parser.add_argument("--horizon", type=float, help="the makespan asked for (at most); with --hint, default: "
                        "the hint's makespan")
    parser.add_argument("--hint", metavar="PLAN.json", help="start from this schedule of the same case (opsched "
                        "compare ... --placement v --methods mip -o DIR writes DIR/mip/plan.json) and minimise")
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    try:
        import ortools  # noqa: F401
    except ImportError:
        print("bench_cpsat_peer: OR-Tools is not installed; install it with: pip install ortools", file=sys.stderr)
        return 2
    if args.horizon is None and args.hint is None:
        parser.error("give --horizon, or --hint to start from a schedule")
    sg, limit = grid_case(args.devices, args.microbatches, args.ratio)
    js = JobSet(sg, args.microbatches)
    hint = None if args.hint is None else _hint(js, args.hint, parser)
    horizon = args.horizon if args.horizon is not None else max(hint[k] + js.duration[k] for k in hint)
    budgets = activation_budgets(sg, limit)
    bound = lower_bound(js, budgets)
    status, starts, seconds = peer_schedule(js, budgets, horizon, args.time_limit, args.workers, hint)
    row = {"devices": args.devices, "microbatches": args.microbatches, "ratio": args.ratio, "horizon": horizon,
           "hint": args.hint, "memory_limit": limit, "opsched_bound": bound, "peer_status": status,
           "seconds": round(seconds, 1), "makespan": None}
    if starts is not None:
        # start times become an order; opsched's simulator times it and its validator checks it
        order = starts_to_order(js, starts)
        schedule = Schedule(sg, args.microbatches, simulate(sg, order, args.microbatches), memory_limit=limit,
                            name="cp-sat")
        validate(schedule)
        row["makespan"] = max(e.end for e in schedule.events)
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(row, fh, indent=1)
    return 0


def _hint(js: JobSet, path: str, parser: argparse.ArgumentParser) -> dict[int, float]:
    """Start time by job number of the schedule in ``path``, which must run exactly ``js``'s jobs, unpaired."""
    events = read_plan_schedule(path).events
    starts = {js.index.get(e.job): e.start for e in events}
    if None in starts or len(starts) != len(js) or any(e.pair is not None for e in events):
        parser.error(f"--hint {path}: not a schedule of this case's jobs without pairs (write it with opsched "
                     "compare on the same case, --placement v --methods mip -o DIR)")
    return starts


if __name__ == "__main__":
    sys.exit(main_())
