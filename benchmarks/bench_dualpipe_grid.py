"""The DualPipe grid (issue 11), a subset: `opsched compare` on 2D stages in a V, memory = DualPipeV's peak.

Cases: D in {4, 8} devices, M in {2D, 4D} microbatches, F:I:W in {1:1:1,
2:2:1}, overlap gain in {0, 0.5, 1}. Each case runs

    opsched compare --devices D --stages 2D --placement auto --microbatches M --f F --b I+W --w W
                    --overlap-gain G --memory-limit dualpipev --time-limit T --json

and prints one markdown row: every baseline's makespan (or "-" when it is
refused, over the memory or not applicable), mip's makespan, the placement
it kept, its lower bound on that placement, the least bound over the
placements tried, and its status.

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

RATIOS = {"1:1:1": (1.0, 1.0, 1.0), "2:2:1": (2.0, 2.0, 1.0)}
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
             verdict, f"{case['seconds']:.0f}"]
    return "| " + " | ".join(cells) + " |"


def main_(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="4,8")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    header = ["D", "M", "F:I:W", "gain", *NAMES, "mip", "mip placement", "bound (that placement)",
              "bound (all tried)", "status", "mip vs best baseline", "s"]
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
