"""A self-contained HTML page of a timed schedule: inline SVG, hover details, no network.

The page needs nothing but a browser: the chart is inline SVG (no external
script, style sheet or font), each bar carries a ``<title>`` so hovering
shows its stage, microbatch, pass and times, and a few lines of inline
JavaScript highlight every bar of the hovered microbatch. The plan itself
(:func:`opsched.export.plan_json.plan_dict`) is embedded as JSON in a
``<script type="application/json" id="plan">`` element for other tools.
"""

from __future__ import annotations

import json
import math
import os
from html import escape
from pathlib import Path

from opsched.export.gantt_bars import (
    PASS_COLOURS,
    PASS_NAMES,
    bar_colour,
    gantt_bars,
    job_description,
    lighten,
    title_text,
)
from opsched.export.plan_json import plan_dict
from opsched.fileio import write_text
from opsched.schedule import PASSES, Schedule, metrics

CHART_WIDTH = 1200  # pixels of the time axis
ROW = 30
LEFT, TOP = 80, 20


def nice_ticks(end: float, target: int = 10) -> list[float]:
    """About ``target`` round tick values from 0 to ``end`` (steps of 1, 2 or 5 times a power of ten).

    >>> nice_ticks(69)
    [0, 10, 20, 30, 40, 50, 60]
    """
    if end <= 0:
        return [0]
    raw = end / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw)
    count = int(end / step + 1e-9)
    return [round(i * step, 12) if not float(i * step).is_integer() else int(i * step) for i in range(count + 1)]


def svg_chart(schedule: Schedule) -> str:
    """The inline ``<svg>`` element (no xmlns needed inside HTML)."""
    sg = schedule.stage_graph
    n = sg.num_devices or 1
    bars = gantt_bars(schedule)
    makespan = max((b.end for b in bars), default=1.0) or 1.0
    scale = CHART_WIDTH / makespan
    height = TOP + n * ROW + 40
    out = [f'<svg width="{LEFT + CHART_WIDTH + 20}" height="{height}" role="img" font-family="sans-serif" font-size="11">']
    for t in nice_ticks(makespan):
        x = LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{TOP}" x2="{x:.2f}" y2="{TOP + n * ROW}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x:.2f}" y="{TOP + n * ROW + 16}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{LEFT + CHART_WIDTH / 2}" y="{TOP + n * ROW + 34}" text-anchor="middle">time</text>')
    for d in range(n):
        out.append(f'<text x="{LEFT - 8}" y="{TOP + d * ROW + ROW / 2 + 4}" text-anchor="end">device {d}</text>')
    for b in bars:
        halves = b.events if b.is_pair else b.events[:1]
        part = (ROW - 6) / len(halves)
        x, w = LEFT + b.start * scale, max((b.end - b.start) * scale, 0.5)
        for k, e in enumerate(halves):
            y = TOP + b.device * ROW + 3 + k * part
            stroke = 'stroke="#000" stroke-width="1"' if b.is_pair else 'stroke="#fff" stroke-width="0.5"'
            tip = escape(job_description(e, schedule))
            out.append(
                f'<g class="job mb{e.microbatch}" data-mb="{e.microbatch}">'
                f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{part:.2f}" fill="{bar_colour(e.pass_, b.chunks[k])}" {stroke}>'
                f"<title>{tip}</title></rect>"
            )
            label = str(e.microbatch)
            if w >= 6.5 * len(label) + 3 and part >= 10:
                colour = "#fff" if b.chunks[k] == 0 else "#000"
                out.append(
                    f'<text x="{x + w / 2:.2f}" y="{y + part / 2 + 3.5:.2f}" text-anchor="middle" fill="{colour}" '
                    f'font-size="{10 if part >= 14 else 8}" pointer-events="none">{label}</text>'
                )
            out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.2em; }
.job.dim rect { opacity: 0.25; }
.legend span { display: inline-block; margin-right: 1.2em; }
.legend i { display: inline-block; width: 1em; height: 1em; vertical-align: middle; margin-right: 0.3em; border: 1px solid #fff; }
table { border-collapse: collapse; margin-top: 1em; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
"""

# hovering a bar dims every bar of another microbatch
_SCRIPT = """
document.querySelectorAll('.job').forEach(function (g) {
  g.addEventListener('mouseenter', function () {
    var mb = g.getAttribute('data-mb');
    document.querySelectorAll('.job').forEach(function (h) {
      h.classList.toggle('dim', h.getAttribute('data-mb') !== mb);
    });
  });
  g.addEventListener('mouseleave', function () {
    document.querySelectorAll('.job.dim').forEach(function (h) { h.classList.remove('dim'); });
  });
});
"""


def html_page(schedule: Schedule, *, title: str | None = None) -> str:
    """The whole page as a string."""
    m = metrics(schedule)
    heading = escape(title_text(schedule, title, m))
    used = sorted({e.pass_ for e in schedule.events}, key=PASSES.index)
    legend = "".join(
        f'<span><i style="background:{PASS_COLOURS[p]}"></i>{p} {escape(PASS_NAMES[p])}</span>' for p in used
    )
    if any(max(b.chunks) > 0 for b in gantt_bars(schedule)):
        legend += f'<span><i style="background:{lighten("#777777", 0.45)}"></i>lighter: 2nd stage on the device</span>'
    if any(e.pair is not None for e in schedule.events):
        legend += '<span><i style="background:#fff;border-color:#000"></i>overlapped F&amp;B pair (top/bottom halves)</span>'
    rows = "".join(
        f"<tr><td>{d}</td><td>{m.busy[d]:.6g}</td><td>{m.idle[d]:.6g}</td>"
        f"<td>{m.peak_activation_bytes[d]:.6g}</td><td>{m.param_bytes[d]:.6g}</td></tr>"
        for d in range(len(m.busy))
    )
    data = json.dumps(plan_dict(schedule, m), allow_nan=False).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{heading}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>{heading}</h1>
<p class="legend">{legend}</p>
<p>Hover a bar for its stage, microbatch, pass and times; the other microbatches dim.</p>
{svg_chart(schedule)}
<table>
<tr><th>device</th><th>busy</th><th>idle</th><th>peak activation bytes</th><th>parameter bytes</th></tr>
{rows}
</table>
<p>bubble ratio {m.bubble_ratio:.4f}, transferred bytes {m.transferred_bytes:.6g}, parameter copies {m.param_copies:.3g}</p>
<script type="application/json" id="plan">{data}</script>
<script>{_SCRIPT}</script>
</body>
</html>
"""


def write_html(schedule: Schedule, path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Write the page atomically."""
    return write_text(path, html_page(schedule, title=title))
