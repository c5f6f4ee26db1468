"""Lower-level benchmark suite (issue 4): the MIP against every baseline that fits the same memory.

Cases:

* ``dualpipe``: F = I = W = 1, 4 devices x 2 stages in a V, 16 microbatches,
  memory = DualPipeV's peak;
* ``v-tight``: the same V pipeline with memory 5 (below every baseline's
  peak), where the neighbourhood search has to do the work;
* ``zb-p`` / ``zb-2p``: Zero Bubble's setting (p = 8, m = 24, T_F 18.522,
  T_I 18.086, T_W 9.337, transfer 0.601), memory p*M_B and 2p*M_B (M_B = 1,
  act_w = 0.5); the MIP minimises their cost (``objective="zb-span"``);
* ``uneven``: the same with stages 0 and 7 1.5x heavier (embedding, head), memory p*M_B;

The three chain cases and ``towers`` also run the MIP on ZB-V's V placement of
the (linearized) chain (row ``mip-v``), since the V baselines re-place the
chain that way.
* ``towers``: a two-tower StageGraph (3 + 2 stages joining into 3), Zero Bubble's costs, memory 8;
  the baselines run its chain-only linearization (``placement.linearize``:
  the towers one after the other, as a chain-only runtime would run them);
* ``scale``: 8 devices x 2 stages (V), 32 microbatches, I/W split (1,536 jobs),
  memory = ZB-V's peak.

Usage::

    python benchmarks/bench_lower.py --solver cbc --time-limit 120 [--search-budget N] [--cases dualpipe,zb-p] [--json out.json]

Prints one markdown table per case (makespan, bubble ratio, the Zero Bubble
paper's bubble rate, idle per device, peak memory, lower bound, gap, seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from opsched.baselines import NAMES, baseline_orders, placed_stage_graph, run_baseline
from opsched.schedule.placement import linearize
from opsched.errors import OpschedError
from opsched.lower import solve
from opsched.lower.solve import SEARCH_BUDGET
from opsched.schedule import Edge, Stage, StageGraph, chain_stage_graph, metrics, validate, zb_bubble_rate

ZB = dict(f=18.522, i=18.086, w=9.337, comm=0.601)


def zb_chain(scale_ends: float = 1.0) -> StageGraph:
    """Zero Bubble's p = 8 chain; stages 0 and 7 scaled by ``scale_ends``."""
    k = [scale_ends] + [1.0] * 6 + [scale_ends]
    return chain_stage_graph(
        8,
        f=[ZB["f"] * x for x in k],
        b=[(ZB["i"] + ZB["w"]) * x for x in k],
        w=[ZB["w"] * x for x in k],
        comm=ZB["comm"],
    )


def towers() -> StageGraph:
    """Two towers (stages 0-2 and 3-4) joining into stages 5-7, one stage per device."""
    times = {"F": ZB["f"], "I": ZB["i"], "W": ZB["w"]}
    light = {p: 0.6 * t for p, t in times.items()}
    stages = [Stage(k, (k,), light if k in (3, 4) else times, name=f"s{k}") for k in range(8)]
    edges = [Edge(a, b, ZB["comm"]) for a, b in ((0, 1), (1, 2), (2, 5), (3, 4), (4, 5), (5, 6), (6, 7))]
    return StageGraph(stages, edges, num_devices=8)


def cases():
    v4 = chain_stage_graph(8, devices=4, placement="v", f=1, b=2, w=1)
    v8 = chain_stage_graph(16, devices=8, placement="v", f=1, b=2, w=1)
    return {
        "dualpipe": dict(sg=v4, m=16, memory=("method", "dualpipev"), objective="makespan"),
        "v-tight": dict(sg=v4, m=16, memory=5.0, objective="makespan"),
        "zb-p": dict(sg=zb_chain(), m=24, memory=8.0, objective="zb-span", also_v=True),
        "zb-2p": dict(sg=zb_chain(), m=24, memory=16.0, objective="zb-span", also_v=True),
        "uneven": dict(sg=zb_chain(1.5), m=24, memory=8.0, objective="makespan", also_v=True),
        "towers": dict(sg=towers(), m=24, memory=8.0, objective="makespan", linearize=True, also_v=True),
        "scale": dict(sg=v8, m=32, memory=("method", "zb-v"), objective="makespan"),
    }


def row(name, schedule, extra=None):
    m = metrics(schedule)
    out = {
        "method": name,
        "makespan": m.makespan,
        "bubble_ratio": m.bubble_ratio,
        "zb_bubble_rate": zb_bubble_rate(schedule),
        "idle_max": max(m.idle),
        "idle_min": min(m.idle),
        "peak_memory": max(m.peak_memory_bytes),
    }
    out.update(extra or {})
    return out


def run_case(name, case, solver, time_limit, threads, budget=SEARCH_BUDGET):
    sg, m = case["sg"], case["m"]
    memory = case["memory"]
    if isinstance(memory, tuple):
        memory = max(metrics(run_baseline(memory[1], sg, m)).peak_memory_bytes)
    rows = []
    chain = linearize(sg) if case.get("linearize") else sg
    for method in NAMES:
        try:
            schedule = run_baseline(method, chain, m, memory_limit=memory,
                                    comm=max((e.time for e in sg.edges), default=0.0))
        except OpschedError as exc:
            rows.append({"method": method, "skipped": str(exc)})
            continue
        rows.append(row(method, schedule))
    graphs = {"mip": sg}
    if case.get("also_v"):  # the same chain in ZB-V's V placement, as the V baselines run it
        graphs["mip-v"] = placed_stage_graph("zb-v", chain, m, max(e.time for e in sg.edges))
    for label, graph in graphs.items():
        t = time.monotonic()
        result = solve(graph, m, memory_limit=memory, time_limit=time_limit, solver=solver, threads=threads,
                       warm_orders=baseline_orders(graph, m),
                       objective=case["objective"], search_budget=budget)
        validate(result.schedule)
        rows.append(row(label, result.schedule, {
            "lower_bound": result.lower_bound, "gap": result.gap, "status": result.status,
            "objective": case["objective"], "solve_seconds": time.monotonic() - t,
            "warm_start": result.warm_start, "slot": result.slot, "search_solves": result.search_solves,
            "log_last": result.log[-1] if result.log else None,
            "idle": metrics(result.schedule).idle,
        }))
    return {"case": name, "memory": memory, "microbatches": m, "solver": solver, "rows": rows}


def markdown(res):
    lines = [f"### {res['case']} (memory {res['memory']:g}, {res['microbatches']} microbatches, solver {res['solver']})", "",
             "| method | makespan | bubble ratio | ZB bubble rate | idle/device (max) | peak memory | lower bound | gap | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['method']} | — ({r['skipped'][:70]}) | | | | | | | |")
            continue
        lb = f"{r['lower_bound']:.4g} ({r['objective']})" if "lower_bound" in r else ""
        gap = f"{r['gap']:.4f} {r['status']}" if "gap" in r else ""
        secs = f"{r['solve_seconds']:.1f} ({r['search_solves']} sub-MIPs)" if "solve_seconds" in r else ""
        lines.append(
            f"| {r['method']} | {r['makespan']:.6g} | {r['bubble_ratio']:.4f} | {r['zb_bubble_rate']:.4f} | "
            f"{r['idle_max']:.4g} | {r['peak_memory']:.4g} | {lb} | {gap} | {secs} |"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--solver", default="cbc", choices=("cbc", "highs"))
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--search-budget", type=int, default=SEARCH_BUDGET, help="neighbourhood sub-MIPs (solve's default)")
    ap.add_argument("--cases", default=",".join(cases()))
    ap.add_argument("--json", help="also write the results as JSON")
    args = ap.parse_args()
    all_cases = cases()
    results = []
    print(f"load average at start: {os.getloadavg()}")
    for name in args.cases.split(","):
        res = run_case(name, all_cases[name], args.solver, args.time_limit, args.threads, args.search_budget)
        results.append(res)
        print(markdown(res), flush=True)
        print(flush=True)
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
