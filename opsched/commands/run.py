"""Execute a plan on CPU processes and check its gradients against one process.

A chain of stages is exported to a compute-only CSV (as `opsched export` does),
which one process per pipeline rank (gloo, one thread each) loads into torch's
``_PipelineScheduleRuntime``. A stage graph that branches (CLIP's towers on
different device groups; GraphPipe's MMT), which torch's pipelining cannot run,
runs on opsched's own point-to-point executor (docs/torch.md). Either way a
few training steps of a model split into the plan's stages run:

  --hf-config CONFIG.json  the Hugging Face model the plan was made from (the
                           config given to `opsched onnx --hf-config`), random
                           weights from a fixed seed, each stage holding the
                           layers plan.json's stage_contents names (embedding
                           on the first, norm and head on the last). A causal
                           LM (Llama, Mixtral; a tied embedding's gradient is
                           summed over its stages): cross-entropy on the next
                           token of random token ids. CLIP: each tower's layers
                           as planned, the contrastive loss of each microbatch
  --mmt-config CONFIG.json a tiny GraphPipe multi-modal transformer (the sizes
                           build.py's branchy_transformer took), on the executor
  without either           a synthetic stand-in for timing studies: a tiny MoE
                           transformer, 1 to 4 blocks per stage in proportion
                           to its planned forward time; an MLP per stage (a DAG)

Losses and gradients are compared with one process (exit 0: they match, 1: not).
A plan the run cannot split (a layer split between stages; other layers than the
config's; a tower's parts on stages no edge joins; SigLIP) is refused first.

Needs torch (``pip install "opsched[torch]"``; with --hf-config also transformers, the ``hf`` extra).

examples:
  opsched run out/plan.json --hf-config tiny-llama.json --steps 2
  opsched run out/mmt/plan.json --mmt-config tiny-mmt.json
  opsched run out/plan.json --steps 2
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

from opsched.commands.args import positive_float, positive_int
from opsched.errors import OpschedError
from opsched.units import plural

log = logging.getLogger(__name__)

MAX_RANKS = 8
#: --dtype -> compare_with_reference's tolerances: float64 element by element; float32 per parameter,
#: relative to its largest reference gradient (issue 14: gradients match one process to 1e-5 relative)
TOLERANCES = {"float64": dict(rtol=1e-9, atol=1e-12), "float32": dict(rtol=1e-5, atol=1e-7, grad_rtol_of_max=1e-5)}


def even_width(text: str) -> int:
    """The tiny model's width: an even number >= 2 (its two attention heads split it).

    >>> even_width("16")
    16
    """
    value = positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"must be an even number >= 2, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.json", help="a plan written by opsched")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--hf-config", metavar="CONFIG.json",
                        help="run this Hugging Face model (the config the plan's ONNX was exported from with "
                             "`opsched onnx --hf-config`; random weights) instead of the synthetic stand-in")
    model.add_argument("--mmt-config", metavar="CONFIG.json", help="run a tiny GraphPipe MMT of these sizes "
                       "(branches, layers, dim, heads, ff, seq: build.py's branchy_transformer) on opsched's executor")
    parser.add_argument("--steps", type=positive_int, default=2, help="training steps to run and check (default 2)")
    parser.add_argument("--microbatch-size", type=positive_int, default=2, help="samples per microbatch (default 2)")
    parser.add_argument("--dim", type=even_width, default=16,
                        help="model width of the synthetic stand-in (a tiny MoE transformer), even (default 16)")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                        help="float64 (default) allows a tight gradient tolerance")
    parser.add_argument("--torch-csv", metavar="FILE.csv", help="also keep the exported schedule CSV here")
    parser.add_argument("--timeout", type=positive_float, default=300.0,
                        help="seconds before the run is stopped (default 300)")


def blocks_per_stage(forward_times: list[float], most: int = 4) -> tuple[int, ...]:
    """Blocks of the tiny model per stage, in proportion to the planned forward times (1..most).

    >>> blocks_per_stage([1.0, 2.0, 1.0, 9.0])
    (1, 2, 1, 4)
    """
    positive = [t for t in forward_times if t > 0]
    unit = min(positive) if positive else 1.0
    return tuple(max(1, min(most, round(t / unit))) for t in forward_times)


def run(args: argparse.Namespace) -> int:
    from opsched.export import torch_csv

    if not torch_csv.torch_available():
        raise OpschedError('`opsched run` needs torch: pip install "opsched[torch]" (torch>=2.6)')
    from opsched.export.plan_json import read_plan
    from opsched.fileio import check_not_input, check_output_file
    from opsched.schedule import ScheduleError, validate
    from opsched.schedule.placement import is_chain

    if args.torch_csv:
        check_not_input(args.torch_csv, [args.plan], "--torch-csv")
        check_output_file(args.torch_csv, "--torch-csv", example="schedule.csv")
    schedule, doc = read_plan(args.plan)
    try:
        validate(schedule)
    except ScheduleError as exc:
        raise OpschedError(f"{args.plan} is not a valid plan: {exc} (`opsched gantt --no-validate` draws it)") from None
    sg = schedule.stage_graph
    if args.mmt_config or not is_chain(sg):  # torch's pipelining runs a chain; opsched's executor any DAG
        return _run_dag(args, schedule, doc)
    torch_csv.check_expressible(sg, schedule.microbatches)
    ranks = torch_csv.torch_ranks(sg)
    if len(ranks) > MAX_RANKS:
        raise OpschedError(f"the plan has {len(ranks)} pipeline ranks; `opsched run` starts one process per rank on "
                           f"this machine and allows at most {MAX_RANKS}")
    if args.hf_config:
        from opsched.torchrun.hf_model import hf_spec_for_plan

        spec = hf_spec_for_plan(args.hf_config, doc, len(sg.stages), args.dtype)
        _note_wide_groups([g for g in ranks if len(g) > 1])
        what = f"{spec.model_name}, {spec.split_text()}, seq {spec.seq}"
    else:
        from opsched.torchrun.model import ModelSpec

        spec = ModelSpec(dim=args.dim, hidden=2 * args.dim, heads=2, blocks=blocks_per_stage(
            [s.duration("F") for s in sg.stages]), dtype=args.dtype)
        what = f"the synthetic stand-in (a tiny MoE, {list(spec.blocks)} blocks per stage)"
    return _run_and_check(args, schedule, spec, what)


def _note_wide_groups(wide: list) -> None:
    if wide:
        print(f"note: each device group runs as one process (groups {wide} of the plan); their tensor/context/"
              "data/expert parallel modes are not executed, the pipeline schedule is")


def _run_dag(args: argparse.Namespace, schedule, doc: dict) -> int:
    """A plan whose stages branch (or any plan of the MMT) on opsched's own point-to-point executor."""
    from opsched.export.torch_csv import torch_ranks
    from opsched.torchrun.dag_models import dag_spec_for_plan
    from opsched.torchrun.dag_runtime import check_dag, dag_job, run_dag_job
    sg = schedule.stage_graph
    if args.torch_csv:
        raise OpschedError("--torch-csv: this plan runs on opsched's own executor, not torch's: it has no torch CSV")
    check_dag(sg)
    spec = dag_spec_for_plan(doc, sg, args.hf_config, args.mmt_config, args.dim, args.dtype)
    job = dag_job(schedule, spec, args.microbatch_size, args.steps, MAX_RANKS)
    _note_wide_groups([g for g in torch_ranks(sg) if len(g) > 1])
    what = f"{spec.model_name}, {spec.split_text()}"
    log.info("running %s on opsched's point-to-point executor: %d ranks (gloo), %d stages of %s", args.plan,
             job.world_size, len(sg.stages), what)
    results = run_dag_job(job, timeout=args.timeout)
    print("ran on opsched's point-to-point executor (the stage graph is a DAG, which torch.distributed.pipelining, "
          "Megatron-LM and torchtitan cannot run: they pass activations from stage k to stage k+1 only)")
    return _verdict(args, sg, job, results, what)


def _run_and_check(args: argparse.Namespace, schedule, spec, what: str) -> int:
    """Export the schedule, run it on one process per rank, compare with one process, print the verdict."""
    from opsched.export import torch_csv
    from opsched.torchrun.launch import RunJob, run_job

    sg = schedule.stage_graph
    with tempfile.TemporaryDirectory(prefix="opsched-run-") as tmp:
        csv_path = Path(args.torch_csv) if args.torch_csv else Path(tmp) / "schedule.csv"
        torch_csv.write_torch_csv(csv_path, schedule)
        job = RunJob(spec, torch_csv.stage_ranks(sg), schedule.microbatches, csv_path=str(csv_path),
                     microbatch_size=args.microbatch_size, steps=args.steps)
        log.info("running %s: %d ranks (gloo, 1 thread each), %d stages of %s, %d microbatches, %d step(s)",
                 args.plan, job.world_size, len(sg.stages), what, schedule.microbatches, args.steps)
        results = run_job(job, timeout=args.timeout)
    return _verdict(args, sg, job, results, what)


def _verdict(args: argparse.Namespace, sg, job, results, what: str) -> int:
    """Compare the run with one process and print what ran, the step times and the verdict; the exit code."""
    from opsched.torchrun.launch import compare_with_reference, compute_medians, step_seconds

    report = compare_with_reference(job, results, **TOLERANCES[args.dtype])
    print(f"ran {what}")
    last = next(r for r in results if len(sg.stages) - 1 in r.stages)
    for step, losses in enumerate(last.losses):
        print(f"  step {step}: mean loss {statistics.fmean(losses):.6f}")
    times = step_seconds(results)
    print(f"  measured step time: median {1e3 * statistics.median(times):.1f} ms over {len(times)} steps")
    medians = compute_medians(results)
    for s in sg.stages:
        parts = ", ".join(f"{p} {1e3 * medians[(s.id, p)]:.2f}" for p in ("F", "I", "W", "B") if (s.id, p) in medians)
        print(f"  stage {s.id} (rank {job.stage_ranks[s.id]}): {parts} ms")
    verdict = "match" if report["ok"] else "DO NOT match"
    print(f"losses and {report['params']} parameter gradients {verdict} the single-process reference "
          f"(max |loss diff| {report['max_loss_diff']:.2g}, max |grad diff| {report['max_grad_diff']:.2g}, "
          f"max relative grad diff {report['max_rel_grad_diff']:.2g})")
    if report["zero_grads"]:
        print(f"  {plural(report['zero_grads'], 'gradient')} zero but for rounding in the reference (e.g. attention "
              "key biases, which the softmax cancels): checked by the absolute tolerance, not in the relative figure")
    for problem in report["problems"][:10]:
        print(f"  {problem}")
    return 0 if report["ok"] else 1
