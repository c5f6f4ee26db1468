"""The hand-written baselines' phase with one worker and with two (issue 13, item 2: "every core").

`opsched plan` tries every hand-written method on every pipeline depth
(:func:`opsched.plan.contiguous.contiguous_baselines`); the depths run in a
process pool of ``--jobs`` workers and are merged in depth order. This runs
that phase alone, on a model's reduced block graph as the planner builds
it, with no deadline (so the work, not the clock, decides what is tried),
once per worker count, and checks that the rows and refusals are the same.

usage:
  python benchmarks/bench_baselines_pool.py [--model models/deepseek_moe.onnx] [--devices 512] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import time

from opsched.cost.cluster import Training, preset
from opsched.model.coarsen import coarsen
from opsched.plan.contiguous import contiguous_baselines
from opsched.model.onnx_import import import_onnx
from opsched.plan.smallest_memory import _reduced
from opsched.upper.layouts import layouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/deepseek_moe.onnx")
    parser.add_argument("--devices", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    cluster = preset("h100-sxm", args.devices)
    small, _ = _reduced(coarsen(import_onnx(args.model)), layouts(cluster), None)  # the planner's own reduction
    training = Training(microbatches=args.microbatches)
    found = {}
    print("| workers | wall s | rows | refused |\n|---:|---:|---:|---:|")
    for w in args.workers:
        t0 = time.perf_counter()
        rows, _, refused = contiguous_baselines(small, cluster, training, cluster.memory_bytes, workers=w)
        print(f"| {w} | {time.perf_counter() - t0:.2f} | {len(rows)} | {len(refused)} |", flush=True)
        found[w] = ([(b.method, b.layout, b.step_time, b.schedule.events) for b in rows], refused)
    same = all(v == found[args.workers[0]] for v in found.values())
    print(f"\nthe same rows and refusals for every worker count: {same}")


if __name__ == "__main__":
    main()
