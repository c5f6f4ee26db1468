"""Gantt outputs: trace JSON fields, SVG well-formed XML, HTML self-contained, PNG size; the CLI."""

import json
import re
import shutil
import subprocess
import struct
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from opsched.cli import main
from opsched.errors import OpschedError
from opsched.export.gantt import gantt_bars, write_gantt
from opsched.export.gantt_image import write_image
from opsched.export.plan_json import write_plan
from opsched.schedule import Edge, Job, Pair, Schedule, Stage, StageGraph, chain_stage_graph, metrics, simulate


def small_schedule():
    """Three devices: a 2-device stage, a V-shaped second stage on device 0, one overlapped pair."""
    t = {"F": 1.0, "I": 1.0, "W": 1.0}
    stages = [Stage(0, (0, 1), t, name="embed"), Stage(1, (2,), t), Stage(2, (0,), t, name="head")]
    sg = StageGraph(stages, [Edge(0, 1, 0.5, 10.0), Edge(1, 2, 0.5, 10.0)], overlap_gain=0.5)
    order = {
        0: [Job(0, 0, "F"), Job(0, 1, "F"), Job(2, 0, "F"), Pair(Job(2, 1, "F"), Job(2, 0, "B")), Job(2, 1, "I"),
            Job(2, 1, "W"), Job(0, 0, "B"), Job(0, 1, "B")],
        1: [Job(0, 0, "F"), Job(0, 1, "F"), Job(0, 0, "B"), Job(0, 1, "B")],
        2: [Job(1, 0, "F"), Job(1, 1, "F"), Job(1, 0, "B"), Job(1, 1, "B")],
    }
    return Schedule(sg, 2, simulate(sg, order, 2), name="hand-made", memory_limit=10.0)


def test_bars_cover_every_device_of_a_group_and_pairs_once():
    s = small_schedule()
    bars = gantt_bars(s)
    assert sum(1 for b in bars if b.label == "0F0") == 2  # on devices 0 and 1
    pairs = [b for b in bars if b.is_pair]
    assert len(pairs) == 1 and pairs[0].label == "2F1+2B0" and pairs[0].chunk == 1
    assert all(b.chunk == 0 for b in bars if b.events[0].stage in (0, 1))


def test_trace_json_fields(tmp_path):
    s = small_schedule()
    path = write_gantt(s, tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    evs = doc["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "device 0", 1: "device 1", 2: "device 2"}  # device 0 hosts stage 2 too: its own track
    xs = [e for e in evs if e["ph"] == "X"]
    # one X event per (event, device of its stage's group)
    assert len(xs) == sum(len(s.stage_graph.stage(e.stage).devices) for e in s.events)
    f0 = [e for e in xs if e["args"] == {"stage": 0, "microbatch": 0, "pass": "F", "stage_name": "embed"}]
    assert sorted(e["tid"] for e in f0) == [0, 1]
    assert f0[0]["ts"] == 0 and f0[0]["dur"] == pytest.approx(1e6)  # plan seconds -> microseconds
    paired = [e for e in xs if "pair" in e["args"]]
    assert len(paired) == 2 and paired[0]["ts"] == paired[1]["ts"] and paired[0]["dur"] == paired[1]["dur"]
    assert any(e["ph"] == "C" for e in evs)
    assert doc["otherData"]["method"] == "hand-made"


def test_devices_hosting_the_same_stages_share_one_track_and_their_figures_are_each_devices(tmp_path):
    t = {"F": 1.0, "I": 2.0, "W": 1.0}
    sg = StageGraph([Stage(0, tuple(range(0, 512)), t, act_bytes=3.0), Stage(1, tuple(range(512, 1024)), t)],
                    [Edge(0, 1)], num_devices=1025)  # device 1024 holds nothing
    order = {d: [Job(d // 512, 0, p) for p in "FIW"] for d in range(1024)}
    s = Schedule(sg, 1, simulate(sg, order, 1), name="wide")
    doc = json.loads(write_gantt(s, tmp_path / "trace.json").read_text())
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert names == ["devices 0-511", "devices 512-1023", "device 1024"]
    assert sum(1 for e in doc["traceEvents"] if e["ph"] == "X") == 6
    m = metrics(s)  # per device, computed once per class of alike devices
    assert m.busy[0] == m.busy[511] == 4.0 and m.busy[512] == m.busy[1023] == 4.0 and m.busy[1024] == 0.0
    assert m.peak_activation_bytes[0] == m.peak_activation_bytes[511] == 3.0 and m.peak_activation_bytes[1024] == 0
    assert len(m.busy) == 1025
    html = write_gantt(s, tmp_path / "g.html").read_text()
    assert html.count("<tr><td>") == 3 and "<tr><td>0-511</td>" in html and "<tr><td>1024</td>" in html


def test_svg_is_xml_with_title(tmp_path):
    path = write_gantt(small_schedule(), tmp_path / "g.svg", title="My plan")
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    text = path.read_text()
    assert "My plan" in text and "bubble ratio" in text and "makespan" in text


def test_svg_is_deterministic(tmp_path):
    a = write_gantt(small_schedule(), tmp_path / "a.svg").read_bytes()
    b = write_gantt(small_schedule(), tmp_path / "b.svg").read_bytes()
    assert a == b


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_png_has_the_expected_pixel_size(tmp_path):
    path = write_image(small_schedule(), tmp_path / "g.png", width=6, height=2.5, dpi=40)
    assert png_size(path) == (240, 100)
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.shape[:2] == (100, 240)
    assert img[..., :3].std() > 0.05  # not a blank image


class Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.stack, self.data = [], [], []
        self.titles = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in ("meta", "br", "hr", "img", "input", "link"):  # HTML void elements have no end tag
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-3:])
        self.stack.pop()

    def handle_data(self, data):
        if self.stack and self.stack[-1] == "title":
            self.titles.append(data)
        self.data.append(data)


def test_html_is_self_contained_and_well_formed(tmp_path):
    s = small_schedule()
    path = write_gantt(s, tmp_path / "g.html")
    text = path.read_text()
    parser = Collect()
    parser.feed(text)
    parser.close()
    assert parser.stack == []
    assert "http://" not in text and "https://" not in text
    tags = [t for t, _ in parser.tags]
    bars = [a for t, a in parser.tags if t == "rect" and a.get("class") == "bar"]
    assert "svg" in tags and len(bars) == len(gantt_bars(s)) + 1  # + the pair's second half
    assert not any(t in ("link", "img", "iframe") for t in tags)
    assert not any(t == "script" and "src" in a for t, a in parser.tags)
    assert any("stage 2 (head), microbatch 1, forward F" in t for t in parser.titles)
    plan = json.loads(next(d for d in parser.data if d.startswith('{"schema"')))
    assert plan["method"] == "hand-made" and len(plan["schedule"]["events"]) == len(s.events)


def test_unknown_suffix_is_refused(tmp_path):
    from opsched.export.gantt import SUFFIXES_TEXT

    with pytest.raises(OpschedError, match=re.escape(SUFFIXES_TEXT)):
        write_gantt(small_schedule(), tmp_path / "g.pdf")
    assert list(tmp_path.iterdir()) == []


def test_cli_gantt_writes_every_format(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    write_plan(plan, small_schedule())
    from opsched.export.gantt import GANTT_FORMATS

    outs = [tmp_path / f"g{suffix}" for fmt in GANTT_FORMATS for suffix in fmt.suffixes]  # every format
    args = ["gantt", str(plan), "--title", "T1"]
    for o in outs:
        args += ["-o", str(o)]
    assert main(args) == 0
    assert all(o.exists() and o.stat().st_size > 0 for o in outs)
    assert "T1" in outs[0].read_text()


def test_cli_gantt_refuses_invalid_plan_unless_asked(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    doc = write_plan(plan, small_schedule())
    doc["schedule"]["events"][0]["start"] += 0.5
    doc["schedule"]["events"][0]["end"] += 0.5
    plan.write_text(json.dumps(doc))
    out = tmp_path / "g.svg"
    assert main(["gantt", str(plan), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not a valid plan" in err and "--no-validate" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    assert main(["gantt", str(plan), "-o", str(out), "--no-validate"]) == 0
    assert out.exists()


def test_cli_gantt_bad_suffix_writes_nothing(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    write_plan(plan, small_schedule())
    assert main(["gantt", str(plan), "-o", str(tmp_path / "a.svg"), "-o", str(tmp_path / "b.unknown")]) == 2
    assert "b.unknown" in capsys.readouterr().err
    assert not (tmp_path / "a.svg").exists()


def test_chain_picture_smoke(tmp_path):
    sg = chain_stage_graph(2, f=1, b=2, w=1)
    order = {0: [Job(0, 0, "F"), Job(0, 0, "I"), Job(0, 0, "W")], 1: [Job(1, 0, "F"), Job(1, 0, "I"), Job(1, 0, "W")]}
    s = Schedule(sg, 1, simulate(sg, order, 1))
    assert png_size(write_gantt(s, tmp_path / "c.png")) == (1400, int(round((1.6 + 0.42 * 2) * 100)))


def test_pair_halves_keep_their_own_stage_shade():
    from opsched.schedule import Event

    sg = chain_stage_graph(2, devices=1, placement="interleaved")
    events = [Event(0, 1, "F", 0, 1, pair=3), Event(1, 0, "B", 0, 1, pair=3)]
    (bar,) = gantt_bars(Schedule(sg, 2, events))
    assert bar.label == "0F1+1B0" and bar.chunks == (0, 1)


@pytest.mark.parametrize("suffix", ["png", "svg", "html", "json"])
def test_empty_schedule_and_odd_titles_draw(tmp_path, suffix):
    empty = Schedule(StageGraph([Stage(0, (0,), {"F": 1, "I": 1, "W": 1}, microbatches=())]), 1, [])
    assert write_gantt(empty, tmp_path / f"e.{suffix}").stat().st_size > 0
    # "$" would start matplotlib math mode and "<" must be escaped in SVG/HTML
    out = write_gantt(small_schedule(), tmp_path / f"t.{suffix}", title="cost $5 and $6 <b>")
    if suffix == "svg":
        ET.parse(out)
    if suffix == "html":
        assert "cost $5 and $6 &lt;b&gt;" in out.read_text()


# --------------------------------------------------------------------------- units, labels and zoom (issue 15 item 3)


def sixteen_microbatches(job_seconds: float = 0.00786):
    """One stage on one device, 16 microbatches of F then B: bars about as narrow as the quick start's."""
    sg = chain_stage_graph(1, f=job_seconds, b=2 * job_seconds, w=job_seconds)
    order = {0: [Job(0, m, "F") for m in range(16)] + [Job(0, m, "B") for m in range(16)]}
    return Schedule(sg, 16, simulate(sg, order, 16), name="sixteen")


def test_every_format_says_its_time_unit_and_both_figures_of_the_title(tmp_path):
    s = sixteen_microbatches()
    html = write_gantt(s, tmp_path / "g.html", step_time=0.3929).read_text()
    assert "step time 392.9 ms, makespan 377.3 ms" in html  # 16 x (7.86 + 15.72) ms
    assert ">time (ms)</text>" in html
    assert "microbatch 15, forward F: 117.9 ms to 125.8 ms (7.86 ms)" in html
    trace = json.loads(write_gantt(s, tmp_path / "t.json", step_time=0.3929).read_text())
    assert "step time 392.9 ms" in trace["traceEvents"][0]["args"]["name"]
    svg = write_gantt(s, tmp_path / "g.svg", step_time=0.3929).read_text()
    assert "step time 392.9 ms" in svg and "time (ms)" in svg
    shown = re.sub(r"<script.*?</script>", "", html, flags=re.S)  # the data and code, not what a reader sees
    assert not re.search(r"\de[+-]\d", shown + svg), "a number in exponent notation"


def test_cli_gantt_titles_a_plans_step_time(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    write_plan(plan, sixteen_microbatches(), extra={"step_time": 0.4})
    out = tmp_path / "g.html"
    assert main(["gantt", str(plan), "-o", str(out)]) == 0
    assert "step time 400 ms, makespan 377.3 ms" in out.read_text()


@pytest.mark.parametrize("b_over_f", [5.0, 5.5])
def test_two_digit_microbatches_are_labelled_on_narrow_bars(b_over_f, tmp_path, monkeypatch):
    # the quick start's chart lost 10-15: its bars are 7.1-7.9 ms in a 0.74 s chart, 11.5-13 px of the page's 1200
    f = 0.00786
    sg = chain_stage_graph(1, f=f, b=b_over_f * f, w=f)  # 16 x (F + B): 96 or 104 F-widths in the chart
    order = {0: [Job(0, m, "F") for m in range(16)] + [Job(0, m, "B") for m in range(16)]}
    s = Schedule(sg, 16, simulate(sg, order, 16), name="narrow")
    html = write_gantt(s, tmp_path / "g.html").read_text()
    forward = re.findall(r'<title>[^<]*forward F[^<]*</title></rect><text ([^>]*)>(\d+)</text>', html)
    assert len(forward) == 16
    assert {int(text) for attrs, text in forward if "hidden" not in attrs} == set(range(16))

    import matplotlib.axes

    drawn = []
    real_text = matplotlib.axes.Axes.text
    monkeypatch.setattr(matplotlib.axes.Axes, "text",
                        lambda ax, x, y, t, **kw: drawn.append((x, t)) or real_text(ax, x, y, t, **kw))
    write_image(s, tmp_path / "g.png")
    assert {int(t) for x, t in drawn if t.isdigit() and x < 16 * f} == set(range(16))


def test_html_zooms_and_pans_without_network(tmp_path):
    html = write_gantt(small_schedule(), tmp_path / "g.html").read_text()
    assert "addEventListener('wheel'" in html and "pointermove" in html and "dblclick" in html
    assert 'id="zoom-in"' in html and 'id="zoom-reset"' in html and 'clip-path="url(#plot-area)"' in html
    assert not re.search(r"<script[^>]*\ssrc=", html) and not re.search(r"https?://", html)
    # every bar says where it lies in time, which the zoom redraws from
    assert html.count('data-t0="') == html.count('class="bar"')


NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_page_script_parses_and_follows_the_python_rules(tmp_path):
    from opsched.export.gantt_bars import label_font
    from opsched.export.gantt_html import CHART_MATH_JS, LABEL_FONTS_PX, _SCRIPT, nice_ticks

    script = tmp_path / "page.js"
    script.write_text(CHART_MATH_JS + _SCRIPT)
    assert subprocess.run([NODE, "--check", str(script)], capture_output=True).returncode == 0
    ends = [69, 0.7379, 737.9, 3.0, 12345.0, 1e-3]
    widths = [5.0, 11.0, 11.6, 13.7, 20.0, 40.0]
    probe = tmp_path / "probe.js"
    probe.write_text(CHART_MATH_JS + "console.log(JSON.stringify({ticks: %s.map(function (e) { return niceTicks(0, e, 10).ticks; }),"
                     " fonts: %s.map(function (w) { return [1, 2, 3].map(function (c) { return labelFont(c, w, 24); }); })}));"
                     % (json.dumps(ends), json.dumps(widths)))
    got = json.loads(subprocess.run([NODE, str(probe)], capture_output=True, text=True, check=True).stdout)
    for end, ticks in zip(ends, got["ticks"]):
        assert ticks == pytest.approx(nice_ticks(end)), end
    for w, fonts in zip(widths, got["fonts"]):
        assert fonts == [label_font("9" * c, w, 24, LABEL_FONTS_PX) or 0 for c in (1, 2, 3)], w


# a few DOM stand-ins, just enough for the page script: it runs under node against the chart's own numbers
FAKE_DOM_JS = """
function El(attrs) {
  this.attrs = attrs || {}; this.dataset = {}; this.handlers = {}; this.children = []; this.textContent = '';
  var own = this;
  this.classList = {set: {}, add: function (c) { own.classList.set[c] = 1; }, remove: function (c) { delete own.classList.set[c]; },
                    toggle: function (c, on) { if (on) { own.classList.set[c] = 1; } else { delete own.classList.set[c]; } }};
}
El.prototype.setAttribute = function (k, v) { this.attrs[k] = String(v); };
El.prototype.getAttribute = function (k) { return this.attrs[k]; };
El.prototype.addEventListener = function (type, f) { this.handlers[type] = f; };
El.prototype.appendChild = function (c) { this.children.push(c); this.firstChild = this.children[0]; };
El.prototype.removeChild = function (c) { this.children.shift(); this.firstChild = this.children[0]; };
El.prototype.fire = function (type, event) { this.handlers[type](Object.assign({preventDefault: function () {}}, event || {})); };
var byId = {}, jobs = [], documentHandlers = {};
var svg = byId.chart = new El();
svg.namespaceURI = 'svg';
svg.width = {baseVal: {value: CHART.left + CHART.width + 20}};
svg.getBoundingClientRect = function () { return {left: 0, width: CHART.left + CHART.width + 20}; };
svg.setPointerCapture = function () {};
Object.assign(svg.dataset, {left: CHART.left, width: CHART.width, top: 20, bottom: 200, end: CHART.end, unitSize: CHART.unit});
byId.ticks = new El();
byId['zoom-window'] = new El(); byId['zoom-window'].dataset.unit = 'ms';
['zoom-in', 'zoom-out', 'zoom-reset'].forEach(function (id) { byId[id] = new El(); });
CHART.jobs.forEach(function (j) {
  var g = new El({'data-mb': String(j.mb)}), rect = new El({height: String(j.h)}), text = new El();
  Object.assign(g.dataset, {t0: j.t0, t1: j.t1, mb: j.mb});
  text.textContent = String(j.mb);
  g.querySelector = function (sel) { return sel === 'rect' ? rect : text; };
  g.rect = rect; g.text = text; jobs.push(g);
});
svg.querySelectorAll = function () { return jobs; };
var document = {
  getElementById: function (id) { return byId[id]; },
  querySelectorAll: function (sel) { return sel === '.job' ? jobs : jobs.filter(function (g) { return g.classList.set.dim; }); },
  createElementNS: function () { return new El(); },
  addEventListener: function (type, f) { documentHandlers[type] = f; }
};
function snapshot() {
  return {bars: jobs.map(function (g) { return [+g.rect.attrs.x, +g.rect.attrs.width, g.text.attrs.visibility]; }),
          ticks: byId.ticks.children.filter(function (c) { return c.textContent; }).map(function (c) { return c.textContent; }),
          shown: byId['zoom-window'].textContent};
}
"""

DRIVE_JS = """
var seen = {};
byId['zoom-reset'].fire('click'); seen.start = snapshot();
byId['zoom-in'].fire('click'); byId['zoom-in'].fire('click'); seen.zoomed = snapshot();
byId['zoom-reset'].fire('click');
svg.fire('wheel', {deltaY: -500, deltaX: 0, clientX: CHART.left + CHART.width / 4}); seen.wheel = snapshot();
svg.fire('pointerdown', {clientX: 600, pointerId: 1}); svg.fire('pointermove', {clientX: 500}); svg.fire('pointerup', {});
seen.panned = snapshot();
documentHandlers.keydown({key: '0', target: {tagName: 'BODY'}, preventDefault: function () {}}); seen.reset = snapshot();
svg.fire('wheel', {deltaY: -1000, deltaX: 0, clientX: CHART.left}); seen.early = snapshot();
console.log(JSON.stringify(seen));
"""


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_page_zooms_pans_and_relabels(tmp_path):
    """The page's script, run against stand-ins for the DOM: zoom, wheel, drag and reset move the bars and ticks."""
    from opsched.export.gantt_html import CHART_MATH_JS, CHART_WIDTH, LEFT, _SCRIPT

    f = 0.00786
    sg = chain_stage_graph(1, f=f, b=12 * f, w=f)  # F bars of 1200 px / 208 = 5.8 px: too narrow for a digit
    order = {0: [Job(0, m, "F") for m in range(16)] + [Job(0, m, "B") for m in range(16)]}
    s = Schedule(sg, 16, simulate(sg, order, 16))
    bars = gantt_bars(s)
    end = max(b.end for b in bars)
    chart = {"left": LEFT, "width": CHART_WIDTH, "end": end, "unit": 1e-3,
             "jobs": [{"t0": b.start, "t1": b.end, "mb": b.events[0].microbatch, "h": 24} for b in bars]}
    probe = tmp_path / "drive.js"
    probe.write_text(f"var CHART = {json.dumps(chart)};\n" + FAKE_DOM_JS + CHART_MATH_JS + _SCRIPT + DRIVE_JS)
    seen = json.loads(subprocess.run([NODE, str(probe)], capture_output=True, text=True, check=True).stdout)
    scale = CHART_WIDTH / end
    first = seen["start"]["bars"][0]
    assert first[0] == pytest.approx(LEFT, abs=0.01) and first[1] == pytest.approx(f * scale, abs=0.01)
    assert seen["start"]["shown"] == "the whole step" and 6 <= len(seen["start"]["ticks"]) <= 11
    # zoomed 4x about the centre: every bar 4x as wide, the ticks finer, the window named in ms
    assert seen["zoomed"]["bars"][0][1] == pytest.approx(4 * f * scale, abs=0.02)
    assert seen["zoomed"]["ticks"] != seen["start"]["ticks"] and seen["zoomed"]["shown"].startswith("showing ")
    assert seen["zoomed"]["shown"].endswith(" ms")
    # labels too wide for a bar are hidden, and shown once zooming makes room
    assert seen["start"]["bars"][0][2] == "hidden" and seen["start"]["bars"][20][2] == "visible"  # an F bar, a B bar
    early = seen["early"]["bars"][:16]  # the F bars, zoomed about 7x at the start of the step
    assert all(b[2] == "visible" and b[1] > 5 * f * CHART_WIDTH / end for b in early)
    # the wheel zooms about the pointer: the time under it stays where it was
    pointer_t = end / 4
    wheel = seen["wheel"]["bars"]
    under = next(i for i, b in enumerate(bars) if b.start <= pointer_t <= b.end)
    x_before = LEFT + bars[under].start * scale
    assert wheel[under][1] > 2 * (bars[under].end - bars[under].start) * scale  # zoomed in
    assert (LEFT + CHART_WIDTH / 4 - wheel[under][0]) / wheel[under][1] == pytest.approx(
        (LEFT + CHART_WIDTH / 4 - x_before) / ((bars[under].end - bars[under].start) * scale), rel=1e-3)  # x to 0.01 px
    # a drag 100 px to the left moves every bar 100 px left
    assert [b[0] for b in seen["panned"]["bars"]] == pytest.approx([b[0] - 100 for b in wheel], abs=0.02)
    assert seen["reset"] == seen["start"]


def test_the_devices_of_a_group_share_one_row():
    """A plan on 1,024 devices in groups of 64 draws 16 rows: the devices of a group run the same jobs."""
    from opsched.export.gantt_bars import device_rows
    from opsched.export.gantt_image import ROW_INCHES, figure_size
    from opsched.schedule import Edge, Schedule, Stage, StageGraph, simulate, Job

    stages = [Stage(k, tuple(range(4 * k, 4 * k + 4)), {"F": 1.0, "I": 1.0, "W": 1.0}) for k in range(2)]
    sg = StageGraph(stages, [Edge(0, 1)])
    order = {d: [Job(d // 4, 0, p) for p in ("F", "I", "W")] for d in range(8)}
    schedule = Schedule(sg, 1, simulate(sg, order, 1))
    assert device_rows(schedule) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert figure_size(schedule)[1] == pytest.approx(1.6 + 2 * ROW_INCHES)
