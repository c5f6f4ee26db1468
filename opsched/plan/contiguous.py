"""The hand-written baselines on a contiguous split of the model, at the planner's memory limit.

What a user runs today: the model's topological order cut into a method's
stage count, one parallel configuration for every block, each method on its
best pipeline depth and cut (:func:`contiguous_baselines`). The planner
compares its plans with these and offers the best of them to the lower level.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace

import networkx as nx

from opsched.baselines import NAMES, run_baseline
from opsched.baselines import method as baseline_module
from opsched.schedule.placement import onto_groups
from opsched.cost.cluster import Cluster, Training, with_devices
from opsched.cost.blocks import stage_streams
from opsched.errors import OverMemory, Unsupported
from opsched.plan.plan_records import Baseline
from opsched.solving.isolate import Call, SolverCrash, run_isolated_all
from opsched.schedule import Edge, Schedule, Stage, StageGraph, metrics
from opsched.upper.layouts import Layout, layouts
from opsched.units import bytes_text, plain, seconds_text
from opsched.upper.mip import CostTable, UpperProblem, contiguous_start, uniform_start, upper_problem

log = logging.getLogger(__name__)


def method_stage_count(method: str, groups: int) -> int:
    """Logical stages a hand-written method uses on ``groups`` pipeline ranks.

    Its placement's ``stages_per_device`` for a chain of one stage per rank, times the ranks.

    >>> [method_stage_count(name, 4) for name in ("1f1b", "interleaved-1f1b", "zb-v", "dualpipe")]
    [4, 8, 8, 4]
    """
    return baseline_module(method).stages_per_device(groups, groups) * groups


@dataclass
class ContiguousChain:
    """A contiguous split of the model as a chain of stages on pseudo-devices (:func:`contiguous_chain`)."""

    stage_graph: StageGraph
    syncs: list[float]  # each stage's gradient sync per step
    config: str  # the parallel configuration's name, e.g. "dp4+ep"
    blocks_of_stage: list[list[tuple[int, str]]]  # stage k -> (block id, mode name), in model order


def contiguous_chain(p: UpperProblem, uniform: bool = True) -> ContiguousChain | None:
    """A contiguous split of ``p`` as a chain on pseudo-devices, one per group.

    ``uniform``: one parallel configuration for every block, as users set it
    (:func:`opsched.upper.mip.uniform_start`); else per-block modes chosen by
    the mode MIP (:func:`opsched.upper.mip.contiguous_start`).

    Stage k runs on pseudo-device ``k mod G`` (so a baseline can re-place the
    chain); a stage's figures are its blocks' under their modes; the edge
    k -> k+1 carries every block edge that crosses the cut after stage k.
    Returns the chain with each stage's gradient sync, the configuration's
    name and the blocks of each stage, or None when no contiguous split fits
    in memory. Empty slots are dropped.
    """
    if uniform:
        found = uniform_start(p)
        if found is None:
            return None
        config, start = found
    else:
        config, start = "per-block modes", contiguous_start(p)
        if start is None:
            return None
    used = sorted({s for s, _ in start.values()})
    index = {s: i for i, s in enumerate(used)}
    G = p.layout.groups
    stages, syncs, blocks_of_stage = [], [], []
    for s in used:
        k = index[s]
        costs = [p.cost[(b, p.group(s), m)] for b, (slot, m) in start.items() if slot == s]
        blocks_of_stage.append([(b, str(start[b][1])) for b in p.blocks if start[b][0] == s])
        stages.append(
            Stage(
                id=k,
                devices=(k % G,),
                time={"F": sum(c.F for c in costs), "I": sum(c.I for c in costs), "W": sum(c.W for c in costs)},
                param_bytes=sum(c.param_bytes for c in costs),
                act_bytes=sum(c.act_bytes for c in costs),
                act_w_bytes=sum(c.act_w_bytes for c in costs),
                name=f"part{k}",
                streams=stage_streams(costs) if p.overlap_pairs else None,
            )
        )
        syncs.append(sum(c.grad_sync for c in costs))
    edges = []
    for k in range(len(used) - 1):
        crossing = sum(n for (u, v), n in p.edges.items() if index[start[u][0]] <= k < index[start[v][0]])
        a, c = used[k], used[k + 1]
        time_ = 0.0 if p.group(a) == p.group(c) else p.links.latency(a, c) + crossing * p.links.rate(a, c)
        edges.append(Edge(k, k + 1, time=time_, bytes=crossing))
    return ContiguousChain(StageGraph(stages, edges, num_devices=G), syncs, config, blocks_of_stage)


def _device_sync(method: str, syncs: list[float], groups: int) -> float:
    """The largest per-pseudo-device gradient sync when a method places the chain its way.

    Stage k's sync counts on every device of the method's ``devices_of(k, groups)``
    (DualPipe's two copies: on both). ``syncs`` has at most the method's
    stage count (:func:`method_stage_count`) entries.

    >>> _device_sync("zb-v", [1.0, 2.0, 3.0, 4.0], 2), _device_sync("dualpipe", [1.0, 2.0], 2)
    (5.0, 3.0)
    """
    devices_of = baseline_module(method).devices_of
    per = [0.0] * groups
    for k, s in enumerate(syncs):
        for d in devices_of(k, groups):
            per[d] += s
    return max(per) if syncs else 0.0


def on_real_devices(schedule: Schedule, layout: Layout) -> Schedule:
    """A schedule on pseudo-devices (one per group) moved onto the groups' real devices."""
    groups = [tuple(layout.devices_of_group(g)) for g in range(layout.groups)]
    return onto_groups(schedule, groups, layout.devices)


#: the contiguous split is cut for these fractions of the memory limit (a tighter
#: cut balances memory more evenly, which some methods need to fit at all)
SPLIT_MEMORY_SCALES = (1.0, 0.9, 0.8, 0.7, 0.6)


def contiguous_baselines(
    bg: nx.DiGraph, cluster: Cluster, training: Training, memory_limit: float, table: CostTable | None = None,
    deadline: float | None = None, workers: int = 1, found_elsewhere: bool = False,
) -> tuple[list[Baseline], Baseline | None, dict[str, str]]:
    """Every hand-written method on its best contiguous split at the same memory.

    For each method and each pipeline depth G ≥ 2 (G divides the devices,
    groups of N/G devices with the upper level's cost model and per-block
    modes), the topological order is cut into the method's stage count
    (:func:`contiguous_chain`, cut for each of :data:`SPLIT_MEMORY_SCALES` of
    the limit); the method runs on it with the full memory limit, and the
    split with the best step time is kept. Returns one :class:`Baseline` per method that fits
    anywhere (sorted by step time), the overall best, and method -> the reason
    for every method that fits nowhere (:func:`refusal_reason`). Past
    ``deadline`` (a :func:`time.monotonic` instant) the depths not yet tried
    are skipped once some method has a baseline, or at once with
    ``found_elsewhere`` (the caller holds a plan already: a search on fewer
    devices or as a chain, or one offered the Megatron-style layouts); a
    method left with none says so. ``workers`` depths are tried at once,
    each in its own process.
    """
    rows, best, refused = _contiguous_rows(bg, cluster, training, memory_limit, table, deadline, workers,
                                           found_elsewhere)
    _log_rows(rows)
    for name, reason in refused.items():
        log.info("baseline: %s refused: %s", name, reason)
    return rows, best, refused


def _contiguous_rows(
    bg: nx.DiGraph, cluster: Cluster, training: Training, memory_limit: float, table: CostTable | None = None,
    deadline: float | None = None, workers: int = 1, found_elsewhere: bool = False,
) -> tuple[list[Baseline], Baseline | None, dict[str, str]]:
    """:func:`contiguous_baselines` without its progress lines; ``workers`` pipeline depths at once.

    Each depth is tried on its own (:func:`_rows_at_depth`), in its own
    process when ``workers`` > 1, and the depths' rows are merged in depth
    order, so the result is the same for any ``workers`` unless the clock
    stops some depths.
    """
    table = table or CostTable(bg, cluster, training)  # costs do not change with the memory scale
    depths = [lay for lay in layouts(cluster, max_virtual=1) if lay.groups >= 2]
    found: list[_DepthRows | SolverCrash | None] = [None] * len(depths)  # filled as each depth's rows arrive

    def take(k: int, rows: _DepthRows | SolverCrash) -> None:
        found[k] = rows

    def next_call(k: int, running: int) -> Call | None:
        # past the deadline, the depths not yet tried are skipped once some method has a baseline, and a depth
        # under way stops between methods (once it, or a depth before it, has one); with a plan found elsewhere
        # the clock alone decides: the search for one to fall back on cost a 1,024-GPU DeepSeek-V3 plan 230 s
        some = found_elsewhere or any(isinstance(r, _DepthRows) and r.best for r in found)
        if deadline is not None and time.monotonic() > deadline and some:
            return None
        return Call(_rows_at_depth, (bg, depths[k], cluster, training, memory_limit, table, deadline, some),
                    timeout=DEPTH_TIMEOUT)

    if workers > 1:
        run_isolated_all(next_call, len(depths), jobs=workers, on_result=take)
    else:  # in this process: no fork per depth
        for k in range(len(depths)):
            if (call := next_call(k, 0)) is not None:
                take(k, call.fn(*call.args))
    skipped = False
    best: dict[str, Baseline] = {}
    reasons: dict[str, dict[int, str]] = {name: {} for name in NAMES}  # method -> depth -> first reason
    for lay, rows in zip(depths, found):
        if not isinstance(rows, _DepthRows):  # skipped, or its process died
            skipped = True
            continue
        skipped = skipped or rows.cut
        for method, reason in rows.reasons.items():
            reasons[method].setdefault(lay.groups, reason)
        for method, cand in rows.best.items():
            if method not in best or cand.step_time < best[method].step_time:
                best[method] = cand
    rows = sorted(best.values(), key=lambda b: (b.step_time, b.method))
    refused = {name: refusal_reason(reasons[name], cluster.devices) for name in NAMES if name not in best}
    if skipped:  # what was not tried is not refused: the clock stopped it
        refused = {name: f"not tried on every split: the time limit was spent ({why})" if reasons[name] else
                   "not tried: the time limit was spent" for name, why in refused.items()}
    return rows, (rows[0] if rows else None), refused


#: how long one pipeline depth's baselines may take in their own process (seconds: they take well under one on the
#: bundled models; only a hung process meets it)
DEPTH_TIMEOUT = 3600.0


@dataclass
class _DepthRows:
    """What the methods gave at one pipeline depth: each one's best baseline there, or why it was refused there."""

    best: dict[str, Baseline]
    reasons: dict[str, str]
    #: the deadline stopped the depth before every method ran
    cut: bool = False


def _rows_at_depth(bg: nx.DiGraph, lay: Layout, cluster: Cluster, training: Training, memory_limit: float,
                   table: CostTable, deadline: float | None = None, found_before: bool = False) -> _DepthRows:
    """Every method on its best contiguous split into ``lay.groups`` groups (each memory scale's cut); past
    ``deadline``, the methods left are not run once a baseline exists (here, or ``found_before`` elsewhere)."""
    M, G = training.microbatches, lay.groups
    best: dict[str, Baseline] = {}
    reasons: dict[str, str] = {}
    chains: dict[tuple[int, float], ContiguousChain | None] = {}
    ran: set[tuple] = set()  # a tighter memory scale often cuts the same split: each method runs on it once
    for method, scale in itertools.product(NAMES, SPLIT_MEMORY_SCALES):
        if deadline is not None and (best or found_before) and time.monotonic() > deadline:
            return _DepthRows(best, reasons, cut=True)
        count = method_stage_count(method, G)
        if (count, scale) not in chains:
            shape = Layout(lay.devices, G) if count == G else Layout(lay.devices, G, count // G, "interleaved")
            chains[count, scale] = contiguous_chain(upper_problem(bg, shape, cluster, training, memory_limit * scale,
                                                                  table))
        chain = chains[count, scale]
        if chain is None:
            reasons.setdefault(method, "no contiguous split of the model fits in the memory limit")
            continue
        if (split := (method, chain.config, tuple(map(tuple, chain.blocks_of_stage)))) in ran:
            continue  # at the full memory limit, the same split gives the same schedule
        ran.add(split)
        t0 = time.perf_counter()
        try:
            sched = run_baseline(method, chain.stage_graph, M, memory_limit=memory_limit)
        except Unsupported as exc:
            # a memory refusal counts in bytes here, so it is worded with their units
            reasons.setdefault(method, exc.worded(bytes_text) if isinstance(exc, OverMemory) else str(exc))
            continue
        m = metrics(sched)
        sync = _device_sync(method, chain.syncs, G)
        cand = Baseline(
            method=method,
            layout=f"{G}x{lay.group_size} contiguous, {chain.config}",
            schedule=on_real_devices(sched, lay),
            makespan=m.makespan,
            step_time=sched.step_time(sync),
            bubble_ratio=m.bubble_ratio,
            peak_memory_bytes=max(m.peak_memory_bytes, default=0.0),
            grad_sync=sync,
            solve_seconds=time.perf_counter() - t0,
            stage_blocks=_placed_blocks(sched.stage_graph, chain.blocks_of_stage),
        )
        if method not in best or cand.step_time < best[method].step_time:
            best[method] = cand
    return _DepthRows(best, reasons)


def _log_rows(rows: list[Baseline]) -> None:
    for b in rows:
        log.info("baseline: %s on %s: step time %s, bubble ratio %.3f",
                 b.method, b.layout, seconds_text(b.step_time), b.bubble_ratio)


def fewer_device_baselines(
    bg: nx.DiGraph, cluster: Cluster, training: Training, memory_limit: float, deadline: float | None = None,
    workers: int = 1,
) -> list[Baseline]:
    """The best hand-written baseline on the first half, the first quarter, ... of the nodes, the rest idle.

    More devices can make every split slower (groups that straddle nodes, a
    group's traffic growing with it, as many microbatches as before), and a
    plan on more nodes should never be slower than one on fewer, which could
    leave the others idle: these rows join the planner's baselines so that it
    can choose them (its report then names the idle devices and why). Whole
    nodes only, down to one: devices idle within a busy node are not offered
    (a single node's plan keeps every device busy unless the search itself
    finds otherwise). One row per device count, its ``layout`` saying how
    many devices it uses. Past ``deadline`` (a :func:`time.monotonic`
    instant) the counts not yet tried are skipped.

    >>> import networkx as nx
    >>> from opsched.cost.cluster import preset
    >>> from opsched.model.graph import Block
    >>> bg = nx.DiGraph(kind="BlockGraph")
    >>> for i in range(4):
    ...     bg.add_node(i, block=Block(i, f"b{i}", (), (), flops=1e12, param_count=10**6, output_bytes=1e6, saved_bytes=1e6))
    >>> bg.add_edges_from([(0, 1), (1, 2), (2, 3)], bytes=1e6)
    >>> [b.layout.split(", on ")[1] for b in fewer_device_baselines(bg, preset("h100-sxm", 32), Training(), 8e10)]
    ['16 of the 32 devices', '8 of the 32 devices']
    >>> fewer_device_baselines(bg, preset("h100-sxm", 8), Training(), 8e10)  # one node: none
    []
    """
    rows, n, per_node = [], cluster.devices, cluster.devices_per_node
    while n % (2 * per_node) == 0 and (deadline is None or time.monotonic() < deadline):
        n //= 2
        # a row here is only an alternative to those on every device: the clock alone stops it
        found, _, _ = _contiguous_rows(bg, with_devices(cluster, n), training, memory_limit, deadline=deadline,
                                       workers=workers, found_elsewhere=True)
        rows += [replace(b, layout=f"{b.layout}, on {plain(n)} of the {plain(cluster.devices)} devices")
                 for b in found[:1]]
    _log_rows(rows)
    return rows


def _placed_blocks(placed: StageGraph, blocks_of_stage: list[list[tuple[int, str]]]) -> dict[int, list[tuple[int, str]]]:
    """Stage id of a method's placed chain -> the blocks it holds (a copy holds its original's).

    Empty when the method regrouped the chain (its stage count differs), so
    that no stage is said to hold blocks it does not.
    """
    originals = [s for s in placed.stages if s.copy_of is None]
    if len(originals) != len(blocks_of_stage):
        return {}
    return {s.id: blocks_of_stage[s.id if s.copy_of is None else s.copy_of] for s in placed.stages}


def refusal_reason(by_depth: dict[int, str], devices: int) -> str:
    """One line for a method that fits nowhere, from its first refusal at each pipeline depth.

    >>> refusal_reason({2: "needs 9e10 per device", 4: "needs 9e10 per device", 8: "needs an even depth"}, 8)
    'at 2 and 4 groups: needs 9e10 per device; at 8 groups: needs an even depth'
    >>> refusal_reason({}, 1)
    'a pipeline needs at least 2 device groups, got 1 device'
    """
    if not by_depth:
        return f"a pipeline needs at least 2 device groups, got {devices} device{'' if devices == 1 else 's'}"
    depths: dict[str, list[int]] = {}
    for G, reason in sorted(by_depth.items()):
        depths.setdefault(reason, []).append(G)
    parts = []
    for reason, gs in depths.items():
        listed = str(gs[0]) if len(gs) == 1 else ", ".join(map(str, gs[:-1])) + f" and {gs[-1]}"
        parts.append(f"at {listed} groups: {reason}")
    return "; ".join(parts)
