"""report.html and gantt.html of a large schedule: the time to write each, and in Chromium the time to load, to
zoom, and the page's width in a 1,280-pixel window (issue 45 item 7).

The schedule is 1F1B on a chain of ``--stages`` stages with ``--microbatches``
microbatches (2 jobs per stage and microbatch: 16,384 by default, the size
the plan command's export budget, EXPORT_SECONDS_PER_JOB, was measured at).
The browser part runs when Playwright and a Chromium are installed (as
tests/test_report_html.py finds them).

usage:
  python benchmarks/bench_report_html.py [--stages 16] [--microbatches 512] [--out /tmp/bench-report]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from opsched.baselines import run_baseline
from opsched.export.gantt_html import write_html
from opsched.export.report_html import MethodRow, ReportPage, write_report_html
from opsched.schedule import chain_stage_graph, metrics

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def timed(action) -> tuple[float, object]:
    start = time.perf_counter()
    value = action()
    return time.perf_counter() - start, value


def in_browser(path: Path) -> None:
    """Load ``path`` in a 1,280-pixel window, zoom once, and print the times and the page's width."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("  browser: skipped (pip install playwright)")
        return
    chromium = os.environ.get("OPSCHED_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        print(f"  browser: skipped (no Chromium at {chromium})")
        return
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        load, _ = timed(lambda: page.goto(path.as_uri()))
        zoom, _ = timed(lambda: (page.click("#zoom-in"), page.evaluate("1")))
        width = page.evaluate("document.documentElement.scrollWidth")
        browser.close()
    print(f"  browser: load {load:.2f} s, zoom in {zoom:.2f} s, width {width} px in a 1280-px window")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--out", default="/tmp/bench-report")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    schedule = run_baseline("1f1b", chain_stage_graph(args.stages), args.microbatches)
    metrics(schedule)  # computed once and kept, as the plan command has them before its files
    step = max(e.end for e in schedule.events)
    page = ReportPage("1f1b", "summary", schedule, step, (MethodRow("1f1b", "chain", step, chosen=True),))
    print(f"{len(schedule.events):,} jobs on {args.stages} devices")
    for name, write in (("gantt.html", lambda: write_html(schedule, out / "gantt.html")),
                        # as `opsched plan` writes it: after gantt.html, whose chart it reuses (kept on the schedule)
                        ("report.html", lambda: write_report_html(page, out / "report.html"))):
        seconds, path = timed(write)
        print(f"{name}: written in {seconds:.2f} s, {path.stat().st_size / 2**20:.1f} MiB")
        in_browser(path)


if __name__ == "__main__":
    main()
