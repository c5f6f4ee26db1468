"""Draw a plan.json as a Gantt timeline.

The format follows the output suffix: .svg or .png (matplotlib picture),
.html (self-contained page with hover details) or .json (Perfetto /
chrome://tracing trace). Give -o several times to write several formats.
The plan is validated first; --no-validate draws an invalid plan anyway
(useful to see what is wrong with it).

example:
  opsched gantt out/plan.json -o out/gantt.png -o out/gantt.html --title "DualPipe PP=8"
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from opsched.errors import OpschedError
from opsched.export.gantt import GANTT_FORMATS, gantt_format, write_gantt

log = logging.getLogger(__name__)

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.json", help="a plan file (schema opsched.plan/1)")
    parser.add_argument(
        "-o", "--output", action="append", required=True, metavar="OUT",
        help="output file, its suffix naming the format: "
             + "; ".join(f"{'/'.join(f.suffixes)} {f.what}" for f in GANTT_FORMATS)
             + "; repeat for several; never the plan itself",
    )
    parser.add_argument("--title", help="title shown instead of the method name (step time, makespan and bubble ratio follow)")
    parser.add_argument("--no-validate", action="store_true", help="draw the plan even if it breaks a validity rule")


def run(args: argparse.Namespace) -> int:
    from opsched.export.plan_json import is_plan_file, plan_step_time, read_plan
    from opsched.fileio import check_not_input, check_output_file
    from opsched.schedule import ScheduleError, validate

    # check every output before writing anything, so a typo or a bad place leaves no partial set of files
    for out in args.output:
        gantt_format(out)  # a suffix that names no format is refused here, before anything is read
        check_not_input(out, [args.plan], "-o")
        if is_plan_file(out):  # a trace would silently replace another plan (often a search of hours)
            raise OpschedError(f"-o {out}: is a plan file, which the Gantt trace would replace; give another file "
                               "name, e.g. trace.json")
        check_output_file(out, "-o", example="gantt" + Path(out).suffix)
    schedule, doc = read_plan(args.plan)
    if not args.no_validate:
        try:
            validate(schedule)
        except ScheduleError as exc:
            raise OpschedError(f"{args.plan} is not a valid plan: {exc} (use --no-validate to draw it anyway)") from None
    for out in args.output:
        write_gantt(schedule, out, title=args.title, step_time=plan_step_time(doc))
        log.info("wrote %s", out)
    return 0
