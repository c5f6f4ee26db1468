"""What branches buy (issue 44): `opsched plan --branches on` against `--branches off` and the best baseline.

Models are written on demand by models/build.py into a temporary folder: GraphPipe's MMT (4 towers of 8
layers) at 8, 16 and 32 devices, and the K-branch family (K towers of MMT's 8 layers, K = 2, 4, 8, 16) at 32,
on GraphPipe's testbed preset (v100-16g: 4 GPUs a node). Each row runs `opsched plan` twice, with branches
on and off, at the same global batch, microbatches and time limit; the best baseline is the one the run with
branches on reports (hand-written schedules and Megatron-style layouts, on chains of whole blocks). Prints
a markdown table (the one in docs/BENCHMARKS.md, "What branches buy").

    python benchmarks/bench_branches.py                              # the whole table
    python benchmarks/bench_branches.py --rows mmt:32 branches_k16:32 --time-limit 60
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from bench_scale import load_build

ROOT = Path(__file__).resolve().parent.parent
ROWS = ["mmt:8", "mmt:16", "mmt:32", "branches_k2:32", "branches_k4:32", "branches_k8:32", "branches_k16:32"]


class Run(NamedTuple):
    """One `opsched plan` run's figures (``error`` set when it refused)."""

    step: float | None
    layout: str
    source: str
    baseline: str | None
    baseline_step: float | None
    wall: float
    error: str | None = None


def plan(path: Path, devices: int, branches: str, args) -> Run:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "opsched", "plan", str(path), "--preset", args.preset, "--devices", str(devices),
               "--global-batch", str(args.global_batch), "--microbatches", str(args.microbatches),
               "--time-limit", str(args.time_limit), "--branches", branches, "-o", out, "--json"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return Run(None, "", "", None, None, wall, proc.stderr.strip().splitlines()[-1])
    doc = json.loads(proc.stdout)
    best = doc["best_baseline"]
    return Run(doc["step_time"], doc["layout"], doc["source"], best and f"{best['method']} ({best['layout']})",
               best and best["step_time"], wall)


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="*", default=ROWS, help="MODEL:DEVICES pairs (default: the whole table)")
    ap.add_argument("--preset", default="v100-16g")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args(argv)
    build = load_build()
    print(f"preset {args.preset}, global batch {args.global_batch}, {args.microbatches} microbatches, "
          f"--time-limit {args.time_limit:g} s a run\n")
    print("| model | devices | on (ms) | layout (on) | off (ms) | layout (off) | on / off | best baseline (ms) | "
          "on / baseline | wall on + off (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for row in args.rows:
            name, devices = row.split(":")
            path = Path(folder) / f"{name}.onnx"
            if not path.exists():
                build.write_model(build.MODELS[name](), str(path))
            on, off = plan(path, int(devices), "on", args), plan(path, int(devices), "off", args)
            if on.error or off.error:
                print(f"| {name} | {devices} | {on.error or ''} | | {off.error or ''} | | | | | |")
                continue
            print(f"| {name} | {devices} | {ms(on.step)} | {on.source} {on.layout} | {ms(off.step)} | "
                  f"{off.source} {off.layout} | {off.step / on.step:.3f}x | {ms(on.baseline_step)} {on.baseline} | "
                  f"{on.baseline_step / on.step:.2f}x | {on.wall:.0f} + {off.wall:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
