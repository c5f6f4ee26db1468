"""report.html: one self-contained page of a plan, beside report.md.

The summary ``opsched plan`` prints; the StageGraph drawn as a graph
(:mod:`opsched.export.stage_graph_svg`: branches side by side, nodes in their
device group's colour, as the Gantt's row strips); the interactive Gantt
(:func:`opsched.export.gantt_html.gantt_section`, its zoom, pan and hover box);
the plan's step time against every baseline's as a bar chart; and every layout
the search tried. Inline SVG, CSS and script only: no network, no file beside it.
Every figure drawn fits a 1,280-pixel window (the SVGs shrink with the window,
long words in tables wrap).

The page is built from a :class:`ReportPage` (typed rows, no planner types),
which :func:`opsched.plan.report_page.report_page` makes from a plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from opsched.export.gantt_bars import PASS_COLOURS, TITLE_JOIN, title_text
from opsched.export.gantt_html import _STYLE, CHART_SCRIPTS, embedded_plan, gantt_section, heading_html, nice_ticks
from opsched.export.stage_graph_svg import stage_graph_svg
from opsched.fileio import write_text
from opsched.schedule import Schedule, metrics
from opsched.schedule.shape import shape_lines
from opsched.units import column_time_unit, plain

#: the bar chart's parts, in pixels: method names, bars, the figure after each bar
NAMES_W, BARS_W, FIGURE_W = 300, 700, 90
BAR_ROW = 24
OTHER_BAR = "#9aa7b4"  # a baseline's bar; the plan's is the forward pass's blue


@dataclass(frozen=True)
class MethodRow:
    """A bar of the chart: a method (the plan or a baseline), its layout and step time (s)."""

    method: str
    layout: str
    step_time: float
    chosen: bool = False


@dataclass(frozen=True)
class LayoutTried:
    """A row of the layouts tried: what the search did with one candidate layout (times in seconds)."""

    source: str
    layout: str
    status: str
    estimate: float | None = None
    makespan: float | None = None
    step_time: float | None = None
    bubble_ratio: float | None = None
    lower_bound: float | None = None
    gap: float | None = None


@dataclass(frozen=True)
class ReportPage:
    """Everything report.html shows. ``title`` heads the page (and the Gantt), ``summary`` is the plan's summary
    as printed, ``notes`` says what each stage holds (stage id -> a line)."""

    title: str
    summary: str
    schedule: Schedule
    step_time: float
    methods: tuple[MethodRow, ...]
    refused: tuple[tuple[str, str], ...] = ()
    layouts: tuple[LayoutTried, ...] = ()
    notes: dict[int, str] = field(default_factory=dict)


_PAGE_STYLE = """
body { max-width: 1240px; }
h2 { font-size: 1.05em; margin-top: 1.6em; }
pre.summary { white-space: pre-wrap; overflow-wrap: anywhere; background: #f6f6f6; padding: 0.6em; font-size: 0.85em; }
table { max-width: 100%; }
td { white-space: nowrap; }
td.text { text-align: left; white-space: normal; overflow-wrap: break-word; }
"""


#: hovering a stage node dims every bar of the Gantt but that stage's
STAGE_LINK_SCRIPT = """
document.querySelectorAll('#stage-graph .stage-node').forEach(function (node) {
  node.addEventListener('mouseenter', function () {
    var stage = node.getAttribute('data-stage');
    document.querySelectorAll('#chart .job').forEach(function (g) {
      g.classList.toggle('dim', g.getAttribute('data-stage') !== stage);
    });
  });
  node.addEventListener('mouseleave', function () {
    document.querySelectorAll('#chart .job.dim').forEach(function (g) { g.classList.remove('dim'); });
  });
});
"""


def methods_svg(methods: tuple[MethodRow, ...]) -> str:
    """The plan against every baseline: one horizontal bar per method, its step time at the end, from 0 up."""
    unit = column_time_unit([m.step_time for m in methods])
    longest = max((m.step_time for m in methods), default=0.0) or 1.0
    top = 8
    height = top + BAR_ROW * len(methods) + 34
    width = NAMES_W + BARS_W + FIGURE_W
    out = [f'<svg id="methods" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'style="max-width:100%;height:auto" role="img" font-family="sans-serif" font-size="11">']
    bottom = top + BAR_ROW * len(methods)
    for t in nice_ticks(longest / unit.size, 8):
        x = NAMES_W + t * unit.size / longest * BARS_W
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#e4e4e4"/>'
                   f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">{plain(t)}</text>')
    out.append(f'<text x="{NAMES_W + BARS_W / 2}" y="{bottom + 30}" text-anchor="middle">step time ({unit.name})</text>')
    for k, m in enumerate(methods):
        y = top + k * BAR_ROW
        name = f"{m.method} ({m.layout})"
        shown = name if len(name) <= 48 else name[:47] + "…"
        w = max(m.step_time / longest * BARS_W, 1.0)
        colour = PASS_COLOURS["F"] if m.chosen else OTHER_BAR
        weight = ' font-weight="bold"' if m.chosen else ""
        out.append(f'<g class="method-bar"><title>{escape(name)}: step time {unit.text(m.step_time)}</title>'
                   f'<text x="{NAMES_W - 6}" y="{y + BAR_ROW / 2 + 4}" text-anchor="end"{weight}>{escape(shown)}</text>'
                   f'<rect x="{NAMES_W}" y="{y + 3}" width="{w:.1f}" height="{BAR_ROW - 6}" fill="{colour}"/>'
                   f'<text x="{NAMES_W + w + 4:.1f}" y="{y + BAR_ROW / 2 + 4}">{unit.text(m.step_time)}</text></g>')
    out.append("</svg>")
    return "\n".join(out)


def layouts_table(layouts: tuple[LayoutTried, ...]) -> str:
    """Every layout the search tried and how far it got, times in one unit per page."""
    unit = column_time_unit([v for c in layouts for v in (c.estimate, c.makespan, c.step_time, c.lower_bound)
                             if v is not None])
    t = lambda v: "-" if v is None else unit.number(v)  # noqa: E731
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    rows = "".join(f'<tr><td class="text">{escape(c.source)}</td><td class="text">{escape(c.layout)}</td>'
                   f'<td class="text">{escape(c.status)}</td><td>{t(c.estimate)}</td><td>{t(c.makespan)}</td>'
                   f'<td>{t(c.step_time)}</td><td>{f(c.bubble_ratio)}</td><td>{t(c.lower_bound)}</td>'
                   f'<td>{f(c.gap)}</td></tr>' for c in layouts)
    return (f'<table id="layouts"><tr><th>source</th><th>layout</th><th>status</th><th>estimate ({unit.name})</th>'
            f'<th>makespan ({unit.name})</th><th>step time ({unit.name})</th><th>bubbles</th>'
            f'<th>lower bound ({unit.name})</th><th>gap</th></tr>{rows}</table>')


def report_html(page: ReportPage) -> str:
    """The whole page as a string."""
    schedule = page.schedule
    heading = title_text(schedule, page.title, metrics(schedule), page.step_time)
    shape = "".join(f"<li>{escape(name)}: {escape(line)}</li>" for name, line in shape_lines(schedule))
    refused = "".join(f"<li>{escape(method)}: {escape(why)}</li>" for method, why in page.refused)
    best = [m for m in page.methods if not m.chosen]
    versus = (f"<p>Speed-up over the best baseline ({escape(best[0].method)}): "
              f"{best[0].step_time / page.step_time:.3f}x</p>" if best and page.step_time > 0 else
              "<p>No hand-written baseline fits in this memory on any contiguous split.</p>")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{escape(heading.replace(chr(10), TITLE_JOIN))}</title>
<style>{_STYLE}{_PAGE_STYLE}</style>
</head>
<body>
<h1>{heading_html(heading)}</h1>
<pre class="summary">{escape(page.summary)}</pre>
<h2>Stage graph</h2>
<ul>{shape}</ul>
<p>One node per stage, in the colour of its device group (the strips by the Gantt's rows); inputs to the left,
branches that run side by side in lanes of their own; a dashed outline is a copy of another stage. Hover a node
for its devices, pass times and what it holds; the Gantt below then shows that stage's bars alone.</p>
{stage_graph_svg(schedule, page.notes)}
<h2>Schedule</h2>
{gantt_section(schedule)}
<h2>The plan against every baseline</h2>
<p>Step time (makespan + gradient sync) of each method on the same model, cluster and memory limit; shorter is
faster. Baselines run on the best contiguous layer split (report.md says how).</p>
{methods_svg(page.methods)}
{versus}
{f"<p>Refused:</p><ul>{refused}</ul>" if refused else ""}
<h2>Layouts tried</h2>
{layouts_table(page.layouts)}
{embedded_plan(schedule)}
<script>{CHART_SCRIPTS}{STAGE_LINK_SCRIPT}</script>
</body>
</html>
"""


def write_report_html(page: ReportPage, path: str | os.PathLike) -> Path:
    """Write the page atomically."""
    return write_text(path, report_html(page))
