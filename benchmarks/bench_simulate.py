"""The simulator's speed: timing the DualPipe grid's warm orders, and pairing them up one merge at a time.

Every search of the lower level (the start phase, pairing up, parting and
thinning pairs, the neighbourhood search's acceptance) times orders with
:func:`opsched.schedule.simulate`; where a clock ends a search, its speed
decides how far the search gets. Cases: the V of ``bench_dualpipe_grid.py``
(2D stages, F:I:W 2:2:1, overlap gain 0.5, memory = DualPipeV's peak) at D
devices and M microbatches. For each case it prints the median wall time of
``--repeats`` simulations of Zero Bubble's V and of DualPipeV's order (and
per job), and the seconds :func:`opsched.lower.pairing.pair_up` takes from
Zero Bubble's V one merge at a time within ``--simulations`` simulations
(most of them resumed where the merge changed the order), with the pairs it
merged: a deterministic amount of work, so the figures compare code
versions.

Usage::

    python benchmarks/bench_simulate.py [--cases 8x16,8x32,16x32,16x64] [--repeats 20] [--simulations 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench_dualpipe_grid import case_argv  # the grid's cases have one home

from opsched.cli import build_parser
from opsched.commands.compare import resolve_limit, stage_graph_from_args
from opsched.lower.jobs import JobSet, activation_budgets
from opsched.lower.pairing import pair_up
from opsched.lower.starts import split_fused_backward
from opsched.plan.placements import placements_to_try
from opsched.schedule import simulate


def measure(devices: int, microbatches: int, repeats: int, simulations: int) -> dict:
    """One case's figures (see the module docstring)."""
    args = build_parser().parse_args(case_argv(devices, microbatches, "2:2:1", 0.5, placement="v"))
    sg, _ = stage_graph_from_args(args)
    limit, _ = resolve_limit("dualpipev", sg, microbatches, args)
    v = next(c for c in placements_to_try(sg, microbatches, "v") if c.stage_graph is not None)
    row = {"devices": devices, "microbatches": microbatches}
    for name in ("zb-v", "dualpipev"):
        order = v.warm_orders[name]
        jobs = len(simulate(v.stage_graph, order, microbatches))  # also fills the graph's caches, as a search has
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            simulate(v.stage_graph, order, microbatches)
            seconds.append(time.perf_counter() - t0)
        row[name] = {"jobs": jobs, "ms": 1e3 * statistics.median(seconds),
                     "us_per_job": 1e6 * statistics.median(seconds) / jobs}
    js = JobSet(v.stage_graph, microbatches, True)
    t0 = time.perf_counter()
    paired = pair_up(js, split_fused_backward(v.warm_orders["zb-v"]), activation_budgets(v.stage_graph, limit),
                     max_simulations=simulations)
    row["pair_up"] = {"seconds": time.perf_counter() - t0, "simulations": paired.simulations,
                      "merges": paired.merges, "makespan": paired.makespan}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="8x16,8x32,16x32,16x64", help="DxM,... (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--simulations", type=int, default=100, help="pair_up's budget (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    print("| D | M | jobs | zb-v ms | dualpipev ms | us per job (zb-v) | pair-up s (simulations, merges, makespan) |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for d, m in cases:
        row = measure(d, m, args.repeats, args.simulations)
        rows.append(row)
        pu = row["pair_up"]
        print(f"| {d} | {m} | {row['zb-v']['jobs']} | {row['zb-v']['ms']:.1f} | {row['dualpipev']['ms']:.1f} | "
              f"{row['zb-v']['us_per_job']:.2f} | {pu['seconds']:.2f} ({pu['simulations']}, {pu['merges']}, "
              f"{pu['makespan']:g}) |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
