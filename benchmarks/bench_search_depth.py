"""The lower level's search without its work budget, on one DualPipe-grid case: does more search find more?

``opsched compare`` stops the neighbourhood search after
``opsched.lower.solve.SEARCH_BUDGET`` sub-MIPs (or at ``--time-limit``).
This script solves one grid case on the V (``bench_dualpipe_grid.py``: 2D
stages, F:I:W, overlap gain, memory = DualPipeV's peak) with
``search_budget=None``: the search then sweeps until a sweep at full width
finds nothing, a local optimum of its neighbourhoods, within
``--time-limit``. Warm starts are the hand-written schedules, as in
``compare``. It prints the makespan, the proven bound, the status, the
sub-MIPs solved, the seconds and the idle device-time (makespan less busy
time, an overlapped pair counted once, summed over the devices).

Usage::

    python benchmarks/bench_search_depth.py --devices 16 --microbatches 32 --ratio 1:1.5:0.5 [--gain 0] \\
        [--time-limit 1200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench_dualpipe_grid import RATIOS, grid_case  # the grid's V and its memory have one home

from opsched.baselines import baseline_orders
from opsched.lower.solve import solve
from opsched.schedule import metrics


def main_(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--ratio", choices=sorted(RATIOS), required=True)
    parser.add_argument("--gain", type=float, default=0.0, help="overlap gain (default 0)")
    parser.add_argument("--time-limit", type=float, default=1200.0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    sg, limit = grid_case(args.devices, args.microbatches, args.ratio, args.gain)
    t0 = time.monotonic()
    result = solve(sg, args.microbatches, memory_limit=limit, time_limit=args.time_limit,
                   warm_orders=baseline_orders(sg, args.microbatches), search_budget=None)
    seconds = time.monotonic() - t0
    idle = sum(metrics(result.schedule).idle)  # as compare reports it (the grid's idle column)
    row = {"devices": args.devices, "microbatches": args.microbatches, "ratio": args.ratio, "gain": args.gain,
           "memory_limit": limit, "makespan": result.makespan, "lower_bound": result.lower_bound,
           "status": result.status.value, "sub_mips": result.search_solves, "seconds": round(seconds, 1),
           "idle": idle}
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(row, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main_())
