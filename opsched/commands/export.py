"""Write a plan as a schedule file for torch.distributed.pipelining.

The compute-only CSV has one row per pipeline rank (one rank per device group,
ranks numbered by the group's smallest device) and one action per cell, in the
plan's event order on that rank. torch's ``_PipelineScheduleRuntime`` loads it
with ``_load_csv(path, format="compute_only")``. A plan torch cannot run (a
branching StageGraph, a stage that runs only some microbatches, an order that
would deadlock) is refused and no file is written; so is a plan that breaks a
validity rule (overlapping events, a dependency out of order), as `opsched
gantt` refuses it. Where the file goes is checked before the plan is read.

example:
  opsched export out/plan.json --torch-csv out/schedule.csv
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.json", help="a plan written by `opsched plan` or `opsched compare`")
    parser.add_argument(
        "--torch-csv", metavar="FILE.csv", required=True, help="where to write the compute-only schedule CSV"
    )
    parser.add_argument(
        "--no-torch-check",
        action="store_true",
        help="skip loading the file with torch's own loader and deadlock simulation (done when torch is installed)",
    )


def run(args: argparse.Namespace) -> int:
    from opsched.errors import OpschedError
    from opsched.export import torch_csv
    from opsched.export.plan_json import read_plan_schedule
    from opsched.fileio import check_not_input, check_output_file
    from opsched.schedule import ScheduleError, validate

    check_not_input(args.torch_csv, [args.plan], "--torch-csv")
    check_output_file(args.torch_csv, "--torch-csv", example="schedule.csv")
    schedule = read_plan_schedule(args.plan)
    try:  # the same rules `opsched gantt` checks: a CSV of an invalid plan would run something else
        validate(schedule)
    except ScheduleError as exc:
        raise OpschedError(f"{args.plan} is not a valid plan: {exc} (`opsched gantt --no-validate` draws it)") from None
    check = not args.no_torch_check and torch_csv.torch_available()
    rows = torch_csv.write_torch_csv(args.torch_csv, schedule, check_with_torch=check)
    groups = torch_csv.torch_ranks(schedule.stage_graph)
    mapping = ", ".join(f"rank {r} = devices {list(g)}" for r, g in enumerate(groups))
    status = "passed torch's loader and deadlock simulation" if check else "not checked with torch"
    print(
        f"wrote {args.torch_csv}: {len(rows)} ranks ({mapping}), {len(schedule.stage_graph.stages)} stages, "
        f"{schedule.microbatches} microbatches, {sum(len(r) for r in rows)} actions; {status}"
    )
    return 0
