"""SVG / PNG Gantt chart of a timed schedule, drawn with matplotlib (Agg backend).

One row per device (device 0 on top), one bar per job coloured by pass (F
blue, I orange, W green, B red; a device's second stage -- a later model
chunk or DualPipe's reverse direction -- in a lighter shade), the microbatch
number on bars wide enough to hold it, an overlapped F&B pair as one bar
split into its two halves (top: first job, bottom: second) with a black
outline. Time axis below, legend at the bottom, title with the method,
makespan and bubble ratio. The picture is ``width x height`` inches at
``dpi`` (no tight cropping), so a PNG is exactly ``width*dpi x height*dpi`` pixels.
"""

from __future__ import annotations

import os
from pathlib import Path

from opsched.errors import OpschedError
from opsched.export.gantt_bars import PASS_COLOURS, PASS_NAMES, bar_colour, gantt_bars, lighten, title_text
from opsched.fileio import atomic_path
from opsched.schedule import PASSES, Schedule

ROW_INCHES = 0.42


def figure_size(schedule: Schedule, width: float | None = None, height: float | None = None) -> tuple[float, float]:
    """Default size in inches: 14 wide, 1.6 + 0.42 per device high."""
    n = schedule.stage_graph.num_devices or 1
    return (width or 14.0, height or 1.6 + ROW_INCHES * n)


def write_image(
    schedule: Schedule,
    path: str | os.PathLike,
    *,
    title: str | None = None,
    width: float | None = None,
    height: float | None = None,
    dpi: int = 100,
) -> Path:
    """Draw the schedule to ``path`` (format from the suffix: .svg or .png), atomically."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in ("svg", "png"):
        raise OpschedError(f"write_image draws .svg or .png files, not {str(path)!r}")
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:  # pragma: no cover - depends on the environment
        raise OpschedError("drawing SVG/PNG needs matplotlib: pip install 'opsched[pictures]'") from None

    size = figure_size(schedule, width, height)
    # a fixed hash salt and no date keep an SVG byte-for-byte deterministic
    with matplotlib.rc_context({"svg.hashsalt": "opsched", "svg.fonttype": "path"}):
        fig = plt.figure(figsize=size, dpi=dpi)
        try:
            _draw(fig, schedule, title, Patch)
            with atomic_path(path) as tmp:
                meta = {"Date": None} if fmt == "svg" else {"Software": None}
                fig.savefig(tmp, format=fmt, dpi=dpi, metadata=meta)
        finally:
            plt.close(fig)
    return Path(path)


def _draw(fig, schedule: Schedule, title: str | None, Patch) -> None:
    sg = schedule.stage_graph
    n = sg.num_devices or 1
    bars = gantt_bars(schedule)
    makespan = max((b.end for b in bars), default=1.0) or 1.0
    width_in, height_in = fig.get_size_inches()
    # fixed margins in inches, so rows keep their size whatever the device count
    left, right, top, bottom = 0.9 / width_in, 0.2 / width_in, 0.45 / height_in, 0.95 / height_in
    ax = fig.add_axes([left, bottom, 1 - left - right, 1 - top - bottom])
    ax.set_xlim(0, makespan)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"device {d}" for d in range(n)])
    ax.set_xlabel("time")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    # a literal "$" would start matplotlib's math mode
    ax.set_title(title_text(schedule, title).replace("$", r"\$"), fontsize=11)
    px_per_unit = (1 - left - right) * width_in * fig.dpi / makespan
    font = 7.5 if n <= 16 else 6
    h = 0.8
    # one broken_barh call per (row slot, colour, outline): thousands of bars draw in one go
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for b in bars:
        halves = b.events if b.is_pair else b.events[:1]
        part = h / len(halves)
        for k, e in enumerate(halves):
            y0 = b.device - h / 2 + k * part
            key = (y0, part, bar_colour(e.pass_, b.chunks[k]), b.is_pair)
            groups.setdefault(key, []).append((b.start, b.end - b.start))
            text = str(e.microbatch)
            # label only when the bar is wide enough for the digits (about 5.5 px each at 7.5 pt)
            if (b.end - b.start) * px_per_unit >= 5.5 * len(text) + 3 and part * ROW_INCHES * fig.dpi >= 8:
                ax.text(
                    (b.start + b.end) / 2, y0 + part / 2, text, ha="center", va="center",
                    fontsize=font if not b.is_pair else font - 1, color="white" if b.chunks[k] == 0 else "black",
                )
    for (y0, part, colour, is_pair), spans in sorted(groups.items()):
        ax.broken_barh(
            spans, (y0, part), facecolors=colour,
            edgecolors="black" if is_pair else "white", linewidth=0.9 if is_pair else 0.4,
        )
    used = sorted({e.pass_ for e in schedule.events}, key=PASSES.index)
    handles = [Patch(facecolor=PASS_COLOURS[p], label=f"{p} {PASS_NAMES[p]}") for p in used]
    if any(max(b.chunks) > 0 for b in bars):
        handles.append(Patch(facecolor=lighten("#777777", 0.45), label="lighter: 2nd stage on the device"))
    if any(b.is_pair for b in bars):
        handles.append(Patch(facecolor="white", edgecolor="black", label="overlapped F&B pair (top/bottom halves)"))
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
