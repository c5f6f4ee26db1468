"""Perfetto / chrome://tracing JSON of a timed schedule.

One process (the plan), one track (thread) per device named by ``ph: "M"``
metadata events, one complete event (``ph: "X"``, ``ts``/``dur`` in
microseconds of plan time) per job and device: a stage on a device group
shows on every device's track; the two halves of an overlapped pair are two
events with the same times (Perfetto nests them). ``args`` carries the stage,
microbatch, pass (and pair id). A counter track per device (``ph: "C"``)
shows the activation bytes held. Open the file at https://ui.perfetto.dev or
chrome://tracing (loading a local file needs no upload).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from opsched.export.gantt_bars import PASS_NAMES, title_text
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
        {"ph": "M", "pid": _PID, "tid": 0, "name": "process_name", "args": {"name": title_text(schedule, title, m, step_time)}}
    ]
    for d in range(sg.num_devices or 0):
        events.append({"ph": "M", "pid": _PID, "tid": d, "name": "thread_name", "args": {"name": f"device {d}"}})
        events.append({"ph": "M", "pid": _PID, "tid": d, "name": "thread_sort_index", "args": {"sort_index": d}})
    for e in sorted(schedule.events, key=lambda e: (e.start, e.stage, e.microbatch, e.pass_)):
        st = sg.stage(e.stage)
        args = {"stage": e.stage, "microbatch": e.microbatch, "pass": e.pass_}
        if st.name:
            args["stage_name"] = st.name
        if e.pair is not None:
            args["pair"] = e.pair
        for d in st.devices:
            events.append(
                {
                    "name": f"{e.stage}{e.pass_}{e.microbatch}",
                    "cat": PASS_NAMES[e.pass_],
                    "ph": "X",
                    "pid": _PID,
                    "tid": d,
                    "ts": e.start * scale,
                    "dur": (e.end - e.start) * scale,
                    "args": args,
                }
            )
    for d, steps in sorted(memory_profile(schedule).items()):
        for t, value in steps:
            events.append(
                {"name": f"activation bytes, device {d}", "ph": "C", "pid": _PID, "ts": t * scale, "args": {"bytes": value}}
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
