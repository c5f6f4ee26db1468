"""opsched evaluate against published training runs (issue 12, "Against published runs").

Each row is a published run: its model, cluster, layout, sequence length and
global batch, the figure its authors report, and the source. The benchmark
runs ``opsched evaluate`` with exactly that setting (the command is printed
in the table) and compares the prediction with the published figure:

* a TFLOP/s-per-GPU figure is compared with the prediction's model FLOPs per
  step / step time / devices (both count 3 x the forward FLOPs, attention
  included, no recomputation: PaLM's convention, which the sources use);
* a tokens/s-per-GPU figure with the predicted tokens/s per device.

``ratio`` = predicted / published throughput; the issue's target is
0.85-1.15. A row outside it stays in the table.

usage:
  python benchmarks/bench_published.py            # markdown table on stdout
  python benchmarks/bench_published.py --json
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Run:
    name: str
    model: str  # in models/
    devices: int
    preset: str
    layout: str
    seq_len: int
    global_batch: int
    micro_batch_size: int
    published: float
    unit: str  # "TFLOP/s/GPU" or "tokens/s/GPU"
    source: str
    note: str = ""
    dtype: str = "bf16"

    def command(self) -> list[str]:
        return ["opsched", "evaluate", f"models/{self.model}", "--devices", str(self.devices), "--preset", self.preset,
                "--layout", self.layout, "--seq-len", str(self.seq_len), "--global-batch", str(self.global_batch),
                "--micro-batch-size", str(self.micro_batch_size), "--dtype", self.dtype, "--json", "-q"]


RUNS = [
    Run("Mixtral-8x7B, Megatron-Core MoE", "mixtral_8x7b.onnx", 64, "h100-sxm", "tp=1,pp=4,vpp=8,ep=8,zero=1",
        4096, 256, 1, 468.0, "TFLOP/s/GPU",
        "NVIDIA/Megatron-LM @ c230e0d7, megatron/core/transformer/moe/README.md lines 3 and 358-373",
        "micro-batch 1 (Megatron-MoE-ModelZoo runtime.conf); distributed optimizer as zero=1"),
    Run("MPT-7B, llm-foundry, 8 x H100", "mpt_7b.onnx", 8, "h100-sxm", "tp=1,pp=1,zero=3,recompute=full",
        4096, 256, 16, 8611.0, "tokens/s/GPU",
        "mosaicml/llm-foundry @ 8c8dd48f, scripts/train/benchmarking/README.md line 117",
        "micro-batch 16, 2 accumulation steps (sweep.sh); FSDP full shard as zero=3, activation checkpointing as "
        "recompute=full"),
    Run("MPT-7B, llm-foundry, 8 x A100-80GB", "mpt_7b.onnx", 8, "a100-80g", "tp=1,pp=1,zero=3,recompute=full",
        4096, 256, 16, 3684.0, "tokens/s/GPU",
        "mosaicml/llm-foundry @ 8c8dd48f, scripts/train/benchmarking/README.md line 183",
        "as the H100 row"),
    Run("Llama2-7B, NeMo 24.07, 8 x H100, FP8", "llama_7b.onnx", 8, "h100-sxm", "tp=1,pp=1,zero=1",
        4096, 128, 1, 780.0, "TFLOP/s/GPU",
        "NVIDIA/NeMo @ 8e3d65dc, docs/source/performance/performance_summary.md line 18",
        "DP8; the page gives no optimizer or recompute settings: NeMo's default distributed optimizer (zero=1), no recompute", dtype="fp8"),
]


def measure(run: Run) -> dict:
    out = subprocess.run(run.command(), cwd=ROOT, capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    if run.unit == "TFLOP/s/GPU":
        predicted = doc["model_flops_per_step"] / doc["step_time"] / run.devices / 1e12
    else:
        predicted = doc["tokens_per_second_per_device"]
    return {"run": run.name, "predicted": predicted, "published": run.published, "unit": run.unit,
            "ratio": predicted / run.published, "step_time": doc["step_time"], "mfu": doc["mfu"],
            "fits": doc["fits"], "command": shlex.join(run.command()[:-2]), "source": run.source, "note": run.note}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [measure(r) for r in RUNS]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| run | published | predicted | ratio | predicted MFU | fits | command |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['published']:,.0f} {r['unit']} | {r['predicted']:,.0f} | {r['ratio']:.2f} | "
              f"{100 * r['mfu']:.1f} % | {'yes' if r['fits'] else 'no'} | `{r['command']}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
