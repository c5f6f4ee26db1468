"""Gantt timelines of a timed schedule: Perfetto trace JSON, SVG/PNG (matplotlib), self-contained HTML.

:func:`write_gantt` picks the format from the file suffix:

* ``.json`` -- chrome://tracing / Perfetto trace (:func:`write_trace`);
* ``.svg`` / ``.png`` -- a matplotlib picture (:func:`write_image`);
* ``.html`` -- one page with an inline SVG and hover details, no network needed (:func:`write_html`).

All writers are atomic (temporary file, then rename). What the three share
(the bars to draw, colours, the title) lives in :mod:`opsched.export.gantt_bars`,
which they import instead of this module, so the dispatch here imports them
without a cycle. matplotlib is imported only when a picture is drawn.

>>> from opsched.schedule import chain_stage_graph, simulate, Schedule, Job
>>> sg = chain_stage_graph(1)
>>> schedule = Schedule(sg, 1, simulate(sg, {0: [Job(0, 0, "F"), Job(0, 0, "B")]}, 1))
>>> write_gantt(schedule, "timeline.pdf")
Traceback (most recent call last):
...
opsched.errors.OpschedError: cannot tell the Gantt format of 'timeline.pdf': use a .svg, .png, .html or .json (Perfetto) file name
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from opsched.errors import OpschedError
from opsched.export.gantt_bars import Bar, gantt_bars  # noqa: F401 - the bars are part of this module's API
from opsched.export.gantt_html import write_html
from opsched.export.gantt_image import write_image
from opsched.export.gantt_trace import write_trace
from opsched.schedule import Schedule

__all__ = ["Bar", "can_draw_images", "gantt_bars", "write_gantt", "write_html", "write_image", "write_trace"]


def write_gantt(
    schedule: Schedule, path: str | os.PathLike, *, title: str | None = None, step_time: float | None = None
) -> Path:
    """Write a Gantt timeline in the format named by the suffix of ``path`` (.json, .svg, .png, .html).

    ``step_time`` (seconds: the makespan plus the once-per-step gradient
    sync, plan.json's ``step_time``) joins the makespan in the title when given.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return write_trace(schedule, path, title=title, step_time=step_time)
    if suffix in (".svg", ".png"):
        return write_image(schedule, path, title=title, step_time=step_time)
    if suffix in (".html", ".htm"):
        return write_html(schedule, path, title=title, step_time=step_time)
    raise OpschedError(f"cannot tell the Gantt format of {str(path)!r}: use a .svg, .png, .html or .json (Perfetto) file name")


def can_draw_images() -> bool:
    """Whether matplotlib (the ``pictures`` extra) is installed, so SVG/PNG can be drawn."""
    return importlib.util.find_spec("matplotlib") is not None
