"""Benchmark `opsched plan` on the bundled MoE and multimodal models (issue 5 targets).

For each model and device count: end-to-end wall time of `opsched plan`, the
plan's step time and throughput against the best hand-written baseline on
the best contiguous split at the same memory, bubbles, the lower MIP's gap.
Prints a markdown table (the one recorded in docs/BENCHMARKS.md).

    python benchmarks/bench_plan.py                       # the full table
    python benchmarks/bench_plan.py --models mixtral_8x7b --devices 16 --microbatches 32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["mixtral_8x7b", "deepseek_moe", "clip_vit_l14", "llava_7b"]


def run_one(model: str, devices: int, microbatches: int, time_limit: float, solver: str, preset: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "opsched.cli", "plan", str(ROOT / "models" / f"{model}.onnx"),
               "--devices", str(devices), "--preset", preset, "--microbatches", str(microbatches),
               "--time-limit", str(time_limit), "--solver", solver, "-o", out, "--quiet"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"model": model, "devices": devices, "error": proc.stderr.strip(), "wall": wall, "preset": preset}
        doc = json.loads((Path(out) / "plan.json").read_text())
    best = min(doc["baselines"], key=lambda b: b["step_time"]) if doc["baselines"] else None
    return {
        "model": model,
        "devices": devices,
        "preset": preset,
        "wall": wall,
        "source": doc["source"],
        "layout": doc["layout"],
        "step": doc["step_time"],
        "bubbles": doc["metrics"]["bubble_ratio"],
        "gap": doc["metrics"].get("gap"),
        "baseline": None if best is None else f"{best['method']} ({best['layout']})",
        "baseline_step": None if best is None else best["step_time"],
        "speedup": None if best is None else best["step_time"] / doc["step_time"],
        "baseline_bubbles": None if best is None else best["bubble_ratio"],
        # the speed-up a plan doing the baseline's work per device would reach with no bubble at all
        "ceiling": None if best is None else best["step_time"] / (
            best["step_time"] - best["bubble_ratio"] * best["makespan"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--devices", default="8,16")
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=60)
    ap.add_argument("--solver", default="cbc")
    ap.add_argument("--preset", default="h100-sxm")
    ap.add_argument("--fallback-preset", default="h200",
                    help="preset to retry with when the model does not fit the first one's memory at all")
    args = ap.parse_args(argv)
    print("| model | devices | preset | plan (source, layout) | step (s) | bubbles | best baseline | its step (s) "
          "| its bubbles | speed-up | zero-bubble ceiling | lower gap | wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for devices in (int(d) for d in args.devices.split(",")):
            r = run_one(model, devices, args.microbatches, args.time_limit, args.solver, args.preset)
            if "error" in r and "smallest memory" in r["error"] and args.fallback_preset:
                print(f"| {model} | {devices} | {r['preset']} | does not fit: {r['error']} | | | | | | | | | {r['wall']:.1f} |", flush=True)
                r = run_one(model, devices, args.microbatches, args.time_limit, args.solver, args.fallback_preset)
            if "error" in r:
                print(f"| {model} | {devices} | {r['preset']} | error: {r['error']} | | | | | | | | | {r['wall']:.1f} |", flush=True)
                continue
            gap = "-" if r["gap"] is None else f"{r['gap']:.3f}"
            speed = "-" if r["speedup"] is None else f"{r['speedup']:.3f}x"
            base_step = "-" if r["baseline_step"] is None else f"{r['baseline_step']:.4g}"
            base_bub = "-" if r["baseline_bubbles"] is None else f"{r['baseline_bubbles']:.3f}"
            ceiling = "-" if r["ceiling"] is None else f"{r['ceiling']:.3f}x"
            print(f"| {model} | {devices} | {r['preset']} | {r['source']}, {r['layout']} | {r['step']:.4g} | {r['bubbles']:.3f} | "
                  f"{r['baseline'] or '-'} | {base_step} | {base_bub} | {speed} | {ceiling} | {gap} | {r['wall']:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
