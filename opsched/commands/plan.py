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
  report.html  one page, no network needed: the summary, the stage graph, the interactive Gantt, the plan
               against every baseline as a bar chart, the layouts tried

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
own checks, so the chosen plan always exports to it (--runtime's help lists
each runtime with the export options that write its files); any (default)
keeps every plan. A runtime of one configuration (Megatron-LM, torchtitan)
needs whole layers per stage, one parallel configuration for the whole model
and whole samples per data-parallel replica, so with it the fastest
Megatron-style layout joins the search even without --global-batch; a model
it cannot run at all (two stacks of layers, e.g. CLIP's towers) is refused
right after the import.
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
null when none fits), refused_baselines (method -> reason), branches (those
that run side by side: stages, devices), width and pairs (count, overlapped,
saving_seconds: the overlapped F&B pairs' total saving), branch_search (off,
no towers, or searched) and fastest_side_by_side (source, layout, step_time
of the fastest plan with branches apart, when the chosen one is a chain),
heaviest_fork_shares (the work in its two heaviest branches, or null),
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
import json
import logging
import time
from pathlib import Path

from opsched.commands.args import (
    MAX_DEVICES,
    WholeNumber,
    add_cluster_arguments,
    add_dtype_argument,
    add_optimizer_state_argument,
    byte_size,
    dimension,
    merged_dims,
    microbatch_count,
    positive_float,
    positive_int,
)
from opsched.cost.cluster import ATTENTION_MODES, RECOMPUTE_MODES, ZERO_LEVELS, Training, resolve_cluster
from opsched.errors import OpschedError
from opsched.plan.files import output_files, write_outputs
from opsched.export.runtimes import ANY, RUNTIMES, runtime_help, runtime_named, runtime_overlaps_pairs, verdicts
from opsched.fileio import check_output_dir
from opsched.plan.policy import (EXPORT_SHARE, PlanRequest, dims_as_planned, imported, micro_batch_warning,
                                 microbatch_hint, plan_warnings, plan_with_optimizer_state, whole_layer_batch)
from opsched.plan.report import plan_extra, report_text, runtimes_fields, summary_dict, summary_text
from opsched.plan.search import GLOSSARY
from opsched.solving.solver import SOLVERS, require
from opsched.units import bytes_text, plural
from opsched.upper.layouts import NOTATION, layouts

#: after the options in `opsched plan --help`: how to read the layouts and words the output uses
EPILOG = NOTATION + "\n" + GLOSSARY

log = logging.getLogger(__name__)


#: what --runtime takes: a runtime of opsched.export.runtimes.RUNTIMES, or any
RUNTIME_CHOICES = (ANY, *RUNTIMES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL.onnx", help="an ONNX file (weights need not be present)")
    add_cluster_arguments(parser)
    parser.add_argument("--microbatches", type=microbatch_count, metavar="M",
                        help="microbatches per step, at most 4,096 (default 16, or global batch / micro-batch size)")
    parser.add_argument("--global-batch", type=positive_int, metavar="G",
                        help="sequences per step; data-parallel replicas then take whole sequences of a microbatch "
                             "(without it, a group whose replicas would split a microbatch's sequences splits them "
                             "by context parallelism, its K/V ring costed as `opsched evaluate` costs it)")
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
    parser.add_argument("--zero", type=int, choices=tuple(ZERO_LEVELS), default=1,
                        help="ZeRO level over data-parallel replicas: " + "; ".join(
                            f"{level}{' (default)' if level == 1 else ''} {what}" for level, what in ZERO_LEVELS.items()))
    add_optimizer_state_argument(parser, auto=True)
    add_dtype_argument(parser)
    parser.add_argument("--recompute", choices=(*RECOMPUTE_MODES, "auto"), default="auto",
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
    parser.add_argument("--runtime", choices=RUNTIME_CHOICES, default=ANY, help=runtime_help())
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
    # the time limit is the whole command's: the import counts, and a part is kept for writing the files
    deadline = time.monotonic() + (1.0 - EXPORT_SHARE) * args.time_limit
    require(args.solver)  # a missing backend fails here, before the import
    cluster = resolve_cluster(args.devices, args.cluster, args.preset)
    if cluster.devices > MAX_DEVICES:  # --devices is bounded by its type; a cluster file's count is not
        raise OpschedError(f"{args.cluster}: {cluster.devices:,} devices; opsched plans for at most {MAX_DEVICES:,} "
                           "(the layout search grows with the device count)")
    layouts(cluster), cluster.flops_per_second(args.dtype)  # devices no layout fits, or a dtype they lack, fail here
    limit = args.memory_limit or cluster.memory_bytes
    out = Path(args.out)
    check_output_dir(out, "-o")  # an unwritable place fails here, not after the search
    overlap_tp = tp_comm_overlap(args)  # a runtime that cannot overlap them fails here, before the import
    dims, microbatches = batch_dims(args)  # a batch that does not divide fails here, before the import
    request = PlanRequest(model=args.model, time_limit=args.time_limit, solver=args.solver, jobs=args.jobs,
                          runtime=args.runtime, recompute=args.recompute, optimizer_state=args.optimizer_state,
                          capacity_factor=args.capacity_factor, branches=args.branches == "on")
    og, bg, warnings = imported(request, dims)
    used_dims = dict(og.graph.get("dims", {}))
    if args.global_batch is not None and "batch" not in used_dims:
        raise OpschedError(f"{args.model} has no symbolic batch dimension, so --global-batch cannot size its "
                           "microbatches; plan with --microbatches M")
    training = Training(microbatches=microbatches, microbatch_size=int(used_dims.get("batch", 1)),
                        zero=args.zero, recompute="none" if args.recompute == "auto" else args.recompute,
                        optimizer_state="fp32" if args.optimizer_state == "auto" else args.optimizer_state,
                        dtype=args.dtype, whole_sequences=args.global_batch is not None,
                        tp_comm_overlap=overlap_tp, attention=args.attention,
                        # torch (and torchtitan, through it) runs an OVERLAP_F_B pair as F then B; Megatron pairs nothing
                        overlap_pairs=runtime_overlaps_pairs(args.runtime))
    log.info("cluster: %s, %s (%d per node), memory limit %s per device, %s per step",
             cluster.name, plural(cluster.devices, "device"), cluster.devices_per_node, bytes_text(limit),
             plural(training.microbatches, "microbatch", "microbatches"))
    global_batch = args.global_batch or whole_layer_batch(request, training, used_dims)
    training, result = plan_with_optimizer_state(request, bg, cluster, training, limit, deadline, dims, global_batch,
                                                 warnings)
    log.info("validate: %s on %s", result.source, result.layout)
    hint = microbatch_hint(result, training, args.global_batch if not (args.microbatches or args.micro_batch_size)
                           else None)
    asked = micro_batch_warning(result, args.micro_batch_size)
    for sentence in plan_warnings(result, cluster) + [s for s in (hint, asked) if s]:
        warnings.append(sentence)
        log.warning("plan: %s", sentence)
    extra = plan_extra(args.model, cluster, training, result, warnings, dims=dims_as_planned(used_dims, result))
    runtimes = verdicts(result.schedule, extra)  # the export's own checks, on the plan as written
    extra.update(runtimes_fields(runtimes))
    # report.html shows the summary as printed, so it is written first, with the names of the files to come
    samples = training.microbatches * training.microbatch_size
    summary = summary_text(args.model, cluster, training, result, samples, out, output_files(), warnings, runtimes)
    names = write_outputs(out, result, extra, report_text(args.model, cluster, training, limit, result, warnings,
                                                          runtimes), summary)
    log.info("export: %s in %s", ", ".join(names), out)
    if args.json:
        print(json.dumps(summary_dict(args.model, cluster, training, result, out, names, warnings, runtimes),
                         indent=2))
    else:
        print(summary)
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
    runtime = runtime_named(args.runtime)
    if args.tp_comm_overlap == "auto":
        return runtime is not None and runtime.overlaps_tp_comm
    if args.tp_comm_overlap == "on" and runtime is not None and not runtime.overlaps_tp_comm:
        raise OpschedError(f"--tp-comm-overlap on: {args.runtime} does not overlap tensor-parallel collectives with "
                           "their GEMMs (Megatron-LM with Transformer Engine does); plan with --tp-comm-overlap off, "
                           "or --runtime megatron or any")
    return args.tp_comm_overlap == "on"


def batch_dims(args: argparse.Namespace) -> tuple[dict[str, int], int]:
    """The import dims and microbatches per step from --dim, --seq-len, --global-batch, --micro-batch-size, --microbatches.

    With --global-batch G: microbatches M = G / B; B is --micro-batch-size, else G / --microbatches (16).
    Every mismatch is one line, before the import.
    """
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


