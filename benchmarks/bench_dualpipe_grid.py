"""The DualPipe grid (issue 11): `opsched compare` on 2D stages in a V, memory = DualPipeV's peak.

Cases: D in {4, 8, 16} devices (``--devices``), M in {2D, 4D} microbatches,
F:I:W in {1:1:1, 1:1.5:0.5, 2:2:1}, overlap gain in {0, 0.5, 1}. Each case runs

    opsched compare --devices D --stages 2D --placement auto --microbatches M --f F --b I+W --w W
                    --overlap-gain G --memory-limit dualpipev --time-limit T --json

and prints one markdown row: every baseline's makespan (or "-" when it is
refused, over the memory or not applicable), mip's makespan, the placement
it kept, its lower bound on that placement, the least bound over the
placements tried, its status, and its idle time against DualPipeV's: the
target is at most half of DualPipeV's idle (device-time summed over
devices); where it is not met, "makespan for half" is the makespan at which
the devices would idle half as long as under DualPipeV with the same busy
time. "idle floor" is the least idle any schedule can have, from
``lower.bounds.idle_lower_bound`` summed over the devices (before each
device's first job, and the makespan bound less the longest the device can
be busy; pairs or not), on the V and over every placement tried: where it
is above half DualPipeV's idle the row says "out of reach" on the V, or on
every placement tried. The floor is computed at DualPipeV's peak, as the solve is.

Usage::

    python benchmarks/bench_dualpipe_grid.py [--devices 4,8] [--gains 0,0.5,1] [--time-limit 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import time

from opsched.baselines import NAMES
from opsched.cli import build_parser, main
from opsched.commands.compare import resolve_limit, stage_graph_from_args
from opsched.lower.bounds import idle_lower_bound
from opsched.lower.jobs import JobSet, activation_budgets
from opsched.plan.placements import placements_to_try

RATIOS = {"1:1:1": (1.0, 1.0, 1.0), "1:1.5:0.5": (1.0, 1.5, 0.5), "2:2:1": (2.0, 2.0, 1.0)}
GAINS = (0.0, 0.5, 1.0)


def case_argv(d: int, m: int, ratio: str, gain: float, placement: str = "auto") -> list[str]:
    """The ``opsched compare`` arguments of one case: its pipeline, placement and memory (no method options)."""
    f, i, w = RATIOS[ratio]
    return ["compare", "--devices", str(d), "--stages", str(2 * d), "--placement", placement, "--microbatches", str(m),
            "--f", f"{f:g}", "--b", f"{i + w:g}", "--w", f"{w:g}", "--overlap-gain", f"{gain:g}",
            "--memory-limit", "dualpipev"]


def grid_case(devices: int, microbatches: int, ratio: str, gain: float = 0.0):
    """(the V StageGraph, its memory limit = DualPipeV's peak) of one case, as ``compare`` builds them."""
    args = build_parser().parse_args(case_argv(devices, microbatches, ratio, gain, placement="v"))
    sg, _ = stage_graph_from_args(args)
    limit, _ = resolve_limit("dualpipev", sg, microbatches, args)
    v = next(c.stage_graph for c in placements_to_try(sg, microbatches, "v") if c.stage_graph is not None)
    return v, limit


def run_case(d: int, m: int, ratio: str, gain: float, time_limit: float) -> dict:
    """The compare rows of one case, by method, with the wall-clock seconds of the command."""
    argv = case_argv(d, m, ratio, gain) + ["--time-limit", f"{time_limit:g}", "--json", "--quiet"]
    out = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    seconds = time.monotonic() - t0
    if code != 0:
        raise SystemExit(f"case D={d} M={m} {ratio} G={gain}: exit {code}")
    rows = {r["method"]: r for r in json.loads(out.getvalue())}
    return {"rows": rows, "seconds": seconds, "command": "opsched " + " ".join(argv[:-2]),
            "idle_floor": idle_floors(argv, m, rows["dualpipev"]["peak_memory_bytes"])}


def idle_floors(argv: list[str], m: int, limit: float) -> dict[str, float]:
    """Per placement compare tries, the least idle (device-time summed over devices) of any schedule on it at
    ``limit`` (the memory the case gives every method)."""
    args = build_parser().parse_args(argv)
    sg, _ = stage_graph_from_args(args)
    out = {}
    for c in placements_to_try(sg, m, "auto"):
        if c.stage_graph is not None:
            budgets = activation_budgets(c.stage_graph, limit)
            out[c.placement] = sum(idle_lower_bound(JobSet(c.stage_graph, m), budgets).values())
    return out


def _g(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def row_text(d: int, m: int, ratio: str, gain: float, case: dict) -> str:
    rows = case["rows"]
    mip = rows["mip"]
    base = [_g(rows[n]["makespan"]) for n in NAMES]
    fitted = [rows[n]["makespan"] for n in NAMES if rows[n]["makespan"] is not None]
    best = min(fitted) if fitted else None
    verdict = "-" if best is None or mip["makespan"] is None else ("<=" if mip["makespan"] <= best + 1e-9 else ">")
    cells = [str(d), str(m), ratio, f"{gain:g}", *base, _g(mip["makespan"]), mip.get("placement_name", "-"),
             _g(mip.get("lower_bound")), _g(mip.get("lower_bound_all_placements")), str(mip.get("status")),
             verdict, *idle_cells(rows, d, case["idle_floor"]), f"{case['seconds']:.0f}"]
    return "| " + " | ".join(cells) + " |"


def idle_cells(rows: dict, d: int, floors: dict[str, float]) -> list[str]:
    """mip's idle over DualPipeV's, the makespan for half DualPipeV's idle, the idle floors (V, least over the
    placements tried), and whether the target is met, or proven out of reach by a floor."""
    mip, dpv = rows["mip"], rows["dualpipev"]
    if mip["makespan"] is None or dpv["makespan"] is None or not sum(dpv["idle"]):
        return ["-"] * 5
    target = 0.5 * sum(dpv["idle"])
    ratio = sum(mip["idle"]) / sum(dpv["idle"])
    half = dpv["makespan"] - target / d
    v_floor, least = floors.get("v"), min(floors.values())
    verdict = ("met" if ratio <= 0.5 + 1e-9 else "out of reach" if least > target + 1e-9
               else "out of reach on the V" if v_floor is not None and v_floor > target + 1e-9 else "not met")
    return [f"{ratio:.2f}", f"{half:.4g}", f"{target:.4g}", f"{_g(v_floor)} / {least:.4g}", verdict]


def main_(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="4,8")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--gains", default=",".join(f"{g:g}" for g in GAINS), help="overlap gains to run (default: all)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    gains = [float(g) for g in args.gains.split(",")]
    header = ["D", "M", "F:I:W", "gain", *NAMES, "mip", "mip placement", "bound (that placement)",
              "bound (all tried)", "status", "mip vs best baseline", "idle / dualpipev's", "makespan for half",
              "half dualpipev's idle", "idle floor (V / all tried)", "half idle", "s"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    results = []
    for d in (int(x) for x in args.devices.split(",")):
        for m, ratio, gain in itertools.product((2 * d, 4 * d), RATIOS, gains):
            case = run_case(d, m, ratio, gain, args.time_limit)
            print(row_text(d, m, ratio, gain, case), flush=True)
            results.append({"devices": d, "microbatches": m, "ratio": ratio, "gain": gain, **case})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main_()
