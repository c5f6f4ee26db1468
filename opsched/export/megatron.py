"""Megatron-LM arguments for a plan (``opsched export PLAN --megatron FILE``).

The file is a bash script that sets one array, ``OPSCHED_MEGATRON_ARGS``,
one ``--flag value`` per line with a comment saying what in the plan it
comes from: the shape of Megatron-LM's own launch scripts
(``examples/gpt3/train_gpt3_175b_distributed.sh`` keeps its parallel
arguments in ``MODEL_PARALLEL_ARGS=( ... )``), so it is sourced and spliced
into ``pretrain_gpt.py``'s command line beside the user's model, data and
optimizer arguments::

    source plan.megatron.sh
    torchrun ... pretrain_gpt.py "${OPSCHED_MEGATRON_ARGS[@]}" --hidden-size 4096 ...

The flags are Megatron-LM's as of Megatron-Core 0.16 (each sets a
``ModelParallelConfig`` / ``TransformerConfig`` field or a training
argument; docs/export.md has the table). A plan Megatron cannot run is
refused with the reason, nothing written: what any framework refuses
(:func:`opsched.export.plan_layout.plan_layout`), plus Megatron's own
limits: stages in a V (Megatron places chunk c on rank ``c mod pp`` only),
ZeRO-2 or 3 (its distributed optimizer shards optimizer states only), BF16
optimizer state without ZeRO-1 (its precision-aware optimizer runs only
inside the distributed optimizer), and an interleaved plan whose
microbatches are not a multiple of pp (Megatron's interleaved schedule runs
them in groups of pp, ``microbatch_group_size_per_vp_stage``).

>>> from opsched.cost.parallel_layout import ParallelLayout
>>> from opsched.export.plan_layout import PlanLayout
>>> lay = PlanLayout(ParallelLayout(tp=2, pp=2, dp=2, sp=True, zero=1), "chain", "tp2.dp2", "model.layers", (15, 17),
...                  (("model.layers.0",), ("model.layers.1",)), 2, 8, 32, 4096, "1f1b", 8)
>>> [f"{a.flag} {a.value}" if a.value else a.flag for a in megatron_args(lay)][:4]
['--tensor-model-parallel-size 2', '--pipeline-model-parallel-size 2', '--context-parallel-size 1', '--sequence-parallel']
>>> [f"{a.flag} {a.value}" for a in megatron_args(lay) if "pipeline-num-layers" in a.flag]
['--decoder-first-pipeline-num-layers 15', '--decoder-last-pipeline-num-layers 17']
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from opsched.baselines import METHODS
from opsched.cost.pipeline_split import compact_pipeline_layout
from opsched.export.framework import Framework
from opsched.export.plan_layout import PlanLayout, plan_layout
from opsched.schedule import Schedule
from opsched.units import plural

MEGATRON = Framework("Megatron-LM", "plan a chain or an interleaved layout: Megatron runs neither DualPipe nor a V")

#: the bash array the file sets
ARRAY = "OPSCHED_MEGATRON_ARGS"

#: the plan methods whose order Megatron's own schedules follow: 1F1B, interleaved 1F1B with vpp > 1
MEGATRON_SCHEDULES = tuple(name for name, module in METHODS.items() if module.MEGATRON_RUNS)


@dataclass(frozen=True)
class MegatronArg:
    """One Megatron-LM argument: its flag, its value (None for a switch) and what in the plan it comes from."""

    flag: str
    value: str | tuple[str, ...] | None  # a tuple: a flag taking several values (nargs="*")
    source: str

    def words(self) -> list[str]:
        if self.value is None:
            return [self.flag]
        return [self.flag, *self.value] if isinstance(self.value, tuple) else [self.flag, self.value]


def megatron_args(layout: PlanLayout) -> list[MegatronArg]:
    """The arguments that set ``layout`` in Megatron-LM, or :class:`OpschedError` for a plan Megatron cannot run."""
    p = layout.parallel
    refuse = MEGATRON.cannot_run
    if layout.placement == "v":
        raise refuse("its stages sit in a V (pipeline rank 0 holds the first and the last stage, as Zero Bubble V "
                     "and DualPipeV place them); Megatron puts chunk c on rank c mod pp; plan an interleaved layout")
    if p.zero >= 2:
        raise refuse(f"it shards gradients{' and parameters' if p.zero == 3 else ''} over the data-parallel replicas "
                     f"(zero {p.zero}); Megatron's distributed optimizer shards only the optimizer states: "
                     "plan with --zero 1")
    if layout.optimizer_state != "fp32" and p.zero != 1:
        raise refuse(f"it keeps Adam's state in {layout.optimizer_state} without ZeRO-1; Megatron's precision-aware "
                     "optimizer runs only with its distributed optimizer: plan with --zero 1")
    if p.vpp > 1 and layout.microbatches % p.pp:
        raise refuse(f"its {plural(layout.microbatches, 'microbatch', 'microbatches')} are no multiple of pp={p.pp}; "
                     "Megatron's interleaved schedule runs microbatches in groups of pp: plan with --microbatches "
                     f"{p.pp * -(-layout.microbatches // p.pp)}")
    arg = MegatronArg
    out = [
        arg("--tensor-model-parallel-size", str(p.tp), f"every stage's configuration is {layout.config}"),
        arg("--pipeline-model-parallel-size", str(p.pp), f"{plural(p.pp, 'device group')} of "
            f"{plural(layout.devices // p.pp, 'device')}, rank r on devices r*{layout.devices // p.pp}.."),
        arg("--context-parallel-size", str(p.cp),
            f"{layout.config}: each sequence split over {p.cp} ranks, K/V passed round a ring" if p.cp > 1
            else "no context parallelism"),
    ]
    if p.sp:
        out.append(arg("--sequence-parallel", None, "the cost model shards activations tp ways (docs/cost-model.md)"))
    if p.tp_overlap:  # needs Transformer Engine (--transformer-impl transformer_engine, Megatron's default)
        out.append(arg("--tp-comm-overlap", None, "plan tp_comm_overlap: tensor-parallel collectives costed under "
                                                  "their GEMMs (Transformer Engine's userbuffers)"))
    if p.attention == "unfused":  # Megatron-Core's AttnBackend: the scores in memory, as costed
        out.append(arg("--attention-backend", "unfused", "plan attention unfused: Q·Kᵀ, softmax, dropout and "
                                                         "scores·V as separate kernels"))
    if p.ep > 1:
        out += [
            arg("--expert-model-parallel-size", str(p.ep), f"{layout.config}: the experts spread over each group"),
            arg("--expert-tensor-parallel-size", str(p.etp), "an expert is not split tensor-parallel"),
        ]
    if p.zero == 1:
        out.append(arg("--use-distributed-optimizer", None, "plan zero 1: optimizer states sharded over dp"))
    out += _optimizer_precision(layout.optimizer_state)
    out += compute_precision(layout.dtype)
    if p.recompute == "full":
        out += [
            arg("--recompute-granularity", "full", "plan recompute full"),
            arg("--recompute-method", "uniform", "every layer keeps only its input"),
            arg("--recompute-num-layers", "1", "one layer per recomputed unit"),
        ]
    elif p.recompute == "selective":  # Megatron's selective recompute runs the attention core again (core_attn)
        out.append(arg("--recompute-granularity", "selective", "plan recompute selective: the attention core"))
    elif p.recompute_modules:  # Megatron's selective recompute of the modules named (its default: core_attn alone)
        out += [
            arg("--recompute-granularity", "selective", "plan recompute_modules: Megatron's selective recompute"),
            arg("--recompute-modules", p.recomputed_modules, "plan recompute_modules: these modules' forward again"),
        ]
    out.append(arg("--num-layers", str(layout.num_layers), f"{layout.layer_stack}.0-{layout.num_layers - 1}"))
    out += _layer_split(layout)
    samples = layout.global_batch_size // layout.microbatches
    out += [
        arg("--micro-batch-size", str(layout.micro_batch_size),
            f"microbatch of {plural(samples, 'sample')} over dp{p.dp}"),
        arg("--global-batch-size", str(layout.global_batch_size),
            f"{plural(layout.microbatches, 'microbatch', 'microbatches')} x {plural(samples, 'sample')}"),
    ]
    if layout.seq_len is not None:
        out.append(arg("--seq-length", str(layout.seq_len), "the plan's seq dim"))
    return out


def compute_precision(dtype: str) -> list[MegatronArg]:
    """The flags that run the plan's compute dtype (none for FP32, Megatron's default).

    FP8 is Transformer Engine's on a BF16 model: E4M3 for every GEMM's inputs with blockwise scaling (1 x 128
    activation tiles, 128 x 128 weight blocks), the recipe DeepSeek-V3 trained with (arXiv 2412.19437 §3.3) and
    Megatron-Bridge's DeepSeek-V3 FP8 runs use; attention and the rest stay in BF16, as the plan was costed
    (opsched.cost.cluster.attention_dtype).

    >>> [" ".join(a.words()) for a in compute_precision("fp8")]
    ['--bf16', '--fp8-format e4m3', '--fp8-recipe blockwise']
    """
    arg = MegatronArg
    if dtype == "fp32":
        return []
    if dtype == "fp16":
        return [arg("--fp16", None, "plan dtype fp16 (with Megatron's loss scaling)")]
    out = [arg("--bf16", None, f"plan dtype {dtype}" + (": the model in BF16, its GEMMs in FP8" if dtype == "fp8"
                                                          else ""))]
    if dtype == "fp8":
        out += [arg("--fp8-format", "e4m3", "FP8 GEMMs, E4M3 inputs in forward and backward (DeepSeek-V3's)"),
                arg("--fp8-recipe", "blockwise", "1x128 / 128x128 scaling blocks (Transformer Engine >= 2.3)")]
    return out


def _optimizer_precision(state: str) -> list[MegatronArg]:
    """The precision-aware optimizer's flags for Adam's state in ``state`` (none for FP32, Megatron's default):
    the bytes per parameter the plan was costed with (opsched.cost.cluster.OPTIMIZER_STATE_BYTES).

    >>> [" ".join(a.words()) for a in _optimizer_precision("bf16")][1:3]
    ['--main-grads-dtype bf16', '--main-params-dtype fp32']
    >>> _optimizer_precision("fp32")
    []
    """
    if state == "fp32":
        return []
    arg = MegatronArg
    return [
        arg("--use-precision-aware-optimizer", None, "plan optimizer_state bf16: Adam in Transformer Engine's FusedAdam"),
        arg("--main-grads-dtype", "bf16", "the plan's 2-byte gradients (Megatron's default keeps them in fp32)"),
        arg("--main-params-dtype", "fp32", "master weight kept as its 16 bits beyond the bf16 weight (TE >= 2.1)"),
        arg("--exp-avg-dtype", "bf16", "Adam's first moment, 2 bytes"),
        arg("--exp-avg-sq-dtype", "bf16", "Adam's second moment, 2 bytes"),
    ]


def _layer_split(layout: PlanLayout) -> list[MegatronArg]:
    """How Megatron splits the layers as the plan does: vpp chunks per rank, evenly; else uneven first and last
    ranks; else a layout string naming every chunk's layers."""
    p = layout.parallel
    counts = layout.stage_layers
    vpp = [] if p.vpp == 1 else [MegatronArg("--num-virtual-stages-per-pipeline-rank", str(p.vpp),
                                             f"{p.vpp} stages per group, interleaved")]
    if len(set(counts)) == 1:
        return vpp
    per_rank = [[counts[c] for c in range(len(counts)) if layout.rank_of_stage(c) == r] for r in range(p.pp)]
    middle = [n for rank in per_rank[1:-1] for n in rank]
    same = lambda ns: len(set(ns)) == 1 and ns[0] > 0  # noqa: E731
    if p.pp >= 2 and same(per_rank[0]) and same(per_rank[-1]) and (not middle or same(middle)):
        first, last = sum(per_rank[0]), sum(per_rank[-1])
        return vpp + [
            MegatronArg("--decoder-first-pipeline-num-layers", str(first), "the layers of the first pipeline rank"),
            MegatronArg("--decoder-last-pipeline-num-layers", str(last), "the layers of the last pipeline rank"),
        ]
    # --pipeline-model-parallel-layout sets vpp itself; Megatron-LM refuses it beside the vpp flag
    return [MegatronArg("--pipeline-model-parallel-layout", pipeline_layout_text(counts),
                        "each stage's layers; E embedding, t a layer, L the output layer and loss")]


def pipeline_layout_text(counts: tuple[int, ...] | list[int]) -> str:
    """Megatron's ``--pipeline-model-parallel-layout`` for chunks holding ``counts`` layers, in chunk order.

    Chunk ``i = virtual index x pp + rank``, which is opsched's stage order on
    an interleaved layout; the embedding goes with the first chunk, the
    output layer and loss with the last; written as
    :func:`opsched.cost.pipeline_split.compact_pipeline_layout` writes any split
    (the grammar ``evaluate --layout pipeline_layout=...`` reads).

    >>> pipeline_layout_text([3, 4, 4, 1])
    'Et*3|(t*4|)*2tL'
    """
    units = ["t" * n for n in counts]
    units[0] = "E" + units[0]
    units[-1] += "L"
    return compact_pipeline_layout(units)


def megatron_text(layout: PlanLayout, args: list[MegatronArg], plan_path: str | os.PathLike) -> str:
    """The bash file: a header saying what the plan is and how to use the array, then the array."""
    p = layout.parallel
    header = [
        "# Megatron-LM arguments for the opsched plan " + str(plan_path) + " (opsched export --megatron),",
        "# flags as of Megatron-Core 0.16. Layout: " + layout.describe() + f"; dp {p.dp} is Megatron's own",
        "# world size / (tp x pp x cp). Source this file and add \"${" + ARRAY + "[@]}\" to pretrain_gpt.py's",
        "# arguments beside your model's (--hidden-size, --num-attention-heads, ...), data and optimizer.",
    ]
    if layout.method not in MEGATRON_SCHEDULES:
        schedule = "interleaved 1F1B" if p.vpp > 1 else "1F1B"
        header.append(f"# Megatron runs its {schedule} on this layout, not the plan's {layout.method} order, "
                      "so its step time may differ from the plan's.")
    width = max(len(shlex.join(a.words())) for a in args)
    lines = [f"  {shlex.join(a.words()):<{width}}  # {a.source}" for a in args]
    return "\n".join(header + [f"{ARRAY}=("] + lines + [")"]) + "\n"


@dataclass(frozen=True)
class MegatronFile:
    """A plan's Megatron-LM arguments file, every check passed: its layout, its arguments and its text."""

    layout: PlanLayout
    args: list[MegatronArg]
    text: str


def megatron_file(schedule: Schedule, doc: dict, plan_path: str | os.PathLike) -> MegatronFile:
    """The arguments file of the plan ``doc`` (its :class:`Schedule` read by :func:`opsched.export.plan_json.read_plan`),
    or :class:`OpschedError` saying why Megatron cannot run it; nothing is written."""
    layout = plan_layout(schedule, doc, MEGATRON)
    args = megatron_args(layout)
    return MegatronFile(layout, args, megatron_text(layout, args, plan_path))
