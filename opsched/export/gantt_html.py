"""A self-contained HTML page of a timed schedule: inline SVG, hover details, zoom and pan, no network.

The page needs nothing but a browser: the chart is inline SVG (no external
script, style sheet or font). Each bar carries a ``<title>``, so hovering
shows its stage, microbatch, pass and times with their unit, and every bar
wide enough shows its microbatch number. A few lines of inline JavaScript
highlight every bar of the hovered microbatch and zoom the time axis: the
mouse wheel zooms around the pointer, dragging pans, a double click (or the
"whole step" button) shows the whole step again, and the keys + - 0 and the
arrows do the same. Zooming redraws the axis ticks and labels the bars that
became wide enough, by the same rule as the static chart
(:func:`opsched.export.gantt_bars.label_font`). The plan itself
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
    DIGIT_EM,
    LABEL_PAD_PX,
    PASS_COLOURS,
    PASS_NAMES,
    TITLE_JOIN,
    bar_colour,
    chart_time_unit,
    device_groups,
    device_rows,
    gantt_bars,
    job_description,
    label_font,
    lighten,
    row_label,
    title_text,
)
from opsched.export.plan_json import plan_dict
from opsched.fileio import write_text
from opsched.schedule import PASSES, Schedule, cached_on, metrics
from opsched.units import Unit, bytes_text, column_size_unit, plain, ranges_text

CHART_WIDTH = 1200  # pixels of the time axis
ROW = 30
LEFT, TOP = 130, 20  # room for a row label such as "devices 12288-16383"
#: label font sizes in pixels, largest first (the smaller ones fit two-digit microbatches on narrow bars)
LABEL_FONTS_PX = (10.0, 8.0, 7.0)
#: ticks the axis aims at, at any zoom
TICKS = 10


def nice_ticks(end: float, target: int = TICKS) -> list[float]:
    """About ``target`` round tick values from 0 to ``end`` (steps of 1, 2 or 5 times a power of ten).

    The page's script (``niceTicks`` in :data:`CHART_MATH_JS`) follows the
    same rule for a zoomed window.

    >>> nice_ticks(69)
    [0, 10, 20, 30, 40, 50, 60]
    """
    if end <= 0:
        return [0]
    raw = end / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw * (1 - 1e-9))  # a tie is not lost to rounding
    count = int(end / step + 1e-9)
    return [round(i * step, 12) if not float(i * step).is_integer() else int(i * step) for i in range(count + 1)]


def svg_chart(schedule: Schedule, unit: Unit | None = None) -> str:
    """The inline ``<svg>`` element (no xmlns needed inside HTML); times on the axis in ``unit``.

    The ``data-*`` attributes of the ``<svg>`` and of each ``.job`` group
    (its start and end in seconds) are what the zoom script redraws from.
    """
    # one row per run of devices that host the same stages (a group's devices draw the same bars)
    rows = device_rows(schedule) or [(0,)]
    row_of = {row[0]: r for r, row in enumerate(rows)}
    n = len(rows)
    unit = unit or chart_time_unit(schedule)
    bars = gantt_bars(schedule, row_of)
    makespan = max((b.end for b in bars), default=1.0) or 1.0
    scale = CHART_WIDTH / makespan
    bottom = TOP + n * ROW
    height = bottom + 40
    width = LEFT + CHART_WIDTH + 20
    out = [
        # drawn at its own size, and narrower in a narrower window (viewBox; the zoom script reads the ratio)
        f'<svg id="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'style="max-width:100%;height:auto" role="img" font-family="sans-serif" '
        f'font-size="11" data-left="{LEFT}" data-width="{CHART_WIDTH}" data-top="{TOP}" data-bottom="{bottom}" '
        f'data-end="{makespan!r}" data-unit-size="{unit.size!r}">',
        # bars and labels outside the plot area (when zoomed in) are cut off at its edges
        f'<defs><clipPath id="plot-area"><rect x="{LEFT}" y="0" width="{CHART_WIDTH}" height="{height}"/></clipPath></defs>',
        '<g id="ticks">',
    ]
    for t in nice_ticks(makespan / unit.size):
        x = LEFT + t * unit.size * scale
        out.append(f'<line x1="{x:.2f}" y1="{TOP}" x2="{x:.2f}" y2="{bottom}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x:.2f}" y="{bottom + 16}" text-anchor="middle">{plain(t)}</text>')
    out.append("</g>")
    out.append(f'<text x="{LEFT + CHART_WIDTH / 2}" y="{bottom + 34}" text-anchor="middle">time ({unit.name})</text>')
    colours = device_groups(schedule)
    sg = schedule.stage_graph
    for r, row in enumerate(rows):
        out.append(f'<text class="row-label" x="{LEFT - 12}" y="{TOP + r * ROW + ROW / 2 + 4}" '
                   f'text-anchor="end">{row_label(row)}</text>')
        # a strip in the colour of each device group the row's devices belong to, as the report's stage graph
        groups = list(dict.fromkeys(sg.stage(sid).devices for sid in sg.stages_on(row[0])))
        for k, group in enumerate(groups):
            part = (ROW - 6) / len(groups)
            out.append(f'<rect class="group" x="{LEFT - 8}" y="{TOP + r * ROW + 3 + k * part:.2f}" width="5" '
                       f'height="{part:.2f}" fill="{colours[group]}" stroke="#888" stroke-width="0.5"><title>devices {ranges_text(group)}</title></rect>')
    out.append('<g id="bars" clip-path="url(#plot-area)">')
    for b in bars:
        halves = b.events if b.is_pair else b.events[:1]
        part = (ROW - 6) / len(halves)
        x, w = LEFT + b.start * scale, max((b.end - b.start) * scale, 0.5)
        for k, e in enumerate(halves):
            y = TOP + row_of[b.device] * ROW + 3 + k * part
            stroke = 'stroke="#000" stroke-width="1"' if b.is_pair else 'stroke="#fff" stroke-width="0.5"'
            tip = escape(job_description(e, schedule, unit))
            label = str(e.microbatch)
            size = label_font(label, w, part, LABEL_FONTS_PX)
            # every bar has its label, hidden where it does not fit, so zooming in can show it
            shown = f'font-size="{size:g}"' if size else f'font-size="{LABEL_FONTS_PX[-1]:g}" visibility="hidden"'
            colour = "#fff" if b.chunks[k] == 0 else "#000"
            out.append(
                f'<g class="job mb{e.microbatch}" data-mb="{e.microbatch}" data-stage="{e.stage}" '
                f'data-row="{row_of[b.device]}" '
                f'data-t0="{b.start!r}" data-t1="{b.end!r}">'
                f'<rect class="bar" x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{part:.2f}" '
                f'fill="{bar_colour(e.pass_, b.chunks[k])}" {stroke}><title>{tip}</title></rect>'
                f'<text x="{x + w / 2:.2f}" y="{y + part / 2:.2f}" text-anchor="middle" dominant-baseline="central" '
                f'fill="{colour}" {shown} pointer-events="none">{label}</text></g>'
            )
    out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.2em; }
.job.dim rect { opacity: 0.25; }
#chart { cursor: grab; user-select: none; touch-action: none; }
#chart.panning { cursor: grabbing; }
.legend span { display: inline-block; margin-right: 1.2em; }
.legend i { display: inline-block; width: 1em; height: 1em; vertical-align: middle; margin-right: 0.3em; border: 1px solid #fff; }
.zoom button { margin-right: 0.4em; }
.zoom output { margin-left: 0.8em; color: #555; }
h1 small { display: block; font-size: 0.8em; font-weight: normal; color: #444; margin-top: 0.2em; }
#tip { position: fixed; display: none; max-width: 36em; padding: 3px 6px; background: #fffff0; border: 1px solid #888;
       font-size: 0.85em; pointer-events: none; z-index: 10; }
table { border-collapse: collapse; margin-top: 1em; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
"""

#: the chart's rules in script form, apart from the page so a test can run them: the tick rule of
#: :func:`nice_ticks` for any window, and :func:`opsched.export.gantt_bars.label_font` with its constants
CHART_MATH_JS = f"""
var DIGIT_EM = {DIGIT_EM!r}, LABEL_PAD = {LABEL_PAD_PX!r}, LABEL_FONTS = {json.dumps(list(LABEL_FONTS_PX))};
function niceTicks(a, b, target) {{
  var span = b - a;
  if (!(span > 0)) {{ return [a]; }}
  var raw = span / target, mag = Math.pow(10, Math.floor(Math.log10(raw))), step = 10 * mag;
  [1, 2, 5].forEach(function (k) {{ if (k * mag >= raw * (1 - 1e-9) && k * mag < step) {{ step = k * mag; }} }});
  var ticks = [];
  for (var i = Math.ceil(a / step - 1e-9); i <= Math.floor(b / step + 1e-9); i++) {{
    ticks.push(+(i * step).toPrecision(12));
  }}
  return {{ticks: ticks, step: step}};
}}
function tickText(value, step) {{
  var decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  return value.toLocaleString('en-US', {{minimumFractionDigits: decimals, maximumFractionDigits: decimals}});
}}
function labelFont(chars, width, height) {{
  for (var i = 0; i < LABEL_FONTS.length; i++) {{
    var size = LABEL_FONTS[i];
    if (DIGIT_EM * size * chars + LABEL_PAD <= width && size <= height) {{ return size; }}
  }}
  return 0;
}}
"""

# hovering a bar dims every bar of another microbatch; the wheel, a drag, buttons and keys zoom and pan the time axis
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
(function () {
  var svg = document.getElementById('chart');
  if (!svg) { return; }
  var NS = svg.namespaceURI, d = svg.dataset;
  var LEFT = +d.left, WIDTH = +d.width, TOP = +d.top, BOTTOM = +d.bottom, END = +d.end, UNIT = +d.unitSize;
  var MIN_SPAN = END / 1e4;  // deep enough to read one job of ten thousand per device
  var ticks = document.getElementById('ticks'), shown = document.getElementById('zoom-window');
  var jobs = Array.prototype.map.call(svg.querySelectorAll('.job'), function (g) {
    var rect = g.querySelector('rect'), text = g.querySelector('text');
    return {t0: +g.dataset.t0, t1: +g.dataset.t1, rect: rect, text: text,
            height: +rect.getAttribute('height'), chars: text.textContent.length};
  });
  var v0 = 0, v1 = END;

  function render() {
    var scale = WIDTH / (v1 - v0);
    jobs.forEach(function (j) {
      var x = LEFT + (j.t0 - v0) * scale, w = Math.max((j.t1 - j.t0) * scale, 0.5);
      j.rect.setAttribute('x', x.toFixed(2));
      j.rect.setAttribute('width', w.toFixed(2));
      j.text.setAttribute('x', (x + w / 2).toFixed(2));
      var size = labelFont(j.chars, w, j.height);
      j.text.setAttribute('visibility', size ? 'visible' : 'hidden');
      if (size) { j.text.setAttribute('font-size', size); }
    });
    while (ticks.firstChild) { ticks.removeChild(ticks.firstChild); }
    var found = niceTicks(v0 / UNIT, v1 / UNIT, 10);
    found.ticks.forEach(function (t) {
      var x = (LEFT + (t * UNIT - v0) * scale).toFixed(2);
      var line = document.createElementNS(NS, 'line');
      [['x1', x], ['x2', x], ['y1', TOP], ['y2', BOTTOM], ['stroke', '#e4e4e4']].forEach(function (a) {
        line.setAttribute(a[0], a[1]);
      });
      var label = document.createElementNS(NS, 'text');
      [['x', x], ['y', BOTTOM + 16], ['text-anchor', 'middle']].forEach(function (a) { label.setAttribute(a[0], a[1]); });
      label.textContent = tickText(t, found.step);
      ticks.appendChild(line);
      ticks.appendChild(label);
    });
    if (shown) {
      var whole = v0 <= 0 && v1 >= END;
      shown.textContent = whole ? 'the whole step' : 'showing ' + tickText(v0 / UNIT, found.step / 10) + ' to ' +
        tickText(v1 / UNIT, found.step / 10) + ' ' + shown.dataset.unit;
    }
  }
  function setWindow(a, b) {
    var span = Math.min(END, Math.max(MIN_SPAN, b - a));
    a = Math.min(Math.max(0, a), END - span);
    v0 = a; v1 = a + span;
    render();
  }
  function zoomAt(t, factor) {
    var span = Math.min(END, Math.max(MIN_SPAN, (v1 - v0) * factor));
    setWindow(t - (t - v0) * span / (v1 - v0), t - (t - v0) * span / (v1 - v0) + span);
  }
  function pixels(clientX) {  // the pointer's x in the SVG's own pixels, whatever the page zoom
    var box = svg.getBoundingClientRect();
    return (clientX - box.left) * svg.width.baseVal.value / box.width;
  }
  function timeAt(clientX) {
    var px = Math.min(Math.max(pixels(clientX), LEFT), LEFT + WIDTH);
    return v0 + (px - LEFT) / WIDTH * (v1 - v0);
  }
  svg.addEventListener('wheel', function (e) {
    e.preventDefault();
    if (e.shiftKey || Math.abs(e.deltaX) > Math.abs(e.deltaY)) {
      var delta = e.shiftKey ? e.deltaY : e.deltaX;
      setWindow(v0 + delta / WIDTH * (v1 - v0), v1 + delta / WIDTH * (v1 - v0));
    } else {
      zoomAt(timeAt(e.clientX), Math.exp(e.deltaY * 0.002));
    }
  }, {passive: false});
  var drag = null;
  svg.addEventListener('pointerdown', function (e) {
    drag = {x: pixels(e.clientX), v0: v0, v1: v1};
    svg.classList.add('panning');
    svg.setPointerCapture(e.pointerId);
  });
  svg.addEventListener('pointermove', function (e) {
    if (!drag) { return; }
    var dt = (pixels(e.clientX) - drag.x) / WIDTH * (drag.v1 - drag.v0);
    setWindow(drag.v0 - dt, drag.v1 - dt);
  });
  ['pointerup', 'pointercancel'].forEach(function (type) {
    svg.addEventListener(type, function () { drag = null; svg.classList.remove('panning'); });
  });
  svg.addEventListener('dblclick', function () { setWindow(0, END); });
  function centre() { return (v0 + v1) / 2; }
  var actions = {
    'zoom-in': function () { zoomAt(centre(), 0.5); },
    'zoom-out': function () { zoomAt(centre(), 2); },
    'zoom-reset': function () { setWindow(0, END); }
  };
  Object.keys(actions).forEach(function (id) {
    var button = document.getElementById(id);
    if (button) { button.addEventListener('click', actions[id]); }
  });
  document.addEventListener('keydown', function (e) {
    if (e.target.tagName === 'INPUT' || e.ctrlKey || e.metaKey || e.altKey) { return; }
    var step = (v1 - v0) / 10;
    var keys = {'+': actions['zoom-in'], '=': actions['zoom-in'], '-': actions['zoom-out'], '0': actions['zoom-reset'],
                'ArrowLeft': function () { setWindow(v0 - step, v1 - step); },
                'ArrowRight': function () { setWindow(v0 + step, v1 + step); }};
    if (keys[e.key]) { e.preventDefault(); keys[e.key](); }
  });
})();
"""

#: the page's own hover text: a bar's job, times and devices in a box by the pointer (the browser's own tooltip,
#: the <title> of the bar, shows late and not at all in some browsers; the <title>s stay for a page read without
#: scripts, and the script takes them out so that the two do not show at once)
TIP_SCRIPT = """
(function () {
  var svg = document.getElementById('chart');
  if (!svg) { return; }
  var tip = document.createElement('div');
  tip.id = 'tip';
  tip.setAttribute('role', 'tooltip');
  document.body.appendChild(tip);
  var labels = svg.querySelectorAll('.row-label');
  function place(e) {
    tip.style.left = Math.max(0, Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 4)) + 'px';
    tip.style.top = Math.max(0, Math.min(e.clientY + 14, window.innerHeight - tip.offsetHeight - 4)) + 'px';
  }
  svg.querySelectorAll('.job').forEach(function (g) {
    var title = g.querySelector('title'), row = labels[+g.dataset.row];
    var text = (row ? row.textContent + ': ' : '') + (title ? title.textContent : '');
    if (title) { title.parentNode.removeChild(title); }
    g.addEventListener('mouseenter', function (e) { tip.textContent = text; tip.style.display = 'block'; place(e); });
    g.addEventListener('mousemove', place);
    g.addEventListener('mouseleave', function () { tip.style.display = 'none'; });
  });
})();
"""


def heading_html(text: str) -> str:
    """A two-line title as a heading's inner HTML: the second line smaller, below the first."""
    first, _, rest = escape(text).partition("\n")
    return first + (f"<small>{rest}</small>" if rest else "")


def gantt_section(schedule: Schedule) -> str:
    """The interactive chart with its legend, help line, zoom buttons and per-row table: gantt.html's body, and
    report.html's Gantt (the page's scripts, :data:`CHART_MATH_JS`, :data:`_SCRIPT` and :data:`TIP_SCRIPT`, drive it).
    Kept on the schedule (:func:`opsched.schedule.cached_on`): the second page of a plan costs nothing more."""
    return cached_on(schedule, "gantt section", _gantt_section)


def _gantt_section(schedule: Schedule) -> str:
    m = metrics(schedule)
    unit = chart_time_unit(schedule)
    used = sorted({e.pass_ for e in schedule.events}, key=PASSES.index)
    legend = "".join(
        f'<span><i style="background:{PASS_COLOURS[p]}"></i>{p} {escape(PASS_NAMES[p])}</span>' for p in used
    )
    rows = device_rows(schedule)
    if any(max(b.chunks) > 0 for b in gantt_bars(schedule, [row[0] for row in rows])):
        legend += f'<span><i style="background:{lighten("#777777", 0.45)}"></i>lighter: 2nd stage on the device</span>'
    if any(e.pair is not None for e in schedule.events):
        legend += '<span><i style="background:#fff;border-color:#000"></i>overlapped F&amp;B pair (top/bottom halves)</span>'
    sizes = column_size_unit(list(m.peak_activation_bytes) + list(m.param_bytes))
    table = "".join(  # one line per chart row: its devices host the same stages, so have the same figures
        f"<tr><td>{ranges_text(row)}</td><td>{unit.number(m.busy[d])}</td><td>{unit.number(m.idle[d])}</td>"
        f"<td>{sizes.number(m.peak_activation_bytes[d])}</td><td>{sizes.number(m.param_bytes[d])}</td></tr>"
        for row in rows for d in row[:1]
    )
    return f"""<p class="legend">{legend}</p>
<p>Hover a bar for its devices, stage, microbatch, pass and times; the other microbatches dim. The strip by a row's name is the colour of its device group.
Zoom the time axis with the mouse wheel (or the buttons, or the keys + and -), drag to pan (or the arrow keys),
double-click (or 0) to see the whole step again.</p>
<p class="zoom"><button id="zoom-in" type="button">zoom in</button><button id="zoom-out" type="button">zoom out</button><button id="zoom-reset" type="button">whole step</button><output id="zoom-window" data-unit="{unit.name}">the whole step</output></p>
{svg_chart(schedule, unit)}
<table>
<tr><th>devices</th><th>busy ({unit.name})</th><th>idle ({unit.name})</th><th>peak activations ({sizes.name})</th><th>parameters ({sizes.name})</th></tr>
{table}
</table>
<p>bubble ratio {m.bubble_ratio:.4f}, transferred {bytes_text(m.transferred_bytes)}, parameter copies {plain(m.param_copies, 3)}</p>
"""


#: every script of a page with the chart: the rules, the zoom and the hover box
CHART_SCRIPTS = CHART_MATH_JS + _SCRIPT + TIP_SCRIPT


def embedded_plan(schedule: Schedule) -> str:
    """The plan (:func:`opsched.export.plan_json.plan_dict`) as a JSON script element, for other tools (kept on the
    schedule, as :func:`gantt_section`)."""
    return cached_on(schedule, "embedded plan", _embedded_plan)


def _embedded_plan(schedule: Schedule) -> str:
    data = json.dumps(plan_dict(schedule, metrics(schedule)), allow_nan=False).replace("</", "<\\/")
    return f'<script type="application/json" id="plan">{data}</script>'


def html_page(schedule: Schedule, *, title: str | None = None, step_time: float | None = None) -> str:
    """The whole page as a string; ``step_time`` (seconds) joins the heading when given."""
    heading = title_text(schedule, title, metrics(schedule), step_time)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{escape(heading.replace(chr(10), TITLE_JOIN))}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>{heading_html(heading)}</h1>
{gantt_section(schedule)}{embedded_plan(schedule)}
<script>{CHART_SCRIPTS}</script>
</body>
</html>
"""


def write_html(
    schedule: Schedule, path: str | os.PathLike, *, title: str | None = None, step_time: float | None = None
) -> Path:
    """Write the page atomically."""
    return write_text(path, html_page(schedule, title=title, step_time=step_time))
