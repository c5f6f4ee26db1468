"""Schedules as CSV files for PyTorch's pipeline runtime (``torch.distributed.pipelining``).

PyTorch's ``_PipelineScheduleRuntime`` reads a schedule from a CSV file: one row
per pipeline rank in rank order, one action per cell (``0F3``, ``2I5``, ``2W5``,
``1B0``, an overlapped pair ``(0F7;7B3)OVERLAP_F_B``), stage ids global. In the
*compute-only* format the runtime inserts the sends and receives itself.

This module goes both ways:

* :func:`torch_rows` / :func:`write_torch_csv` turn an opsched order (or a timed
  :class:`~opsched.schedule.Schedule`) into such a file, after checking that
  PyTorch's runtime can express the plan (a chain of stages, every stage runs
  every microbatch, device groups equal or disjoint) and that the order cannot
  deadlock;
* :func:`read_torch_csv` reads a hand-written file (compute-only, or with comm
  actions, which are ignored for timing) back into an opsched order, with
  errors that name the row and cell.

One pipeline rank is one device group: a stage on devices ``(2, 3)`` runs on one
rank. Ranks are the distinct device groups, numbered by their smallest device.

>>> from opsched.schedule import Job, chain_stage_graph
>>> sg = chain_stage_graph(2, f=1, b=2, w=1)
>>> order = {0: [Job(0, 0, "F"), Job(0, 0, "B")], 1: [Job(1, 0, "F"), Job(1, 0, "B")]}
>>> torch_rows(sg, order, microbatches=1)
[['0F0', '0B0'], ['1F0', '1B0']]
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path
from typing import Sequence

from opsched.errors import OpschedError
from opsched.export.framework import Framework
from opsched.fileio import atomic_path
from opsched.schedule import (
    Action,
    Job,
    Order,
    Pair,
    PassKind,
    Schedule,
    StageGraph,
    backward_kinds,
    dependencies,
    jobs_of,
    order_from_schedule,
    simulate,
)

_JOB_RE = re.compile(r"^(\d+)([FIWB])(\d+)$")
_COMM_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")
_PAIR_RE = re.compile(r"^\(([^;()]*);([^;()]*)\)OVERLAP_F_B$")
_EXAMPLE = "expected e.g. 1F3, 1I3, 1W3, 1B3, (0F7;3B2)OVERLAP_F_B or a comm action such as 1SEND_F3"


# --------------------------------------------------------------------------- ranks


def torch_ranks(sg: StageGraph) -> list[tuple[int, ...]]:
    """The pipeline ranks of ``sg``: its distinct device groups, ordered by smallest device.

    Raises :class:`OpschedError` when two groups share a device without being
    the same group (PyTorch gives each stage exactly one rank).

    >>> from opsched.schedule import chain_stage_graph
    >>> torch_ranks(chain_stage_graph(4, devices=2, placement="v"))
    [(0,), (1,)]
    """
    groups: dict[tuple[int, ...], int] = {}  # group -> its number: devices compare numbers, not whole groups
    owner: dict[int, tuple[int, int]] = {}  # device -> (first stage on it, its group's number)
    for s in sg.stages:
        group = tuple(sorted(s.devices))
        number = groups.setdefault(group, len(groups))
        for d in group:
            first, held = owner.setdefault(d, (s.id, number))
            if held != number:
                other_group = next(g for g, n in groups.items() if n == held)
                raise OpschedError(
                    f"stage {s.id} runs on devices {group}, which overlap stage {first}'s group {other_group} "
                    "without being the same group; torch's runtime gives each stage one pipeline rank, "
                    "so device groups must be equal or disjoint"
                )
    return sorted(groups, key=min)


def stage_ranks(sg: StageGraph) -> dict[int, int]:
    """stage id -> pipeline rank (see :func:`torch_ranks`)."""
    ranks = {g: r for r, g in enumerate(torch_ranks(sg))}
    return {s.id: ranks[tuple(sorted(s.devices))] for s in sg.stages}


#: what a pipeline runtime is called in a refusal, and what to plan instead of DualPipe's two copies there
TORCH_RUNTIME = Framework("torch.distributed.pipelining", "use DualPipeV, which torch runs")


def check_expressible(sg: StageGraph, microbatches: int, runtime: Framework = TORCH_RUNTIME) -> None:
    """Raise :class:`OpschedError` saying why PyTorch's runtime cannot run ``sg``, if it cannot.

    The runtime (torch 2.6 to 2.13) passes activations only from stage k to
    stage k+1, so the StageGraph must be the chain 0 -> 1 -> ... -> N-1; every
    stage runs every microbatch; a stage's device group maps to one rank.
    Megatron-LM's and torchtitan's pipelines take the same shape, so their
    exports check it here too, named by ``runtime`` (its name, and the hint
    for a plan with DualPipe's copied stages).
    """
    name, copies_hint = runtime
    n = len(sg.stages)
    # a fork or join anywhere comes first: a branching plan's first stage may feed a later one without forking
    # itself, and renumbering its stages (the hint below) cannot make a DAG a chain
    which = _branching(sg)
    if which:
        raise OpschedError(
            f"the StageGraph branches ({which}); {name} only runs a chain of "
            "stages 0 -> 1 -> ... -> N-1, so this plan cannot be exported "
            "(plan a chain: `opsched plan --runtime torch`; `opsched run` runs a branching plan on its own "
            "point-to-point executor)"
        )
    for s in sg.stages:
        succs = sorted(e.dst for e in sg.succs(s.id))
        want_succs = [s.id + 1] if s.id < n - 1 else []
        if succs != want_succs:
            got = f"feeds stage {succs[0]}" if succs else "feeds no stage"
            want = f"stage {s.id + 1}" if want_succs else "no stage"
            raise OpschedError(
                f"stage {s.id} {got}, but {name} runs stage k into stage k+1: "
                f"stage {s.id} must feed {want}; number the stages along the chain"
            )
        if s.microbatches is not None and set(s.microbatches) != set(range(microbatches)):
            raise OpschedError(
                f"stage {s.id} runs only microbatches {list(s.microbatches)} (e.g. one direction of "
                f"bidirectional DualPipe with copied stages); {name} sends every microbatch through "
                f"every stage, so this plan cannot be exported ({copies_hint})"
            )
    torch_ranks(sg)


def _branching(sg: StageGraph) -> str | None:
    """The first fork or join of ``sg`` in stage order, as a refusal names it (None for a graph without one)."""
    for s in sg.stages:
        succs = sorted(e.dst for e in sg.succs(s.id))
        preds = sorted(e.src for e in sg.preds(s.id))
        if len(succs) > 1:
            return f"stage {s.id} feeds stages {succs}"
        if len(preds) > 1:
            return f"stages {preds} feed stage {s.id}"
    return None


# --------------------------------------------------------------------------- schedule -> order


# --------------------------------------------------------------------------- order -> rows


def _check_complete(sg: StageGraph, rows: Sequence[Sequence[Action]], microbatches: int, where) -> None:
    """Every (stage, microbatch) has one F and either one B or one I and one W, each listed once.

    ``where(row, index)`` names a cell in error messages.
    """
    seen: dict[Job, tuple[int, int]] = {}
    for r, row in enumerate(rows):
        for i, action in enumerate(row):
            for job in jobs_of(action):
                if job.stage >= len(sg.stages):
                    raise OpschedError(
                        f"{where(r, i)}: '{action}' names stage {job.stage}, but the plan has stages "
                        f"0..{len(sg.stages) - 1}"
                    )
                if job.microbatch >= microbatches:
                    raise OpschedError(
                        f"{where(r, i)}: '{action}' names microbatch {job.microbatch}, but there are "
                        f"{microbatches} microbatches (0..{microbatches - 1})"
                    )
                if job in seen:
                    raise OpschedError(
                        f"{where(r, i)}: '{job}' appears a second time (first at {where(*seen[job])}); "
                        "list each action once"
                    )
                seen[job] = (r, i)
    ranks = stage_ranks(sg)
    for s in sg.stages:
        for m in range(microbatches):
            if not s.runs(m):
                continue
            missing = [p for p in (PassKind.F,) if Job(s.id, m, p) not in seen]
            has_b = Job(s.id, m, PassKind.B) in seen
            has_i, has_w = Job(s.id, m, PassKind.I) in seen, Job(s.id, m, PassKind.W) in seen
            if has_b and (has_i or has_w):
                raise OpschedError(
                    f"stage {s.id} microbatch {m} has both a full backward {s.id}B{m} and a split one "
                    f"({s.id}I{m}/{s.id}W{m}); keep either B or I and W"
                )
            if not has_b:
                missing += [p for p, has in ((PassKind.I, has_i), (PassKind.W, has_w)) if not has]
                if not has_i and not has_w:
                    missing = missing[:-2] + ["B (or I and W)"]
            if missing:
                r = ranks[s.id]
                raise OpschedError(
                    f"stage {s.id} microbatch {m} has no {' and no '.join(missing)}: add "
                    f"{', '.join(f'{s.id}{p[0]}{m}' for p in missing)} to row {r + 1} (rank {r})"
                )


def _blocked_heads(sg: StageGraph, rows: Sequence[Sequence[Action]]) -> dict[int, tuple[int, list[Job]]] | None:
    """Run the rows in order without times, as torch's runtime does.

    Returns None when every row runs to its end, else, for each row that is
    stuck, the index of its blocked action and the dependencies it waits for.
    """
    backward = backward_kinds(a for row in rows for a in row)
    done: set[Job] = set()
    heads = [0] * len(rows)
    while True:
        progressed = False
        for r, row in enumerate(rows):
            while heads[r] < len(row):
                jobs = jobs_of(row[heads[r]])
                if any(d not in done for job in jobs for d, _ in dependencies(sg, job, backward)):
                    break
                done.update(jobs)
                heads[r] += 1
                progressed = True
        if all(heads[r] >= len(row) for r, row in enumerate(rows)):
            return None
        if not progressed:
            return {
                r: (heads[r], [d for job in jobs_of(row[heads[r]]) for d, _ in dependencies(sg, job, backward) if d not in done])
                for r, row in enumerate(rows)
                if heads[r] < len(row)
            }


def _deadlock_detail(rows, blocked, where) -> str:
    return "; ".join(
        f"{where(r, i)}: '{rows[r][i]}' waits for {', '.join(map(str, deps))}" for r, (i, deps) in blocked.items()
    )


def _rank_rows(sg: StageGraph, order: Order) -> list[list[Action]]:
    """One list of actions per rank (device group), checking the group's devices agree."""
    rows = []
    for group in torch_ranks(sg):
        lists = {d: list(order.get(d, [])) for d in group}
        first = lists[group[0]]
        for d in group[1:]:
            if lists[d] != first:
                raise OpschedError(
                    f"devices {group[0]} and {d} of one group list different actions; torch runs a device "
                    "group as one pipeline rank, so every device of the group must run the same order"
                )
        rows.append(first)
    return rows


def _check_placed(sg: StageGraph, order: Order, name: str) -> None:
    """Refuse an action listed on a device that does not host its stage.

    A device whose list equals its group's first device's is covered by that
    device's check (they host the same stages): a plan on thousands of
    devices in a few groups is checked a few lists deep, not thousands.
    """
    hosts = [frozenset(s.devices) for s in sg.stages]
    first_of = {d: group[0] for group in torch_ranks(sg) for d in group}
    for d, acts in order.items():
        first = first_of.get(d)
        if first is not None and first != d and order.get(first) == acts:
            continue
        for a in acts:
            for job in jobs_of(a):
                if job.stage >= len(hosts) or d not in hosts[job.stage]:
                    raise OpschedError(f"{name}: action {a} is listed on device {d}, which does not host its stage")


def checked_rank_rows(sg: StageGraph, order: Order, microbatches: int, name: str = "the order",
                      chain: bool = True) -> list[list[Action]]:
    """Rank rows of ``order`` after every check: expressible (with ``chain``: a chain of stages, as torch's runtime
    needs; without, any stage graph whose device groups are equal or disjoint, as opsched's own DAG executor
    :mod:`opsched.torchrun.dag_runtime` runs), complete, placed, deadlock-free."""
    if chain:
        check_expressible(sg, microbatches)
    ranks = stage_ranks(sg)
    _check_placed(sg, order, name)
    rows = _rank_rows(sg, order)
    where = lambda r, i: f"{name} rank {r}, action {i + 1}"  # noqa: E731
    _check_complete(sg, rows, microbatches, where)
    for r, row in enumerate(rows):
        for a in row:
            if isinstance(a, Pair) and ranks[a.first.stage] != ranks[a.second.stage]:
                raise OpschedError(f"{name}: pair {a} joins stages on different ranks")
    blocked = _blocked_heads(sg, rows)
    if blocked:
        detail = _deadlock_detail(rows, blocked, where)
        raise OpschedError(f"{name} would deadlock in torch's runtime: {detail}; reorder the actions")
    return rows


def torch_rows(sg: StageGraph, order: Order, microbatches: int) -> list[list[str]]:
    """The compute-only CSV rows of ``order``: one list of action strings per rank, microbatches numbered in
    the order the last stage runs their forwards (:func:`in_loss_order`).

    Raises :class:`OpschedError` when torch cannot express the plan or the
    order is incomplete or would deadlock (so a bad file is never written).
    """
    rows = in_loss_order(checked_rank_rows(sg, order, microbatches), len(sg.stages) - 1)
    return [[str(a) for a in row] for row in rows]


def in_loss_order(rows: list[list[Action]], last_stage: int) -> list[list[Action]]:
    """``rows`` with the microbatches renumbered so that ``last_stage`` runs their forwards as 0, 1, 2, ...

    torch's runtime (``_PipelineScheduleRuntime``; seen in torch 2.13) keeps the
    losses in a list in the order the last stage computes them and reads
    microbatch m's loss at position m, so a last stage running F3 before F2
    would stop (or take another microbatch's loss). Which data chunk is called
    microbatch m is free: renumbering every stage the same way runs the same
    order (every dependency joins jobs of one microbatch).

    >>> rows = [[Job(0, 0, "F"), Job(0, 1, "F")], [Job(1, 1, "F"), Job(1, 0, "F")]]
    >>> [[str(a) for a in row] for row in in_loss_order(rows, 1)]
    [['0F1', '0F0'], ['1F0', '1F1']]
    """
    forwards = [job.microbatch for row in rows for a in row for job in jobs_of(a)
                if job.stage == last_stage and job.pass_ == PassKind.F]
    number = {m: k for k, m in enumerate(forwards)}
    if all(m == k for m, k in number.items()):
        return rows

    def renumbered(job: Job) -> Job:
        return Job(job.stage, number[job.microbatch], job.pass_)

    return [[Pair(renumbered(a.first), renumbered(a.second)) if isinstance(a, Pair) else renumbered(a) for a in row]
            for row in rows]


def csv_text(rows: Sequence[Sequence[str]]) -> str:
    """CSV text of rows, as ``csv.writer`` writes it (what torch's ``_dump_csv`` does)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    for row in rows:
        writer.writerow(row)
    return buf.getvalue()


def write_torch_csv(
    path: str | os.PathLike,
    schedule: Schedule | None = None,
    *,
    sg: StageGraph | None = None,
    order: Order | None = None,
    microbatches: int | None = None,
    check_with_torch: bool = True,
) -> list[list[str]]:
    """Write a schedule (or ``sg`` + ``order`` + ``microbatches``) as a compute-only torch CSV.

    The file is written atomically and only after every check passed: opsched's
    own (see :func:`torch_rows`) and, when torch is installed and
    ``check_with_torch``, torch's loader, validation and deadlock simulation
    (:func:`check_with_torch_loader`). Returns the rows.
    """
    if schedule is not None:
        sg, order, microbatches = schedule.stage_graph, order_from_schedule(schedule), schedule.microbatches
    if sg is None or order is None or microbatches is None:
        raise OpschedError("write_torch_csv needs a schedule, or sg, order and microbatches")
    rows = torch_rows(sg, order, microbatches)
    with atomic_path(path) as tmp:
        tmp.write_text(csv_text(rows), encoding="utf-8", newline="")
        if check_with_torch and torch_available():
            check_with_torch_loader(tmp, num_stages=len(sg.stages), microbatches=microbatches)
    return rows


# --------------------------------------------------------------------------- torch's own checks


def torch_available() -> bool:
    """True when ``torch.distributed.pipelining`` imports (torch is an optional extra)."""
    try:
        import torch.distributed.pipelining.schedules  # noqa: F401
    except Exception:
        return False
    return True


def _mock_stages(num_stages: int, num_ranks: int, per_rank: int):
    from types import SimpleNamespace

    return [
        SimpleNamespace(num_stages=num_stages, group_size=num_ranks, group_rank=0, stage_index=k, submod=None)
        for k in range(max(per_rank, 1))
    ]


def load_with_torch(path: str | os.PathLike, num_stages: int, microbatches: int):
    """Load a compute-only CSV with torch's own ``_PipelineScheduleRuntime._load_csv``.

    No process group is needed: the runtime object is built on stand-in stage
    records. Returns the runtime (``pipeline_order`` and
    ``pipeline_order_with_comms`` filled in). torch's errors pass through.
    """
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    with open(path, newline="") as f:
        num_ranks = sum(1 for _ in csv.reader(f))
    runtime = _PipelineScheduleRuntime(_mock_stages(num_stages, num_ranks, 1), microbatches)
    runtime._load_csv(str(path), format="compute_only")
    return runtime


def torch_simulate(runtime) -> dict:
    """Run torch's dry-run deadlock simulation (``_simulate_comms_compute``) on a loaded runtime.

    torch's simulator knows compute and send/receive actions only, so the
    REDUCE_GRAD/UNSHARD/RESHARD bookkeeping actions are dropped and an
    overlapped pair is unrolled into its two sub-actions, in the order the
    runtime executes them.
    """
    from torch.distributed.pipelining.schedules import _ComputationType, _simulate_comms_compute

    skip = {_ComputationType.REDUCE_GRAD, _ComputationType.UNSHARD, _ComputationType.RESHARD}
    flat = {}
    for rank, actions in runtime.pipeline_order_with_comms.items():
        out = []
        for a in actions:
            if a is None or a.computation_type in skip:
                continue
            out.extend(a.sub_actions if a.sub_actions is not None else (a,))
        flat[rank] = out
    mapping = runtime.stage_index_to_group_rank
    return _simulate_comms_compute(flat, lambda s: mapping[s], runtime._num_stages)


def check_with_torch_loader(path: str | os.PathLike, num_stages: int, microbatches: int) -> None:
    """Load ``path`` with torch's loader and run torch's validation and deadlock simulation.

    Raises :class:`OpschedError` with torch's first message line when torch rejects it.
    """
    import contextlib

    try:
        runtime = load_with_torch(path, num_stages, microbatches)
        # torch prints the stuck schedule before raising; keep stdout clean
        with contextlib.redirect_stdout(io.StringIO()):
            torch_simulate(runtime)
    except (AssertionError, ValueError, RuntimeError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise OpschedError(f"torch's pipeline runtime rejects the schedule: {first}") from None


# --------------------------------------------------------------------------- reading


def parse_cell(text: str) -> Action | str | None:
    """Parse one CSV cell: a Job, a Pair, ``"comm"`` for a comm/bookkeeping action, None if empty.

    A job's pass is a :class:`~opsched.schedule.PassKind` member. Raises ``ValueError`` with a short reason on
    anything else.

    >>> parse_cell("1F3"), parse_cell("1SEND_F3"), parse_cell(" ")
    (Job(stage=1, microbatch=3, pass_=<PassKind.F: 'F'>), 'comm', None)
    >>> pair = parse_cell("(0F7;3B2)OVERLAP_F_B")
    >>> pair == Pair(Job(0, 7, PassKind.F), Job(3, 2, PassKind.B)), pair.second.pass_ is PassKind.B, str(pair)
    (True, True, '(0F7;3B2)OVERLAP_F_B')
    """
    text = text.strip()
    if not text:
        return None
    if m := _JOB_RE.match(text):
        return Job(int(m.group(1)), int(m.group(3)), PassKind(m.group(2)))
    if _COMM_RE.match(text):
        return "comm"
    if m := _PAIR_RE.match(text):
        halves = []
        for part in (m.group(1).strip(), m.group(2).strip()):
            j = _JOB_RE.match(part)
            if not j:
                raise ValueError(f"'{part}' inside the pair is not a compute action")
            halves.append(Job(int(j.group(1)), int(j.group(3)), PassKind(j.group(2))))
        return Pair(halves[0], halves[1])
    raise ValueError("is not an action")


def read_torch_csv(path: str | os.PathLike, sg: StageGraph, microbatches: int) -> Order:
    """Read a PyTorch pipeline CSV (compute-only, or with comm actions) into an opsched order.

    Row r is pipeline rank r, i.e. the r-th device group of ``sg`` (see
    :func:`torch_ranks`); its actions go to every device of that group. Comm
    and bookkeeping actions (SEND_F, RECV_B, UNSHARD, REDUCE_GRAD, ...) are
    checked for syntax and ignored, as opsched times transfers from the
    StageGraph's edges. Checks, each error naming the row and cell: every cell
    parses, every action sits on the rank that hosts its stage, every job is
    present exactly once, and the order can run without deadlock.

    >>> import tempfile, os                                  # doctest: +SKIP
    >>> order = read_torch_csv("schedule.csv", sg, 8)        # doctest: +SKIP
    """
    name = Path(path).name
    try:
        with open(path, newline="", encoding="utf-8") as f:
            raw = list(csv.reader(f))
    except FileNotFoundError:
        raise OpschedError(f"{path}: no such schedule file; pass the path of a CSV file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise OpschedError(f"{path}: cannot read it as CSV ({exc})") from None
    check_expressible(sg, microbatches)
    groups = torch_ranks(sg)
    while raw and not any(c.strip() for c in raw[-1]):
        raw.pop()  # a trailing blank line is not a rank
    if len(raw) != len(groups):
        raise OpschedError(
            f"{name} has {len(raw)} rows but the plan has {len(groups)} pipeline ranks "
            f"(device groups {groups}); write one row per rank in rank order"
        )
    ranks = stage_ranks(sg)
    rows: list[list[Action]] = []
    cells: list[list[int]] = []  # 1-based cell number of each kept action
    where_cell = lambda r, c: f"{name} row {r + 1} (rank {r}), cell {c}"  # noqa: E731
    for r, row in enumerate(raw):
        kept: list[Action] = []
        kept_cells: list[int] = []
        for c, text in enumerate(row, start=1):
            try:
                action = parse_cell(text)
            except ValueError as exc:
                raise OpschedError(f"{where_cell(r, c)}: '{text.strip()}' {exc}; {_EXAMPLE}") from None
            if action is None or action == "comm":
                continue
            for job in jobs_of(action):
                if job.stage >= len(sg.stages):
                    raise OpschedError(
                        f"{where_cell(r, c)}: '{text.strip()}' names stage {job.stage}, but the plan has stages "
                        f"0..{len(sg.stages) - 1}"
                    )
                if ranks[job.stage] != r:
                    raise OpschedError(
                        f"{where_cell(r, c)}: '{text.strip()}' runs stage {job.stage}, which lives on rank "
                        f"{ranks[job.stage]} (devices {groups[ranks[job.stage]]}); move it to row {ranks[job.stage] + 1}"
                    )
            if isinstance(action, Pair) and action.first == action.second:
                raise OpschedError(f"{where_cell(r, c)}: '{text.strip()}' pairs a job with itself")
            kept.append(action)
            kept_cells.append(c)
        rows.append(kept)
        cells.append(kept_cells)
    where = lambda r, i: where_cell(r, cells[r][i])  # noqa: E731
    _check_complete(sg, rows, microbatches, where)
    blocked = _blocked_heads(sg, rows)
    if blocked:
        detail = _deadlock_detail(rows, blocked, where)
        raise OpschedError(f"the schedule deadlocks: {detail}; reorder the actions so every dependency comes first")
    order: Order = {d: [] for d in range(sg.num_devices or 0)}
    for group, row in zip(groups, rows):
        for d in group:
            order[d] = list(row)
    simulate(sg, order, microbatches)  # the timing check every order goes through
    return order


def schedule_from_csv(path: str | os.PathLike, sg: StageGraph, microbatches: int) -> Schedule:
    """A hand-written torch CSV read (with every check of :func:`read_torch_csv`) and timed by the simulator.

    The schedule is named after the file (e.g. ``my_zbv.csv``), so it can be
    listed beside the baselines.
    """
    order = read_torch_csv(path, sg, microbatches)
    return Schedule(sg, microbatches, simulate(sg, order, microbatches), name=Path(path).name)
