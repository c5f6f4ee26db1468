"""The files of a plan (plan.json, trace.json, gantt.svg, gantt.html, report.md), written all or none."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from pathlib import Path

from opsched.export import gantt  # the module, not its names: a test stands in for can_draw_images
from opsched.export.plan_json import write_plan
from opsched.export.report_html import write_report_html
from opsched.plan.report_page import report_page
from opsched.fileio import signals_held, write_text

log = logging.getLogger(__name__)


def output_files() -> list[str]:
    """The files `opsched plan` writes; gantt.svg only where matplotlib is installed."""
    pictures = ["gantt.svg"] if gantt.can_draw_images() else []
    return ["plan.json", "trace.json", *pictures, "gantt.html", "report.md", "report.html"]


def write_outputs(out: Path, result, extra: dict, report: str, summary: str = "") -> list[str]:
    """Write every file into a temporary directory, then move them into ``out`` (no partial plan on failure).

    Returns the names written. Without matplotlib (the ``pictures`` extra) the
    SVG is skipped with a note; the HTML timeline needs no extra.
    """
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".opsched-plan-", dir=out))
    done = False
    try:
        title = f"opsched plan ({result.source}, {result.layout})"
        step = result.step_time  # the summary's headline figure; the charts show it next to the makespan
        write_plan(tmp / "plan.json", result.schedule, extra=extra)
        gantt.write_trace(result.schedule, tmp / "trace.json", title=title, step_time=step)
        names = output_files()
        if "gantt.svg" in names:
            gantt.write_image(result.schedule, tmp / "gantt.svg", title=title, step_time=step)
        else:
            log.warning("export: gantt.svg skipped (needs matplotlib: pip install 'opsched[pictures]'); "
                        "gantt.html has the picture")
        gantt.write_html(result.schedule, tmp / "gantt.html", title=title, step_time=step)
        write_text(tmp / "report.md", report)
        write_report_html(report_page(result, summary, title), tmp / "report.html")
        with signals_held():  # a stop request waits for the renames: the set is complete or absent
            for name in names:
                (tmp / name).replace(out / name)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and not done:
            with contextlib.suppress(OSError):
                out.rmdir()
    return names
