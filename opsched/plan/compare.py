"""Running ``opsched compare``'s methods on one pipeline: every hand-written schedule and the MIP.

Each method re-places the same stage graph the way it needs and goes through
the one simulator and validator; the MIP runs last, for the time the other
rows left until the command's deadline less the work after its search. A
method that cannot run gets a refused row with the reason. The command
(opsched.commands.compare) parses the flags and prints; this module runs the
methods and builds the rows, and opsched.plan.compare_table renders them.
"""

from __future__ import annotations

import time
from pathlib import Path

from opsched.errors import OpschedError, Unsupported
from opsched.schedule.placement import PLACEMENTS
from opsched.solving.isolate import SolverCrash
from opsched.solving.solver import Status

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
    from opsched.plan.placements import placements_to_try

    # with --plan the plan's own placement is tried too (first): it may branch or use device groups
    tries = placements_to_try(sg, microbatches, args.placement, as_given=bool(args.plan))
    # each solve holds its share of --time-limit itself (its search runs in a watched child that it stops at the
    # limit); this outer child, as the planner's, is the backstop: a native abort or hang anywhere costs this row
    # (SolverCrash), not the command. The hand-written orders that run on a placement start its solve.
    found = isolate.run_isolated(
        solve_placements, tries, microbatches,
        lower.LowerOptions(memory_limit=limit, time_limit=time_limit, solver=args.solver, objective=args.objective),
        solve_one=lower.solve, thin_one=thin_pairs,
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
