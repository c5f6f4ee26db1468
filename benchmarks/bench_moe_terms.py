"""Where a MoE layout's time goes in opsched's cost model: one chunk's passes, and its vector traffic by operator.

For a published row that stays off (docs/BENCHMARKS.md, "MoE at the frontier"), the terms to compare: one
device's forward, input-gradient and weight-gradient time for one microbatch of one chunk, the
communication inside the forward, the forward's compute by kind of operator (expert matmuls, other
matmuls, attention, vector work), and, with ``--layer N``, the vector (non-matmul, non-attention) memory
traffic of the model's N-th numbered layer by ONNX operator type. With ``--memory`` (and the row's
``--global-batch``, ``--schedule``, ``--optimizer-state``), where the busiest device's peak memory goes: its
parameter state, each chunk's stored activations per microbatch, and how many microbatches' worth are in
flight at the peak.

usage:
  python benchmarks/bench_moe_terms.py MODEL.onnx DEVICES LAYOUT [--preset h100-sxm] [--dtype fp8] [--chunk 0]
  python benchmarks/bench_moe_terms.py MODEL.onnx DEVICES LAYOUT --layer 10
  python benchmarks/bench_moe_terms.py MODEL.onnx DEVICES LAYOUT --memory --global-batch B [--schedule dualpipe]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from opsched.cost.blocks import compute_time
from opsched.cost.cluster import Training, preset
from opsched.cost.parallel_layout import ParallelLayout
from opsched.model.coarsen import coarsen
from opsched.model.onnx_import import import_onnx
from opsched.plan import chunk_cost as C
from opsched.plan import layouts as L
from opsched.schedule import metrics


def chunk_terms(bg, layout: ParallelLayout, cluster, training: Training, chunk: int) -> tuple[dict, dict]:
    """(passes and forward communication, forward compute by kind), seconds, for one device of ``chunk``."""
    index = L.model_index(bg)
    chunks = L.layer_chunks(bg, layout.pp * layout.vpp, index,
                            units=layout.chunk_units(len(index.layers), len(index.mtp_layers)))
    groups = C._rank_devices(layout, cluster.devices, chunk % layout.pp)
    links = C._ChunkLinks.of(groups, layout, cluster)
    training = dataclasses.replace(training, recompute=layout.recompute, recompute_modules=layout.recomputed_modules,
                                   sequence_parallel=layout.sp)
    passes = dict(F=0.0, I=0.0, W=0.0, f_comm=0.0)
    kinds = dict(matmul_expert=0.0, matmul_other=0.0, attention=0.0, vector=0.0)
    share = layout.tp * layout.cp
    for b in chunks[chunk]:
        block = bg.nodes[b]["block"]
        cost = C._block_share(block, index.tokens_in[b], index.expert_share[b], layout, groups, links, cluster,
                              training, index.routed_copies.get(b, 1.0)).cost
        for k in passes:
            passes[k] += getattr(cost, k)
        expert = index.experts_of[b] > 0
        if expert and layout.ep > 1:
            block = C._weights_read_once_per_ep(block, layout.ep)
        zero = dict(matmul_flops=0.0, matmul_io_bytes=0.0, matmul_padded_flops=0.0, attention_flops=0.0,
                    attention_io_bytes=0.0)
        parts = {
            "matmul_expert" if expert else "matmul_other": dataclasses.replace(
                block, flops=block.matmul_flops, io_bytes=block.matmul_io_bytes, attention_flops=0.0,
                attention_io_bytes=0.0),
            "attention": dataclasses.replace(block, **{**zero, "flops": block.attention_flops,
                                                       "io_bytes": block.attention_io_bytes,
                                                       "attention_flops": block.attention_flops,
                                                       "attention_io_bytes": block.attention_io_bytes}),
            "vector": dataclasses.replace(block, **{**zero, "flops": block.flops - block.matmul_flops
                                                    - block.attention_flops,
                                                    "io_bytes": block.io_bytes - block.matmul_io_bytes
                                                    - block.attention_io_bytes}),
        }
        for kind, part in parts.items():
            kinds[kind] += compute_time(part, share, cluster, training.dtype)
    return passes, kinds


def memory_terms(bg, layout: ParallelLayout, cluster, training: Training, global_batch: int, seq_len: int,
                 schedule: str | None) -> list[str]:
    """Lines: the busiest device's peak = parameter state + activations, and the activations as chunks in flight."""
    result = L.evaluate_layout(bg, cluster, training, layout, global_batch=global_batch, micro_batch_size=1,
                               tokens_per_sequence=seq_len, schedule=schedule)
    m = metrics(result.schedule)
    dev = max(range(len(m.peak_memory_bytes)), key=m.peak_memory_bytes.__getitem__)
    stages = [s for s in result.schedule.stage_graph.stages if dev in s.devices]
    per_chunk = max(s.act_bytes for s in stages)
    gib = 2.0 ** 30
    return [f"peak {m.peak_memory_bytes[dev] / gib:.1f} GiB on device {dev} of {result.memory_limit / gib:.1f}: "
            f"parameter state {m.param_bytes[dev] / gib:.1f} GiB, activations {m.peak_activation_bytes[dev] / gib:.1f}"
            f" GiB = {m.peak_activation_bytes[dev] / per_chunk:.1f} x {per_chunk / gib:.2f} GiB (its largest chunk's "
            "stored activations per microbatch)",
            "its chunks: " + ", ".join(f"{s.name} activations {s.act_bytes / gib:.2f} GiB, parameter state "
                                       f"{s.param_bytes / gib:.1f} GiB" for s in stages)]


def vector_traffic(og, layer: str) -> dict[str, tuple[int, float]]:
    """ONNX operator type -> (operators, vector bytes) in the numbered layer ``layer`` (a module path)."""
    out: dict[str, tuple[int, float]] = {}
    for _, data in og.nodes(data=True):
        op = data["op"]
        if ".".join(op.scope).startswith(layer + ".") or ".".join(op.scope) == layer:
            n, total = out.get(op.op_type, (0, 0.0))
            out[op.op_type] = (n + 1, total + op.io_bytes - op.matmul_io_bytes - op.attention_io_bytes)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("devices", type=int)
    parser.add_argument("layout")
    parser.add_argument("--preset", default="h100-sxm")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--layer", type=int, help="print the vector traffic of this numbered layer instead")
    parser.add_argument("--memory", action="store_true", help="print where the peak memory goes instead")
    parser.add_argument("--global-batch", type=int, default=0)
    parser.add_argument("--schedule")
    parser.add_argument("--optimizer-state", default="fp32")
    args = parser.parse_args()
    og = import_onnx(args.model, dims={"batch": 1, "seq": args.seq_len})
    bg = coarsen(og)
    if args.layer is not None:
        layer = L.model_index(bg).layers[args.layer]
        rows = sorted(vector_traffic(og, layer).items(), key=lambda kv: -kv[1][1])
        print(f"{layer}: vector traffic {sum(v[1] for _, v in rows) / 1e9:.2f} GB; by operator type (ops, GB):",
              ", ".join(f"{k} {n} {b / 1e9:.2f}" for k, (n, b) in rows[:8]))
        return 0
    layout = ParallelLayout.parse(args.layout).resolved(args.devices)
    if args.memory:
        training = Training(dtype=args.dtype, optimizer_state=args.optimizer_state)
        print("\n".join(memory_terms(bg, layout, preset(args.preset, args.devices), training,
                                     args.global_batch or layout.dp, args.seq_len, args.schedule)))
        return 0
    passes, kinds = chunk_terms(bg, layout, preset(args.preset, args.devices), Training(dtype=args.dtype), args.chunk)
    print(f"chunk {args.chunk}, one microbatch, one device (ms):",
          ", ".join(f"{k} {v * 1e3:.1f}" for k, v in passes.items()))
    print("forward compute by kind (ms):", ", ".join(f"{k} {v * 1e3:.1f}" for k, v in kinds.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
