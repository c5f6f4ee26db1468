"""opsched evaluate against published training runs (issue 12, "Against published runs").

Each row is a published run: its model, cluster, layout, sequence length and
global batch, the figure its authors report, and the source. The benchmark
runs ``opsched evaluate`` with exactly that setting (the command is printed
in the table) and compares the prediction with the published figure:

* a TFLOP/s-per-GPU figure is compared with the prediction's model FLOPs per
  step / step time / devices (both count 3 x the forward FLOPs, attention
  included, no recomputation: PaLM's convention, which the sources use);
* a tokens/s-per-GPU figure with the predicted tokens/s per device;
* a step time (``s/step``: the SC'21 rows, whose TFLOP/s count the recomputed
  forward, converted to seconds per step with the paper's own formula in
  ``docs/published-runs.md``) with the predicted step time.

``ratio`` = predicted / published throughput; the issue's target is
0.85-1.15. A row outside it stays in the table, and so does a row whose
setting ``opsched evaluate`` refuses (its message in place of the figures);
the last line counts the rows within. A model that is not in ``models/``
(one ``models/build.py`` writes only on demand) is generated into a
temporary folder first; the printed command names it as ``models/NAME.onnx``. Each row is also evaluated
on the same machine with the kernel ceilings of ``benchmarks/clusters/``
(efficiency by kind of operator), to show how far they sit above training.

With ``--plan`` it instead runs ``opsched plan`` with each row's model,
cluster, sequence length and global batch (``--time-limit 60``) and compares
the plan's step time with the published layout's, both counted the planner's
way (makespan + the whole gradient sync): the issue's target is a plan at
least as fast. An FP8 row is planned in FP8 (plan --dtype); a row whose layout
runs ``attention=unfused`` is planned with ``--attention unfused``.

usage:
  python benchmarks/bench_published.py            # markdown table on stdout
  python benchmarks/bench_published.py --json
  python benchmarks/bench_published.py --plan [--rows 0 4]
  python benchmarks/bench_published.py --rows 13 28   # some rows (indices into RUNS)
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
    unit: str  # "TFLOP/s/GPU", "tokens/s/GPU" or "s/step"
    source: str
    note: str = ""
    dtype: str = "bf16"
    schedule: str | None = None  # evaluate's default (1f1b, interleaved-1f1b with vpp > 1) when None
    optimizer_state: str = "fp32"

    def command(self, kernels: bool = False, model_path: str | None = None) -> list[str]:
        """The row's ``opsched evaluate`` command; ``kernels``: on the preset with kernel-ceiling efficiencies.

        ``model_path``: where the model file is, when not in ``models/`` (one written on demand).
        """
        machine = (["--cluster", f"benchmarks/clusters/{self.preset}-kernels.json"] if kernels
                   else ["--preset", self.preset])
        return ["opsched", "evaluate", model_path or f"models/{self.model}", "--devices", str(self.devices), *machine,
                "--layout", self.layout, "--seq-len", str(self.seq_len), "--global-batch", str(self.global_batch),
                "--micro-batch-size", str(self.micro_batch_size), "--dtype", self.dtype,
                *(["--schedule", self.schedule] if self.schedule else []),
                *(["--optimizer-state", self.optimizer_state] if self.optimizer_state != "fp32" else []),
                "--json", "-q"]


def sc21_step_seconds(layers: int, hidden: int, global_batch: int, tflops_per_gpu: float, gpus: int,
                      seq_len: int = 2048, vocab: int = 51200) -> float:
    """The step time an SC'21 Table 1 row implies: the paper's Eq. 3 FLOPs over its published rate.

    Eq. 3 (Narayanan et al. 2021, section 5.1) counts the recomputed forward:
    ``F = 96 B s l h^2 (1 + s / 6h + V / 16 l h)``.

    >>> round(sc21_step_seconds(24, 2304, 512, 137, 32), 2)  # GPT 1.7B, row C1 of docs/published-runs.md
    3.53
    """
    flops = 96 * global_batch * seq_len * layers * hidden**2 * (
        1 + seq_len / (6 * hidden) + vocab / (16 * layers * hidden))
    return flops / (tflops_per_gpu * 1e12 * gpus)


SC21_SOURCE = "NVIDIA/Megatron-LM @ b83477a3 images/cases_april2021.png; examples/sc21/run_table_1.sh @ e70f8312"
MCORE_R08_SOURCE = ("NVIDIA/Megatron-LM @ f2e5db40 README.md, images/model_table.png (weak scaling, "
                    "Megatron-Core r0.8.0)")
MCORE_R08_NOTE = ("DP48; BF16 (the MFU column is TFLOP/s / 989); micro-batch size and recomputation are not "
                  "published: micro-batch 1 and none, as Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh "
                  "(@ 157006d6) sets them; --overlap-param-gather needs the distributed optimizer (zero=1) and "
                  "--tp-comm-overlap sequence parallelism (sp=1), both asserted by Megatron's arguments.py; "
                  "--tp-comm-overlap itself as tp_overlap=1 where tp > 1; no "
                  "interleaving stated (vpp 1); the model's architecture beyond layers, hidden, heads and vocab is "
                  "assumed (models/build.py, MCORE_R08_GPT)")


def mcore_r08(model: str, size: str, devices: int, tp: int, pp: int, global_batch: int, tflops: float) -> Run:
    """One row of the Megatron-Core r0.8 H100 weak-scaling table (DP 48 in every row)."""
    sp = ",sp=1,tp_overlap=1" if tp > 1 else ""  # the README's runs set --tp-comm-overlap
    return Run(f"GPT {size}, Megatron-Core r0.8, {devices} x H100", model, devices, "h100-sxm",
               f"tp={tp},pp={pp}{sp},zero=1", 4096, global_batch, 1, tflops, "TFLOP/s/GPU", MCORE_R08_SOURCE,
               MCORE_R08_NOTE)


def sc21(model: str, size: str, devices: int, layers: int, hidden: int, layout: str, global_batch: int,
         micro_batch_size: int, tflops: float) -> Run:
    """One of the larger rows of SC'21 Table 1, as a step time from the paper's Eq. 3 and its TFLOP/s."""
    return Run(f"GPT {size}, Megatron-LM SC'21 Table 1, {devices} x A100", model, devices, "a100-80g",
               f"{layout},recompute=full,attention=unfused", 2048, global_batch, micro_batch_size,
               round(sc21_step_seconds(layers, hidden, global_batch, tflops, devices), 2), "s/step",
               f"{SC21_SOURCE} ({tflops:g} TFLOP/s)",
               f"step time from Eq. 3 and {tflops:g} TFLOP/s per GPU; vpp from --num-layers-per-virtual-pipeline-stage; "
               "no distributed optimizer (2021); attention unfused, as the 1.7B row", dtype="fp16")


FOUNDRY_SOURCE = ("mosaicml/llm-foundry @ 061f2c7c, scripts/train/benchmarking/README.md, tables "
                  "\"{gpu} 80GB BF16\" / \"A100 80GB with 1600 Gbps node-node interconnect (RoCE)\", row {size} at "
                  "sequence {seq}")


def foundry(size: str, gpu: str, seq: int, micro_batch_size: int, global_batch: int, checkpointing: bool,
            tokens: float) -> Run:
    """One row of llm-foundry's MPT training benchmarks on 8 GPUs (FSDP full shard, amp_bf16, FlashAttention)."""
    preset, label = {"H100": ("h100-sxm", "H100"), "A100": ("a100-80g", "A100-80GB")}[gpu]
    recompute = "full" if checkpointing else "none"
    return Run(f"MPT-{size}, llm-foundry, 8 x {label}, seq {seq}", f"mpt_{size.lower()}.onnx", 8, preset,
               f"tp=1,pp=1,zero=3,recompute={recompute}", seq, global_batch, micro_batch_size, tokens,
               "tokens/s/GPU", FOUNDRY_SOURCE.format(gpu=gpu, size=size.lower(), seq=seq),
               f"micro-batch {micro_batch_size}, {global_batch // (8 * micro_batch_size)} accumulation steps; FSDP "
               f"full shard as zero=3; activation checkpointing {'on: recompute=full' if checkpointing else 'off'}; "
               "learned position embeddings of the benchmark's configuration left out (models/build.py)")


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
    Run("GPT 1.7B, Megatron-LM SC'21 Table 1, 32 x A100", "gpt_1_7b.onnx", 32, "a100-80g",
        "tp=1,pp=1,recompute=full,attention=unfused", 2048, 512, 16, 3.53, "s/step",
        "NVIDIA/Megatron-LM @ b83477a3 images/cases_april2021.png (137 TFLOP/s); examples/sc21/run_table_1.sh @ e70f8312",
        "step time from the paper's FLOP formula (Eq. 3) and its 137 TFLOP/s per GPU; Megatron-LM of 2021 had no "
        "FlashAttention: attention=unfused, with its default --attention-dropout 0.1 (megatron/arguments.py)",
        dtype="fp16"),
    Run("GPT 3.6B, Megatron-LM SC'21 Table 1, 64 x A100", "gpt_3_6b.onnx", 64, "a100-80g",
        "tp=2,pp=1,recompute=full,attention=unfused", 2048, 512, 16, 3.70, "s/step", "as the 1.7B row (138 TFLOP/s)",
        "as the 1.7B row", dtype="fp16"),
    Run("GPT 7.5B, Megatron-LM SC'21 Table 1, 128 x A100", "gpt_7_5b.onnx", 128, "a100-80g",
        "tp=4,pp=1,recompute=full,attention=unfused", 2048, 512, 16, 3.70, "s/step", "as the 1.7B row (142 TFLOP/s)",
        "as the 1.7B row", dtype="fp16"),
    Run("GPT 18.4B, Megatron-LM SC'21 Table 1, 256 x A100", "gpt_18_4b.onnx", 256, "a100-80g",
        "tp=8,pp=1,recompute=full,attention=unfused", 2048, 1024, 8, 9.40, "s/step", "as the 1.7B row (135 TFLOP/s)",
        "as the 1.7B row", dtype="fp16"),
    Run("Llama 3.1 8B, torchtitan, 8 x H100", "llama3_8b.onnx", 8, "h100-sxm", "tp=1,pp=1,zero=3,recompute=selective",
        8192, 16, 2, 5762.0, "tokens/s/GPU",
        "pytorch/torchtitan @ b5bcd76c benchmarks/llama3_h100_202412_torchtitan.md Table 1",
        "FSDP as zero=3; torchtitan's selective AC is its op policy (saves matmul and attention outputs, recomputes "
        "every other matmul and every elementwise op), not Megatron's recompute=selective (the attention core only): "
        "it keeps far fewer activations, so the prediction does not fit; the run's H100s are 500 W HBM2e parts, "
        "slower than the h100-sxm preset"),
    *(Run(f"Llama 3.1 8B, torchtitan, 8 x H100, CP{cp}, seq {seq // 1024}K, FP8", "llama3_8b.onnx", 8, "h100-sxm",
          f"tp=1,pp=1,cp={cp},zero=3,recompute=full", seq, 8 // cp, 1, published, "tokens/s/GPU",
          "pytorch/torchtitan @ 31a17bfd benchmarks/llama3_h100_202412_torchtitan.md Table 2",
          f"FSDP {8 // cp} x CP {cp} (FSDP shards over dp x cp: zero=3), local batch 1, full AC, torch.compile, Float8 "
          "linears (attention stays BF16, as the cost model keeps it under --dtype fp8); 500 W HBM2e H100s",
          dtype="fp8")
      for cp, seq, published in ((2, 65536, 2540.0), (4, 131072, 1071.0), (8, 262144, 548.0))),
    Run("Llama 3 8B, Megatron-Bridge, 8 x H100, FP8", "llama3_8b.onnx", 8, "h100-sxm", "tp=1,pp=1,zero=3",
        8192, 128, 1, 14451.0, "tokens/s/GPU",
        "NVIDIA-NeMo/Megatron-Bridge @ 067f987d docs/performance-summary-archive.md line 589",
        "FSDP over 8 as zero=3; the recipe recomputes 5 of 32 layers, not expressible: none assumed", dtype="fp8"),
    sc21("gpt_39_1b.onnx", "39.1B", 512, 48, 8192, "tp=8,pp=2", 1536, 4, 138),
    sc21("gpt_76_1b.onnx", "76.1B", 1024, 60, 10240, "tp=8,pp=4,vpp=3", 1792, 2, 140),
    sc21("gpt_145_6b.onnx", "145.6B", 1536, 80, 12288, "tp=8,pp=8,vpp=2", 2304, 2, 148),
    sc21("gpt_310_1b.onnx", "310.1B", 1920, 96, 16384, "tp=8,pp=16,vpp=2", 2160, 1, 155),
    sc21("gpt_529_6b.onnx", "529.6B", 2520, 105, 20480, "tp=8,pp=35,vpp=3", 2520, 1, 163),
    sc21("gpt_1008b.onnx", "1008B", 3072, 128, 25600, "tp=8,pp=64", 3072, 1, 163),
    mcore_r08("mcore_gpt_1_7b.onnx", "1.7B", 48, 1, 1, 192, 408.8),
    mcore_r08("mcore_gpt_7_1b.onnx", "7.1B", 96, 2, 1, 192, 465.9),
    mcore_r08("mcore_gpt_16b.onnx", "16B", 192, 4, 1, 192, 489.1),
    mcore_r08("mcore_gpt_32b.onnx", "32B", 384, 8, 1, 192, 459.6),
    mcore_r08("mcore_gpt_70b.onnx", "70B", 768, 8, 2, 384, 419.7),
    mcore_r08("mcore_gpt_119b.onnx", "119B", 1536, 8, 4, 768, 420.5),
    mcore_r08("mcore_gpt_177b.onnx", "177B", 2304, 8, 6, 1152, 432.8),
    mcore_r08("mcore_gpt_314b.onnx", "314B", 3072, 8, 8, 1536, 474.4),
    mcore_r08("mcore_gpt_462b.onnx", "462B", 6144, 8, 16, 3072, 459.9),
    Run("BLOOM-176B, Megatron-DeepSpeed, 384 x A100-80GB", "bloom_176b.onnx", 384, "a100-80g",
        "tp=4,pp=12,zero=1,recompute=full,ends_as_layers=1,attention=unfused", 2048, 2048, 2, 104.70, "s/step",
        "bigscience-workshop/bigscience @ 9e64edec train/tr11-176B-ml/README.md lines 661-663; "
        "tr11-176B-ml.slurm @ dc8d99ff",
        "the published seconds per iteration at global batch 2048; DP8, 128 microbatches of 2; the BF16 optimizer's "
        "ZeRO-1 as zero=1; --checkpoint-activations as recompute=full; --pp-partition-method type:transformer|embedding as ends_as_layers=1 (70 layers + 2 embeddings = 6 per stage); "
        "Megatron-DeepSpeed's fused softmax (--abort-on-unmet-fused-kernel-constraints), no FlashAttention, no dropout "
        "flag (the default 0.1): attention=unfused"),
    # further rows of llm-foundry's table (added with the unfused attention rule, 2026-12-01): other sizes,
    # sequences and checkpointing settings on both GPUs
    foundry("13B", "A100", 4096, 10, 240, True, 2060.0),
    foundry("30B", "A100", 2048, 3, 504, True, 916.0),
    foundry("7B", "A100", 2048, 6, 96, False, 4641.0),
    foundry("7B", "A100", 8192, 8, 128, True, 3206.0),
    foundry("13B", "H100", 4096, 10, 240, True, 4717.0),
    foundry("30B", "H100", 2048, 3, 504, True, 2002.0),
    foundry("7B", "H100", 2048, 6, 48, False, 10643.0),
    foundry("7B", "H100", 8192, 8, 128, True, 6935.0),
    # MoE at the frontier (issue 43; docs/published-runs.md, "MoE at the frontier"), models written on demand
    Run("DeepSeek-V3 + MTP, DualPipe, 2,048 x H800, FP8", "deepseek_v3_mtp.onnx", 2048, "h800",
        "tp=1,pp=16,ep=64,zero=1,max_nodes=4,recompute_modules=layernorm+mla_up_proj+moe_act,"
        "pipeline_layout=Ettt|(tttt|)*14ttmL", 4096, 15360, 1, 19.926, "s/step",
        "ISCA'25 'Insights into DeepSeek-V3' (arXiv 2505.09343) §5.1.2 Table 4; layout and precision: DeepSeek-V3 "
        "technical report (arXiv 2412.19437) §3",
        "PP16 with DualPipe, EP64 over 8 nodes, node-limited routing to 4 nodes, ZeRO-1, no TP; 61 layers + MTP as "
        "16 chunks of 4 units; FP8 GEMMs and dispatch, BF16 moments with an FP32 master (optimizer_state bf16); "
        "RMSNorm and the MLA up-projections recomputed (§3.2.3), and the experts' SwiGLU output from its inputs "
        "cached in FP8 (§3.3.3 (2); recompute_modules=layernorm+mla_up_proj+moe_act)",
        dtype="fp8", schedule="dualpipe", optimizer_state="bf16"),
    Run("DeepSeek-V3 + MTP, Megatron-Bridge 25.09, 1,024 x H100, FP8", "deepseek_v3_mtp.onnx", 1024, "h100-sxm",
        "tp=2,pp=8,ep=64,etp=1,sp=1,zero=1,recompute_modules=mla_up_proj+mlp,pipeline_layout=Et|(tt|)*30mL", 4096, 8192, 1, 1297.0, "tokens/s/GPU",
        "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md, release 25.09, DGX-H100",
        "TP2 PP8 VP4 (from the layout string) EP64 ETP1, MTP 1, FP8 blockwise, interleaved 1F1B, recompute "
        "mla_up_proj and mlp", dtype="fp8"),
    Run("Qwen3-30B-A3B, Megatron-Bridge 26.04.01, 16 x H100, FP8", "qwen3_30b_a3b.onnx", 16, "h100-sxm",
        "tp=1,pp=1,ep=16,zero=1", 4096, 1024, 1, 8960.0, "tokens/s/GPU",
        "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md, release 26.04.01, DGX-H100",
        "TP1 PP1 EP16, micro-batch 1", dtype="fp8"),
    Run("Mixtral-8x22B, Megatron-LM MoE best practice, 128 x H100", "mixtral_8x22b.onnx", 128, "h100-sxm",
        "tp=2,pp=8,vpp=7,ep=8,sp=1,zero=1", 4096, 256, 1, 445.0, "TFLOP/s/GPU",
        "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md, Mixtral-8x22B best-practice script",
        "TP2 PP8 VPP7 EP8, BF16; about 445 TFLOP/s per GPU"),
]

OPTIMUS_SOURCE = "Feng et al., Optimus (USENIX ATC'25; arXiv 2408.03505), Table {table}"
OPTIMUS_NOTE = ("models of appendix A at sequence 2048; image tokens per sample not published (256: 224 px, patch "
                "14; models/build.py); {layout}; recomputation and ZeRO not stated: none and Megatron's distributed "
                "optimizer (zero=1) assumed")


def optimus(model: str, label: str, devices: int, preset: str, layout: str, global_batch: int, micro_batch_size: int,
            seconds: float, table: int, layout_note: str) -> Run:
    """One Megatron-LM row of Optimus's tables (a multimodal LLM, the encoder in the first pipeline stage)."""
    return Run(f"{label}, Megatron-LM (Optimus Table {table}), {devices} x {preset.split('-')[0].upper()}",
               f"{model}.onnx", devices, preset, layout, 2048, global_batch, micro_batch_size, seconds, "s/step",
               OPTIMUS_SOURCE.format(table=table), OPTIMUS_NOTE.format(layout=layout_note))


# issue 44: Optimus's Megatron-LM baselines. Table 5 gives the layout (TP8 PP8, micro-batch 2, the encoder in the
# first stage; sequence parallelism assumed, as Megatron-LM runs TP with it); Table 4 gives none.
RUNS += [
    # tp8 cannot split ViT-3B's 18 heads (Megatron-Core divides heads over the tensor ranks): Table 5's form, the
    # encoder in the first stage, with the largest tp dividing both models' heads (18, 24) and the node (8), tp2
    optimus("optimus_vit3b_gpt11b", "ViT-3B + GPT-11B", 8, "a100-80g", "tp=2,pp=4,sp=1,zero=1,encoders_first=1", 16, 1,
            3.42, 4, "layout not published: Table 5's form (encoder in the first stage) at tp2 pp4 and micro-batch 1 "
            "assumed (tp8 does not divide ViT-3B's 18 heads)"),
    *(optimus("optimus_vit22b_gpt175b", "ViT-22B + GPT-175B", devices, "h100-sxm",
              "tp=8,pp=8,sp=1,zero=1,encoders_first=1", 1536, 2, seconds, 5, "TP8 PP8 MBS 2 as published")
      for devices, seconds in ((1536, 10.65), (2048, 8.26), (3072, 5.91))),
]


class NotEvaluated(Exception):
    """``opsched evaluate`` refused the row's setting (its one-line message says why)."""


def model_file(run: Run, folder: str) -> str | None:
    """The row's model when it is not in ``models/``: written into ``folder`` by ``models/build.py`` (on demand)."""
    if (ROOT / "models" / run.model).exists():
        return None
    path = str(Path(folder) / run.model)
    if not Path(path).exists():
        from bench_scale import load_build  # models/build.py as a module: one loader for the benchmarks

        build = load_build()
        build.write_model(build.MODELS[run.model.removesuffix(".onnx")](), path)
    return path


def predicted(run: Run, kernels: bool = False, model_path: str | None = None) -> tuple[float, dict]:
    """The row's predicted figure in the published unit, and evaluate's whole JSON."""
    return predicted_by(run, run.command(kernels, model_path))


def predicted_by(run: Run, command: list[str]) -> tuple[float, dict]:
    """:func:`predicted` with ``command`` run in place of the row's own (e.g. on another cluster file)."""
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 2:
        raise NotEvaluated(out.stderr.strip().splitlines()[-1])
    out.check_returncode()
    doc = json.loads(out.stdout)
    if run.unit == "TFLOP/s/GPU":
        return doc["model_flops_per_step"] / doc["step_time"] / run.devices / 1e12, doc
    if run.unit == "s/step":
        return doc["step_time"], doc
    return doc["tokens_per_second_per_device"], doc


def throughput_ratio(run: Run, value: float) -> float:
    """Predicted / published throughput (a step time's ratio is the inverse)."""
    return run.published / value if run.unit == "s/step" else value / run.published


def measure(run: Run, folder: str) -> dict:
    """Evaluate the row on its preset and with kernel ceilings; a refused setting is reported, not raised."""
    path = model_file(run, folder)
    try:
        value, doc = predicted(run, model_path=path)
        ceiling, _ = predicted(run, kernels=True, model_path=path)
    except NotEvaluated as refused:
        return {"run": run.name, "published": run.published, "unit": run.unit, "refused": str(refused),
                "command": shlex.join(run.command()[:-2]), "source": run.source, "note": run.note}
    return {"run": run.name, "predicted": value, "published": run.published, "unit": run.unit,
            "ratio": throughput_ratio(run, value), "ratio_kernel_ceilings": throughput_ratio(run, ceiling),
            "step_time": doc["step_time"], "mfu": doc["mfu"], "phases": doc.get("phases"),
            "fits": doc["fits"], "command": shlex.join(run.command()[:-2]), "source": run.source, "note": run.note}


def plan_row(run: Run, time_limit: float, keep: str | None = None) -> dict:
    """``opsched plan`` on the row's setting against the published layout, both as the planner counts a step.

    ``keep``: a folder to write the plan's output into (report.md, logs), kept; else a temporary one."""
    import tempfile

    planned = run  # plan --dtype plans in the row's own precision
    with tempfile.TemporaryDirectory() as models:
        path = model_file(run, models)
        try:
            _, doc = predicted(planned, model_path=path)
        except NotEvaluated as refused:
            return {"run": run.name, "skipped": str(refused)}
        return _plan_against(run, planned, doc, path, time_limit, keep)


def _plan_against(run: Run, planned: Run, doc: dict, path: str | None, time_limit: float, keep: str | None = None) -> dict:
    """Run ``opsched plan`` on ``run``'s setting; ``doc`` is evaluate's JSON of its published layout."""
    import tempfile
    import time

    published_step = doc["makespan"] + doc["grad_sync_seconds"]
    # plan's default 16 microbatches need a global batch they divide; else one sequence per microbatch
    micro = [] if run.global_batch % 16 == 0 else ["--micro-batch-size", "1"]
    # a published layout run with Megatron's --tp-comm-overlap: the plan may overlap the same way
    overlap = ["--tp-comm-overlap", "on"] if "tp_overlap=1" in run.layout else []
    # the plan runs the published run's attention kernel: a kernel is the user's, not the plan's to choose
    overlap += ["--attention", "unfused"] if "attention=unfused" in run.layout else []
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(keep) / f"row{RUNS.index(run)}") if keep else scratch
        command = ["opsched", "plan", path or f"models/{run.model}", "--devices", str(run.devices), "--preset", run.preset,
                   "--global-batch", str(run.global_batch), *micro, *overlap, "--dtype", run.dtype, "--seq-len", str(run.seq_len), "--time-limit",
                   str(time_limit), "-o", out, "--json", "-q"]
        t0 = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
    if done.returncode != 0:
        return {"run": run.name, "skipped": done.stderr.strip().splitlines()[-1]}
    plan = json.loads(done.stdout)
    return {"run": run.name + (" (planned in BF16)" if planned is not run else ""), "published_layout_step": published_step, "plan_step": plan["step_time"],
            "plan_layout": plan["layout"], "plan_source": plan["source"], "speedup": published_step / plan["step_time"],
            "seconds": seconds, "command": shlex.join([*command[:2], f"models/{run.model}", *command[3:-4], "-o", "OUT"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plan", action="store_true", help="plan each row and compare with its published layout")
    parser.add_argument("--rows", type=int, nargs="*", help="row indices (default: all)")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--keep-plans", metavar="DIR", help="with --plan: keep each plan's output (report.md, logs) in DIR/rowN")
    args = parser.parse_args()
    runs = [RUNS[i] for i in args.rows] if args.rows else RUNS
    if args.plan:
        print("| run | published layout's step (s) | plan's step (s) | plan / published layout | chosen | wall (s) | command |")
        print("|---|---|---|---|---|---|---|")
        for r in runs:
            row = plan_row(r, args.time_limit, args.keep_plans)
            if "skipped" in row:
                print(f"| {row['run']} | – | – | – | skipped: {row['skipped']} | – | – |", flush=True)
                continue
            print(f"| {row['run']} | {row['published_layout_step']:.3f} | {row['plan_step']:.3f} | "
                  f"{row['speedup']:.3f}x | {row['plan_source']} on {row['plan_layout']} | {row['seconds']:.0f} | "
                  f"`{row['command']}` |", flush=True)
        return 0
    import tempfile

    with tempfile.TemporaryDirectory() as folder:  # models written on demand (python models/build.py NAME)
        rows = [measure(r, folder) for r in runs]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| run | published | predicted | ratio | ratio with kernel ceilings | predicted MFU | fits | command |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        digits = ".2f" if r["unit"] == "s/step" else ",.0f"
        if "refused" in r:
            print(f"| {r['run']} | {r['published']:{digits}} {r['unit']} | not evaluated: {r['refused']} | – | – | – | "
                  f"– | `{r['command']}` |")
            continue
        print(f"| {r['run']} | {r['published']:{digits}} {r['unit']} | {r['predicted']:{digits}} | {r['ratio']:.2f} | {r['ratio_kernel_ceilings']:.2f} | "
              f"{100 * r['mfu']:.1f} % | {'yes' if r['fits'] else 'no'} | `{r['command']}` |")
    within = [r for r in rows if "ratio" in r and 0.85 <= r["ratio"] <= 1.15]
    print(f"\nwithin ±15 %: {len(within)} of {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
