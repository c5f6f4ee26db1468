"""opsched's lower level against Zero Bubble's own heuristic scheduler, run here as a peer (issue 11).

The peer is ``zb.py`` of sail-sg/zero-bubble-pipeline-parallelism
(``megatron/core/pipeline_parallel/zerobubble/scheduler/``): ``initial_solution``
tries its ``manual_order`` greedy under 8 settings and keeps the order with the
shortest longest-device span. It is loaded at run time from a fetched copy of
that repository (``--peer-repo``, its git directory); nothing of it is part of
opsched. Its ``pulp`` import (used only by its ILP refinement, not run here)
is satisfied by an empty module when pulp is not installed.

Every case is a chain of ``p`` stages on ``p`` devices, I/W split, with the
peer's cost model (F adds M_B = 1 activation, I adds M_W - M_B, W adds -M_W,
M_W = 0.5; transfer ``comm`` between neighbours) and a memory limit of ``p``
or ``2p`` activations per device:

* cost sets: ``zb`` (their 1.5B model: F 18.522, I 18.086, W 9.337, comm
  0.601 ms), ``uniform`` (F = I = W = 1, comm 0), ``ends`` (``zb`` with the
  first and last stage 1.5x), ``random`` (``zb`` with every stage's costs
  scaled by a factor in [0.7, 1.3], seeded per case);
* p in {4, 8, 16}, m in {p, 2p, 3p, 4p}.

The peer's order is re-timed by opsched's simulator (its own times are
checked against that) and validated by opsched's validator at the same
memory. opsched's ``lower.solve`` runs once per objective (``makespan``,
``zb-span``) with opsched's baselines as warm starts, never the peer's order.

Usage::

    python benchmarks/bench_zb_peer.py --peer-repo /work/.mirror/sail-sg+zero-bubble-pipeline-parallelism/repo \\
        [--p 4,8,16] [--m-factors 1,2,3,4] [--costs zb,uniform,ends,random] [--time-limit 30] [--json out.json]

Prints one markdown row per case and objective: the peer's value, opsched's,
opsched's proven lower bound and status, and whether opsched is at or below
the peer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import types
from dataclasses import asdict, dataclass
from pathlib import Path

from opsched.baselines import baseline_orders
from opsched.lower import solve
from opsched.lower.jobs import JobSet
from opsched.lower.lns import objective_value
from opsched.schedule import Job, Schedule, StageGraph, chain_stage_graph, simulate, validate
from opsched.solving.solver import Objective

PEER_DIR = "megatron/core/pipeline_parallel/zerobubble/scheduler"
ZB = dict(f=18.522, i=18.086, w=9.337, comm=0.601)
ACT_W = 0.5  # M_W in units of M_B


@dataclass(frozen=True)
class Case:
    costs: str
    p: int
    m: int
    memory: int  # activations per device

    @property
    def name(self) -> str:
        return f"{self.costs} p={self.p} m={self.m} mem={self.memory}"


@dataclass
class Row:
    case: str
    objective: str
    peer: float | None
    peer_note: str
    opsched: float
    bound: float
    status: str
    seconds: float

    @property
    def at_or_below(self) -> bool | None:
        return None if self.peer is None else self.opsched <= self.peer * (1 + 1e-9)


def stage_costs(case: Case) -> tuple[list[float], list[float], list[float], float]:
    """(F, I, W per stage, transfer time) of a case."""
    p = case.p
    if case.costs == "uniform":
        return [1.0] * p, [1.0] * p, [1.0] * p, 0.0
    scale = [1.0] * p
    if case.costs == "ends":
        scale[0] = scale[-1] = 1.5
    elif case.costs == "random":
        rng = random.Random(f"{case.p}-{case.m}-{case.memory}")
        scale = [rng.uniform(0.7, 1.3) for _ in range(p)]
    elif case.costs != "zb":
        raise SystemExit(f"unknown cost set {case.costs!r}; choose zb, uniform, ends or random")
    return [ZB["f"] * s for s in scale], [ZB["i"] * s for s in scale], [ZB["w"] * s for s in scale], ZB["comm"]


def load_peer(repo: Path) -> types.ModuleType:
    """zb.py and its graph.py from ``repo`` (a git directory), imported under their own package names."""
    work = Path(tempfile.mkdtemp(prefix="zb-peer-"))
    for name in ("graph.py", "zb.py"):
        text = subprocess.run(["git", "--git-dir", str(repo), "show", f"HEAD:{PEER_DIR}/{name}"],
                              check=True, capture_output=True, text=True).stdout
        (work / name).write_text(text)
    if importlib.util.find_spec("pulp") is None:
        sys.modules["pulp"] = types.ModuleType("pulp")  # only its ILP refinement uses it
    graph = _load(work / "graph.py", PEER_DIR.replace("/", ".") + ".graph")
    sys.modules[graph.__name__] = graph
    return _load(work / "zb.py", PEER_DIR.replace("/", ".") + ".zb")


def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peer_order(zb: types.ModuleType, case: Case) -> tuple[dict[int, list[Job]], float]:
    """The peer's best order (device -> jobs) for ``case``, and the span it computed for it."""
    f, i, w, comm = stage_costs(case)
    p = case.p
    config = zb.GraphConfig(mem_f=[1.0] * p, mem_b=[ACT_W - 1.0] * p, mem_w=[-ACT_W] * p,
                            max_mem=[float(case.memory)] * p, cost_f=f, cost_b=i, cost_w=w, cost_comm=float(comm),
                            n_stages=p, n_micro=case.m)
    graph = zb.Graph.build_graph(p, case.m, config)
    span, index, _ = zb.initial_solution(graph, print_result=False)
    order: dict[int, list[tuple[int, Job]]] = {d: [] for d in range(p)}
    for node in range(graph.nnodes):
        kind, stage, mb = node // (p * case.m), graph.get_stage(node), node % case.m
        order[stage].append((index[node], Job(stage, mb, "FIW"[kind])))
    return {d: [job for _, job in sorted(jobs)] for d, jobs in order.items()}, span


def stage_graph(case: Case) -> StageGraph:
    f, i, w, comm = stage_costs(case)
    return chain_stage_graph(case.p, f=f, b=[a + b for a, b in zip(i, w)], w=w, comm=comm, act=1.0, act_w=ACT_W)


def peer_values(zb: types.ModuleType, case: Case, sg: StageGraph) -> tuple[dict, str]:
    """The peer's makespan and span re-timed by opsched (``None`` where it gave no valid order), and a note."""
    objectives = (Objective.MAKESPAN, Objective.ZB_SPAN)
    try:
        order, peer_span = peer_order(zb, case)
    except AssertionError as exc:  # the peer checks its own timing and may refuse its result
        return {obj: None for obj in objectives}, f"zb.py's own check failed ({exc})"
    js = JobSet(sg, case.m, True)
    events = simulate(sg, order, case.m)
    values = {obj: objective_value(js, events, obj) for obj in objectives}
    note = ""
    if abs(values[Objective.ZB_SPAN] - peer_span) > 1e-6 * peer_span:
        note = f"its own span {peer_span:.3f}"
    try:
        validate(Schedule(sg, case.m, events, memory_limit=float(case.memory)))
    except Exception as exc:  # noqa: BLE001 - an order over the limit is a result of the row
        return {obj: None for obj in objectives}, f"over the memory limit: {str(exc).splitlines()[0][:80]}"
    return values, note


def run_case(zb: types.ModuleType, case: Case, time_limit: float, solver: str) -> list[Row]:
    sg = stage_graph(case)
    values, note = peer_values(zb, case, sg)
    rows = []
    for objective in (Objective.MAKESPAN, Objective.ZB_SPAN):
        result = solve(sg, case.m, memory_limit=float(case.memory), time_limit=time_limit, solver=solver,
                       warm_orders=baseline_orders(sg, case.m), objective=objective)
        rows.append(Row(case.name, str(objective), values[objective], note, result.value, result.lower_bound,
                        str(result.status), result.solve_seconds))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer-repo", type=Path, required=True,
                    help="git directory of sail-sg/zero-bubble-pipeline-parallelism (the search tool's fetch gives it)")
    ap.add_argument("--p", default="4,8,16")
    ap.add_argument("--m-factors", default="1,2,3,4")
    ap.add_argument("--costs", default="zb,uniform,ends,random")
    ap.add_argument("--memory-factors", default="1,2", help="memory limits in units of p activations")
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per opsched solve")
    ap.add_argument("--solver", default="cbc")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    zb = load_peer(args.peer_repo)
    cases = [Case(c, p, k * p, r * p) for c in args.costs.split(",") for p in map(int, args.p.split(","))
             for k in map(int, args.m_factors.split(",")) for r in map(int, args.memory_factors.split(","))]
    rows: list[Row] = []
    print("| case | objective | zb.py | opsched | bound | status | s | opsched <= zb.py |")
    print("|---|---|---:|---:|---:|---|---:|---|")
    for case in cases:
        for row in run_case(zb, case, args.time_limit, args.solver):
            rows.append(row)
            peer = "-" if row.peer is None else f"{row.peer:.3f}"
            verdict = {True: "yes", False: "**no**", None: "-"}[row.at_or_below]
            print(f"| {row.case} | {row.objective} | {peer}{' (' + row.peer_note + ')' if row.peer_note else ''} "
                  f"| {row.opsched:.3f} | {row.bound:.3f} | {row.status} | {row.seconds:.1f} | {verdict} |",
                  flush=True)
    compared = [r for r in rows if r.at_or_below is not None]
    print(f"\nopsched at or below zb.py in {sum(r.at_or_below for r in compared)} of {len(compared)} comparisons")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"at_or_below": r.at_or_below} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
