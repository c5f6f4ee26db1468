"""Plan a model on a cluster: device groups, parallel modes and a pipeline schedule.

Imports the ONNX model (shapes only), coarsens it into blocks, searches group
layouts with the upper MIP (which group and parallel mode runs each block),
schedules the best few with the lower MIP, and compares the plan with every
hand-written schedule on the best contiguous layer split of the same model
at the same memory. Writes, into OUTDIR:

  plan.json    the plan (validated before writing), with `baselines`, `candidates`, `warnings` and `runtimes`
  trace.json   Perfetto / chrome://tracing timeline
  gantt.svg    Gantt picture;  gantt.html  the same, interactive
  report.md    the plan against every baseline: step time, throughput, bubbles, memory, solve time;
               what the import assumed about the model; how to read it all

The cluster is a preset (--preset; `--devices N` alone uses h100-sxm) or a
JSON/TOML file (--cluster). Memory per device defaults to the cluster's.
Each parameter held costs 16 bytes (Adam in mixed precision); with
--optimizer-state bf16, 10 (Megatron-Core's precision-aware optimizer, which
`opsched export --megatron` then sets). By default (auto) a plan keeps
Adam's state in FP32, and in BF16 only when nothing fits in FP32 but
something does in BF16: its warnings say so. With --optimizer-state fp32
nothing fitting is a refusal, which says whether BF16 state would fit.

Checked before the import and the search, so a mistake costs no time: the
output directory can be written, --memory-limit has a unit (a bare 80 is
80 bytes: write 80GiB), --devices is at most 65,536 and --microbatches at most
4,096 (far above real jobs; the search grows with both); and right after the
import, every --dim names one of the model's symbolic dimensions.

--runtime R keeps only plans runtime R can run, asked with `opsched export`'s
own checks, so the chosen plan always exports to it: torch (--torch-csv),
megatron (--megatron) or torchtitan (--torchtitan with --torch-csv); any
(default) keeps every plan. Megatron-LM and torchtitan need whole layers per
stage, one parallel configuration for the whole model and whole samples per
data-parallel replica, so with them the fastest Megatron-style layout joins
the search even without --global-batch; a model they cannot run at all (two
stacks of layers, e.g. CLIP's towers) is refused right after the import.
plan.json (`runtimes`), the summary and report.md list the runtimes that can
run the chosen plan; report.md says why each other one cannot.

On two nodes or more the search also runs on the first half of the nodes
(and so on down to one node) with the time the search on every node leaves,
and that plan competes with the others idle: when the time limit does not
bind, more nodes never give a slower plan; when it leaves that search no
time, the plan's warnings say on how many devices none was searched. A plan that leaves devices idle
says which, and why, in its warnings.

With --json, stdout is one JSON object instead of the summary: model,
cluster, devices, microbatches, microbatch_size, source and layout (the chosen
plan), stages, step_time (s), throughput (samples/s), bubble_ratio,
peak_memory_bytes (per device), lower_bound (s) and gap of the lower MIP
(null for a baseline), best_baseline (method, layout, step_time, speedup;
null when none fits), refused_baselines (method -> reason),
on_half_the_nodes (the plan found on half the nodes: devices, source,
layout, step_time, chosen; null on one node), as_a_chain_step_time (that
of the plan found with the stage graph a chain, as --branches off, when
the model has parallel branches; else null), runtimes (those
that can run the plan), runtimes_refused (runtime -> why not), warnings (what
the import assumed about the model, e.g. balanced MoE routing, and any
other import warning; also in report.md and plan.json) and files (the paths
written). Progress stays on stderr.

examples:
  opsched plan models/mixtral_8x7b.onnx --devices 16 -o out/
  opsched plan models/clip_vit_l14.onnx --devices 8 --preset a100-80g --microbatches 16 -o out/clip
  opsched plan models/llama_7b.onnx --devices 8 --runtime megatron -o out/llama
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from opsched.commands.args import (
    MAX_DEVICES,
    WholeNumber,
    add_cluster_arguments,
    add_optimizer_state_argument,
    byte_size,
    dimension,
    merged_dims,
    microbatch_count,
    positive_float,
    positive_int,
)
from opsched.cost.cluster import ATTENTION_MODES
from opsched.errors import MemoryTooSmall
from opsched.export.runtimes import RUNTIMES
from opsched.plan.search import GLOSSARY
from opsched.solving.solver import SOLVERS
from opsched.upper.layouts import NOTATION

#: after the options in `opsched plan --help`: how to read the layouts and words the output uses
EPILOG = NOTATION + "\n" + GLOSSARY

log = logging.getLogger(__name__)

#: how report.md says what each --zero level shards over data-parallel replicas
ZERO_WORDS = {0: "held whole by every data-parallel replica (ZeRO 0)",
              1: "sharded over data-parallel replicas (ZeRO-1, Megatron's distributed optimizer)",
              2: "sharded over data-parallel replicas, gradients too (ZeRO-2)"}

#: what --runtime takes: a runtime of opsched.export.runtimes.RUNTIMES, or any
RUNTIME_CHOICES = ("any", *RUNTIMES)

#: the part of --time-limit kept for validating the plan and writing its files
EXPORT_SHARE = 0.05
#: and at least this many seconds per job of the largest candidate known before the search (files_deadline):
#: 0.47 ms measured for a 16,384-job plan on 3,072 devices (7.7 s on a 2-core machine at load 1), with a margin
EXPORT_SECONDS_PER_JOB = 6e-4
#: the part of the time left that the Megatron-style layout search may use (with a global batch): past it the
#: layouts not yet evaluated are skipped, and the planner's search gets the rest
LAYOUT_SEARCH_SHARE = 0.3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL.onnx", help="an ONNX file (weights need not be present)")
    add_cluster_arguments(parser)
    parser.add_argument("--microbatches", type=microbatch_count, metavar="M",
                        help="microbatches per step, at most 4,096 (default 16, or global batch / micro-batch size)")
    parser.add_argument("--global-batch", type=positive_int, metavar="G",
                        help="sequences per step; data-parallel replicas then take whole sequences of a microbatch "
                             "(without it, a data-parallel mode may split a microbatch's one sequence, which is "
                             "context parallelism and its traffic is not costed)")
    parser.add_argument("--micro-batch-size", type=positive_int, metavar="B",
                        help="sequences per microbatch (the model's batch dimension; default: global batch / "
                             "microbatches with --global-batch, else the file's)")
    parser.add_argument("--seq-len", type=positive_int, metavar="S",
                        help="tokens per sequence (the model's seq dimension; same as --dim seq=S)")
    parser.add_argument("--dim", type=dimension, action="append", default=[], metavar="NAME=VALUE",
                        help="value of a symbolic dimension, e.g. --dim seq=4096 (repeatable)")
    parser.add_argument("--capacity-factor", type=positive_float, default="1.0", metavar="X",
                        help="MoE capacity factor (default 1.0)")
    parser.add_argument("--memory-limit", type=byte_size, metavar="BYTES",
                        help="per device with a unit, e.g. 80GiB, 80GB or 512MiB; a bare number is bytes, "
                             "e.g. 8e10 (default: the cluster's memory)")
    parser.add_argument("--time-limit", type=positive_float, default="60", metavar="S",
                        help="wall-clock budget of the whole command in seconds (default 60): the import, "
                             "the search and writing the files; the best valid plan found by then is written, "
                             "and a candidate the clock cut short says so in report.md")
    parser.add_argument("--jobs", type=WholeNumber(1), default=None, metavar="N",
                        help="solves to run at once, each in its own process (default: every core this process "
                             "may use). Each solve keeps its own work budget, so the plan is the same for any N "
                             "unless the time limit cuts solves short; more jobs then leave fewer cut")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2), default=1,
                        help="ZeRO level over data-parallel replicas: 0 every replica holds its optimizer states; "
                             "1 (default) they are sharded, as Megatron's distributed optimizer does, for the same "
                             "gradient traffic; 2 the gradients too")
    add_optimizer_state_argument(parser, auto=True)
    parser.add_argument("--recompute", choices=("none", "selective", "full", "auto"), default="auto",
                        help="activation recomputation: none; selective (the attention core's scores are not kept "
                             "and its forward runs again, Megatron's selective recompute); full (each block keeps "
                             "its input and runs its forward again in the backward); auto (default): the "
                             "Megatron-style layouts try none, selective, then full, each keeping the first that "
                             "fits, and the planner's own search plans without recomputation and with full "
                             "recomputation only if nothing fits")
    parser.add_argument("--tp-comm-overlap", choices=("auto", "on", "off"), default="auto",
                        help="Megatron's --tp-comm-overlap (Transformer Engine's userbuffers, with sequence "
                             "parallelism): on costs every tensor-parallel block with its collectives run under its "
                             "GEMMs and writes the flag into the Megatron export; torch and torchtitan do not do "
                             "this and refuse such a plan with tp > 1. auto (default): on with --runtime megatron, "
                             "off otherwise")
    parser.add_argument("--attention", choices=ATTENTION_MODES, default="fused",
                        help="how your framework runs attention: fused (default: FlashAttention, cuDNN or torch's "
                             "SDPA, the scores never leave the chip) or unfused (Megatron-LM before FlashAttention: "
                             "Q·Kᵀ and scores·V as batched GEMMs, the scores written to memory for softmax and "
                             "dropout and kept for the backward); a kernel, not a choice the plan makes")
    parser.add_argument("--runtime", choices=RUNTIME_CHOICES, default="any",
                        help="keep only plans this runtime can run, so that `opsched export` writes its files: "
                             "torch (--torch-csv), megatron (--megatron), torchtitan (--torchtitan with --torch-csv); "
                             "any (default) keeps every plan. With megatron or torchtitan, Megatron-style layouts "
                             "(whole layers, one configuration) join the search even without --global-batch. "
                             "Only with any does an overlapped F&B pair hide one pass's communication under the "
                             "other's compute (a runtime that overlaps them, as DualPipe's does): torch runs "
                             "OVERLAP_F_B as F then B, so with a runtime named a pair costs its two passes")
    parser.add_argument("--branches", choices=("on", "off"), default="on",
                        help="on (default): stages may form a DAG, a model's parallel branches (towers, encoders) on "
                             "groups of their own, and the model is planned as one chain too in the time left, so "
                             "branches never give a slower plan when the time limit does not bind; off: the stage "
                             "graph is a chain (a sequential pipeline), to see what the branches buy")
    parser.add_argument("--solver", default="cbc", choices=SOLVERS, help="MIP solver (default cbc; highs needs pip install highsbox)")
    parser.add_argument("-o", "--out", required=True, metavar="OUTDIR",
                        help="directory for the plan files (made if missing; checked before any work)")
    parser.add_argument("--json", action="store_true",
                        help="print the summary as one JSON object on stdout (fields above); progress stays on stderr")


def run(args: argparse.Namespace) -> int:
    from opsched.cost.cluster import Training, resolve_cluster
    from opsched.model.coarsen import coarsen
    from opsched.errors import OpschedError
    from opsched.export.runtimes import verdicts
    from opsched.fileio import check_output_dir
    from opsched.model.onnx_import import import_onnx, routing_assumptions
    from opsched.solving.solver import require
    from opsched.units import bytes_text, plural
    from opsched.upper.layouts import layouts

    # the time limit is the whole command's: the import counts, and a part is kept for writing the files
    deadline = time.monotonic() + (1.0 - EXPORT_SHARE) * args.time_limit
    require(args.solver)  # a missing backend fails here, before the import
    cluster = resolve_cluster(args.devices, args.cluster, args.preset)
    if cluster.devices > MAX_DEVICES:  # --devices is bounded by its type; a cluster file's count is not
        raise OpschedError(f"{args.cluster}: {cluster.devices:,} devices; opsched plans for at most {MAX_DEVICES:,} "
                           "(the layout search grows with the device count)")
    layouts(cluster)  # devices that fit no layout fail here, before the import
    limit = args.memory_limit or cluster.memory_bytes
    out = Path(args.out)
    check_output_dir(out, "-o")  # an unwritable place fails here, not after the search

    overlap_tp = tp_comm_overlap(args)  # a runtime that cannot overlap them fails here, before the import
    dims, microbatches = batch_dims(args)  # a batch that does not divide fails here, before the import
    # no progress line before the import: a refused --dim is then the only line on stderr
    og = import_onnx(args.model, dims=dims or None, capacity_factor=args.capacity_factor, strict_dims=True)
    used_dims = dict(og.graph.get("dims", {}))
    if args.global_batch is not None and "batch" not in used_dims:
        raise OpschedError(f"{args.model} has no symbolic batch dimension, so --global-batch cannot size its "
                           "microbatches; plan with --microbatches M")
    training = Training(microbatches=microbatches, microbatch_size=int(used_dims.get("batch", 1)),
                        zero=args.zero, recompute="none" if args.recompute == "auto" else args.recompute,
                        optimizer_state="fp32" if args.optimizer_state == "auto" else args.optimizer_state,
                        whole_sequences=args.global_batch is not None,
                        tp_comm_overlap=overlap_tp, attention=args.attention,
                        # torch (and torchtitan, through it) runs an OVERLAP_F_B pair as F then B; Megatron pairs nothing
                        overlap_pairs=args.runtime == "any")
    bg = coarsen(og)
    check_runtime_model(args.runtime, args.model, bg)  # a model the runtime cannot run fails before the search
    dims_text = ", ".join(f"{k}={v}" for k, v in used_dims.items())
    log.info("import: %s: %s; %s", args.model, plural(og.number_of_nodes(), "operator"),
             f"symbolic dims {dims_text}" if dims_text else "no symbolic dims")
    # what the import assumed (MoE routing) or could not know (masks, unknown ops) goes into report.md and
    # plan.json too, not only onto stderr, so a reader of the plan sees what it rests on
    assumed = routing_assumptions(og)
    warnings = assumed + list(og.graph.get("warnings") or [])
    for sentence in assumed:
        log.warning("import: assumes %s", sentence)
    for sentence in og.graph.get("warnings") or []:
        log.warning("import: warning: %s", sentence)
    log.info("coarsen: the operators merged into %s (the units the planner places)",
             plural(bg.number_of_nodes(), "block"))
    log.info("cluster: %s, %s (%d per node), memory limit %s per device, %s per step",
             cluster.name, plural(cluster.devices, "device"), cluster.devices_per_node, bytes_text(limit),
             plural(training.microbatches, "microbatch", "microbatches"))
    # with a global batch (or a runtime that needs whole layers: the plan's samples per step), the
    # Megatron-style layouts users run (micro-batch 1, replicas, EP folded over them, interleaved 1F1B) join
    # the baselines, so a plan is never slower than the best of them
    whole_layers = args.runtime in ("megatron", "torchtitan") and "batch" in used_dims
    global_batch = args.global_batch or (training.microbatches * training.microbatch_size if whole_layers else None)
    training, result = plan_with_optimizer_state(args, bg, cluster, training, limit, deadline, dims, global_batch,
                                                 warnings)
    log.info("validate: %s on %s", result.source, result.layout)
    for sentence in plan_warnings(result, training, cluster):
        warnings.append(sentence)
        log.warning("plan: %s", sentence)
    samples = training.microbatches * training.microbatch_size
    extra = plan_extra(args.model, cluster, training, result, warnings, dims=used_dims)
    runtimes = verdicts(result.schedule, extra)  # the export's own checks, on the plan as written
    extra.update(runtimes_fields(runtimes))
    report = report_text(args.model, cluster, training, limit, result, warnings, runtimes)
    names = write_outputs(out, result, extra, report)
    log.info("export: %s in %s", ", ".join(names), out)
    if args.json:
        print(json.dumps(summary_dict(args.model, cluster, training, result, out, names, warnings, runtimes),
                         indent=2))
    else:
        print(summary_text(args.model, cluster, training, result, samples, out, names, warnings, runtimes))
    return 0


def tp_comm_overlap(args: argparse.Namespace) -> bool:
    """Whether the plan overlaps tensor-parallel collectives with GEMMs (``--tp-comm-overlap``), or
    :class:`OpschedError` for a runtime that cannot.

    >>> tp_comm_overlap(argparse.Namespace(tp_comm_overlap="auto", runtime="megatron"))
    True
    >>> tp_comm_overlap(argparse.Namespace(tp_comm_overlap="on", runtime="torch"))
    Traceback (most recent call last):
    opsched.errors.OpschedError: --tp-comm-overlap on: torch does not overlap tensor-parallel collectives with their GEMMs (Megatron-LM with Transformer Engine does); plan with --tp-comm-overlap off, or --runtime megatron or any
    """
    from opsched.errors import OpschedError

    if args.tp_comm_overlap == "auto":
        return args.runtime == "megatron"
    if args.tp_comm_overlap == "on" and args.runtime in ("torch", "torchtitan"):
        raise OpschedError(f"--tp-comm-overlap on: {args.runtime} does not overlap tensor-parallel collectives with "
                           "their GEMMs (Megatron-LM with Transformer Engine does); plan with --tp-comm-overlap off, "
                           "or --runtime megatron or any")
    return args.tp_comm_overlap == "on"


def files_deadline(deadline: float, time_limit: float, rows: list) -> float:
    """``deadline`` moved earlier when the files of the largest candidate so far (a Megatron-style layout of
    thousands of jobs) need more than :data:`EXPORT_SHARE` of the time limit to write: validating, the runtimes'
    checks, plan.json, the trace and the charts take about :data:`EXPORT_SECONDS_PER_JOB` each.

    >>> files_deadline(95.0, 100.0, []), files_deadline(95.0, 100.0, [argparse.Namespace(schedule=
    ...     argparse.Namespace(events=[None] * 20_000))])
    (95.0, 88.0)
    """
    jobs = max((len(row.schedule.events) for row in rows), default=0)
    return min(deadline, deadline + EXPORT_SHARE * time_limit - EXPORT_SECONDS_PER_JOB * jobs)


def plan_with_optimizer_state(args: argparse.Namespace, bg, cluster, training, limit: float, deadline: float,
                              dims: dict, global_batch: int | None, warnings: list[str]):
    """:func:`plan_with_recompute` with the Megatron-style layouts (with a global batch), and with ``--optimizer-state
    auto`` once more with Adam's state in BF16 when nothing fits in FP32 and something does in BF16 (a sentence in
    ``warnings`` says so); (training as planned, :class:`opsched.plan.search.PlanResult`)."""
    from opsched.cost.cluster import OPTIMIZER_STATE_BYTES
    from opsched.units import plain

    def layouts_today(training) -> list:  # within its share of the time left
        share = time.monotonic() + LAYOUT_SEARCH_SHARE * max(0.0, deadline - time.monotonic())
        return megatron_layouts(args, dims, cluster, training, limit, global_batch, share) if global_batch else []

    today = layouts_today(training)
    deadline = files_deadline(deadline, args.time_limit, today)
    try:
        return plan_with_recompute(args, bg, cluster, training, limit, deadline, today, bool(global_batch))
    except StateInBf16Fits as exc:
        if args.optimizer_state != "auto":
            raise
        # Megatron-Core's precision-aware optimizer: what its users turn on when FP32 state does not fit
        log.info("plan: %s; planning again with Adam's state in bf16", exc)
        training = dataclasses.replace(training, optimizer_state="bf16",
                                       recompute="none" if args.recompute == "auto" else args.recompute)
        today = layouts_today(training)
        planned = plan_with_recompute(args, bg, cluster, training, limit, max(deadline, time.monotonic() + 1.0),
                                      today, bool(global_batch))
        warnings.append(f"Adam's state is kept in bf16 ({plain(OPTIMIZER_STATE_BYTES['bf16'])} bytes per parameter, "
                        f"not {plain(OPTIMIZER_STATE_BYTES['fp32'])}: Megatron-Core's precision-aware optimizer) because nothing "
                        f"fits with it in fp32: {exc.fp32_refusal}; pass --optimizer-state fp32 to refuse instead")
        return planned


def plan_with_recompute(args: argparse.Namespace, bg, cluster, training, limit: float, deadline: float, today: list,
                        searched: bool):
    """(training as planned, :class:`opsched.plan.search.PlanResult`): the planner's search, once more with full
    recomputation when nothing fits without it and ``--recompute auto``; for ``--runtime R`` only plans R can run,
    and :class:`NoRunnablePlan` says why none can, and how to widen the search. ``today``: the Megatron-style
    layouts found (``searched``: whether they were looked for)."""
    from opsched.errors import MemoryTooSmall, NoRunnablePlan, OpschedError
    from opsched.solving.isolate import usable_cores
    from opsched.plan.search import plan_block_graph
    from opsched.units import seconds_text

    runtime = None if args.runtime == "any" else args.runtime
    plan = functools.partial(plan_block_graph, bg, cluster, memory_limit=limit, time_limit=args.time_limit,
                             solver=args.solver, layouts_run_today=today, runtime=runtime,
                             workers=args.jobs or usable_cores(), branches=args.branches == "on")
    # the planner logs its own progress (opsched.plan.search)
    try:
        try:
            return training, plan(training, deadline=deadline)
        except (MemoryTooSmall, NoRunnablePlan) as exc:
            if args.recompute != "auto" or (isinstance(exc, NoRunnablePlan) and not _memory_bound(exc)):
                raise
            log.info("plan: nothing%s fits without recomputation; planning again with full recomputation, %s left",
                     "" if runtime is None else f" {runtime} can run", seconds_text(max(0.0, deadline - time.monotonic())))
            # the Megatron-style layouts already tried recomputation themselves (--recompute auto): kept as found
            training = dataclasses.replace(training, recompute="full")
            return training, plan(training, deadline=max(deadline, time.monotonic() + 1.0))
    except MemoryTooSmall as exc:
        raise with_optimizer_state_hint(exc, bg, cluster, training, limit, args.solver) from None
    except NoRunnablePlan as exc:
        hint = "plan with --runtime any for the fastest plan of any shape"
        if runtime in ("megatron", "torchtitan") and not today:
            hint = ("no Megatron-style layout (whole layers, one configuration) fits: pass a larger --memory-limit or "
                    f"more --devices, or {hint}" if searched else
                    "the model has no symbolic batch dimension, so no Megatron-style layout (whole layers, one "
                    f"configuration) was searched; {hint}")
        raise OpschedError(f"{exc}; {hint}") from None


class StateInBf16Fits(MemoryTooSmall):
    """Nothing fits with Adam's state in FP32, and something would in BF16 (the line says so, and how much)."""

    def __init__(self, message: str, smallest: float, fp32_refusal: str):
        super().__init__(message, smallest)
        self.fp32_refusal = fp32_refusal  # the refusal in FP32 alone


def with_optimizer_state_hint(exc, bg, cluster, training, limit: float, solver: str):
    """``exc`` (a :class:`opsched.errors.MemoryTooSmall`), as :class:`StateInBf16Fits` whose line ends with the memory
    Adam's state in BF16 would need when that fits in ``limit`` and the plan kept it in FP32; else ``exc`` itself."""
    from opsched.cost.cluster import OPTIMIZER_STATE_BYTES
    from opsched.plan.search import smallest_memory
    from opsched.units import bytes_text, plain

    if training.optimizer_state != "fp32":
        return exc
    lighter = dataclasses.replace(training, optimizer_state="bf16")
    smallest = smallest_memory(bg, cluster, lighter, solver)
    log.info("plan: with Adam's state in bf16 the least memory per device would be about %s", bytes_text(smallest))
    if smallest > limit:
        return exc
    return StateInBf16Fits(f"{exc}; with --optimizer-state bf16 (Adam's state in "
                           f"{plain(OPTIMIZER_STATE_BYTES['bf16'])} bytes per parameter, not "
                           f"{plain(OPTIMIZER_STATE_BYTES['fp32'])}) it needs about {bytes_text(smallest)}, which fits",
                           smallest, str(exc))


def _memory_bound(exc) -> bool:
    """Whether a :class:`NoRunnablePlan` had candidates refused for memory, which recomputation may fit."""
    return any("memory" in reason for reason in exc.reasons)


def check_runtime_model(runtime: str, model: str, bg) -> None:
    """Refuse, before the search, a model ``runtime`` can run no plan of: Megatron-LM and torchtitan split one
    stack of numbered layers (:func:`opsched.export.plan_layout.one_layer_stack`, the export's own rule)."""
    from opsched.errors import OpschedError
    from opsched.export.plan_layout import layer_stack_of, one_layer_stack
    from opsched.upper.stages import layer_path

    if runtime not in ("megatron", "torchtitan"):
        return
    stacks = [layer_stack_of(layer_path(bg.nodes[b]["block"].name)) for b in bg.nodes]

    def refuse(reason: str) -> OpschedError:
        reason = reason.replace("its stages hold", "it has")
        return OpschedError(f"--runtime {runtime}: {runtime} can run no plan of {model}: {reason}; plan with "
                            "--runtime torch or --runtime any")

    one_layer_stack([s for s in stacks if s is not None], refuse)


def runtimes_fields(runtimes: dict[str, str | None]) -> dict:
    """plan.json's ``runtimes`` (those that can run the plan) and ``runtimes_refused`` (runtime -> why not).

    >>> runtimes_fields({"torch": None, "megatron": "Megatron-LM cannot run this plan: a V"})
    {'runtimes': ['torch'], 'runtimes_refused': {'megatron': 'Megatron-LM cannot run this plan: a V'}}
    """
    return {"runtimes": [r for r, why in runtimes.items() if why is None],
            "runtimes_refused": {r: why for r, why in runtimes.items() if why is not None}}


def megatron_layouts(args: argparse.Namespace, dims: dict[str, int], cluster, training, limit: float,
                     global_batch: int, deadline: float | None = None) -> list:
    """The fastest Megatron-style layout that fits (:func:`opsched.plan.layouts.search_layouts`) as a baseline row;
    with ``--runtime R``, the fastest R can run (:func:`opsched.export.runtimes.refusal`).

    The model is imported again with one sequence per microbatch (Megatron's
    micro-batch size 1); its step is counted as the planner counts every
    candidate's (makespan + the whole gradient sync), so the rows compare like
    with like. Empty when no such layout fits. Past ``deadline`` the layouts
    not yet evaluated are skipped.
    """
    from opsched.model.coarsen import coarsen
    from opsched.plan.layouts import RECOMPUTE_SEARCH, search_layouts
    from opsched.export.runtimes import layout_fields, refusal
    from opsched.model.onnx_import import import_onnx
    from opsched.units import seconds_text

    t0 = time.perf_counter()
    og = import_onnx(args.model, dims={**dims, "batch": 1}, capacity_factor=args.capacity_factor, strict_dims=True)
    bg = coarsen(og)
    modes = RECOMPUTE_SEARCH if args.recompute == "auto" else (training.recompute,)

    def runs(e) -> bool:  # the runtime asked for can run the layout as plan.json would hold it
        if args.runtime == "any":
            return True
        row = layout_row(e, bg, cluster, t0)
        return refusal(args.runtime, row.schedule, layout_fields(row.contents, row.microbatch_size, training.zero,
                                                                 row.recompute, training.optimizer_state,
                                                                 training.tp_comm_overlap, training.attention)) is None

    found = search_layouts(bg, cluster, training, global_batch=global_batch,
                           tokens_per_sequence=int(og.graph.get("dims", {}).get("seq", 1)), memory_limit=limit,
                           recompute=modes, zero=training.zero, accept=runs,
                           fewer_devices=True, deadline=deadline, whole_sync=True)
    rows = []
    for e in found:
        rows.append(layout_row(e, bg, cluster, t0))
        log.info("baseline: the fastest Megatron-style layout that fits, %s with %s: step time %s",
                 rows[-1].layout, e.schedule_name, seconds_text(rows[-1].step_time))
    return rows


def plan_warnings(result, training, cluster) -> list[str]:
    """What a reader of the chosen plan must know about it: uncosted sequence splits, devices left idle, fewer nodes
    the time limit left unsearched."""
    from opsched.units import plain, plural, ranges_text, seconds_text

    out = []
    split = split_sequences(result, training)
    if split:
        out.append(f"the plan's data-parallel modes {', '.join(split)} split a microbatch of "
                   f"{plural(result.microbatch_size, 'sequence')}: that is context parallelism, whose traffic "
                   "is not costed; pass --global-batch G (and --micro-batch-size B) so that replicas take whole "
                   "sequences")
    if result.idle_devices:
        idle = result.idle_devices
        every = result.on_every_device
        if every is None:
            why = ("no plan the search found gives every device work (report.md's candidates say, layout by "
                   "layout, what was slower, did not fit or was cut by the time limit)")
        else:
            slower = every.step_time / result.step_time - 1.0
            why = (f"it is faster that way: the fastest plan found that gives every device work, {every.source} "
                   f"on {every.layout}, takes {seconds_text(every.step_time)} per step, "
                   f"{plain(100 * slower, 3)} % longer")
        which = f"device {idle[0]} (1 of {cluster.devices}) holds" if len(idle) == 1 else \
            f"devices {ranges_text(idle)} ({len(idle)} of {cluster.devices}) hold"
        out.append(f"{which} no stage of this plan: {why}")
    if result.fewer_nodes_unsearched is not None:
        fewer = plain(result.fewer_nodes_unsearched)
        out.append(f"no plan was searched on {fewer} devices (the first nodes, the others idle): the time limit was "
                   f"spent first, so a run on {fewer} devices alone may find a faster plan than this one; a larger "
                   "--time-limit leaves that search time, and then adding devices never gives a slower plan")
    return out


def layout_row(e, bg, cluster, t0: float):
    """A Megatron-style layout's :class:`opsched.plan.layouts.Evaluation` as a baseline row: its schedule on the real
    devices, what each stage holds, one sequence per data-parallel replica, its own recomputation."""
    from opsched.plan.contiguous import Baseline, on_real_devices
    from opsched.cost.blocks import Mode, expert_count
    from opsched.schedule import metrics
    from opsched.upper.layouts import Layout
    from opsched.upper.stages import stage_contents

    lay = e.layout
    m = metrics(e.schedule)
    # the modes' own names: experts folded over the replicas hold 1/ep of them each; context-parallel ranks
    # are named (tp2.cp2.dp2) so that plan.json and its exports carry cp
    dense = str(Mode(tp=lay.tp, dp=lay.dp, cp=lay.cp))
    expert = str(Mode(tp=lay.tp, dp=lay.dp // lay.ep, ep=lay.ep, cp=lay.cp))
    contents = {
        c: stage_contents([(bg.nodes[b]["block"].name,
                            expert if lay.ep > 1 and expert_count(bg.nodes[b]["block"]) else dense)
                           for b in blocks])
        for c, blocks in enumerate(e.chunks)
    }
    used = "" if lay.devices == cluster.devices else f", on {lay.devices} of the {cluster.devices} devices"
    return Baseline(
        method=f"megatron {e.schedule_name}", layout=f"{lay}, micro-batch 1{used}",
        schedule=on_real_devices(e.schedule, Layout(lay.devices, lay.pp)),
        makespan=m.makespan, step_time=e.planner_step, bubble_ratio=m.bubble_ratio,
        peak_memory_bytes=e.peak_memory_bytes, grad_sync=e.grad_sync, solve_seconds=time.perf_counter() - t0,
        contents=contents, microbatch_size=lay.dp, recompute=lay.recompute,  # one sequence per replica
    )


def split_sequences(result, training) -> list[str]:
    """The chosen plan's modes whose data-parallel degree exceeds a microbatch's sequences (none with --global-batch).

    Such a mode splits sequences across replicas: context parallelism, which the cost model does not cost.
    """
    if training.whole_sequences:
        return []
    from opsched.cost.blocks import Mode

    modes = {m for contents in result.stage_contents.values() for m in contents.modes}
    return sorted(m for m in modes if Mode.parse(m).dp > result.microbatch_size)


def batch_dims(args: argparse.Namespace) -> tuple[dict[str, int], int]:
    """The import dims and microbatches per step from --dim, --seq-len, --global-batch, --micro-batch-size, --microbatches.

    With --global-batch G: microbatches M = G / B; B is --micro-batch-size, else G / --microbatches (16).
    Every mismatch is one line, before the import.
    """
    from opsched.errors import OpschedError

    dims = merged_dims(args.dim)
    for flag, name, value in (("--seq-len", "seq", args.seq_len), ("--micro-batch-size", "batch", args.micro_batch_size)):
        if value is not None:
            if name in dims and dims[name] != value:
                raise OpschedError(f"{flag} {value} and --dim {name}={dims[name]} disagree; give one of them")
            dims[name] = value
    if args.global_batch is None:
        return dims, args.microbatches or 16
    G = args.global_batch
    if args.micro_batch_size is None:
        M = args.microbatches or 16
        if G % M:
            raise OpschedError(f"--global-batch {G} is not a multiple of {M} microbatches; "
                               "pass --micro-batch-size B (or --microbatches M) with B x M = G")
        dims["batch"] = G // M
        return dims, M
    B = args.micro_batch_size
    if G % B:
        raise OpschedError(f"--global-batch {G} is not a multiple of --micro-batch-size {B}")
    if args.microbatches is not None and args.microbatches * B != G:
        raise OpschedError(f"--microbatches {args.microbatches} x --micro-batch-size {B} is not --global-batch {G}; "
                           "leave out --microbatches")
    return dims, G // B


def plan_extra(model: str, cluster, training, result, warnings: list[str] | None = None,
               dims: dict[str, int] | None = None) -> dict:
    """The fields plan.json holds beyond the schedule contract (``warnings``: the import's assumptions and warnings;
    ``dims``: the model's symbolic dims as planned, e.g. batch and seq, which a framework's batch settings need)."""
    from opsched.export.runtimes import layout_fields

    samples = training.microbatches * training.microbatch_size
    return {
        "model": str(model),
        "dims": {str(k): int(v) for k, v in (dims or {}).items()},
        "cluster": {
            "name": cluster.name,
            "devices": cluster.devices,
            "devices_per_node": cluster.devices_per_node,
            "memory_bytes": cluster.memory_bytes,
        },
        "layout": result.layout,
        "source": result.source,
        "step_time": result.step_time,
        "grad_sync_seconds": result.grad_sync,
        "throughput": samples / result.step_time if result.step_time > 0 else 0.0,
        **layout_fields(result.stage_contents, result.microbatch_size, training.zero, result.recompute,
                        training.optimizer_state, training.tp_comm_overlap, training.attention),
        "stage_blocks": {str(k): c.blocks for k, c in result.stage_contents.items()},
        "baselines": [b.to_dict(samples) for b in result.baselines],
        "refused_baselines": [{"method": k, "reason": v} for k, v in result.refused_baselines.items()],
        "candidates": [c.to_dict() for c in result.candidates],
        "on_half_the_nodes": None if result.on_half_the_nodes is None else dataclasses.asdict(result.on_half_the_nodes),
        "warnings": list(warnings or []),
        "metrics": dict(result.solver_metrics),
    }


def output_files() -> list[str]:
    """The files `opsched plan` writes; gantt.svg only where matplotlib is installed."""
    from opsched.export.gantt import can_draw_images

    pictures = ["gantt.svg"] if can_draw_images() else []
    return ["plan.json", "trace.json", *pictures, "gantt.html", "report.md"]


def write_outputs(out: Path, result, extra: dict, report: str) -> list[str]:
    """Write every file into a temporary directory, then move them into ``out`` (no partial plan on failure).

    Returns the names written. Without matplotlib (the ``pictures`` extra) the
    SVG is skipped with a note; the HTML timeline needs no extra.
    """
    from opsched.export.gantt import write_html, write_image, write_trace
    from opsched.export.plan_json import write_plan
    from opsched.fileio import write_text

    from opsched.fileio import signals_held

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".opsched-plan-", dir=out))
    done = False
    try:
        title = f"opsched plan ({result.source}, {result.layout})"
        step = result.step_time  # the summary's headline figure; the charts show it next to the makespan
        write_plan(tmp / "plan.json", result.schedule, extra=extra)
        write_trace(result.schedule, tmp / "trace.json", title=title, step_time=step)
        names = output_files()
        if "gantt.svg" in names:
            write_image(result.schedule, tmp / "gantt.svg", title=title, step_time=step)
        else:
            log.warning("export: gantt.svg skipped (needs matplotlib: pip install 'opsched[pictures]'); "
                        "gantt.html has the picture")
        write_html(result.schedule, tmp / "gantt.html", title=title, step_time=step)
        write_text(tmp / "report.md", report)
        with signals_held():  # a stop request waits for the renames: the set is complete or absent
            for name in names:
                (tmp / name).replace(out / name)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and not done:
            with contextlib.suppress(OSError):
                out.rmdir()
    return names


def report_text(model: str, cluster, training, limit: float, result, warnings: list[str] | None = None,
                runtimes: dict[str, str | None] | None = None) -> str:
    """report.md: the plan against every baseline, every candidate tried, the stages, and how to read it all.

    Times and memory sizes carry units chosen per magnitude (one unit per
    table column), all through :mod:`opsched.units`.
    """
    from opsched.schedule import metrics
    from opsched.units import bytes_text, column_size_unit, column_time_unit, plain, plural, seconds_text
    from opsched.upper.layouts import describe_layout

    samples = training.microbatches * training.microbatch_size
    m = metrics(result.schedule)
    solve = result.solver_metrics.get("solve_seconds")
    stages = len(result.schedule.stage_graph.stages)
    lines = [
        f"# opsched plan: {Path(model).name}",
        "",
        f"- cluster: {cluster.name}, {plural(cluster.devices, 'device')}, {cluster.devices_per_node} per node",
        f"- memory limit: {bytes_text(limit)} per device (parameters + gradients + optimizer state + activations)",
        f"- microbatches: {result.schedule.microbatches} of {plural(result.microbatch_size, 'sample')} each; "
        f"dtype {training.dtype}",
        f"- optimizer states: {ZERO_WORDS[training.zero]}, in {training.optimizer_state} "
        f"({plain(training.bytes_per_param)} bytes per parameter with weight and gradient); "
        f"activation recomputation: {result.recompute}",
        "- tensor-parallel collectives: " + ("run under their GEMMs (Megatron's --tp-comm-overlap; torch and "
                                             "torchtitan do not)" if training.tp_comm_overlap else "exposed"),
        f"- attention: {training.attention}" + (" (the scores written to memory between its kernels)"
                                                if training.attention == "unfused" else " (one kernel)"),
        f"- chosen: {result.source} on layout {result.layout} ({describe_layout(result.layout)}), "
        f"{plural(stages, 'pipeline stage')}",
        f"- step time {seconds_text(result.step_time)} (makespan {seconds_text(m.makespan)} + gradient sync "
        f"{seconds_text(result.grad_sync)}), throughput {plain(samples / result.step_time)} samples/s",
        f"- upper MIP placed {plural(result.blocks, 'block')}; time spent: upper {seconds_text(result.seconds.get('upper', 0))}, "
        f"baselines {seconds_text(result.seconds.get('baselines', 0))}, lower {seconds_text(result.seconds.get('lower', 0))}",
        *half_the_nodes_lines(result, cluster),
    ]
    if runtimes:
        lines.append(f"- runtimes that can run it: {runtimes_line(runtimes)} (section Runtimes)")
    if warnings:
        lines += ["", "## Assumptions and warnings", "",
                  "What the import had to assume about the model; the plan is only as right as these are.", ""]
        lines += [f"- {w}" for w in warnings]
    lines += [
        "",
        "## Plan and baselines",
        "",
        "Step time = schedule makespan + the once-per-step gradient all-reduce. Baselines run on the best",
        "contiguous layer split of the same model (same cost model, same memory limit); see docs/cost-model.md.",
        "How to read a layout: at the end of this report.",
        "",
    ]
    time_unit = column_time_unit([result.step_time] + [b.step_time for b in result.baselines])
    peak = max(m.peak_memory_bytes, default=0.0)
    size_unit = column_size_unit([peak] + [b.peak_memory_bytes for b in result.baselines])
    cell = lambda v, unit: "-" if v is None else unit.number(v)  # noqa: E731
    lines += [
        f"| method | layout | step time ({time_unit.name}) | throughput (samples/s) | bubble ratio | "
        f"peak memory ({size_unit.name}) | solve (s) |",
        "|---|---|---|---|---|---|---|",
        f"| **opsched** ({result.source}) | {result.layout} | {time_unit.number(result.step_time)} | "
        f"{plain(samples / result.step_time)} | {m.bubble_ratio:.3f} | {size_unit.number(peak)} | "
        f"{'-' if solve is None else f'{solve:.1f}'} |",
    ]
    for b in result.baselines:
        lines.append(
            f"| {b.method} | {b.layout} | {time_unit.number(b.step_time)} | {plain(samples / b.step_time)} | "
            f"{b.bubble_ratio:.3f} | {cell(b.peak_memory_bytes, size_unit)} | {b.solve_seconds:.2f} |"
        )
    if result.baselines:
        best = result.baselines[0]
        lines += ["", f"Speed-up over the best baseline ({best.method}): {best.step_time / result.step_time:.3f}x"]
    else:
        lines += ["", "No hand-written baseline fits in this memory on any contiguous split."]
    if result.refused_baselines:
        lines += ["", "Baselines refused on every contiguous split (groups = pipeline depth tried), or left out because "
                  "the runtime asked for (--runtime) cannot run them:", ""]
        lines += [f"- {method}: {reason}" for method, reason in result.refused_baselines.items()]
    lines += (candidates_table(result) + stages_table(result)
              + runtimes_table(runtimes or {}, overlapped_pairs(result.schedule)))
    lines += ["", "## How to read this report", "", "```", NOTATION.rstrip(), "", GLOSSARY.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def runtimes_line(runtimes: dict[str, str | None]) -> str:
    """The runtimes that can run the plan, in a line.

    >>> runtimes_line({"torch": None, "megatron": "a V", "torchtitan": None})
    'torch, torchtitan; not megatron'
    >>> runtimes_line({"torch": "branches", "megatron": "branches"})
    'none'
    """
    can = [r for r, why in runtimes.items() if why is None]
    cannot = [r for r, why in runtimes.items() if why is not None]
    return (", ".join(can) or "none") + (f"; not {', '.join(cannot)}" if can and cannot else "")


def overlapped_pairs(schedule) -> int:
    """How many of the schedule's F&B pairs are shorter than their two passes (a runtime must overlap them)."""
    from opsched.schedule import Pair, pair_duration

    sg, found = schedule.stage_graph, 0
    halves: dict[int, list] = {}
    for e in schedule.events:
        if e.pair is not None:
            halves.setdefault(e.pair, []).append(e)
    for a, b in (h for h in halves.values() if len(h) == 2):
        alone = sg.stage(a.stage).duration(a.pass_) + sg.stage(b.stage).duration(b.pass_)
        found += pair_duration(sg, Pair(a.job, b.job)) < alone * (1 - 1e-9)
    return found


def runtimes_table(runtimes: dict[str, str | None], overlapped: int = 0) -> list[str]:
    """The report's Runtimes section: each runtime, the export that writes its files, or why it cannot run the plan."""
    from opsched.export.runtimes import RUNTIMES

    if not runtimes:
        return []
    lines = ["", "## Runtimes", "",
             "Whether `opsched export` writes each runtime's files for this plan (its own checks; docs/export.md).",
             "`opsched plan --runtime R` keeps only plans R can run.", "",
             "| runtime | can run it | export, or why not |", "|---|---|---|"]
    for runtime, why in runtimes.items():
        lines.append(f"| {runtime} | {'yes' if why is None else 'no'} | "
                     + (f"`opsched export plan.json {RUNTIMES[runtime]}` |" if why is None else f"{why} |"))
    if overlapped:
        lines += ["", f"The step time counts {overlapped} overlapped F&B pairs as shorter than their two passes: "
                  "a runtime that overlaps them (DualPipe's) runs the plan as planned; torch's runtime (and "
                  "torchtitan's) runs each `OVERLAP_F_B` as F then B, which takes longer. `opsched plan "
                  "--runtime torch` plans without counting on the overlap."]
    return lines


def candidates_table(result) -> list[str]:
    """The report's Candidates section: every layout tried and how far each got, times in one unit."""
    from opsched.units import column_time_unit

    times = [v for c in result.candidates for v in (c.estimate, c.makespan, c.step_time, c.lower_bound)]
    unit = column_time_unit(times)
    t = lambda v: "-" if v is None else unit.number(v)  # noqa: E731
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [
        "",
        "## Candidates tried",
        "",
        f"| source | layout | status | estimate ({unit.name}) | upper | makespan ({unit.name}) | "
        f"step time ({unit.name}) | bubbles | lower bound ({unit.name}) | gap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result.candidates:
        lines.append(
            f"| {c.source} | {c.layout} | {c.status} | {t(c.estimate)} | {c.upper_status or '-'} | {t(c.makespan)} | "
            f"{t(c.step_time)} | {f(c.bubble_ratio)} | {t(c.lower_bound)} | {f(c.gap)} |"
        )
    return lines


def half_the_nodes_lines(result, cluster) -> list[str]:
    """report.md's line on the plan found on half the nodes (none on one node)."""
    from opsched.units import plain, seconds_text

    half = result.on_half_the_nodes
    if half is None:
        return []
    return [f"- on half the nodes ({plain(half.devices)} of the {plain(cluster.devices)} devices, the others idle) "
            f"the search found {half.source} on layout {half.layout}, step time {seconds_text(half.step_time)} "
            f"(in {seconds_text(result.seconds.get('half the nodes', 0))}): "
            + ("this plan, the fastest found" if half.chosen else "offered, and slower than this plan")]


def own_pair(sg, sid: int) -> tuple[float, float]:
    """The overlapped pair of stage ``sid``'s F and B (two microbatches) and its gain, ``(F + B - pair) / min(F, B)``."""
    from opsched.schedule import Job, Pair, pair_duration

    f, b = sg.stage(sid).duration("F"), sg.stage(sid).duration("B")
    pair = pair_duration(sg, Pair(Job(sid, 0, "F"), Job(sid, 1, "B")))
    return pair, (f + b - pair) / min(f, b) if min(f, b) > 0 else 0.0


def stages_table(result) -> list[str]:
    """The report's Stages section: every stage's devices, times, layers and parallel modes, for every plan."""
    from opsched.units import column_time_unit

    sg = result.schedule.stage_graph
    stages = sg.stages
    unit = column_time_unit([s.time[p] for s in stages for p in ("F", "I", "W")])
    lines = ["", "## Stages", "",
             f"| stage | devices | F / I / W ({unit.name}) | F&B pair ({unit.name}) | overlap gain | layers | "
             "parallel modes |", "|---|---|---|---|---|---|---|"]
    for s in stages:
        t = s.time
        held = result.stage_contents.get(s.id)
        copy = f" (copy of stage {s.copy_of})" if s.copy_of is not None else ""
        layers = (held.layers if held else "-") + copy
        modes = held.modes_text if held else "-"
        devices = f"{s.devices[0]}" if len(s.devices) == 1 else f"{s.devices[0]}-{s.devices[-1]}"
        pair, gain = own_pair(sg, s.id)
        lines.append(f"| {s.id} | {devices} | {' / '.join(unit.number(t[p]) for p in ('F', 'I', 'W'))} | "
                     f"{unit.number(pair)} | {gain:.2f} | {layers} | {modes} |")
    lines += ["", "F&B pair: the stage's forward of one microbatch and backward (B) of another run overlapped, timed "
              "from the passes' compute and communication operations (docs/cost-model.md, \"Overlap\"), for a "
              "runtime that overlaps them as DualPipe's does; overlap gain: the share of the shorter pass it hides, "
              "(F + B - pair) / min(F, B). With --runtime R a pair costs its two passes (torch runs OVERLAP_F_B "
              "as F then B): gain 0."]
    if not result.stage_contents:
        lines += ["", "(this schedule regroups the model's split into its own stages, so which blocks each holds is not tracked)"]
    else:
        lines += ["", "Every block of each stage, with its mode, is in plan.json (`stage_contents`)."]
    return lines


def summary_text(model: str, cluster, training, result, samples: int, out: Path, names: list[str],
                 warnings: list[str] | None = None, runtimes: dict[str, str | None] | None = None) -> str:
    """The one-screen summary printed at the end; its step time is the one the Gantt titles show."""
    from opsched.schedule import metrics
    from opsched.units import bytes_text, plain, plural, seconds_text

    m = metrics(result.schedule)
    stages = len(result.schedule.stage_graph.stages)
    lines = [
        f"opsched plan {Path(model).name} on {cluster.devices} x {cluster.name}, {plural(result.schedule.microbatches, 'microbatch', 'microbatches')}",
        f"  chosen      {result.source} on layout {result.layout}, {plural(stages, 'stage')}",
        f"  step time   {seconds_text(result.step_time)} (makespan {seconds_text(m.makespan)} + gradient sync "
        f"{seconds_text(result.grad_sync)})   throughput {plain(samples / result.step_time)} samples/s",
        f"  bubbles     {m.bubble_ratio:.3f}   peak memory {bytes_text(max(m.peak_memory_bytes, default=0.0))} per device",
    ]
    gap = result.solver_metrics.get("gap")
    if gap is not None:
        lines.append(f"  lower MIP   bound {seconds_text(result.solver_metrics.get('lower_bound', 0))} on the makespan, "
                     f"gap {gap:.3f}")
    if result.baselines:
        best = result.baselines[0]
        lines.append(
            f"  vs best baseline {best.method} ({best.layout}): {seconds_text(best.step_time)} -> "
            f"{best.step_time / result.step_time:.3f}x"
        )
    if result.refused_baselines:
        lines.append(f"  refused     {', '.join(result.refused_baselines)} (reasons in report.md)")
    if runtimes:
        lines.append(f"  runtimes    {runtimes_line(runtimes)}"
                     + (" (reasons in report.md)" if any(why for why in runtimes.values()) else ""))
    if warnings:
        lines.append(f"  import      {plural(len(warnings), 'note')} on what the plan assumes about the model "
                     "(in report.md and plan.json)")
    lines.append(f"  files       {out}/{', '.join(names)}")
    return "\n".join(lines)


def summary_dict(model: str, cluster, training, result, out: Path, names: list[str],
                 warnings: list[str] | None = None, runtimes: dict[str, str | None] | None = None) -> dict:
    """What ``--json`` prints: the summary's figures with plan.json's names and units (seconds, bytes)."""
    from opsched.schedule import metrics

    m = metrics(result.schedule)
    samples = training.microbatches * training.microbatch_size
    best = result.baselines[0] if result.baselines else None
    return {
        "model": str(model),
        "cluster": cluster.name,
        "devices": cluster.devices,
        "microbatches": result.schedule.microbatches,
        "microbatch_size": result.microbatch_size,
        "source": result.source,
        "layout": result.layout,
        "stages": len(result.schedule.stage_graph.stages),
        "step_time": result.step_time,
        "throughput": samples / result.step_time if result.step_time > 0 else 0.0,
        "bubble_ratio": m.bubble_ratio,
        "peak_memory_bytes": max(m.peak_memory_bytes, default=0.0),
        "lower_bound": result.solver_metrics.get("lower_bound"),
        "gap": result.solver_metrics.get("gap"),
        "best_baseline": None if best is None else {
            "method": best.method,
            "layout": best.layout,
            "step_time": best.step_time,
            "speedup": best.step_time / result.step_time if result.step_time > 0 else None,
        },
        "refused_baselines": dict(result.refused_baselines),
        "on_half_the_nodes": None if result.on_half_the_nodes is None else dataclasses.asdict(result.on_half_the_nodes),
        "as_a_chain_step_time": result.chain_step_time,
        "warnings": list(warnings or []),
        **runtimes_fields(runtimes or {}),
        "files": [str(out / name) for name in names],
    }
