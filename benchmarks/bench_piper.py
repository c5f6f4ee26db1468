"""Piper (msr-fiddle/piper, NeurIPS'21) and opsched on the same costs (issue 44, item 5).

For each MODEL:DEVICES row (MMT and CANDLE-Uno from models/build.py, on the ``v100-16g`` preset), the model is
imported at one microbatch of ``global batch / microbatches`` samples and coarsened as ``opsched plan`` does,
and a Piper input is written from opsched's cost model (:func:`opsched.cost.blocks.block_cost`):

* a Piper node per block; its TMPCs for tensor-parallel degree t in 1, 2, 4 (``Mode(tp=t)``, a block without
  weights only t = 1): ``timePerSample`` = F + I + W of one microbatch (Piper's "sample" is a microbatch;
  opsched's tensor-parallel all-reduces are inside these times, so ``syncTimeFw``/``syncTimeBw`` are 0),
  ``parameterSize`` = parameters / t x gradient bytes (what Piper's data-parallel resync moves),
  ``memoryUsageA`` = activation bytes kept per microbatch in flight, ``memoryUsageB`` = weights, gradients and
  Adam state on a device (``param_bytes``); one TMPC id, "vanilla" (no recomputation TMPC: opsched plans
  without recomputation here);
* a Piper edge per block edge, ``communicationCost`` = the edge's bytes;
* ``maxDevices`` = devices, ``maxMemoryPerDevice`` = the preset's memory, ``bandwidth`` = its inter-node
  bandwidth per device (Piper has one bandwidth; opsched's NVLink inside a node has no counterpart),
  ``mbsInBatch`` = microbatches.

Piper's objective (TPS) is the steady-state time per microbatch of its slowest stage (no pipeline fill and
drain: PipeDream-2BW's schedule), so its time per sample is TPS / microbatch size; opsched's is the step time
of ``opsched plan`` (fill, drain and gradient sync included) / global batch. What has no counterpart: Piper's
per-stage data-parallel degree over a stage's microbatches and its 2BW weight stashing (opsched's modes split
a microbatch; its schedules flush every step), opsched's F/I/W split, zero-bubble and interleaved schedules and
two link speeds. Piper's plan is reported by its own objective, not re-timed in opsched.

Piper is not part of opsched: build its planner with benchmarks/piper/piper_driver.cpp (see that file) and
pass the binary::

    python benchmarks/bench_piper.py --piper /tmp/piper [--rows mmt:8 candle_uno:8] [--piper-timeout 300]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_scale import load_build

from opsched.cost.blocks import Mode, block_cost
from opsched.cost.cluster import Training, preset
from opsched.model.coarsen import coarsen
from opsched.model.onnx_import import import_onnx

ROWS = ["mmt:8", "mmt:16", "mmt:32", "candle_uno:8", "candle_uno:16", "candle_uno:32"]
TP_DEGREES = (1, 2, 4)


def piper_input(bg, devices: int, args) -> dict:
    """Piper's input JSON for the block graph ``bg`` (see the module docstring for the fields)."""
    cluster = preset(args.preset, devices)
    training = Training(microbatches=args.microbatches, microbatch_size=args.global_batch // args.microbatches,
                        dtype=args.dtype)
    nodes = []
    for b in bg.nodes:
        block = bg.nodes[b]["block"]
        tmpcs = {}
        for t in TP_DEGREES if block.param_count > 0 else (1,):
            cost = block_cost(block, Mode(tp=t), tuple(range(t)), cluster, training)
            tmpcs[str(t)] = [{"id": "vanilla", "timePerSample": cost.work,
                              "parameterSize": block.param_count / t * training.grad_bytes,
                              "memoryUsageA": cost.act_bytes, "memoryUsageB": cost.param_bytes,
                              "syncTimeFw": {str(u): 0.0 for u in bg.predecessors(b)},
                              "syncTimeBw": {str(w): 0.0 for w in bg.successors(b)}}]
        nodes.append({"id": int(b), "name": block.name, "TMPCs": tmpcs})
    edges = [{"sourceId": int(u), "destId": int(v), "communicationCost": float(d.get("bytes", 0.0))}
             for u, v, d in bg.edges(data=True)]
    return {"maxDevices": devices, "maxMemoryPerDevice": cluster.memory_bytes,
            "bandwidth": cluster.inter_node_bandwidth, "mbsInBatch": args.microbatches, "nodes": nodes,
            "edges": edges}


def run_piper(doc: dict, args) -> tuple[dict | None, float]:
    """(Piper's output, or None when it ran out of ``--piper-timeout``; wall seconds)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(doc, f)
        f.flush()
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([args.piper, f.name], capture_output=True, text=True, timeout=args.piper_timeout)
        except subprocess.TimeoutExpired:
            return None, time.perf_counter() - t0
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"piper failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout), wall


def run_opsched(path: Path, devices: int, args) -> tuple[float | None, str, float]:
    """(opsched plan's step time or None, its layout or error, wall seconds)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "opsched", "plan", str(path), "--preset", args.preset, "--devices",
               str(devices), "--global-batch", str(args.global_batch), "--microbatches", str(args.microbatches),
               "--dtype", args.dtype, "--time-limit", str(args.time_limit), "-o", out, "--json"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return None, proc.stderr.strip().splitlines()[-1], wall
    doc = json.loads(proc.stdout)
    return doc["step_time"], f"{doc['source']} {doc['layout']}", wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--piper", required=True, help="Piper's planner built from benchmarks/piper/piper_driver.cpp")
    ap.add_argument("--rows", nargs="*", default=ROWS, help="MODEL:DEVICES pairs")
    ap.add_argument("--preset", default="v100-16g")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=60.0, help="opsched plan's --time-limit")
    ap.add_argument("--piper-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    build = load_build()
    print(f"preset {args.preset}, {args.dtype}, global batch {args.global_batch} in {args.microbatches} "
          f"microbatches; times per sample in ms\n")
    print("| model | devices | blocks | Piper (ms/sample) | Piper search (s) | Piper stages (d x t) | opsched (ms/sample) "
          "| opsched search (s) | opsched layout | Piper / opsched |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    mb = args.global_batch // args.microbatches
    with tempfile.TemporaryDirectory() as folder:
        for row in args.rows:
            name, devices = row.split(":")
            path = Path(folder) / f"{name}.onnx"
            if not path.exists():
                build.write_model(build.MODELS[name](), str(path))
            bg = coarsen(import_onnx(str(path), dims={"batch": mb}))
            out, piper_wall = run_piper(piper_input(bg, int(devices), args), args)
            piper = None if out is None or out["tps"] is None else out["tps"] / mb
            shapes = "" if out is None else " ".join(f"{s['dataParallelDegree']}x{s['tensorParallelDegree']}"
                                                    for s in out["stages"])
            piper_text = "timeout" if out is None else ("infeasible" if piper is None else f"{piper * 1e3:.3f}")
            piper_s = f">{args.piper_timeout:.0f}" if out is None else f"{out['seconds']:.1f}"
            step, layout, wall = run_opsched(path, int(devices), args)
            ours = None if step is None else step / args.global_batch
            ratio = f"{piper / ours:.2f}x" if piper and ours else "-"
            print(f"| {name} | {devices} | {bg.number_of_nodes()} | {piper_text} | {piper_s} | {shapes} | "
                  f"{'-' if ours is None else f'{ours * 1e3:.3f}'} | {wall:.0f} | {layout} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
