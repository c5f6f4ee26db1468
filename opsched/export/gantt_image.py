"""SVG / PNG Gantt chart of a timed schedule, drawn with matplotlib (Agg backend).

One row per device (device 0 on top; the devices of a group, which run the
same jobs at the same times, share one row named ``devices 0-63``), one bar per job coloured by pass (F
blue, I orange, W green, B red; a device's second stage -- a later model
chunk or DualPipe's reverse direction -- in a lighter shade), the microbatch
number on every bar wide enough to hold it (in a smaller font when the
normal one does not fit), an overlapped F&B pair as one bar split into its
two halves (top: first job, bottom: second) with a black outline. Time axis
below in the unit the makespan reads best in (µs, ms or s), legend at the
bottom, title with the method, step time (when known), makespan and bubble
ratio. The picture is ``width x height`` inches at
``dpi`` (no tight cropping), so a PNG is exactly ``width*dpi x height*dpi`` pixels.
"""

from __future__ import annotations

import os
from pathlib import Path

from opsched.errors import OpschedError
from opsched.export.gantt_bars import (
    PASS_COLOURS,
    PASS_NAMES,
    bar_colour,
    chart_time_unit,
    device_rows,
    gantt_bars,
    label_font,
    lighten,
    row_label,
    title_text,
)
from opsched.fileio import atomic_path
from opsched.schedule import PASSES, Schedule

ROW_INCHES = 0.42


def figure_size(schedule: Schedule, width: float | None = None, height: float | None = None) -> tuple[float, float]:
    """Default size in inches: 14 wide, 1.6 + 0.42 per row high (a row: the devices of one group, :func:`device_rows`)."""
    n = len(device_rows(schedule)) or 1
    return (width or 14.0, height or 1.6 + ROW_INCHES * n)


def write_image(
    schedule: Schedule,
    path: str | os.PathLike,
    *,
    title: str | None = None,
    step_time: float | None = None,
    width: float | None = None,
    height: float | None = None,
    dpi: int = 100,
) -> Path:
    """Draw the schedule to ``path`` (format from the suffix: .svg or .png), atomically.

    ``step_time`` (seconds, makespan + gradient sync) joins the title when given.
    """
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in ("svg", "png"):
        raise OpschedError(f"write_image draws .svg or .png files, not {str(path)!r}")
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter
    except ImportError:  # pragma: no cover - depends on the environment
        raise OpschedError("drawing SVG/PNG needs matplotlib: pip install 'opsched[pictures]'") from None

    size = figure_size(schedule, width, height)
    # a fixed hash salt and no date keep an SVG byte-for-byte deterministic
    with matplotlib.rc_context({"svg.hashsalt": "opsched", "svg.fonttype": "path"}):
        fig = plt.figure(figsize=size, dpi=dpi)
        try:
            _draw(fig, schedule, title, step_time, Patch, FuncFormatter)
            with atomic_path(path) as tmp:
                meta = {"Date": None} if fmt == "svg" else {"Software": None}
                fig.savefig(tmp, format=fmt, dpi=dpi, metadata=meta)
        finally:
            plt.close(fig)
    return Path(path)


#: above this many bars an SVG holds them as one embedded image at the figure's dpi (text, axes and legend stay
#: vectors): each bar as its own path costs about 0.2 ms to write (3 s for a 16,384-job plan) and swells the file;
#: gantt.html keeps every bar a vector, to zoom
VECTOR_BARS = 4000


def _draw(fig, schedule: Schedule, title: str | None, step_time: float | None, Patch, FuncFormatter) -> None:
    rows = device_rows(schedule) or [(0,)]
    n = len(rows)
    row_of = {row[0]: k for k, row in enumerate(rows)}  # the devices of a row draw the same bars: the first's are drawn
    bars = gantt_bars(schedule, row_of)
    makespan = max((b.end for b in bars), default=1.0) or 1.0
    width_in, height_in = fig.get_size_inches()
    # fixed margins in inches, so rows keep their size whatever the device count
    labels = [row_label(row) for row in rows]
    # the left margin holds the longest row name ("devices 960-1023" is about 1.3 inches at 10 pt)
    left_in = max(0.9, 0.2 + 0.075 * max(len(t) for t in labels))
    heading = title_text(schedule, title, step_time=step_time)
    # 0.45 inches hold a line of the title; each further line takes 0.2 more (11 pt)
    top_in = 0.45 + 0.2 * heading.count("\n")
    left, right, top, bottom = left_in / width_in, 0.2 / width_in, top_in / height_in, 0.95 / height_in
    ax = fig.add_axes([left, bottom, 1 - left - right, 1 - top - bottom])
    ax.set_xlim(0, makespan)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(n))
    ax.set_yticklabels(labels)
    unit = chart_time_unit(schedule)
    ax.set_xlabel(f"time ({unit.name})")
    # tick labels in the chart's unit; a formatter of its own also keeps matplotlib's "1e-5" offset text away
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: unit.number(x)))
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    # a literal "$" would start matplotlib's math mode
    ax.set_title(heading.replace("$", r"\$"), fontsize=11)
    px_per_second = (1 - left - right) * width_in * fig.dpi / makespan
    row_px = (1 - top - bottom) * height_in * fig.dpi / n
    # label fonts in points, largest first: the smaller one labels bars too narrow for the first (two-digit microbatches)
    fonts_pt = (7.5, 6.0) if n <= 16 else (6.0, 5.0)
    pt_to_px = fig.dpi / 72
    h = 0.8
    # one broken_barh call per (row slot, colour, outline): thousands of bars draw in one go
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for b in bars:
        halves = b.events if b.is_pair else b.events[:1]
        part = h / len(halves)
        for k, e in enumerate(halves):
            y0 = row_of[b.device] - h / 2 + k * part
            key = (y0, part, bar_colour(e.pass_, b.chunks[k]), b.is_pair)
            groups.setdefault(key, []).append((b.start, b.end - b.start))
            text = str(e.microbatch)
            size_px = label_font(text, (b.end - b.start) * px_per_second, part * row_px,
                                 tuple(pt * pt_to_px for pt in fonts_pt))
            if size_px is not None:
                ax.text(
                    (b.start + b.end) / 2, y0 + part / 2, text, ha="center", va="center",
                    fontsize=size_px / pt_to_px, color="white" if b.chunks[k] == 0 else "black",
                )
    for (y0, part, colour, is_pair), spans in sorted(groups.items()):
        ax.broken_barh(
            spans, (y0, part), facecolors=colour,
            edgecolors="black" if is_pair else "white", linewidth=0.9 if is_pair else 0.4,
            rasterized=len(bars) > VECTOR_BARS,
        )
    used = sorted({e.pass_ for e in schedule.events}, key=PASSES.index)
    handles = [Patch(facecolor=PASS_COLOURS[p], label=f"{p} {PASS_NAMES[p]}") for p in used]
    if any(max(b.chunks) > 0 for b in bars):
        handles.append(Patch(facecolor=lighten("#777777", 0.45), label="lighter: 2nd stage on the device"))
    if any(b.is_pair for b in bars):
        handles.append(Patch(facecolor="white", edgecolor="black", label="overlapped F&B pair (top/bottom halves)"))
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
