"""Time the hand-written pipeline schedules and the MIP on one pipeline.

The pipeline is a synthetic chain of --stages stages, or the stage graph of a
plan file (--plan). Every method re-places the same chain the way it needs
on the same devices (see docs/baselines.md) and goes through the one
simulator and validator; a method whose preconditions fail, or that needs
more memory than --memory-limit, is listed with the reason. When every method
is refused, the table is still printed and the exit code is 2. The mip
method tries the chain, the V, interleaved and DualPipe's two-copy
(bidirectional) placements at the same memory and keeps the best
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
from opsched.errors import OpschedError, Unsupported
from opsched.solving.isolate import SolverCrash
from opsched.plan.placements import CHOICES as PLACEMENT_CHOICES
from opsched.schedule.placement import PLACEMENTS
from opsched.solving.solver import SOLVERS, Objective, Status, require

log = logging.getLogger(__name__)

#: the Gantt files written per method with -o
GANTT_FILES = ("gantt.svg", "gantt.png", "gantt.html", "trace.json")

# --time-limit is the whole command's wall clock, as plan's is: the rows before the MIP count, and the MIP's search
# ends early enough for the work after it. That work grows with the jobs of the schedules (measured on 2 cores
# shared with other work, load 4 to 4.5, issue 45; docs/BENCHMARKS.md, "Time limits under load"):
#: seconds per job of the MIP's schedule after its search: sent back from the isolated solve, validated, measured
#: (2.5 s for the 98,304 jobs of p=64, m=256 on the V: 2.5e-5, doubled for a busier machine)
AFTER_SEARCH_SECONDS_PER_JOB = 5e-5
#: the work after the MIP's search in measurements of a row (row_of): sending its schedule back from the isolated
#: solve costs about one more (1.8 s and 2.2 s at p=64, m=256, load 9); with a margin
AFTER_SEARCH_ROWS = 3.0
#: seconds per job of every schedule written with -o: plan.json, the two pictures, the HTML page and the trace
#: (18 s for the 49,152 jobs of zb-h1 at p=64, m=256: 3.7e-4, with a margin)
FILES_SECONDS_PER_JOB = 6e-4
#: the least part of --time-limit the MIP gets when the work before it took the whole limit (it then returns about
#: its first start, and the command runs over by about this part)
LEAST_MIP_SHARE = 0.05


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
        help="where mip puts the chain: auto (default) solves the chain, the V, interleaved (v >= 2) and DualPipe's "
             "two-copy bidirectional layout at the same memory and keeps the best (one whose lower bound is not below "
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


# --------------------------------------------------------------------------- running


def describe_placement(name: str, sg) -> str:
    """A short text of how a schedule's stage graph sits on devices."""
    from opsched.baselines import placement_of

    p = len(sg.stages)
    if name.endswith(".csv"):
        return f"as written ({p} stages)"
    if name == "mip":
        return f"as given ({p} stages)"
    return f"{PLACEMENTS[placement_of(name)].rule} ({p} stages)"


def run_method(name: str, sg, microbatches: int, limit: float | None, args, time_limit: float | None = None):
    """(schedule, extra metrics) of one method; raises OpschedError with the reason it cannot run.

    ``time_limit``: the MIP's seconds (default --time-limit)."""
    from opsched.baselines import run_baseline
    from opsched.schedule import validate

    if name == "mip":
        schedule, extra = run_mip(sg, microbatches, limit, args, args.time_limit if time_limit is None else time_limit)
    else:
        from opsched.schedule.placement import is_chain, linearize, on_group_devices, onto_groups

        comm = max((e.time for e in sg.edges), default=0.0)
        # stages on device groups: each group is one pseudo-device for the baselines
        pseudo, groups = on_group_devices(sg)
        # a branching plan: the baselines run the chain a chain-only runtime would
        chain = pseudo if is_chain(pseudo) else linearize(pseudo)
        schedule = onto_groups(run_baseline(name, chain, microbatches, memory_limit=limit, comm=comm),
                               groups, sg.num_devices)
        extra = {} if chain is pseudo else {"linearized": True}
        # (the MIP's schedule was validated where it was made, lower.solve's last step: 2.5 s at p=64, m=256 on a
        # busy machine, which the command's time limit would pay twice)
        validate(schedule)
    return schedule, extra


def run_mip(sg, microbatches: int, limit: float | None, args, time_limit: float) -> tuple:
    """(schedule, extra row fields) of the MIP over the placements ``--placement`` names, at memory ``limit``,
    within ``time_limit`` seconds."""
    from opsched import lower
    from opsched.solving import isolate
    from opsched.lower.placements import solve_placements
    from opsched.lower.solve import thin_pairs
    from opsched.plan.placements import candidates

    # with --plan the plan's own placement is tried too (first): it may branch or use device groups
    tries = candidates(sg, microbatches, args.placement, as_given=bool(args.plan))
    # each solve holds its share of --time-limit itself (its search runs in a watched child that it stops at the
    # limit); this outer child, as the planner's, is the backstop: a native abort or hang anywhere costs this row
    # (SolverCrash), not the command. The hand-written orders that run on a placement start its solve.
    found = isolate.run_isolated(
        solve_placements, tries, microbatches, memory_limit=limit, time_limit=time_limit, solver=args.solver,
        objective=args.objective, solve_one=lower.solve, thin_one=thin_pairs,
        timeout=solve_timeout(time_limit),
    )
    result = found.result
    schedule = result.schedule
    schedule.name = schedule.name or "mip"
    extra = {
        "placement": placement_text(found.placement, schedule.stage_graph),
        "placement_name": found.placement,
        "objective": str(result.objective),
        "objective_value": result.value,
        "lower_bound": result.lower_bound,
        "gap": result.gap,
        # overlapped pairs of the best order that the makespan did not need, run one job after the other
        "pairs_parted": result.pairs_parted,
        "lower_bound_all_placements": found.lower_bound_all,
        "placements_tried": [tried_row(t) for t in found.tried],
        # the winner's status, for its placement; a search the clock cut before every placement ran says so
        "status": str(Status.TIME_LIMIT if found.cut else result.status),
        # what stopped a search whose status is the time limit's: the limit, or a clock cap inside it
        "cut_by": (f"the {args.time_limit:g} s limit, before every placement was tried" if found.cut
                   else result.cut_by) or None,
        "solver": result.solver,
        "solve_seconds": found.seconds,
    }
    return schedule, extra


def placement_text(placement: str, sg) -> str:
    """'V, device i holds stages i and 2D-1-i (16 stages)' for a placement the MIP searched.

    >>> from opsched.schedule import chain_stage_graph
    >>> placement_text("chain", chain_stage_graph(4))
    'chain, stage k on device k (4 stages)'
    """
    from opsched.plan.placements import AS_GIVEN

    rule = PLACEMENTS[placement].rule if placement in PLACEMENTS else AS_GIVEN
    return f"{rule} ({len(sg.stages)} stages)"


def tried_row(tried) -> dict:
    """The JSON object of one placement the MIP tried: its figures, or why it could not run."""
    return {"placement": tried.placement, "objective_value": tried.value, "lower_bound": tried.lower_bound,
            "status": None if tried.status is None else str(tried.status), "error": tried.refused or None}


def solve_timeout(time_limit: float) -> float:
    """Seconds after which an isolated MIP solve counts as hung and is stopped: 3 x its time limit + 60 s.

    The solve holds its own limit (within 10 %); this is only the backstop
    for a hang outside its watched search.

    >>> solve_timeout(120)
    420.0
    """
    return 3.0 * float(time_limit) + 60.0


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


def row_of(name: str, schedule, extra: dict) -> dict:
    """The JSON object of one method that ran."""
    from opsched.schedule import metrics, zb_bubble_rate

    m = metrics(schedule)
    sg = schedule.stage_graph
    return {
        "method": name,
        "placement": describe_placement(name, sg),
        "devices": sg.num_devices,
        "stages": len(sg.stages),
        "makespan": m.makespan,
        "bubble_ratio": m.bubble_ratio,
        "idle": m.idle,
        "peak_activation_bytes": max(m.peak_activation_bytes, default=0.0),
        "peak_activation_bytes_per_device": m.peak_activation_bytes,
        "peak_memory_bytes": max(m.peak_memory_bytes, default=0.0),
        "param_copies": m.param_copies,
        "zb_bubble_rate": zb_bubble_rate(schedule),
        "error": None,
        **extra,
    }


def refused_row(name: str, reason: str) -> dict:
    """The JSON object of a method that could not run, with the reason."""
    return {
        "method": name,
        "makespan": None,
        "bubble_ratio": None,
        "peak_activation_bytes": None,
        "error": reason,
    }


def compare(sg, microbatches: int, names: list[str], limit: float | None, args, deadline: float | None = None,
            after_jobs: int = 0) -> tuple[list[dict], dict]:
    """Run every method; returns the rows (in ``names`` order) and the schedules that ran.

    The MIP runs last, whatever its row's place: it takes the time the others left until ``deadline`` (a
    :func:`time.monotonic` instant; ``None``: --time-limit from its start), less what the work after it needs
    (:func:`mip_time_limit`; ``after_jobs`` more jobs of hand-written schedules are checked after it).
    """
    rows: dict[str, dict] = {}
    schedules = {}
    measured = 0.0  # seconds per job of measuring a row here, now: the machine's speed, load included
    for name in sorted(names, key=lambda n: n == "mip"):
        time_limit = None
        if name == "mip" and deadline is not None:
            time_limit = mip_time_limit(deadline, args.time_limit, sg, microbatches, list(schedules.values()),
                                        after_jobs, files=bool(args.output), measured=measured)
        try:
            schedule, extra = run_method(name, sg, microbatches, limit, args, time_limit)
        except Unsupported as exc:
            rows[name] = refused_row(name, str(exc))
            continue
        except (OpschedError, SolverCrash) as exc:  # an order that deadlocks or breaks the memory limit; a native
            rows[name] = refused_row(name, f"{name}: {exc}")  # abort, death or hang of the isolated solver
            continue
        schedule.memory_limit = limit
        schedules[name] = schedule
        began = time.monotonic()
        rows[name] = row_of(name, schedule, extra)
        measured = max(measured, (time.monotonic() - began) / max(1, len(schedule.events)))
    return [rows[name] for name in names], {name: schedules[name] for name in names if name in schedules}


def mip_time_limit(deadline: float, time_limit: float, sg, microbatches: int, done: list, after_jobs: int,
                   files: bool, measured: float = 0.0) -> float:
    """Seconds the MIP may search so that the command ends by ``deadline``: the time left, less the work after
    the search (:data:`AFTER_SEARCH_SECONDS_PER_JOB` per job of its largest placement and of ``after_jobs``, or
    :data:`AFTER_SEARCH_ROWS` times ``measured``, the seconds per job a row took to measure here, when that is more:
    a busy machine; and with ``files`` :data:`FILES_SECONDS_PER_JOB` per job of every schedule written, ``done``
    the rows' so far); at least :data:`LEAST_MIP_SHARE` of ``time_limit``.

    >>> from opsched.schedule import chain_stage_graph
    >>> now = time.monotonic()
    >>> round(mip_time_limit(now + 120, 120, chain_stage_graph(64), 256, [], 0, files=False))   # 98,304 jobs
    115
    >>> mip_time_limit(now - 1, 120, chain_stage_graph(64), 256, [], 0, files=False)
    6.0
    """
    # the largest placement the MIP tries holds max(P, 2D) stages (the V, DualPipe's two copies), 3 jobs each
    mip_jobs = 3 * microbatches * max(len(sg.stages), 2 * (sg.num_devices or len(sg.stages)))
    reserve = max(AFTER_SEARCH_SECONDS_PER_JOB, AFTER_SEARCH_ROWS * measured) * (mip_jobs + after_jobs)
    if files:
        reserve += FILES_SECONDS_PER_JOB * (mip_jobs + after_jobs + sum(len(s.events) for s in done))
    return max(LEAST_MIP_SHARE * float(time_limit), deadline - time.monotonic() - reserve)


def schedule_files(paths: list[str], sg, microbatches: int) -> list:
    """Each --schedule FILE.csv read, checked (errors name the row and cell) and timed."""
    from opsched.export.torch_csv import schedule_from_csv

    names = [Path(p).name for p in paths]
    if len(set(names)) != len(names):
        raise OpschedError(f"--schedule: two files share a name ({', '.join(names)}); rows are named by file name")
    return [schedule_from_csv(p, sg, microbatches) for p in paths]


def add_schedule_file_rows(written: list, limit: float | None, rows: list[dict], schedules: dict) -> None:
    """Append a row per hand-written schedule (refused if over the memory limit)."""
    from opsched.schedule import metrics, validate

    for schedule in written:
        peak = max(metrics(schedule).peak_memory_bytes, default=0.0)
        if limit is not None and peak > limit * (1 + 1e-9):
            rows.append(refused_row(schedule.name, f"needs {peak:g} per device, over the memory limit {limit:g}"))
            continue
        validate(schedule)
        schedule.memory_limit = limit
        schedules[schedule.name] = schedule
        rows.append(row_of(schedule.name, schedule, {}))


# --------------------------------------------------------------------------- output


def _g(x: float) -> str:
    return f"{x:.4g}"


def idle_text(idle: list[float]) -> str:
    """Idle time per device: one value when all agree, else the list (or min..max for many devices)."""
    if max(idle) - min(idle) <= 1e-9 * max(1.0, max(idle)):
        return f"{_g(idle[0])} each"
    if len(idle) <= 8:
        return " ".join(_g(x) for x in idle)
    return f"{_g(min(idle))}..{_g(max(idle))}"


def solver_note(row: dict) -> str:
    """'; lower bound 27, gap 0%, cbc 0.1 s' for a MIP row, else ''.

    With another objective than the makespan, its value comes first, and the
    bound and gap are on it:

    >>> solver_note({"objective": "zb-span", "objective_value": 30, "lower_bound": 27, "gap": 0.1})
    '; zb-span 30, lower bound 27, gap 10.0%'

    A solve that a clock stopped, or whose search crashed, says so last (its
    schedule is the best found by then):

    >>> solver_note({"lower_bound": 27, "gap": 0.1, "solver": "cbc", "solve_seconds": 120.2,
    ...              "status": "time limit reached", "cut_by": "the 120 s limit"})
    '; lower bound 27, gap 10.0%, cbc 120.2 s, time limit reached (the 120 s limit)'

    Overlapped pairs the makespan did not need, run one job after the other:

    >>> solver_note({"lower_bound": 47, "gap": 0.01, "pairs_parted": 6})
    '; lower bound 47, gap 1.0%, 6 pairs parted (they saved no time)'
    """
    if row.get("lower_bound") is None:
        return ""
    objective = row.get("objective", "makespan")
    value_text = "" if objective == "makespan" else f"; {objective} {_g(row['objective_value'])},"
    gap = row.get("gap")
    gap_text = "" if gap is None else f", gap {100 * gap:.1f}%"
    secs = row.get("solve_seconds")
    time_text = "" if secs is None else f", {row.get('solver', '')} {secs:.1f} s"
    status = row.get("status")
    status_text = f", {status}" if status in (str(Status.TIME_LIMIT), str(Status.ERROR)) else ""
    if status == str(Status.TIME_LIMIT) and row.get("cut_by"):
        status_text += f" ({row['cut_by']})"
    parted = row.get("pairs_parted") or 0
    parted_text = f", {parted} pairs parted (they saved no time)" if parted else ""
    tried = row.get("placements_tried") or []
    bound_text = f"lower bound {_g(row['lower_bound'])}"
    if len(tried) > 1:  # the bound and gap hold for the winning placement; the least over all tried is separate
        bound_text += f" on this placement ({_g(row['lower_bound_all_placements'])} over the {len(tried)} tried)"
    return f"{search_note(tried)}{value_text or ';'} {bound_text}{gap_text}{parted_text}{time_text}{status_text}"


def search_note(tried: list[dict]) -> str:
    """'; best of chain 55, v 51.5, bidirectional refused' when the MIP tried several placements, else ''.

    A placement whose bound proved it could not win before any search shows that bound:

    >>> search_note([{"placement": "chain", "objective_value": None, "lower_bound": 58.0, "error": "not solved: ..."},
    ...              {"placement": "v", "objective_value": 51.5, "lower_bound": 51.5, "error": None},
    ...              {"placement": "bidirectional", "objective_value": None, "error": "too small"}])
    '; best of chain cannot win (bound 58), v 51.5, bidirectional refused'
    """
    if len(tried) < 2:
        return ""
    return "; best of " + ", ".join(f"{t['placement']} {_tried_text(t)}" for t in tried)


def _tried_text(t: dict) -> str:
    if not t["error"]:
        return _g(t["objective_value"])
    if t["error"].startswith("not tried"):
        return "not tried"
    if t["error"].startswith("no schedule"):
        return "no schedule in time"
    if t["error"].startswith("not solved"):
        return f"cannot win (bound {_g(t['lower_bound'])})"
    return "refused"


def table(rows: list[dict], header: str) -> str:
    """The plain-text table of method x (makespan, bubble ratio, idle per device, peak activation, copies, placement)."""
    cols = ["method", "makespan", "bubble", "idle per device", "peak act", "params", "placement"]
    body = []
    for r in rows:
        if r["error"]:
            body.append([r["method"], "refused: " + r["error"]])
            continue
        body.append([
            r["method"],
            _g(r["makespan"]),
            f"{r['bubble_ratio']:.4f}",
            idle_text(r["idle"]),
            _g(r["peak_activation_bytes"]),
            f"{r['param_copies']:g}x",
            r["placement"] + (" (branches run one after another)" if r.get("linearized") else "") + solver_note(r),
        ])
    full = [b for b in body if len(b) == len(cols)]
    widths = [max([len(c)] + [len(b[i]) for b in full]) for i, c in enumerate(cols)]
    widths[0] = max([widths[0]] + [len(b[0]) for b in body])
    right = {1, 2, 4, 5}

    def line(cells):
        if len(cells) == 2:
            return f"{cells[0]:<{widths[0]}}  {cells[1]}"
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([header, line(cols)] + [line(b) for b in body])


def plan_figures(row: dict) -> dict:
    """A MIP row's solver figures for plan.json's metrics; there ``lower_bound`` and ``gap`` are on the makespan.

    >>> plan_figures({"objective": "zb-span", "objective_value": 30, "lower_bound": 27, "gap": 0.1, "solver": "cbc"})
    {'solver': 'cbc', 'objective': 'zb-span', 'objective_value': 30, 'objective_lower_bound': 27, 'objective_gap': 0.1}
    """
    figures = {k: row[k] for k in ("lower_bound", "gap", "solver", "solve_seconds") if k in row}
    if row.get("objective", "makespan") != "makespan":  # the bound is on that objective, not on the makespan
        figures = {k: v for k, v in figures.items() if k not in ("lower_bound", "gap")}
        figures.update(objective=row["objective"], objective_value=row["objective_value"],
                       objective_lower_bound=row["lower_bound"], objective_gap=row["gap"])
    return figures


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
        limit_text = "" if limit is None else f", memory limit {_g(limit)}" + (f" (= {limit_from}'s peak)" if limit_from else "")
        header = f"{source} on {sg.num_devices} devices, {microbatches} microbatches{limit_text}"
        print(table(rows, header))
    if not schedules:
        raise OpschedError(f"every method was refused on this pipeline ({len(rows)} tried; each row on stdout says "
                           "why): try more microbatches, a higher --memory-limit or other --methods")
    if out_dir is not None:
        log.info("wrote %d plans under %s/", len(schedules), out_dir)
    return 0
