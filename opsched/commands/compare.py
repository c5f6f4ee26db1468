"""Time the hand-written pipeline schedules and the MIP on one pipeline.

The pipeline is a synthetic chain of --stages stages, or the stage graph of a
plan file (--plan). Every method re-places the same chain the way it needs
on the same devices (see docs/baselines.md) and goes through the one
simulator and validator; a method whose preconditions fail, or that needs
more memory than --memory-limit, is listed with the reason. When every method
is refused, the table is still printed and the exit code is 2. The mip
method tries every placement (the chain, the V, interleaved, DualPipe's
two-copy bidirectional, ...) at the same memory and keeps the best
(--placement auto; a name fixes it): its lower bound and gap are the winning
placement's, for that placement only.

F, B, W, A and AW take one value or a comma list with one value per stage;
B is the full backward, so the input-gradient part is I = B - W. Memory is in
the units of A (activation per microbatch per stage; AW of it is held until W).

examples:
  opsched compare --stages 8 --microbatches 16 --f 1 --b 2 --w 1
  opsched compare --stages 8 --devices 4 --placement v --microbatches 16 --methods zb-v,dualpipev,mip
  opsched compare --stages 8 --microbatches 16 --memory-limit dualpipe --methods zb-v,dualpipe,mip
  opsched compare --stages 4 --microbatches 12 --f 1,1,2,1 --memory-limit dualpipe --json
  opsched compare --stages 8 --microbatches 20 -o out/   # out/<method>/plan.json + Gantt pictures
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

from opsched.commands.args import (
    MAX_STAGES,
    device_count,
    fraction,
    microbatch_count,
    non_negative_float,
    per_stage,
    positive_float,
    stage_count,
)
from opsched.errors import OpschedError
from opsched.plan.compare import LEAST_MIP_SHARE, add_schedule_file_rows, compare, run_method, schedule_files
from opsched.plan.compare_table import plan_figures, table
from opsched.solving.isolate import SolverCrash
from opsched.plan.placements import CHOICES as PLACEMENT_CHOICES
from opsched.solving.solver import SOLVERS, Objective, require

log = logging.getLogger(__name__)

#: the Gantt files written per method with -o
GANTT_FILES = ("gantt.svg", "gantt.png", "gantt.html", "trace.json")



def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("pipeline")
    src.add_argument("--stages", type=stage_count, metavar="P",
                     help=f"number of stages of the synthetic chain, at most {MAX_STAGES:,}")
    src.add_argument("--microbatches", type=microbatch_count, metavar="M",
                     help="microbatches per step, at most 4,096 (default with --plan: the plan's)")
    src.add_argument("--f", type=per_stage, default="1", metavar="F", help="forward time per stage (default 1)")
    src.add_argument("--b", type=per_stage, default="2", metavar="B", help="full backward time per stage, I + W (default 2)")
    src.add_argument("--w", type=per_stage, default="1", metavar="W", help="weight-gradient part of B (default 1)")
    src.add_argument("--devices", type=device_count, metavar="D", help="devices, at most 65,536 (default P)")
    src.add_argument(
        "--placement", default="auto", choices=PLACEMENT_CHOICES,
        help=f"where mip puts the chain: auto (default) solves every placement ({', '.join(PLACEMENT_CHOICES[1:])}; "
             "interleaved with v >= 2) at the same memory and keeps the best (one whose lower bound is not below "
             "a schedule already in hand is left out, its time going to the others); a name fixes it (each baseline "
             "re-places the chain its own way). The P stages as given, which --schedule files use, follow its rule "
             "where that holds P stages, else the chain if P = D, the V if P = 2D, interleaved otherwise",
    )
    src.add_argument("--comm", type=non_negative_float, default="0", metavar="C",
                     help="transfer time between stages on different devices")
    src.add_argument("--act", type=per_stage, default="1", metavar="A", help="activation per microbatch per stage (default 1)")
    src.add_argument("--act-w", type=per_stage, default="0.5", metavar="AW", help="part of A held until W (default 0.5)")
    src.add_argument("--overlap-gain", type=fraction, default="0", metavar="G",
                     help="overlapped F&B pair lasts F + B - G*min(F, B); 0 = no gain (default), 1 = perfect. mip "
                          "pairs where that shortens the step, then keeps the step and runs apart the pairs it can "
                          "(a pair costs what overlap costs in a real run)")
    src.add_argument("--plan", metavar="PLAN.json",
                     help="take the stage graph from a plan file instead (baselines treat each device group as one "
                          "device and run a branching graph's stages one after another, as a chain-only runtime would)")
    run_ = parser.add_argument_group("methods")
    run_.add_argument("--methods", metavar="a,b,...", help="methods to run (default: all baselines and mip)")
    run_.add_argument("--memory-limit", metavar="X",
                      help="per-device memory limit: a number, or a method name meaning that method's peak")
    run_.add_argument("--time-limit", type=positive_float, default="120", metavar="S",
                      help="wall-clock limit of the command in seconds (default 120): the MIP runs after the other "
                           "methods and searches for the time they leave, less what checking its schedule (and with -o "
                           "writing the files) needs, shared by the placements it tries; it returns the best schedule "
                           "found by then, with status 'time limit reached'; when the limit does not bind, work "
                           "budgets decide the result, so it is deterministic")
    run_.add_argument("--objective", default="makespan", choices=[o.value for o in Objective],
                      help="what mip minimises: makespan (default) or zb-span, Zero Bubble's cost (the longest device "
                           "span from its first F to its last W or B); its lower bound and gap refer to it")
    run_.add_argument("--solver", default="cbc", choices=SOLVERS, help="MIP solver (default cbc; highs needs pip install highsbox)")
    run_.add_argument("--schedule", action="append", default=[], metavar="FILE.csv",
                      help="also time a hand-written schedule in PyTorch's pipelining CSV format, one row per "
                           "rank (repeatable; comm actions are ignored; stages as given by --placement or --plan)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print a JSON list of per-method objects instead of a table")
    out.add_argument("-o", "--output", metavar="DIR", help="write DIR/<method>/plan.json and its Gantt pictures")


# --------------------------------------------------------------------------- input


def method_names(args: argparse.Namespace) -> list[str]:
    """The methods to run, in table order; unknown names are refused."""
    from opsched.baselines import NAMES

    known = [*NAMES, "mip"]
    if args.methods is None:
        return known
    names = [n.strip().lower() for n in args.methods.split(",") if n.strip()]
    if not names:  # `--methods ''` (an unset shell variable) would otherwise run everything without a word
        raise OpschedError(f"--methods {args.methods!r} names no method; give a comma list from {','.join(known)} "
                           "(or leave out --methods to run them all)")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise OpschedError(f"--methods: unknown method {', '.join(unknown)}; choose from {','.join(known)}")
    return list(dict.fromkeys(names))


def stage_graph_from_args(args: argparse.Namespace):
    """(StageGraph, microbatches) from the synthetic flags or from --plan."""
    from opsched.schedule import StageGraph, chain_stage_graph

    if args.plan:
        synthetic = [f for f in ("stages", "devices") if getattr(args, f) is not None]
        if synthetic:
            raise OpschedError(f"--plan takes the stages from the plan; drop --{synthetic[0]}")
        from opsched.export.plan_json import read_plan

        schedule, _doc = read_plan(args.plan)
        m = args.microbatches or schedule.microbatches
        sg = schedule.stage_graph
        if args.overlap_gain:  # 0, the default, keeps the plan's own pair rule
            # the flag replaces it: stages keeping their stream operations would still time their pairs from them
            sg = StageGraph([dataclasses.replace(s, streams=None) for s in sg.stages], list(sg.edges),
                            num_devices=sg.num_devices, overlap_gain=args.overlap_gain)
        return sg, m
    if args.stages is None or args.microbatches is None:
        raise OpschedError("give --stages P and --microbatches M (or --plan PLAN.json)")
    sg = chain_stage_graph(
        args.stages,
        f=args.f,
        b=args.b,
        w=args.w,
        devices=args.devices if args.devices is not None else args.stages,
        placement=given_placement(args.stages, args.devices or args.stages, args.placement),
        comm=args.comm,
        act=args.act,
        act_w=args.act_w,
        overlap_gain=args.overlap_gain,
    )
    for s in sg.stages:
        if s.act_w_bytes > s.act_bytes:
            raise OpschedError(f"stage {s.id}: --act-w {s.act_w_bytes:g} exceeds --act {s.act_bytes:g}; AW is part of A")
    if not any(float(s.time[p]) > 0 for s in sg.stages for p in s.timed_passes()):
        # every method's step would be 0 and the MIP has no time unit to slot it in: nothing to compare
        raise OpschedError("--f, --b and --w are 0 on every stage: the pipeline has no work to schedule; "
                           "give a time > 0 to at least one of them")
    return sg, args.microbatches


def given_placement(stages: int, devices: int, choice: str) -> str:
    """How ``--stages`` sit on ``--devices`` as given (for --schedule files): ``choice`` where its rule holds them.

    Otherwise (auto, bidirectional, or a rule for another stage count: mip
    re-places the chain anyway) the chain when P = D, else the V when P = 2D,
    else interleaved.

    >>> given_placement(8, 4, "auto"), given_placement(8, 8, "v"), given_placement(8, 4, "interleaved")
    ('v', 'chain', 'interleaved')

    Stages that no rule holds are refused, naming the placement asked for (not a fallback):

    >>> given_placement(8, 3, "v")
    Traceback (most recent call last):
    ...
    opsched.errors.OpschedError: --placement v: 8 stages fit on 3 devices under no placement rule (v needs --stages 6 = 2 x --devices, chain --stages 3, interleaved --stages a multiple of 3); change --stages or --devices
    """
    fits = {"chain": stages == devices, "v": stages == 2 * devices, "interleaved": stages % devices == 0}
    if fits.get(choice):
        return choice
    if not any(fits.values()):
        needs = {"chain": f"--stages {devices}", "v": f"--stages {2 * devices} = 2 x --devices",
                 "interleaved": f"--stages a multiple of {devices}"}
        first = choice if choice in needs else "interleaved"
        order = [first] + [n for n in needs if n != first]
        asked = "" if choice == "auto" else f"--placement {choice}: "
        raise OpschedError(
            f"{asked}{stages} stages fit on {devices} devices under no placement rule "
            f"({order[0]} needs {needs[order[0]]}, {', '.join(f'{n} {needs[n]}' for n in order[1:])}); "
            "change --stages or --devices")
    return "chain" if stages == devices else "v" if stages == 2 * devices else "interleaved"


def resolve_limit(text: str | None, sg, microbatches: int, args,
                  deadline: float | None = None) -> tuple[float | None, str | None]:
    """(limit, method it came from) for --memory-limit: a number, or a method's peak memory per device.

    ``--memory-limit mip`` runs the MIP for half the time left until ``deadline`` (the command's; ``None``: for
    --time-limit), so that the MIP's row has the other half.
    """
    from opsched.baselines import NAMES
    from opsched.schedule import metrics

    if text is None:
        return None, None
    name = text.strip().lower()
    if name in NAMES or name == "mip":
        time_limit = None
        if name == "mip" and deadline is not None:
            time_limit = max(LEAST_MIP_SHARE * args.time_limit, (deadline - time.monotonic()) / 2)
        try:
            schedule, _ = run_method(name, sg, microbatches, None, args, time_limit)
        except SolverCrash as exc:
            raise OpschedError(f"--memory-limit {name}: the solver was lost ({exc}); give a number instead") from None
        except OpschedError as exc:
            raise OpschedError(f"--memory-limit {name}: {name} cannot run on this pipeline ({exc})") from None
        return max(metrics(schedule).peak_memory_bytes), name
    if name.startswith("-"):
        raise OpschedError(f"--memory-limit {text}: a memory limit cannot be negative; give a number >= 0 (in the "
                           "units of --act) or a method name")
    try:
        return non_negative_float(text), None
    except argparse.ArgumentTypeError:
        raise OpschedError(
            f"--memory-limit: give a number or a method name ({', '.join(NAMES)}), got {text!r}"
        ) from None


# --------------------------------------------------------------------------- output


def write_outputs(out_dir: Path, rows: list[dict], schedules: dict) -> None:
    """DIR/<method>/plan.json and Gantt files for every method that ran, and DIR/compare.json."""
    from opsched.export.gantt import can_draw_images, write_gantt
    from opsched.export.plan_json import write_plan
    from opsched.fileio import write_text

    # SVG/PNG need matplotlib (the pictures extra); the trace and HTML do not
    files = [f for f in GANTT_FILES if can_draw_images() or not f.endswith((".svg", ".png"))]
    by_name = {r["method"]: r for r in rows}
    for name, schedule in schedules.items():
        folder = out_dir / name
        # a MIP's bound and gap join the plan's metrics
        figures = plan_figures(by_name[name])
        write_plan(folder / "plan.json", schedule, extra={"method": name, "metrics": figures})
        for file in files:
            write_gantt(schedule, folder / file)
    write_text(out_dir / "compare.json", json.dumps(rows, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.time_limit  # the whole command's (mip_time_limit)
    sg, microbatches = stage_graph_from_args(args)
    names = method_names(args)
    if "mip" in names:
        require(args.solver)  # a missing backend fails here, before any method runs
    out_dir = Path(args.output) if args.output else None
    if out_dir is not None:
        from opsched.fileio import check_output_dir

        check_output_dir(out_dir, "-o")  # before any method runs
    written = schedule_files(args.schedule, sg, microbatches)  # checked before anything runs
    limit, limit_from = resolve_limit(args.memory_limit, sg, microbatches, args, deadline)
    rows, schedules = compare(sg, microbatches, names, limit, args, deadline,
                              after_jobs=sum(len(w.events) for w in written))
    add_schedule_file_rows(written, limit, rows, schedules)
    if out_dir is not None and schedules:
        write_outputs(out_dir, rows, schedules)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        source = f"plan {args.plan}" if args.plan else f"{len(sg.stages)} stages"
        limit_text = "" if limit is None else f", memory limit {limit:.4g}" + (f" (= {limit_from}'s peak)" if limit_from else "")
        header = f"{source} on {sg.num_devices} devices, {microbatches} microbatches{limit_text}"
        print(table(rows, header))
    if not schedules:
        raise OpschedError(f"every method was refused on this pipeline ({len(rows)} tried; each row on stdout says "
                           "why): try more microbatches, a higher --memory-limit or other --methods")
    if out_dir is not None:
        log.info("wrote %d plans under %s/", len(schedules), out_dir)
    return 0
