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
time, and the row says whether the least bound over the placements is above
it (then no schedule reaches the target with that busy time).

Usage::

    python benchmarks/bench_dualpipe_grid.py [--devices 4,8] [--time-limit 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import time

from opsched.baselines import NAMES
from opsched.cli import main

RATIOS = {"1:1:1": (1.0, 1.0, 1.0), "1:1.5:0.5": (1.0, 1.5, 0.5), "2:2:1": (2.0, 2.0, 1.0)}
GAINS = (0.0, 0.5, 1.0)


def run_case(d: int, m: int, ratio: str, gain: float, time_limit: float) -> dict:
    """The compare rows of one case, by method, with the wall-clock seconds of the command."""
    f, i, w = RATIOS[ratio]
    argv = ["compare", "--devices", str(d), "--stages", str(2 * d), "--placement", "auto", "--microbatches", str(m),
            "--f", f"{f:g}", "--b", f"{i + w:g}", "--w", f"{w:g}", "--overlap-gain", f"{gain:g}",
            "--memory-limit", "dualpipev", "--time-limit", f"{time_limit:g}", "--json", "--quiet"]
    out = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    seconds = time.monotonic() - t0
    if code != 0:
        raise SystemExit(f"case D={d} M={m} {ratio} G={gain}: exit {code}")
    return {"rows": {r["method"]: r for r in json.loads(out.getvalue())}, "seconds": seconds,
            "command": "opsched " + " ".join(argv[:-2])}


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
             verdict, *idle_cells(rows, d), f"{case['seconds']:.0f}"]
    return "| " + " | ".join(cells) + " |"


def idle_cells(rows: dict, d: int) -> list[str]:
    """mip's idle over DualPipeV's, the makespan for half DualPipeV's idle, and whether the target is met or bounded."""
    mip, dpv = rows["mip"], rows["dualpipev"]
    if mip["makespan"] is None or dpv["makespan"] is None or not sum(dpv["idle"]):
        return ["-", "-", "-"]
    ratio = sum(mip["idle"]) / sum(dpv["idle"])
    half = dpv["makespan"] - 0.5 * sum(dpv["idle"]) / d
    bound = mip.get("lower_bound_all_placements")
    verdict = "met" if ratio <= 0.5 + 1e-9 else "bound above" if bound is not None and bound > half + 1e-9 else "not met"
    return [f"{ratio:.2f}", f"{half:.4g}", verdict]


def main_(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="4,8")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    header = ["D", "M", "F:I:W", "gain", *NAMES, "mip", "mip placement", "bound (that placement)",
              "bound (all tried)", "status", "mip vs best baseline", "idle / dualpipev's", "makespan for half",
              "half idle", "s"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    results = []
    for d in (int(x) for x in args.devices.split(",")):
        for m, ratio, gain in itertools.product((2 * d, 4 * d), RATIOS, GAINS):
            case = run_case(d, m, ratio, gain, args.time_limit)
            print(row_text(d, m, ratio, gain, case), flush=True)
            results.append({"devices": d, "microbatches": m, "ratio": ratio, "gain": gain, **case})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main_()
