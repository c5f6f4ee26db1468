"""plan.json: the plan contract (schema ``opsched.plan/1``, docs/plan.schema.json), written and read.

A plan file holds the StageGraph (stages with their device groups, times,
memory; edges with transfer times), the timed events and the metrics, so
another tool can check or draw it without opsched. Optional fields written
when they matter: a stage's ``name``, ``microbatches`` (the subset it runs),
``copy_of`` and ``streams`` (its passes' compute and communication
operations, from which overlapped pairs are timed); top-level
``overlap_gain`` and ``method``.

docs/plan.schema.json is the contract as a JSON Schema (draft 2020-12): the
tests check that :func:`plan_dict` follows it. The reader does not use it (a
schema validator is no dependency of opsched); it checks the same field rules
in code, plus the ones that relate fields (see :func:`schedule_from_dict`).

>>> from opsched.schedule import chain_stage_graph, simulate, Schedule, Job
>>> sg = chain_stage_graph(1, f=1, b=2, w=1)
>>> s = Schedule(sg, 1, simulate(sg, {0: [Job(0, 0, "F"), Job(0, 0, "B")]}, 1), name="demo")
>>> d = plan_dict(s)
>>> d["schema"], d["method"], d["schedule"]["events"][1]
('opsched.plan/1', 'demo', {'stage': 0, 'microbatch': 0, 'pass': 'B', 'start': 1.0, 'end': 3.0})
>>> schedule_from_dict(d)[0].events == s.events
True
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from opsched.errors import OpschedError
from opsched.fileio import write_text
from opsched.cost.overlap import STREAM_NAMES, PassStreams, StreamOp
from opsched.schedule import PASSES, Edge, Event, Metrics, PassKind, Schedule, Stage, StageGraph
from opsched.schedule import metrics as schedule_metrics
from opsched.schedule import validate as validate_schedule

SCHEMA = "opsched.plan/1"


def plan_dict(schedule: Schedule, metrics: Metrics | dict | None = None, extra: dict | None = None) -> dict:
    """The plan.json document of a timed schedule, as a plain dict.

    ``metrics`` defaults to :func:`opsched.schedule.metrics` of the schedule;
    a dict is merged over those (so a solver can add ``lower_bound``, ``gap``,
    ``solver``, ``solve_seconds``). ``extra`` adds top-level fields; an
    ``extra["metrics"]`` dict is merged into ``metrics`` instead of replacing it.
    """
    sg = schedule.stage_graph
    if isinstance(metrics, Metrics):
        computed = metrics.to_dict()
    else:
        computed = schedule_metrics(schedule).to_dict()
        computed.update(metrics or {})
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "time_unit": "s",
        "devices": int(sg.num_devices or 0),
        "microbatches": int(schedule.microbatches),
        "memory_limit_bytes": None if schedule.memory_limit is None else float(schedule.memory_limit),
        "stages": [_stage_dict(sg, s) for s in sg.stages],
        "edges": [{"src": int(e.src), "dst": int(e.dst), "time": float(e.time), "bytes": float(e.bytes)} for e in sg.edges],
        "schedule": {"events": [_event_dict(e) for e in schedule.events]},
        "metrics": computed,
    }
    if sg.overlap_gain:
        doc["overlap_gain"] = sg.overlap_gain
    if schedule.name:
        doc["method"] = schedule.name
    for key, value in (extra or {}).items():
        if key == "metrics" and isinstance(value, dict):
            doc["metrics"].update(value)
        else:
            doc[key] = value
    return doc


def _stage_dict(sg: StageGraph, s: Stage) -> dict:
    # int()/float() turn numpy numbers (from solvers) into plain JSON numbers
    d: dict[str, Any] = {
        "id": int(s.id),
        "devices": [int(x) for x in s.devices],
        "preds": [int(e.src) for e in sg.preds(s.id)],
        "time": {p: float(s.time[p]) for p in s.timed_passes()},
        "param_bytes": float(s.param_bytes),
        "act_bytes": float(s.act_bytes),
        "act_w_bytes": float(s.act_w_bytes),
    }
    if s.name:
        d["name"] = str(s.name)
    if s.microbatches is not None:
        d["microbatches"] = [int(m) for m in s.microbatches]
    if s.copy_of is not None:
        d["copy_of"] = int(s.copy_of)
    if s.streams is not None:
        d["streams"] = s.streams.to_dict()
    return d


def _event_dict(e: Event) -> dict:
    d: dict[str, Any] = {
        "stage": int(e.stage), "microbatch": int(e.microbatch), "pass": e.pass_, "start": float(e.start), "end": float(e.end)
    }
    if e.pair is not None:
        d["pair"] = int(e.pair)
    return d


def dumps_plan(doc: dict) -> str:
    """JSON text of a plan document: indented, one event per line, strict JSON (no NaN)."""
    events = doc.get("schedule", {}).get("events", [])
    marker = "__OPSCHED_EVENTS__"
    shell = dict(doc, schedule=dict(doc.get("schedule", {}), events=marker))
    try:
        text = json.dumps(shell, indent=2, allow_nan=False)
        lines = ",\n".join("      " + json.dumps(e, allow_nan=False) for e in events)
    except ValueError as exc:
        raise OpschedError(f"the plan holds a non-finite number and cannot be written as JSON: {exc}") from None
    body = "[\n" + lines + "\n    ]" if events else "[]"
    return text.replace(json.dumps(marker), body, 1) + "\n"


def write_plan(path: str | os.PathLike, schedule: Schedule, *, extra: dict | None = None, validate: bool = True) -> dict:
    """Validate ``schedule`` (unless told not to), then write its plan.json atomically; returns the document.

    An invalid schedule raises :class:`opsched.schedule.ScheduleError` and writes nothing.
    """
    if validate:
        validate_schedule(schedule)
    doc = plan_dict(schedule, extra=extra)
    write_text(path, dumps_plan(doc))
    return doc


def is_plan_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an existing file holding a plan (a JSON object of schema :data:`SCHEMA`).

    Commands that write other JSON (a Gantt trace) refuse to replace one: a plan is the work of a search.

    >>> is_plan_file("pyproject.toml"), is_plan_file("no/such/file.json")
    (False, False)
    """
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA


def read_plan(path: str | os.PathLike) -> tuple[Schedule, dict]:
    """Read a plan.json into a :class:`Schedule` and the raw document.

    Raises :class:`OpschedError` with one line naming the file and the bad
    field when the file is missing, not JSON, or does not follow the schema.
    It does not validate the schedule itself; call
    :func:`opsched.schedule.validate` for that.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        raise OpschedError(f"{path}: no such plan file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OpschedError(f"{path}: cannot read the plan file: {exc}") from None
    except json.JSONDecodeError as exc:
        raise OpschedError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    try:
        return schedule_from_dict(doc)
    except OpschedError as exc:
        raise OpschedError(f"{path}: {exc}") from None


def read_plan_schedule(path: str | os.PathLike) -> Schedule:
    """The :class:`Schedule` of a plan.json, for commands that need no other field (see :func:`read_plan`).

    >>> import os, tempfile
    >>> from opsched.schedule import chain_stage_graph, simulate, Schedule, Job
    >>> sg = chain_stage_graph(1)
    >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
    >>> _ = write_plan(path, Schedule(sg, 1, simulate(sg, {0: [Job(0, 0, "F"), Job(0, 0, "B")]}, 1)))
    >>> read_plan_schedule(path).events[-1]
    Event(stage=0, microbatch=0, pass_=<PassKind.B: 'B'>, start=1.0, end=3.0, pair=None)
    """
    schedule, _doc = read_plan(path)
    return schedule


def plan_step_time(doc: dict) -> float | None:
    """The step time (makespan + gradient sync, seconds) an ``opsched plan`` file records, or None without one.

    >>> plan_step_time({"step_time": 0.75}), plan_step_time({}), plan_step_time({"step_time": "fast"})
    (0.75, None, None)
    """
    value = doc.get("step_time")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def schedule_from_dict(doc: Any) -> tuple[Schedule, dict]:
    """Build the :class:`Schedule` of a plan document; returns ``(schedule, doc)``.

    The checks here are the ones a reader needs to build a schedule without
    a JSON Schema validator at run time: field presence and types, stage ids
    0..n-1 in order, ``preds`` agreeing with ``edges``. docs/plan.schema.json
    states the same field rules for other tools; whether the events make a
    valid schedule is :func:`opsched.schedule.validate`'s job.
    """
    if not isinstance(doc, dict):
        raise OpschedError("a plan must be a JSON object")
    if doc.get("schema") != SCHEMA:
        raise OpschedError(f"field schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    devices = _int(doc, "devices", "devices", minimum=1)
    microbatches = _int(doc, "microbatches", "microbatches", minimum=1)
    limit = doc.get("memory_limit_bytes")
    if limit is not None:
        limit = _num(doc, "memory_limit_bytes", "memory_limit_bytes")
    parsed = [_stage_from(raw, k) for k, raw in enumerate(_list(doc, "stages", "stages"))]
    preds = [ps for _, ps in parsed]
    edges = [_edge_from(raw, k) for k, raw in enumerate(_list(doc, "edges", "edges"))]
    gain = _num(doc, "overlap_gain", "overlap_gain") if "overlap_gain" in doc else 0.0
    sg = StageGraph([stage for stage, _ in parsed], edges, num_devices=devices, overlap_gain=gain)
    for k, ps in enumerate(preds):
        from_edges = sorted(e.src for e in edges if e.dst == k)
        if sorted(ps) != from_edges:
            raise OpschedError(f"field stages[{k}].preds is {ps} but the edges into stage {k} come from {from_edges}")
    sched_raw = doc.get("schedule")
    if not isinstance(sched_raw, dict):
        raise OpschedError("field schedule must be an object with an events list")
    events = [_event_from(raw, k) for k, raw in enumerate(_list(sched_raw, "events", "schedule.events"))]
    name = doc.get("method", "")
    return Schedule(sg, microbatches, events, memory_limit=limit, name=name if isinstance(name, str) else ""), doc


def _object(raw: Any, where: str) -> dict:
    if not isinstance(raw, dict):
        raise OpschedError(f"field {where} must be an object")
    return raw


def _ints(raw: dict, key: str, where: str) -> tuple[int, ...]:
    """A list of integers >= 0 at ``raw[key]``."""
    return tuple(_int({"v": v}, "v", where) for v in _list(raw, key, where))


def _stage_from(raw: Any, k: int) -> tuple[Stage, list[int]]:
    """Stage ``k`` of a plan and the stage ids its ``preds`` names (checked against the edges by the caller)."""
    where = f"stages[{k}]"
    raw = _object(raw, where)
    if _int(raw, "id", f"{where}.id") != k:
        raise OpschedError(f"field {where}.id is {raw['id']}; stage ids must be 0..n-1 in order")
    time_raw = raw.get("time")
    if not isinstance(time_raw, dict):
        raise OpschedError(f"field {where}.time must be an object with F, I and W")
    time = {p: _num(time_raw, p, f"{where}.time.{p}") for p in ("F", "I", "W")}
    if "B" in time_raw:  # optional: a measured fused backward
        time["B"] = _num(time_raw, "B", f"{where}.time.B")
    stage = Stage(
        id=k,
        devices=_ints(raw, "devices", f"{where}.devices"),
        time=time,
        param_bytes=_num(raw, "param_bytes", f"{where}.param_bytes"),
        act_bytes=_num(raw, "act_bytes", f"{where}.act_bytes"),
        act_w_bytes=_num(raw, "act_w_bytes", f"{where}.act_w_bytes"),
        name=str(raw.get("name", "")),
        microbatches=None if raw.get("microbatches") is None else _ints(raw, "microbatches", f"{where}.microbatches"),
        copy_of=None if raw.get("copy_of") is None else _int(raw, "copy_of", f"{where}.copy_of"),
        streams=None if raw.get("streams") is None else _streams_from(_object(raw["streams"], f"{where}.streams"),
                                                                        f"{where}.streams"),
    )
    return stage, list(_ints(raw, "preds", f"{where}.preds"))


def _streams_from(raw: dict, where: str) -> PassStreams:
    """A stage's ``streams``: per pass F, I, W a list of ``[stream, seconds]`` with stream compute or comm."""
    by_name = {name: mask for mask, name in STREAM_NAMES.items()}
    chains = []
    for p in ("F", "I", "W"):
        ops = []
        for k, op in enumerate(_list(raw, p, f"{where}.{p}")):
            if not (isinstance(op, list) and len(op) == 2 and op[0] in by_name):
                raise OpschedError(f"field {where}.{p}[{k}] must be [stream, seconds] with stream "
                                   f"{' or '.join(sorted(by_name))}, got {op!r}")
            ops.append(StreamOp(by_name[op[0]], _num({"v": op[1]}, "v", f"{where}.{p}[{k}][1]")))
        chains.append(tuple(ops))
    return PassStreams(*chains)


def _edge_from(raw: Any, k: int) -> Edge:
    where = f"edges[{k}]"
    raw = _object(raw, where)
    return Edge(
        _int(raw, "src", f"{where}.src"),
        _int(raw, "dst", f"{where}.dst"),
        time=_num(raw, "time", f"{where}.time"),
        bytes=_num(raw, "bytes", f"{where}.bytes") if "bytes" in raw else 0.0,
    )


def _event_from(raw: Any, k: int) -> Event:
    where = f"schedule.events[{k}]"
    raw = _object(raw, where)
    pass_ = raw.get("pass")
    if pass_ not in PASSES:
        raise OpschedError(f"field {where}.pass is {pass_!r}; passes are F, I, W, B")
    pair = raw.get("pair")
    return Event(
        _int(raw, "stage", f"{where}.stage"),
        _int(raw, "microbatch", f"{where}.microbatch"),
        PassKind(pass_),
        _num(raw, "start", f"{where}.start"),
        _num(raw, "end", f"{where}.end"),
        None if pair is None else _int(raw, "pair", f"{where}.pair"),
    )


def _num(obj: dict, key: str, where: str) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise OpschedError(f"field {where} must be a finite number, got {v!r}")
    return float(v)


def _int(obj: dict, key: str, where: str, minimum: int = 0) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise OpschedError(f"field {where} must be an integer >= {minimum}, got {v!r}")
    return v


def _list(obj: dict, key: str, where: str) -> list:
    v = obj.get(key)
    if not isinstance(v, list):
        raise OpschedError(f"field {where} must be a list, got {v!r}")
    return v
