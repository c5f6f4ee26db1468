"""Perfetto / chrome://tracing JSON of a timed schedule.

One process (the plan), one track (thread) per chart row named by ``ph:
"M"`` metadata events: a row is a run of devices hosting the same stages
(:func:`opsched.export.gantt_bars.device_rows`, named ``device 3`` or
``devices 0-63``), which run the same events, so a plan on thousands of
devices in a few groups has a few tracks. One complete event (``ph: "X"``,
``ts``/``dur`` in microseconds of plan time) per job and track: a stage on
several rows shows on each; the two halves of an overlapped pair are two
events with the same times (Perfetto nests them). ``args`` carries the
stage, microbatch, pass (and pair id). A counter track per row (``ph:
"C"``) shows the activation bytes each of its devices holds. Open the file
at https://ui.perfetto.dev or chrome://tracing (loading a local file needs
no upload).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from opsched.export.gantt_bars import PASS_NAMES, TITLE_JOIN, device_rows, row_label, title_text
from opsched.fileio import write_text
from opsched.schedule import Schedule, memory_profile, metrics

#: plan time unit -> trace microseconds
_US = {"s": 1e6, "ms": 1e3, "us": 1.0}
_PID = 1


def trace_dict(
    schedule: Schedule, *, title: str | None = None, time_unit: str = "s", step_time: float | None = None
) -> dict:
    """The trace document: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``."""
    sg = schedule.stage_graph
    scale = _US[time_unit]
    m = metrics(schedule)
    events: list[dict] = [
        {"ph": "M", "pid": _PID, "tid": 0, "name": "process_name", "args": {"name": title_text(schedule, title, m, step_time).replace("\n", TITLE_JOIN)}}
    ]
    # one track per run of devices hosting the same stages (they run the same events), as the charts draw them
    rows = device_rows(schedule)
    row_of = {row[0]: r for r, row in enumerate(rows)}
    for r, row in enumerate(rows):
        events.append({"ph": "M", "pid": _PID, "tid": r, "name": "thread_name", "args": {"name": row_label(row)}})
        events.append({"ph": "M", "pid": _PID, "tid": r, "name": "thread_sort_index", "args": {"sort_index": r}})
    for e in sorted(schedule.events, key=lambda e: (e.start, e.stage, e.microbatch, e.pass_)):
        st = sg.stage(e.stage)
        args = {"stage": e.stage, "microbatch": e.microbatch, "pass": e.pass_}
        if st.name:
            args["stage_name"] = st.name
        if e.pair is not None:
            args["pair"] = e.pair
        for d in st.devices:
            if d not in row_of:
                continue
            events.append(
                {
                    "name": f"{e.stage}{e.pass_}{e.microbatch}",
                    "cat": PASS_NAMES[e.pass_],
                    "ph": "X",
                    "pid": _PID,
                    "tid": row_of[d],
                    "ts": e.start * scale,
                    "dur": (e.end - e.start) * scale,
                    "args": args,
                }
            )
    profile = memory_profile(schedule)
    for row in rows:
        for t, value in profile[row[0]]:
            events.append(
                {"name": f"activation bytes, {row_label(row)}", "ph": "C", "pid": _PID, "ts": t * scale,
                 "args": {"bytes": value}}
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"method": schedule.name, "time_unit": time_unit, **m.to_dict()},
    }


def write_trace(
    schedule: Schedule, path: str | os.PathLike, *, title: str | None = None, step_time: float | None = None
) -> Path:
    """Write the trace JSON atomically (see the module docstring); ``step_time`` joins the title when given."""
    return write_text(path, json.dumps(trace_dict(schedule, title=title, step_time=step_time), allow_nan=False) + "\n")
