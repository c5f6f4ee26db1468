"""Time and memory of generating, importing and coarsening the frontier models (issue 13).

Issue 13's target for import and coarsening: a 180,000-node graph in under
60 s and 2 GB. The models are those of ``models/build.py``: ``deepseek_v3``
(181,990 nodes, written on demand into a temporary folder) and
``llama3_405b`` (1,893 nodes, shipped). Each step runs in a fresh child
process, so each model's peak memory is its own:

1. generate: ``build.MODELS[name]()`` and ``write_model`` (the build script's work);
2. import + coarsen: ``opsched.model.onnx_import.import_onnx`` on the file with its
   default dims, then ``opsched.model.coarsen.coarsen`` (what ``opsched inspect`` does);
   peak resident memory is read after each of the two.

With ``--plan``, instead: issue 13's planning rows (Llama-3-405B at 1,024,
4,096 and 16,384 devices, DeepSeek-V3 at 256, 1,024 and 2,048; target: each
``opsched plan`` under 10 minutes and 4 GB, valid, no idle device without a
reason), one ``opsched plan --json`` after another (never two at once: they
would share the cores). The planner forks its solver children, so its peak
memory is sampled every 0.2 s over the whole process tree from ``/proc``:
the summed proportional set size (PSS: a page shared by the forked children
counts once in all) is the memory the run holds; the summed resident sizes
(RSS, which counts a shared page once per process) are an upper bound.

usage:
  python benchmarks/bench_scale.py [--models deepseek_v3 llama3_405b]
  python benchmarks/bench_scale.py --models deepseek_v3 --profile 25
  python benchmarks/bench_scale.py --plan [--rows llama3_405b:1024:60 deepseek_v3:256:300] [--plan-args '--global-batch 2048']

Prints a markdown table: wall seconds with CPU seconds (user + system) in
brackets, which stay meaningful when other work shares the cores; peak RSS in
MB (the child's ru_maxrss). ``--profile N`` instead runs import + coarsen once under cProfile and
prints the N functions with the most own time, then the N with the most
cumulative time (profiling slows the run down by about half again).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import math
import os
import pstats
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = ("deepseek_v3", "llama3_405b")


def load_build():
    """``models/build.py`` as a module (``models/`` is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("opsched_models_build", ROOT / "models" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_s() -> float:
    """User + system CPU seconds of this process so far (wall time is inflated on a shared machine)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_mb() -> float:
    """Peak resident memory of this process so far, in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_generate(name: str, path: str) -> dict:
    """Build one model and write it to ``path``."""
    build = load_build()
    t0 = time.perf_counter()
    model = build.MODELS[name]()
    build.write_model(model, path)
    seconds = time.perf_counter() - t0
    params = {p.key: p.value for p in model.metadata_props}["opsched.param_count"]
    return {"nodes": len(model.graph.node), "params": int(params), "generate_s": seconds,
            "generate_mb": peak_mb(), "file_mb": Path(path).stat().st_size / 1e6}


def child_import(path: str) -> dict:
    """Import and coarsen one file; times and the peak memory after each step."""
    from opsched.model.coarsen import coarsen
    from opsched.model.graph import totals
    from opsched.model.onnx_import import import_onnx

    c0, t0 = cpu_s(), time.perf_counter()
    g = import_onnx(path)
    c1, t1 = cpu_s(), time.perf_counter()
    import_mb = peak_mb()
    bg = coarsen(g)
    c2, t2 = cpu_s(), time.perf_counter()
    return {"ops": g.number_of_nodes(), "imported_params": int(totals(g)["param_count"]),
            "import_s": t1 - t0, "import_cpu": c1 - c0, "import_mb": import_mb,
            "coarsen_s": t2 - t1, "coarsen_cpu": c2 - c1, "coarsen_mb": peak_mb(), "blocks": bg.number_of_nodes()}


def child_profile(path: str, top: int) -> str:
    """Import and coarsen under cProfile; the top functions by own and by cumulative time."""
    from opsched.model.coarsen import coarsen
    from opsched.model.onnx_import import import_onnx

    profile = cProfile.Profile()
    profile.enable()
    coarsen(import_onnx(path))
    profile.disable()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def run_child(*args: str) -> dict:
    """Run this script as ``--child ARGS`` in a fresh interpreter; its JSON answer."""
    done = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def measure(name: str, folder: str) -> dict:
    """Generate ``name`` into ``folder``, then import and coarsen it, each in its own child."""
    path = str(Path(folder) / f"{name}.onnx")
    row = {"model": name, **run_child("generate", name, path)}
    row.update(run_child("import", path))
    return row


def table(rows: list[dict]) -> str:
    """The figures as a markdown table."""
    head = ("| model | nodes | parameters | file MB | generate s | import s (CPU s) | coarsen s (CPU s) "
            "| import + coarsen s (CPU s) | peak MB after import | peak MB after coarsen | blocks |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['nodes']:,} | {r['imported_params']:,} | {r['file_mb']:.1f} | {r['generate_s']:.1f} "
            f"| {r['import_s']:.1f} ({r['import_cpu']:.1f}) | {r['coarsen_s']:.1f} ({r['coarsen_cpu']:.1f}) "
            f"| {r['import_s'] + r['coarsen_s']:.1f} ({r['import_cpu'] + r['coarsen_cpu']:.1f}) "
            f"| {r['import_mb']:,.0f} | {r['coarsen_mb']:,.0f} | {r['blocks']:,} |"
        )
    return "\n".join(lines)


#: issue 13's planning rows as MODEL:DEVICES:TIME_LIMIT; DeepSeek-V3's import and coarsening alone take about
#: half a minute, so it plans with 300 s (the target is 10 minutes)
PLAN_ROWS = ("llama3_405b:1024:60", "llama3_405b:4096:60", "llama3_405b:16384:60",
             "deepseek_v3:256:300", "deepseek_v3:1024:300", "deepseek_v3:2048:300")


@dataclass
class PlanRow:
    """One ``opsched plan`` run: its wall clock, the process tree's peak memory, what it chose."""

    model: str
    devices: int
    time_limit: int
    wall_s: float
    tree_pss_mb: float
    tree_rss_mb: float
    load: tuple[float, float, float]  # the load average as the run ended
    chosen: str
    step_time_s: float
    idle: str  # the plan's warning about idle devices, or "none"


def tree_memory_kb(root: int) -> tuple[int, int]:
    """(summed PSS, summed RSS) in KiB of ``root`` and every process below it, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the process ended while the table was read
            children.setdefault(ppid, []).append(int(entry))
    pss = rss = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith(("Pss:", "Rss:")):
                    kb = int(line.split()[1])
                    pss, rss = (pss + kb, rss) if line.startswith("Pss:") else (pss, rss + kb)
        except OSError:
            continue
    return pss, rss


def plan_row(model: str, devices: int, time_limit: int, folder: str, extra: tuple[str, ...] = ()) -> PlanRow:
    """Run ``opsched plan --json`` on ``model`` (``models/MODEL.onnx``, generated into ``folder`` if absent),
    with ``extra`` arguments (e.g. ``--global-batch 1024``)."""
    path = ROOT / "models" / f"{model}.onnx"
    if not path.exists():
        path = Path(folder) / f"{model}.onnx"
        if not path.exists():
            run_child("generate", model, str(path))
    cmd = [sys.executable, "-m", "opsched", "plan", str(path), "--devices", str(devices),
           "--time-limit", str(time_limit), "--json", "-q", "-o", str(Path(folder) / f"{model}-{devices}"), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # -q: little on stderr
    pss = rss = 0
    while proc.poll() is None:
        now_pss, now_rss = tree_memory_kb(proc.pid)
        pss, rss = max(pss, now_pss), max(rss, now_rss)
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read(), proc.stderr.read()
    if proc.returncode == 2:  # a refusal (e.g. nothing fits): a row of the table, in the planner's own words
        return PlanRow(model, devices, time_limit, wall, pss / 1024, rss / 1024, os.getloadavg(),
                       f"refused: {err.strip().splitlines()[-1]}", math.nan, "-")
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {err.strip()[-2000:]}")
    doc = json.loads(out)
    idle = [w for w in doc["warnings"] if "hold no stage" in w or "holds no stage" in w]
    return PlanRow(model, devices, time_limit, wall, pss / 1024, rss / 1024, os.getloadavg(),
                   f"{doc['source']} on {doc['layout']}", doc["step_time"], idle[0] if idle else "none")


def plan_table(rows: list[PlanRow]) -> str:
    """The planning figures as a markdown table."""
    head = ("| model | devices | --time-limit s | wall s | peak MB (tree PSS) | tree RSS MB | load average "
            "| chosen | step time | idle devices |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.devices:,} | {r.time_limit} | {r.wall_s:.1f} | {r.tree_pss_mb:,.0f} "
                     f"| {r.tree_rss_mb:,.0f} | {' '.join(f'{x:.1f}' for x in r.load)} | {r.chosen} "
                     f"| {'-' if math.isnan(r.step_time_s) else f'{r.step_time_s * 1e3:.1f} ms'} | {r.idle} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="names in models/build.py")
    parser.add_argument("--profile", type=int, metavar="N", help="profile import + coarsen; print the top N functions")
    parser.add_argument("--plan", action="store_true", help="time opsched plan on issue 13's planning rows")
    parser.add_argument("--rows", nargs="+", default=list(PLAN_ROWS), metavar="MODEL:DEVICES:TIME_LIMIT",
                        help="the planning rows to run with --plan")
    parser.add_argument("--plan-args", default="", metavar="ARGS",
                        help="more arguments for every opsched plan, e.g. '--global-batch 1024 --seq-len 4096'")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        if kind == "generate":
            print(json.dumps(child_generate(*rest)))
        elif kind == "import":
            print(json.dumps(child_import(*rest)))
        return 0
    with tempfile.TemporaryDirectory() as folder:
        if args.plan:
            rows, extra = [], tuple(shlex.split(args.plan_args))
            for row in args.rows:
                model, devices, limit = row.split(":")
                rows.append(plan_row(model, int(devices), int(limit), folder, extra))
                print(plan_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)  # each row as it ends
            print(plan_table(rows))
            return 0
        if args.profile:
            for name in args.models:
                path = str(Path(folder) / f"{name}.onnx")
                run_child("generate", name, path)
                print(f"## {name}: import + coarsen under cProfile\n")
                print(child_profile(path, args.profile))
            return 0
        print(table([measure(name, folder) for name in args.models]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
