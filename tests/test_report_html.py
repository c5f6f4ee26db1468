"""report.html and gantt.html in a real browser (issue 45 item 7): headless Chromium driven by Playwright.

The browser tests skip when Playwright (``pip install playwright``) or a
Chromium (Debian's ``chromium`` package; another one through
OPSCHED_CHROMIUM) is missing; ``playwright install`` is never needed. The
pages: one real ``opsched plan`` (a tiny CLIP), and two built here from
hand-written schedules: two branches side by side, and DualPipe's overlapped
pairs on a reversed copy (a copy of the chain, dashed in the stage graph).
"""

import os
import re
import shutil
from pathlib import Path

import pytest

from opsched.baselines import run_baseline
from opsched.cli import main
from opsched.export.gantt_bars import device_groups
from opsched.export.plan_json import read_plan
from opsched.export.report_html import MethodRow, ReportPage, report_html, write_report_html
from opsched.schedule import Edge, Job, Schedule, Stage, StageGraph, chain_stage_graph, simulate, validate
from opsched.units import ranges_text

MODELS = Path(__file__).resolve().parent.parent / "models"
CHROMIUM = os.environ.get("OPSCHED_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
#: what the issue asks Chromium to run with: no sandbox (root in CI), nothing fetched in the background
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
WINDOW = {"width": 1280, "height": 900}


def towers_schedule() -> Schedule:
    """A fork (stage 0), two towers (1-2 on device 1, 3 on device 2) and a join (stage 4), GPipe order."""
    t = {"F": 1.0, "I": 1.5, "W": 0.5}
    sg = StageGraph([Stage(0, (0,), t), Stage(1, (1,), t), Stage(2, (1,), t), Stage(3, (2,), t), Stage(4, (3,), t)],
                    [Edge(0, 1, 0.1), Edge(1, 2), Edge(0, 3, 0.1), Edge(2, 4, 0.1), Edge(3, 4, 0.1)])
    m = 4
    order = {d: [Job(s, k, "F") for s in sg.stages_on(d) for k in range(m)]
             + [Job(s, k, p) for s in reversed(sg.stages_on(d)) for k in range(m) for p in ("I", "W")]
             for d in range(4)}
    schedule = Schedule(sg, m, simulate(sg, order, m), name="towers")
    validate(schedule)
    return schedule


#: the pages built here: two towers, DualPipe's pairs and reversed copy, a chain of 24 stages (wrapped in bands)
BUILT = {"towers": towers_schedule(),
         "dualpipe": run_baseline("dualpipe", chain_stage_graph(4, overlap_gain=0.5), 8),
         "chain": run_baseline("interleaved-1f1b", chain_stage_graph(24, devices=4, placement="interleaved"), 8)}


def page_of(schedule: Schedule, title: str) -> ReportPage:
    step = max(e.end for e in schedule.events)
    return ReportPage(title=title, summary=f"{title}\n  a page built by the tests", schedule=schedule, step_time=step,
                      methods=(MethodRow("opsched", "hand-written", step, chosen=True),
                               MethodRow("slower", "a baseline", 1.5 * step)))


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    """name -> a page on disk: the real plan's report.html and gantt.html, and the two built here."""
    root = tmp_path_factory.mktemp("pages")
    out = root / "clip"
    assert main(["plan", str(MODELS / "clip_vit_l14.onnx"), "--devices", "4", "--microbatches", "4",
                 "--time-limit", "4", "-o", str(out), "--quiet"]) == 0
    return {"plan": out / "report.html", "gantt": out / "gantt.html",
            **{name: write_report_html(page_of(schedule, name), root / f"{name}.html")
               for name, schedule in BUILT.items()}}


def test_opsched_plan_writes_report_html_with_every_part(pages):
    html = pages["plan"].read_text()
    _, doc = read_plan(pages["plan"].parent / "plan.json")
    for part in ('id="stage-graph"', 'id="chart"', 'id="methods"', 'id="layouts"', 'class="summary"'):
        assert part in html, part
    assert html.count('class="method-bar"') == 1 + len(doc["baselines"])  # the plan and every baseline
    assert html.count("<tr><td class=\"text\">") == len(doc["candidates"])  # every layout tried
    # self-contained: nothing to fetch
    assert not re.search(r"<(script|link|img)[^>]*\s(src|href)=", html) and not re.search(r"https?://", html)


def test_stage_nodes_take_their_device_groups_colour_as_the_gantt_rows_strips():
    schedule = towers_schedule()
    html = report_html(page_of(schedule, "towers"))
    strips = dict(re.findall(r'<rect class="group" [^>]*fill="(#[0-9a-f]{6})"[^>]*><title>devices ([^<]+)</title>', html))
    strips = {devices: colour for colour, devices in strips.items()}
    nodes = re.findall(r'<g class="stage-node" data-stage="(\d+)">.*?fill="(#[0-9a-f]{6})"', html)
    assert len(nodes) == len(schedule.stage_graph.stages)
    for sid, colour in nodes:
        devices = schedule.stage_graph.stage(int(sid)).devices
        assert colour == device_groups(schedule)[devices] == strips[ranges_text(devices)]


try:
    from playwright import sync_api as playwright
except ImportError:  # the browser extra is not installed
    playwright = None
needs_chromium = pytest.mark.skipif(
    playwright is None or not Path(CHROMIUM).exists(),
    reason=f"the browser tests need playwright (pip install playwright) and Chromium at {CHROMIUM} (apt-get install chromium)")


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Opened:
    """A page opened in a 1,280-pixel window, with what it logged and every request it made."""

    def __init__(self, browser, path: Path):
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page = browser.new_page(viewport=WINDOW)
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.as_uri())

    def ticks(self) -> list[str]:
        return self.page.locator("#ticks text").all_text_contents()


@pytest.fixture
def opened(browser):
    made: list[Opened] = []
    yield lambda path: made.append(Opened(browser, path)) or made[-1]
    for o in made:
        o.page.close()


@needs_chromium
@pytest.mark.parametrize("name", ["plan", "gantt", *BUILT])
def test_the_page_loads_with_no_console_error_and_fetches_nothing(opened, pages, name):
    o = opened(pages[name])
    assert o.errors == []
    assert [u for u in o.requests if not u.startswith("file:")] == []
    assert o.page.locator("#chart .job").count() > 0


@needs_chromium
@pytest.mark.parametrize("name", ["plan", "gantt", *BUILT])
def test_nothing_overflows_a_1280_pixel_window(opened, pages, name):
    """Neither the page nor any element in it is wider than the window (gantt.html was 1,374 px)."""
    o = opened(pages[name])
    assert o.page.evaluate("document.documentElement.scrollWidth") <= WINDOW["width"]
    widest = o.page.evaluate("""Math.max.apply(null, Array.prototype.map.call(document.body.querySelectorAll('*'),
                                function (e) { return e.getBoundingClientRect().right; }))""")
    assert widest <= WINDOW["width"]


@needs_chromium
@pytest.mark.parametrize("name", ["plan", "towers"])
def test_hovering_a_bar_shows_its_job_time_and_device(opened, pages, name):
    o = opened(pages[name])
    tip = o.page.locator("#tip")
    assert not tip.is_visible()
    job = o.page.locator("#chart .job").nth(3)
    mb, row = job.get_attribute("data-mb"), int(job.get_attribute("data-row"))
    job.locator("rect").hover()
    assert tip.is_visible()
    text = tip.text_content()
    label = o.page.locator("#chart .row-label").nth(row).text_content()
    assert text.startswith(f"{label}: stage ") and re.match(r"devices? \d", label)  # the device
    assert f", microbatch {mb}, " in text  # the job
    assert re.search(r" (forward F|backward \(inputs\) I|backward \(weights\) W|full backward B): ", text)
    assert re.search(r": [\d.,]+ (µs|ms|s) to [\d.,]+ (µs|ms|s) \([\d.,]+ (µs|ms|s)\)", text)  # the time
    assert job.locator("title").count() == 0  # the browser's own tooltip does not show as well
    o.page.mouse.move(2, 2)
    assert not tip.is_visible()


@needs_chromium
def test_zoom_and_pan_change_the_axis(opened, pages):
    o = opened(pages["plan"])
    whole = o.ticks()
    assert o.page.locator("#zoom-window").text_content() == "the whole step"
    o.page.click("#zoom-in")
    zoomed = o.ticks()
    assert zoomed != whole and o.page.locator("#zoom-window").text_content().startswith("showing ")
    # a drag to the left shows later times: the first tick grows
    box = o.page.locator("#chart").bounding_box()
    y = box["y"] + box["height"] / 3
    o.page.mouse.move(box["x"] + box["width"] * 0.6, y)
    o.page.mouse.down()
    o.page.mouse.move(box["x"] + box["width"] * 0.3, y, steps=5)
    o.page.mouse.up()
    panned = o.ticks()
    assert float(panned[0].replace(",", "")) > float(zoomed[0].replace(",", ""))
    # the wheel zooms in further, a double click shows the whole step again
    o.page.mouse.move(box["x"] + box["width"] * 0.5, y)
    o.page.mouse.wheel(0, -400)
    o.page.wait_for_function("document.querySelector('#ticks text') !== null")
    assert o.ticks() != panned
    o.page.dblclick("#chart", position={"x": box["width"] * 0.5, "y": box["height"] / 3})
    assert o.ticks() == whole and o.page.locator("#zoom-window").text_content() == "the whole step"


@needs_chromium
@pytest.mark.parametrize("name", ["plan", *BUILT])
def test_the_stage_graph_has_one_node_per_stage(opened, pages, name):
    o = opened(pages[name])
    sg = read_plan(pages[name].parent / "plan.json")[0].stage_graph if name == "plan" else BUILT[name].stage_graph
    nodes = o.page.locator("#stage-graph .stage-node")
    assert nodes.count() == len(sg.stages)
    assert sorted(int(n.get_attribute("data-stage")) for n in nodes.all()) == list(range(len(sg.stages)))
    assert o.page.locator("#stage-graph .stage-edge").count() == len(sg.edges)
    # every node is drawn where it can be seen, none on top of another
    boxes = [n.bounding_box() for n in nodes.all()]
    assert all(b["width"] > 40 and b["x"] >= 0 and b["x"] + b["width"] <= WINDOW["width"] for b in boxes)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            apart = (a["x"] + a["width"] <= b["x"] or b["x"] + b["width"] <= a["x"] or a["y"] + a["height"] <= b["y"]
                     or b["y"] + b["height"] <= a["y"])
            assert apart, (a, b)
    # hovering a node leaves that stage's bars alone undimmed in the Gantt
    nodes.nth(1).hover()
    dimmed = o.page.evaluate("""Array.prototype.map.call(document.querySelectorAll('#chart .job'),
                                function (g) { return [g.dataset.stage, g.classList.contains('dim')]; })""")
    assert {stage for stage, dim in dimmed if not dim} == {"1"} and any(dim for _, dim in dimmed)
    if name == "towers":  # the two towers in lanes of their own: stages 1 and 3 in one column, one above the other
        one, three = boxes[1], boxes[3]
        assert one["x"] == pytest.approx(three["x"]) and one["y"] != three["y"]
        assert "2 side by side" in o.page.locator("body").text_content()
