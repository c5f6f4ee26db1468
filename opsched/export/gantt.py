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
>>> write_gantt(schedule, "timeline.pdf")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
opsched.errors.OpschedError: cannot tell the Gantt format of 'timeline.pdf': use a .svg, .png, ... file name
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable, NamedTuple

from opsched.errors import OpschedError
from opsched.export.gantt_bars import Bar, gantt_bars  # noqa: F401 - the bars are part of this module's API
from opsched.export.gantt_html import write_html
from opsched.export.gantt_image import write_image
from opsched.export.gantt_trace import write_trace
from opsched.schedule import Schedule

__all__ = ["GANTT_FORMATS", "Bar", "GanttFormat", "can_draw_images", "gantt_format", "gantt_bars", "write_gantt", "write_html", "write_image", "write_trace"]


class GanttFormat(NamedTuple):
    """A Gantt timeline's file format: the suffixes that name it and its writer."""

    #: the file suffixes that choose it, lower case, the first the usual one
    suffixes: tuple[str, ...]
    #: what it is, in words (help texts)
    what: str
    #: writes a schedule to a path: ``write(schedule, path, title=..., step_time=...)``
    write: Callable[..., Path]
    #: other suffixes taken for it, never shown (.htm)
    aliases: tuple[str, ...] = ()


#: every Gantt format, in the order help texts list them: the one map ``opsched gantt`` and :func:`write_gantt` read
GANTT_FORMATS = (
    GanttFormat((".svg", ".png"), "a matplotlib picture", write_image),
    GanttFormat((".html",), "one page with hover details, zoom and pan, no network needed", write_html, (".htm",)),
    GanttFormat((".json",), "a Perfetto / chrome://tracing trace", write_trace),
)

#: the suffixes in words, for help texts and refusals: ".svg, .png, .html or .json"
SUFFIXES_TEXT = (lambda every: ", ".join(every[:-1]) + " or " + every[-1])(
    [suffix for fmt in GANTT_FORMATS for suffix in fmt.suffixes])


def gantt_format(path: str | os.PathLike) -> GanttFormat:
    """The format the suffix of ``path`` names, or :class:`OpschedError` saying which suffixes there are.

    >>> gantt_format("out/gantt.PNG").what
    'a matplotlib picture'
    """
    suffix = Path(path).suffix.lower()
    for fmt in GANTT_FORMATS:
        if suffix in fmt.suffixes + fmt.aliases:
            return fmt
    raise OpschedError(f"cannot tell the Gantt format of {str(path)!r}: use a {SUFFIXES_TEXT} file name")


def write_gantt(
    schedule: Schedule, path: str | os.PathLike, *, title: str | None = None, step_time: float | None = None
) -> Path:
    """Write a Gantt timeline in the format named by the suffix of ``path`` (:data:`GANTT_FORMATS`).

    ``step_time`` (seconds: the makespan plus the once-per-step gradient
    sync, plan.json's ``step_time``) joins the makespan in the title when given.
    """
    return gantt_format(path).write(schedule, path, title=title, step_time=step_time)


def can_draw_images() -> bool:
    """Whether matplotlib (the ``pictures`` extra) is installed, so SVG/PNG can be drawn."""
    return importlib.util.find_spec("matplotlib") is not None
