"""Predicted against measured step time on torch.distributed.pipelining (2 CPU ranks, 1 thread each).

1. Calibrate: run opsched's ZB-V order of a 4-stage tiny MoE transformer on 2
   gloo ranks with timers on; take each stage's F, I, W compute time (mean or
   median over microbatches and steps) and the one-way time of an
   activation-sized message; build a StageGraph from them.
   The edge time is that measured message time (``--comm fit`` fits it instead).
2. Plan: time opsched's baselines (and ``opsched.lower.solve`` when present)
   on that StageGraph, in V and interleaved placements of the same 4 stages,
   under the activation memory of the leanest built-in V schedule; pick the
   shortest predicted plan; export it to CSV.
3. Run: the opsched plan (from its CSV) and torch's built-in schedules
   (Schedule1F1B and ScheduleGPipe on the 4 stages merged in pairs,
   ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
   ScheduleDualPipeV), each in fresh processes; predicted = opsched's simulator
   on the schedule's own order with the calibrated times.

Prints a markdown table and writes JSON (``--json``). Figures are recorded in
docs/BENCHMARKS.md with the command that produced them.

    nice -n -10 python benchmarks/bench_torch.py --steps 10 --warmup 2 --rounds 2 --json /tmp/torch_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from opsched import baselines
from opsched.errors import OpschedError
from opsched.lower import solve
from opsched.export.torch_csv import csv_text, read_torch_csv, write_torch_csv
from opsched.schedule import Schedule, chain_stage_graph, metrics, simulate
from opsched.torchrun.calibrate import fit_overhead, merged_times, stage_graph_from_times
from opsched.torchrun.launch import RunJob, step_seconds
from opsched.torchrun.model import ModelSpec

#: torch built-in -> (opsched placement of the 4 stages, opsched baseline with the same order or None)
BUILTINS = {
    "1F1B": ("pairs", "1f1b"),
    "GPipe": ("pairs", None),
    "Interleaved1F1B": ("interleaved", None),
    "InterleavedZeroBubble": ("interleaved", None),
    "ZBVZeroBubble": ("v", None),
    "DualPipeV": ("v", None),
}


def compute_stat(results, stat: str) -> dict:
    """(stage, pass) -> mean or median compute time over every timed microbatch of a run."""
    pool: dict = {}
    for r in results:
        for key, vals in r.compute_seconds.items():
            pool.setdefault(key, []).extend(vals)
    f = statistics.fmean if stat == "mean" else statistics.median
    return {key: f(vals) for key, vals in pool.items()}


def torch_order(name: str, sg, microbatches: int, per_rank: int | None):
    """The order torch's built-in ``name`` runs, as an opsched order on ``sg`` (via its CSV)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(name, sg.num_devices, microbatches, per_rank)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.csv"
        path.write_text(csv_text([["" if a is None else str(a) for a in row] for row in ops]))
        return read_torch_csv(path, sg, microbatches)


def graphs(times: dict, comm: float, overhead: float = 0.0) -> dict:
    """The calibrated StageGraphs of the 4 stages: V, interleaved, and merged in pairs (2 stages).

    ``overhead`` is added to every action (after merging: a merged stage's
    pass is still one runtime action).
    """
    v = {0: 0, 1: 1, 2: 1, 3: 0}
    inter = {0: 0, 1: 1, 2: 0, 3: 1}
    return {
        "v": stage_graph_from_times(times, v, comm, overhead=overhead),
        "interleaved": stage_graph_from_times(times, inter, comm, overhead=overhead),
        # a merged stage holds two stages' activations per microbatch
        "pairs": stage_graph_from_times(merged_times(times, [[0, 1], [2, 3]]), {0: 0, 1: 1}, comm,
                                        act_bytes=2.0, act_w_bytes=1.0, overhead=overhead),
    }


def fused(order):
    """``order`` with every I run as a fused B and its W dropped (same memory, fewer actions)."""
    from opsched.schedule import Job

    return {d: [Job(a.stage, a.microbatch, "B") if a.pass_ == "I" else a for a in acts if a.pass_ != "W"]
            for d, acts in order.items()}


RANKS = {"v": {0: 0, 1: 1, 2: 1, 3: 0}, "interleaved": {0: 0, 1: 1, 2: 0, 3: 1}, "pairs": {0: 0, 1: 1}}


def opsched_candidates(gs: dict, microbatches: int, memory_limit: float, lower_seconds: float) -> list[tuple]:
    """(predicted makespan, name, placement, order) of every opsched plan within the memory limit."""
    out = []
    for placement in ("v", "interleaved", "pairs"):
        sg = gs[placement]
        for name in baselines.NAMES:
            try:
                order = baselines.baseline_order(name, sg, microbatches)
            except OpschedError:
                continue
            sched = Schedule(sg, microbatches, simulate(sg, order, microbatches))
            if max(metrics(sched).peak_activation_bytes) <= memory_limit + 1e-9:
                out.append((max(e.end for e in sched.events), name, placement, order))
        if lower_seconds > 0:
            try:
                for split_backward in (True, False):
                    result = solve(sg, microbatches, memory_limit=memory_limit, time_limit=lower_seconds,
                                   split_backward=split_backward, warm_orders=baselines.baseline_orders(sg, microbatches))
                    # re-time the MIP's order on the calibrated (unslotted) times
                    events = simulate(sg, result.order, microbatches)
                    kind = "I/W" if split_backward else "B"
                    out.append((max(e.end for e in events), f"lower-mip {kind} ({result.status})", placement,
                                result.order))
            except (OpschedError, TypeError) as exc:
                print(f"  lower.solve on {placement}: {exc}", file=sys.stderr)
    return sorted(out, key=lambda c: c[0])


def same_run_graph(sg, stats: dict, comm: float, overhead: float):
    """``sg`` re-timed with the action times measured in one run (under that run's load).

    Passes the run did not execute (I and W in a fused-B run) keep their
    calibrated times; ``overhead`` is added to every measured one.
    """
    from opsched.schedule import Edge, Stage, StageGraph

    stages = []
    for st in sg.stages:
        t = dict(st.time)
        for p in ("F", "I", "W", "B"):
            if (st.id, p) in stats and p in t:
                t[p] = stats[(st.id, p)] + overhead
        stages.append(Stage(st.id, st.devices, t, act_bytes=st.act_bytes, act_w_bytes=st.act_w_bytes, name=st.name))
    edges = [Edge(e.src, e.dst, time=comm if e.time > 0 else 0.0) for e in sg.edges]
    return StageGraph(stages, edges, num_devices=sg.num_devices)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    p.add_argument("--dim", type=int, default=256, help="model width (default 256: actions of ~10 ms)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--stat", choices=["mean", "median"], default="mean",
                   help="statistic of the calibrated per-action times (default mean: a step is a sum of actions)")
    p.add_argument("--lower-seconds", type=float, default=20.0, help="time limit of opsched.lower.solve, if present")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every schedule this many times, round-robin, pooling the steps (evens out load drift)")
    p.add_argument("--comm", choices=["fit", "pingpong"], default="pingpong",
                   help="edge time: the measured one-way time of an activation-sized message (default), or fitted "
                        "so the calibration run's simulated step equals its measured median (absorbs load drift "
                        "into the edge time; worse on a shared machine)")
    p.add_argument("--overhead", choices=["fit", "none"], default="fit",
                   help="per-action runtime cost outside the timed compute: fitted so the calibration runs' "
                        "simulated steps (split and fused backward) best match their measured medians (default), "
                        "or none")
    args = p.parse_args(argv)
    mb = args.microbatches
    spec = ModelSpec(dim=args.dim, hidden=2 * args.dim, experts=4, top_k=2, heads=4, seq=args.seq,
                     blocks=(1, 1, 1, 1), dtype="float32")
    t_start = time.time()
    load_before = os.getloadavg()[0]

    # 1. calibrate on opsched's ZB-V order, split (F, I, W) and fused (F, B), interleaved
    #    step by step in the same two processes
    from opsched.torchrun.launch import run_jobs_interleaved

    sg_unit = chain_stage_graph(4, devices=2, placement="v")
    calib_order = baselines.baseline_order("zb-v", sg_unit, mb)
    calib_orders = [calib_order, fused(calib_order)]
    with tempfile.TemporaryDirectory() as tmp:
        calib_jobs = []
        for k, order in enumerate(calib_orders):
            path = Path(tmp) / f"calib{k}.csv"
            write_torch_csv(path, sg=sg_unit, order=order, microbatches=mb)
            calib_jobs.append(RunJob(spec, RANKS["v"], mb, schedule="csv", csv_path=str(path),
                                     microbatch_size=args.microbatch_size, steps=args.steps, warmup=args.warmup,
                                     record_grads=False, measure_comm=True))
        calib_results = run_jobs_interleaved(calib_jobs, timeout=args.timeout)
    split = calibrated_times(calib_results, args.stat)
    pingpong = calib_results[0][0].comm_seconds or 0.0
    calib_medians = [statistics.median(step_seconds(r)) for r in calib_results]
    calib_median = calib_medians[0]
    fitted = fit_comm(split, RANKS["v"], calib_order, mb, calib_median)
    comm = fitted if args.comm == "fit" else pingpong
    overhead = (fit_overhead(lambda o: [makespan(graphs(split, comm, o)["v"], order, mb) for order in calib_orders],
                             calib_medians, largest=MAX_OVERHEAD)
                if args.overhead == "fit" else 0.0)
    gs = graphs(split, comm, overhead)
    print(f"per-action overhead {1e3 * overhead:.2f} ms")
    print("calibrated (ms): " + ", ".join(f"{s}{p} {1e3 * t:.2f}" for (s, p), t in sorted(split.items()))
          + f"; one-way message {1e3 * pingpong:.2f}, fitted edge time {1e3 * fitted:.2f} "
          f"(calibration step medians {', '.join(f'{1e3 * m:.1f}' for m in calib_medians)})")

    # 2. what to run: torch built-ins with their own orders, and the opsched plan
    entries = []
    for name, (placement, same_as) in BUILTINS.items():
        sg = gs[placement]
        if same_as is not None:
            # torch reports Schedule1F1B's last rank with forwards numbered 1..M;
            # its runtime runs opsched's 1F1B order (docs/torch.md)
            order = baselines.baseline_order(same_as, sg, mb)
        else:
            order = torch_order(name, sg, mb, None if placement == "pairs" else 2)
        entries.append({"schedule": f"torch {name}", "builtin": name, "placement": placement, "order": order})
    # the opsched plan gets DualPipeV's activation memory (PP + 1 microbatches: "the same memory as DualPipe")
    for e in entries:
        sched = Schedule(gs[e["placement"]], mb, simulate(gs[e["placement"]], e["order"], mb))
        e["predicted"] = max(ev.end for ev in sched.events)
        e["peak"] = max(metrics(sched).peak_activation_bytes)
    limit = next(e["peak"] for e in entries if e["builtin"] == "DualPipeV")
    cands = opsched_candidates(gs, mb, limit, args.lower_seconds)
    predicted, name, placement, order = cands[0]
    sched = Schedule(gs[placement], mb, simulate(gs[placement], order, mb))
    entries.append({"schedule": f"opsched {name} (CSV)", "builtin": None, "placement": placement, "order": order,
                    "predicted": predicted, "peak": max(metrics(sched).peak_activation_bytes)})
    print(f"opsched plan: {name} on the {placement} placement, predicted {1e3 * predicted:.1f} ms "
          f"(memory limit {limit:g} stage activations per device, one per stage and microbatch)")

    # 3. run everything: in each round, all schedules share two fresh processes and take
    #    turns step by step, so they see the same load; ZB-V's action times from the same
    #    processes give a second calibration ("interleaved calibration")
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.csv"
        write_torch_csv(plan_path, sg=gs[placement], order=order, microbatches=mb)
        plan_csv = plan_path.read_text()
        jobs = [
            RunJob(spec.with_blocks((2, 2) if e["placement"] == "pairs" else (1, 1, 1, 1)), RANKS[e["placement"]], mb,
                   schedule=e["builtin"] or "csv", csv_path=None if e["builtin"] else str(plan_path),
                   microbatch_size=args.microbatch_size, steps=args.steps, warmup=args.warmup,
                   record_grads=False, measure_comm=True)
            for e in entries
        ]
        for _ in range(args.rounds):
            all_results = run_jobs_interleaved(jobs, timeout=args.timeout)
            names = [e["builtin"] for e in entries]
            zbv, i1f1b = (all_results[names.index(n)] for n in ("ZBVZeroBubble", "Interleaved1F1B"))
            inter_times = calibrated_times([zbv, i1f1b], args.stat)
            inter_comm = zbv[0].comm_seconds or 0.0
            fit_entries = [entries[names.index(n)] for n in ("ZBVZeroBubble", "Interleaved1F1B")]
            inter_overhead = (fit_overhead(
                lambda o: [makespan(graphs(inter_times, inter_comm, o)[e["placement"]], e["order"], mb)
                           for e in fit_entries],
                [statistics.median(step_seconds(r)) for r in (zbv, i1f1b)], largest=MAX_OVERHEAD)
                if args.overhead == "fit" else 0.0)
            inter_gs = graphs(inter_times, inter_comm, inter_overhead)
            for e, results in zip(entries, all_results):
                measured = step_seconds(results)
                e.setdefault("measured", []).extend(measured)
                e.setdefault("round_medians", []).append(statistics.median(measured))
                e.setdefault("busy", []).extend(max(b) for b in zip(*(r.busy_seconds for r in results)))
                own = same_run_graph(gs[e["placement"]], compute_stat(results, args.stat), inter_comm, inter_overhead)
                e.setdefault("same_run", []).append(max(ev.end for ev in simulate(own, e["order"], mb)))
                g = inter_gs[e["placement"]]
                e.setdefault("inter", []).append(max(ev.end for ev in simulate(g, e["order"], mb)))
                print(f"  {e['schedule']}: median {1e3 * statistics.median(measured):.1f} ms", flush=True)
    rows = [_row(e["schedule"], e["placement"], e["predicted"], e["measured"], e["peak"],
                 statistics.median(e["same_run"]), e["busy"]) for e in entries]
    for r, e in zip(rows, entries):
        r["round_medians_ms"] = [round(1e3 * m, 1) for m in e["round_medians"]]
        r["round_predicted_interleaved_calibration_ms"] = [round(1e3 * x, 1) for x in e["inter"]]
        r["round_error_interleaved_calibration_pct"] = [
            round(100 * (x - m) / m, 1) for x, m in zip(e["inter"], e["round_medians"])]
        r["predicted_interleaved_calibration_ms"] = 1e3 * statistics.median(e["inter"])
        r["error_interleaved_calibration_pct"] = 100 * (statistics.median(e["inter"]) - statistics.median(
            e["measured"])) / statistics.median(e["measured"])
    for r in rows:
        print(r["line"])

    fair = [r for r in rows[:-1] if r["peak_act"] <= limit + 1e-9]
    best_builtin = min(fair, key=lambda r: r["measured_median_ms"])
    ours = rows[-1]
    summary = {
        "command": "python benchmarks/bench_torch.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": __import__("torch").__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "seconds": time.time() - t_start,
        "stat": args.stat,
        "calibration_ms": {f"{s}{p}": 1e3 * t for (s, p), t in sorted(split.items())},
        "calibration_run_median_ms": 1e3 * calib_median,
        "calibration_run_medians_ms": {"zb-v split": 1e3 * calib_medians[0], "zb-v fused": 1e3 * calib_medians[1]},
        "one_way_message_ms": 1e3 * pingpong,
        "fitted_edge_ms": 1e3 * fitted,
        "edge_ms_used": 1e3 * comm,
        "overhead_ms": 1e3 * overhead,
        "memory_limit_microbatches": limit,
        "opsched_candidates": [(c[1], c[2], 1e3 * c[0]) for c in cands],
        "plan_csv": plan_csv,
        "rows": [{k: v for k, v in r.items() if k != "line"} for r in rows],
        "within_15pct": [r["schedule"] for r in rows if abs(r["error_pct"]) <= 15],
        "within_15pct_same_run": [r["schedule"] for r in rows if abs(r["error_same_run_pct"]) <= 15],
        "within_15pct_interleaved_calibration": [
            r["schedule"] for r in rows if abs(r["error_interleaved_calibration_pct"]) <= 15],
        "opsched_vs_best_builtin": {
            "best_builtin_within_memory": best_builtin["schedule"],
            "best_builtin_ms": best_builtin["measured_median_ms"],
            "opsched_ms": ours["measured_median_ms"],
            "opsched_no_slower": ours["measured_median_ms"] <= best_builtin["measured_median_ms"],
        },
    }
    print()
    print("| schedule | stages on ranks | predicted ms (error) | predicted, interleaved calibration ms (error) "
          "| predicted from same-run times ms (error) "
          "| measured median ms (IQR) | measured min ms | busiest rank's compute ms | peak act. (stage activations) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schedule']} | {r['placement']} | {r['predicted_ms']:.1f} ({r['error_pct']:+.1f} %) "
              f"| {r['predicted_interleaved_calibration_ms']:.1f} ({r['error_interleaved_calibration_pct']:+.1f} %) "
              f"| {r['predicted_same_run_ms']:.1f} ({r['error_same_run_pct']:+.1f} %) | {r['measured_median_ms']:.1f} "
              f"({r['measured_q1_ms']:.1f}-{r['measured_q3_ms']:.1f}) | {r['measured_min_ms']:.1f} "
              f"| {r['busiest_rank_compute_ms']:.1f} | {r['peak_act']:g} |")
    print("\nper round, measured median ms (error of the interleaved-calibration prediction): " + "; ".join(
        f"{r['schedule']} " + ", ".join(f"{m} ({x:+.1f} %)" for m, x in zip(
            r["round_medians_ms"], r["round_error_interleaved_calibration_pct"])) for r in rows))
    print(f"\nwithin 15 %: {len(summary['within_15pct'])}/{len(rows)} (interleaved calibration: "
          f"{len(summary['within_15pct_interleaved_calibration'])}/{len(rows)}; same-run times: "
          f"{len(summary['within_15pct_same_run'])}/{len(rows)}); opsched vs best built-in within its memory "
          f"({best_builtin['schedule']}): {ours['measured_median_ms']:.1f} vs {best_builtin['measured_median_ms']:.1f} ms; "
          f"load average {load_before:.2f} -> {summary['load_average_after']:.2f}; {summary['seconds']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


def calibrated_times(runs, stat: str) -> dict:
    """(stage, pass) -> calibrated compute time, F, I and W and fused B, pooled over ``runs``."""
    pooled = [r for results in runs for r in results]
    return {k: v for k, v in compute_stat(pooled, stat).items() if k[1] in ("F", "I", "W", "B")}


def makespan(sg, order, microbatches: int) -> float:
    return max(e.end for e in simulate(sg, order, microbatches))


#: the largest per-action overhead a fit may return (seconds)
MAX_OVERHEAD = 0.02


def fit_comm(times: dict, ranks: dict, order, microbatches: int, target: float) -> float:
    """The edge time at which the simulated step of ``order`` equals ``target`` (bisection; 0 if already over).

    It stands for everything a cross-rank dependency costs besides compute:
    the message, the runtime's bookkeeping, and waking the waiting process.
    """
    def step(comm: float) -> float:
        sg = stage_graph_from_times(times, ranks, comm)
        return max(e.end for e in simulate(sg, order, microbatches))

    lo, hi = 0.0, max(target, 1e-6)
    if step(lo) >= target:
        return 0.0
    while step(hi) < target:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _row(schedule, placement, predicted, measured, peak, same_run, busy) -> dict:
    med = statistics.median(measured)
    q = statistics.quantiles(measured, n=4) if len(measured) >= 2 else [med, med, med]
    row = {
        "schedule": schedule,
        "placement": placement,
        "predicted_ms": 1e3 * predicted,
        "predicted_same_run_ms": 1e3 * same_run,
        "measured_median_ms": 1e3 * med,
        "measured_q1_ms": 1e3 * q[0],
        "measured_q3_ms": 1e3 * q[2],
        "error_pct": 100 * (predicted - med) / med,
        "error_same_run_pct": 100 * (same_run - med) / med,
        "peak_act": peak,
        "measured_min_ms": 1e3 * min(measured),
        "busiest_rank_compute_ms": 1e3 * statistics.median(busy),
    }
    row["line"] = (f"{schedule:32s} {placement:12s} predicted {row['predicted_ms']:7.1f} ms "
                   f"({row['error_pct']:+.1f} %), from same-run action times {row['predicted_same_run_ms']:7.1f} ms "
                   f"({row['error_same_run_pct']:+.1f} %), measured median {row['measured_median_ms']:7.1f} ms, "
                   f"peak act {peak:g}")
    return row


if __name__ == "__main__":
    sys.exit(main())
