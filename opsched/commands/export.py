"""Write a plan for the runtime that will train with it: a torch pipelining schedule, Megatron-LM arguments,
a torchtitan configuration.

  --torch-csv FILE.csv    the plan's own order as a compute-only schedule for
                          torch.distributed.pipelining: one row per pipeline rank
                          (a device group, ranks numbered by the group's smallest
                          device), one action per cell; torch's
                          _PipelineScheduleRuntime loads it with
                          _load_csv(path, format="compute_only")
  --megatron FILE         Megatron-LM arguments (a bash file setting the array
                          OPSCHED_MEGATRON_ARGS, one --flag value per line, as
                          Megatron-LM's launch scripts keep theirs): tensor,
                          pipeline, virtual-pipeline, expert and context parallel
                          sizes, sequence parallel, distributed optimizer,
                          recomputation, micro and global batch, sequence length
                          and the layer split (uneven first and last pipeline
                          stages, or a pipeline layout) as the plan has them
  --torchtitan FILE.toml  torchtitan's [training], [parallelism] and
                          [activation_checkpoint] keys: data-parallel replicate /
                          shard, tensor, pipeline, context and expert degrees, the
                          schedule, each stage's modules, local and global batch,
                          seq_len; with --torch-csv as well it runs the plan's own
                          order from that file (pipeline_parallel_schedule_csv)

Flags are Megatron-LM's as of Megatron-Core 0.16; the TOML is torchtitan
0.2's job file (torchtitan 0.3 takes the same keys as --parallelism.KEY
overrides). docs/export.md says what every flag and key comes from.

Megatron and torchtitan set one tensor / data / expert split for the whole
model, put whole layers per pipeline stage in model order, and give each
data-parallel replica a whole number of samples: a plan that is not like
that is refused with the reason, as is one that torch's runtime cannot run
(a branching StageGraph, DualPipe's copied stages, an order that would
deadlock; --torch-csv alone: context-parallel stages) or that breaks a validity rule (overlapping events), as `opsched
gantt` refuses it. Megatron also refuses stages in a V, ZeRO-2 and an
interleaved plan whose microbatches are no multiple of pp; torchtitan an
order torch has no schedule for by name unless --torch-csv gives it
({NO_TORCH_SCHEDULE}). A refusal is one line, exit 2, nothing is written;
every output place is checked before the plan is read, each file written whole.

examples:
  opsched export out/plan.json --torch-csv out/schedule.csv
  opsched export out/plan.json --megatron out/megatron_args.sh
  opsched export out/plan.json --torchtitan out/torchtitan.toml --torch-csv out/schedule.csv
"""

from __future__ import annotations

import argparse
import os

from opsched.baselines import METHODS

#: what torch has no schedule class for: mip's order, a baseline setting no TORCH_SCHEDULE (the help reads METHODS)
NO_TORCH_SCHEDULE = ("mip", *(name for name, module in METHODS.items() if module.TORCH_SCHEDULE is None))
__doc__ = __doc__.replace("{NO_TORCH_SCHEDULE}", ", ".join(NO_TORCH_SCHEDULE))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.json", help="a plan written by `opsched plan` (or `opsched compare`: --torch-csv only)")
    parser.add_argument("--torch-csv", metavar="FILE.csv", help="where to write the compute-only schedule CSV")
    parser.add_argument("--megatron", metavar="FILE", help="where to write the Megatron-LM arguments (bash)")
    parser.add_argument("--torchtitan", metavar="FILE.toml", help="where to write the torchtitan configuration")
    parser.add_argument(
        "--no-torch-check",
        action="store_true",
        help="skip torch's own checks: loading the CSV with its loader and its deadlock simulation, building "
        "torchtitan's named schedule (done when torch is installed)",
    )


def run(args: argparse.Namespace) -> int:
    from opsched.errors import OpschedError
    from opsched.export import torch_csv
    from opsched.export.plan_json import read_plan
    from opsched.export.plan_layout import check_torch_can_run
    from opsched.export.runtimes import copied_stages, framework_files
    from opsched.fileio import check_not_input, check_output_file, write_text
    from opsched.schedule import ScheduleError, validate

    outputs = [(flag, path, example) for flag, path, example in (
        ("--torch-csv", args.torch_csv, "schedule.csv"), ("--megatron", args.megatron, "megatron_args.sh"),
        ("--torchtitan", args.torchtitan, "torchtitan.toml")) if path]
    if not outputs:
        raise OpschedError("an output is required: --torch-csv FILE.csv, --megatron FILE or --torchtitan FILE.toml")
    seen: dict[str, str] = {}
    for flag, path, example in outputs:
        check_not_input(path, [args.plan], flag)
        check_output_file(path, flag, example=example)
        real = os.path.realpath(path)
        if real in seen:
            raise OpschedError(f"{flag} {path}: {seen[real]} writes there too; give each output its own file")
        seen[real] = flag
    schedule, doc = read_plan(args.plan)
    try:  # the same rules `opsched gantt` checks: a file made from an invalid plan would run something else
        validate(schedule)
    except ScheduleError as exc:
        raise OpschedError(f"{args.plan} is not a valid plan: {exc} (`opsched gantt --no-validate` draws it)") from None
    torch_check = not args.no_torch_check and torch_csv.torch_available()
    if args.torch_csv and not args.torchtitan:  # the CSV alone is run by torch's runtime, without context parallel
        check_torch_can_run(doc, torch_csv.TORCH_RUNTIME, copied_stages(schedule))

    # every file's text is made, and every check passed, before the first one is written
    texts = framework_files(schedule, doc, args.plan, args.torch_csv, torch_check,
                            megatron=args.megatron, torchtitan=args.torchtitan)
    if args.torch_csv:  # written first: torch's loader checks the file itself, inside its atomic write
        rows = torch_csv.write_torch_csv(args.torch_csv, schedule, check_with_torch=torch_check)
        groups = torch_csv.torch_ranks(schedule.stage_graph)
        mapping = ", ".join(f"rank {r} = devices {list(g)}" for r, g in enumerate(groups))
        status = "passed torch's loader and deadlock simulation" if torch_check else "not checked with torch"
        print(
            f"wrote {args.torch_csv}: {len(rows)} ranks ({mapping}), {len(schedule.stage_graph.stages)} stages, "
            f"{schedule.microbatches} microbatches, {sum(len(r) for r in rows)} actions; {status}"
        )
    for path, text, what in texts:
        write_text(path, text)
        print(f"wrote {path}: {what}")
    return 0
