"""The upper MIP: each block to a slot (so a device group) and a parallel mode.

The math, with the same symbols, is in ``docs/formulation.md (section "Upper level")``. Each
constraint family is one function named after it, in :mod:`opsched.upper.constraints`;
:func:`solve_upper` builds the model from them, and :func:`estimate` evaluates the same objective for a
given assignment in plain Python (used for warm starts, reports and tests).

Symbols: blocks ``b``, block edges ``(u, v)`` with ``bytes_uv``, slots
``s = 0..S-1`` on groups ``g(s)``, modes ``m`` of a block; ``x[b,s,m]``
binary; ``X[b,s] = Σ_m x[b,s,m]``; ``work[b,g,m]`` = F + I + W of the block,
``par[b,g,m]`` and ``act[b,g,m]`` its per-device parameter and activation
bytes, ``sync[b,g,m]`` its gradient all-reduce per step; ``n(s) = min(M, S - s)``
microbatches in flight at slot ``s``.

>>> import networkx as nx
>>> from opsched.model.graph import Block
>>> from opsched.cost.cluster import preset, Training
>>> from opsched.upper.layouts import Layout
>>> bg = nx.DiGraph(kind="BlockGraph")
>>> for i in range(4):
...     bg.add_node(i, block=Block(i, f"b{i}", (), (), flops=1e12, param_count=10**6, output_bytes=1e6, saved_bytes=1e6))
>>> bg.add_edges_from([(0, 1), (1, 2), (2, 3)], bytes=1e6)
>>> p = upper_problem(bg, Layout(2, 2), preset("h100-sxm", 2), Training(microbatches=4))
>>> sol = solve_upper(p)
>>> sorted(set(s for s, _ in sol.assignment.values()))   # both groups used, two blocks each
[0, 1]
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

import mip
import networkx as nx

from opsched.cost.cluster import Cluster, Training
from opsched.cost.blocks import BlockCost, Mode, block_cost, expert_count, modes_for
from opsched.errors import OpschedError
from opsched.solving.solver import Status, new_model
from opsched.units import bytes_text
from opsched.upper.constraints import (
    cut_edge_transfers,
    each_block_once,
    memory_per_device,
    no_backward_flow,
    step_time_estimate,
)
from opsched.upper.layouts import Layout, config_name
from opsched.upper.towers import side_by_side_start, tower_regions

#: block id -> (slot, mode)
Assignment = dict[int, tuple[int, Mode]]


@dataclass
class UpperProblem:
    """Everything the MIP and :func:`estimate` need, precomputed from the inputs."""

    blocks: list[int]  # block ids in topological order
    edges: dict[tuple[int, int], float]  # (u, v) -> bytes per microbatch
    layout: Layout
    modes: dict[int, list[Mode]]
    cost: Mapping[tuple[int, int, Mode], BlockCost]  # (block, group, mode); a GroupCosts from upper_problem
    microbatches: int
    memory_limit: float
    links: SlotLinks  # seconds per byte and per message between two slots
    names: dict[int, str] = field(default_factory=dict)
    domain: dict[int, list[int]] | None = None  # block -> slots it may take (None: all)
    overlap_pairs: bool = True  # the stages carry stream operations (Training.overlap_pairs)
    experts: frozenset[int] = frozenset()  # blocks holding experts (not towers: opsched.upper.towers)

    @property
    def slots(self) -> int:
        return self.layout.slots

    def allowed(self, b: int) -> list[int]:
        """Slots block ``b`` may take, increasing."""
        return list(range(self.slots)) if self.domain is None else self.domain[b]

    def choices(self, b: int) -> list[tuple[int, Mode]]:
        """Every (slot, mode) block ``b`` may take."""
        return [(s, m) for s in self.allowed(b) for m in self.modes[b]]

    def in_flight(self, slot: int) -> int:
        """Microbatches whose activations slot ``slot`` holds at peak (1F1B-like): min(M, S - s)."""
        return min(self.microbatches, self.slots - slot)

    def group(self, slot: int) -> int:
        return self.layout.group_of_slot(slot)


@dataclass
class UpperSolution:
    """An assignment with its estimated step time and how the solver fared."""

    layout: Layout
    assignment: Assignment
    estimate: dict[str, float]  # see :func:`estimate`
    status: Status  # NO_SOLUTION: the MIP found nothing within its budget and the warm start is kept
    bound: float  # the solver's proven lower bound on the objective (0 after a window search)
    solve_seconds: float
    #: found by the window search (:func:`solve_upper` with ``window``): its bound is not a global one
    windowed: bool = False

    @property
    def status_text(self) -> str:
        """The status as a report shows it, e.g. ``window search, time limit reached``."""
        return f"window search, {self.status}" if self.windowed else str(self.status)

    @property
    def objective(self) -> float:
        return self.estimate["step_time"]


class CostTable:
    """Block costs by group shape, shared by every layout (and memory limit) of one plan.

    A block's cost on a group of consecutive devices depends on the devices
    only through which of them share a node (:meth:`Cluster.link`), so two
    groups of the same size that start at the same offset within a node cost
    the same: each block is costed once per mode and such shape, not once
    per group of every layout.

    >>> import networkx as nx
    >>> from opsched.model.graph import Block
    >>> from opsched.cost.cluster import preset, Training
    >>> bg = nx.DiGraph(kind="BlockGraph")
    >>> bg.add_node(0, block=Block(0, "mlp", (), (), flops=1e12, param_count=10**6))
    >>> table = CostTable(bg, preset("h100-sxm", 16), Training())
    >>> table.cost(0, Mode(dp=2), (0, 1)) is table.cost(0, Mode(dp=2), (8, 9))  # the same place in a node
    True
    """

    def __init__(self, bg: nx.DiGraph, cluster: Cluster, training: Training):
        self.bg, self.cluster, self.training = bg, cluster, training
        self._costs: dict[tuple[int, Mode, int, int], BlockCost] = {}
        self._extra: dict[int, dict] = {}

    @functools.cached_property
    def experts(self) -> frozenset[int]:
        """The blocks holding experts, found once for every layout (:func:`expert_count` reads every op's name)."""
        return frozenset(b for b in self.bg.nodes
                         if self.bg.nodes[b].get("expert_params") or expert_count(self.bg.nodes[b]["block"]) > 0)

    def shape(self, devices: tuple[int, ...]) -> tuple[int, int]:
        """What a block's cost on ``devices`` (consecutive) depends on: their count and offset within a node."""
        return len(devices), devices[0] % self.cluster.devices_per_node

    def cost(self, b: int, mode: Mode, devices: tuple[int, ...]) -> BlockCost:
        """:func:`opsched.cost.blocks.block_cost` of block ``b`` under ``mode`` on ``devices`` (consecutive)."""
        key = (b, mode, *self.shape(devices))
        if key not in self._costs:
            if b not in self._extra:
                node = self.bg.nodes[b]
                self._extra[b] = {
                    "expert_params": node.get("expert_params"),
                    # the tokens an expert-parallel block exchanges: what its experts receive when the reduction
                    # recorded it (opsched.upper.reduce.expert_traffic), else its largest input
                    "token_bytes": node.get("expert_tokens") or max(
                        (d.get("bytes", 0.0) for _, _, d in self.bg.in_edges(b, data=True)), default=None),
                    "moe_layers": max(1, node.get("moe_layers", 1)),
                }
            self._costs[key] = block_cost(self.bg.nodes[b]["block"], mode, devices, self.cluster, self.training,
                                          **self._extra[b])
        return self._costs[key]


def upper_problem(
    bg: nx.DiGraph,
    layout: Layout,
    cluster: Cluster,
    training: Training,
    memory_limit: float | None = None,
    table: CostTable | None = None,
) -> UpperProblem:
    """Precompute costs of every block under every mode on every group, and slot-to-slot links.

    ``table``: block costs shared with other layouts of the same ``bg``,
    cluster and training (default: a new one).
    """
    if layout.devices != cluster.devices:
        raise OpschedError(f"layout {layout} is for {layout.devices} devices, the cluster has {cluster.devices}")
    if bg.number_of_nodes() == 0:
        raise OpschedError("the block graph is empty; nothing to place")
    if not nx.is_directed_acyclic_graph(bg):
        raise OpschedError("the block graph has a cycle; coarsening must keep it a DAG")
    table = table or CostTable(bg, cluster, training)
    if table.bg is not bg or (table.cluster, table.training) != (cluster, training):
        raise ValueError("the cost table was made for another block graph, cluster or training")
    blocks = list(nx.lexicographical_topological_sort(bg))
    records = {b: bg.nodes[b]["block"] for b in blocks}
    # replicas take whole sequences of a microbatch; without a global batch (opsched plan --global-batch) a split
    # they would not take whole is context parallelism instead, its K/V ring costed (cost.blocks.block_cost)
    modes = {b: modes_for(records[b], layout.group_size, training.microbatch_size,
                          context=not training.whole_sequences) for b in blocks}
    cost = GroupCosts(table, layout, modes)
    edges = {(u, v): float(d.get("bytes", 0.0)) for u, v, d in bg.edges(data=True)}
    return UpperProblem(
        blocks=blocks,
        edges=edges,
        layout=layout,
        modes=modes,
        cost=cost,
        microbatches=training.microbatches,
        memory_limit=float(cluster.memory_bytes if memory_limit is None else memory_limit),
        links=SlotLinks(layout, cluster),
        names={b: records[b].name for b in blocks},
        overlap_pairs=training.overlap_pairs,
        experts=table.experts,
    )


class GroupCosts(Mapping):
    """An upper problem's block costs, ``(block, group, mode) -> BlockCost``, held once per group shape.

    The groups of a layout come in at most a node's size of shapes
    (:meth:`CostTable.shape`), so a layout of thousands of groups keeps a few
    costs per block and mode, not one per group: the mapping reads the same
    for every group, in memory that does not grow with the device count.

    >>> import networkx as nx
    >>> from opsched.model.graph import Block
    >>> from opsched.cost.cluster import preset, Training
    >>> bg = nx.DiGraph(kind="BlockGraph")
    >>> bg.add_node(0, block=Block(0, "mlp", (), (), flops=1e12, param_count=10**6))
    >>> table = CostTable(bg, preset("h100-sxm", 4096), Training())
    >>> costs = GroupCosts(table, Layout(4096, 4096), {0: [Mode()]})
    >>> len(costs), len(costs._costs), costs[(0, 4095, Mode())] is costs[(0, 7, Mode())]
    (4096, 8, True)
    """

    def __init__(self, table: CostTable, layout: Layout, modes: dict[int, list[Mode]]):
        self._groups, self._modes = layout.groups, modes
        size, per_node = layout.group_size, table.cluster.devices_per_node
        shapes: dict[int, int] = {}  # offset within a node -> shape index
        self._shape_of = [shapes.setdefault(g * size % per_node, len(shapes)) for g in range(layout.groups)]
        first = {i: self._shape_of.index(i) for i in shapes.values()}  # a group of each shape
        self._costs = {(b, i, m): table.cost(b, m, layout.devices_of_group(g))
                       for i, g in first.items() for b in modes for m in modes[b]}

    def __getitem__(self, key: tuple[int, int, Mode]) -> BlockCost:
        b, g, m = key
        if not 0 <= g < self._groups:
            raise KeyError(key)
        return self._costs[(b, self._shape_of[g], m)]

    def __iter__(self) -> Iterator[tuple[int, int, Mode]]:
        return ((b, g, m) for g in range(self._groups) for b in self._modes for m in self._modes[b])

    def __len__(self) -> int:
        return self._groups * sum(len(ms) for ms in self._modes.values())


class SlotLinks:
    """The terms of cost.transfer_time between two slots: 0 within one group, else the link between the groups.

    Found once per pair of groups, and only for the pairs asked about: a
    layout of S slots has S²/2 pairs, most of which no block edge joins.

    >>> from opsched.cost.cluster import preset
    >>> links = SlotLinks(Layout(16, 4, 2, "v"), preset("h100-sxm", 16))
    >>> links.rate(0, 7), links.rate(0, 1) == 1 / preset("h100-sxm").intra_node_bandwidth
    (0.0, True)
    """

    def __init__(self, layout: Layout, cluster: Cluster):
        self.layout, self.cluster = layout, cluster
        self._groups: dict[tuple[int, int], tuple[float, float]] = {}

    def _pair(self, a: int, c: int) -> tuple[float, float]:
        ga, gc = self.layout.group_of_slot(a), self.layout.group_of_slot(c)
        if ga == gc:
            return 0.0, 0.0
        key = (min(ga, gc), max(ga, gc))
        if key not in self._groups:
            bw, lat = self.cluster.link(self.layout.devices_of_group(ga), self.layout.devices_of_group(gc))
            self._groups[key] = (1.0 / bw, lat)
        return self._groups[key]

    def rate(self, a: int, c: int) -> float:
        """Seconds per byte from slot ``a`` to slot ``c``."""
        return self._pair(a, c)[0]

    def latency(self, a: int, c: int) -> float:
        """Seconds per message from slot ``a`` to slot ``c``."""
        return self._pair(a, c)[1]

    def max_rate(self) -> float:
        """The largest rate over every pair of slots (0 with one group)."""
        if self.layout.groups < 2:
            return 0.0
        return max(self._pair(a, c)[0] for a, c in self._group_pair_slots())

    def latency_sum(self) -> float:
        """The sum of the latencies over every pair of slots ``a < c``: each pair of groups has v² of them."""
        v = self.layout.virtual
        return v * v * sum(self._pair(a, c)[1] for a, c in self._group_pair_slots())

    def _group_pair_slots(self):
        """One slot pair per pair of distinct groups (a slot of each)."""
        first = {}
        for s in range(self.layout.slots):
            first.setdefault(self.layout.group_of_slot(s), s)
        slots = [first[g] for g in sorted(first)]
        return itertools.combinations(slots, 2)


# --------------------------------------------------------------------------- evaluation


def estimate(p: UpperProblem, assignment: Assignment) -> dict[str, float]:
    """The objective of the MIP for one assignment, in plain Python.

    Returns ``step_time = (M - 1)·bottleneck + critical_path + grad_sync`` and
    its parts, ``memory`` (the largest per-device memory over groups) and
    ``feasible`` (1.0 when no block flows back and memory fits, else 0.0).
    """
    S, G = p.slots, p.layout.groups
    slot_work = [0.0] * S
    slot_path = [0.0] * S  # F + I: what a microbatch's fill-and-drain path waits for
    group_work = [0.0] * G
    group_sync = [0.0] * G
    group_mem = [0.0] * G
    for b, (s, m) in assignment.items():
        c = p.cost[(b, p.group(s), m)]
        slot_work[s] += c.work
        slot_path[s] += c.F + c.I
        group_work[p.group(s)] += c.work
        group_sync[p.group(s)] += c.grad_sync
        group_mem[p.group(s)] += c.param_bytes + p.in_flight(s) * c.act_bytes
    flows_back = any(assignment[u][0] > assignment[v][0] for u, v in p.edges)
    pair_bytes: dict[tuple[int, int], float] = {}
    for (u, v), nbytes in p.edges.items():
        a, c = assignment[u][0], assignment[v][0]
        if a < c:
            pair_bytes[(a, c)] = pair_bytes.get((a, c), 0.0) + nbytes
    tau = {(a, c): p.links.latency(a, c) + n * p.links.rate(a, c) for (a, c), n in pair_bytes.items()}
    bottleneck = max(group_work + [2 * t for t in tau.values()])
    finish = [0.0] * S
    for s in range(S):
        finish[s] = slot_path[s] + max([finish[a] + 2 * tau[(a, c)] for (a, c) in tau if c == s], default=0.0)
    critical = max(finish)
    sync = max(group_sync)
    memory = max(group_mem)
    return {
        "step_time": (p.microbatches - 1) * bottleneck + critical + sync,
        "bottleneck": bottleneck,
        "critical_path": critical,
        "grad_sync": sync,
        "memory": memory,
        "feasible": float(not flows_back and memory <= p.memory_limit * (1 + 1e-9)),
    }


# --------------------------------------------------------------------------- solve


def contiguous_start(p: UpperProblem, refine_modes: bool = True, solver: str = "cbc") -> Assignment | None:
    """A feasible assignment to warm-start from: the topological order cut into slots.

    Mode rules (each block's least-work mode; its least-memory mode; its
    least-work mode within a fair share of memory, at three scales) times two
    cut rules (equal shares of the total work; the smallest per-slot work cap
    that a greedy left-to-right fill meets within memory, by bisection). With
    ``refine_modes`` each distinct cut then gets the best modes for its slots
    (:func:`best_modes`, a small MIP) and is cut once more with those modes.
    Returns the best of these under :func:`estimate`, or None when none fits.
    """
    candidates = []
    for chosen in _mode_rules(p):
        candidates.append(_proportional_cut(p, chosen))
        candidates.append(_capped_cut(p, chosen))
    if refine_modes:
        seen, refined = set(), []
        for a in candidates:
            if a is None or tuple(a[b][0] for b in p.blocks) in seen:
                continue
            seen.add(tuple(a[b][0] for b in p.blocks))
            better = best_modes(p, a, solver=solver)
            if better is not None:
                refined.append(better)
                refined.append(_capped_cut(p, {b: m for b, (_, m) in better.items()}))
        candidates += refined
    best = None
    for a in candidates:
        if a is None:
            continue
        est = estimate(p, a)
        if est["feasible"] and (best is None or est["step_time"] < best[1]):
            best = (a, est["step_time"])
    return None if best is None else best[0]


def _mode_rules(p: UpperProblem) -> list[dict[int, Mode]]:
    """The modes :func:`contiguous_start` cuts with: each block's least-work mode; its least-memory mode; its
    least-work mode within a fair share of memory, at three scales."""
    rules = [{b: min(p.modes[b], key=_mode_key(p, b, pick)) for b in p.blocks} for pick in ("work", "memory")]
    for scale in (1.0, 0.7, 0.5):
        rules.append(_fair_share_modes(p, scale))
    return rules


def towers_start(p: UpperProblem, solver: str = "cbc") -> Assignment | None:
    """The best start with the model's towers side by side on groups of their own
    (:func:`opsched.upper.towers.side_by_side_start`) under :func:`estimate`, over the mode rules of
    :func:`contiguous_start`, its modes then refined as there (:func:`best_modes`); None when the model has no
    parallel towers or none of these fits.

    A start of its own, not one of :func:`contiguous_start`'s cuts: that one is also the contiguous split the
    hand-written schedules run on (a chain), and these stages form a DAG.
    """
    found = tower_regions(p)
    if not found:
        return None
    best = None
    for chosen in _mode_rules(p):
        a = side_by_side_start(p, chosen, found)
        if a is None:
            return None  # one group: the same for every rule
        est = estimate(p, a)
        if est["feasible"] and (best is None or est["step_time"] < best[1]):
            best = (a, est["step_time"])
    if best is None:
        return None
    better = best_modes(p, best[0], solver=solver)
    if better is not None and estimate(p, better)["step_time"] < best[1]:
        return better
    return best[0]


def uniform_families(p: UpperProblem) -> list[tuple[str, dict[int, Mode]]]:
    """One parallel configuration for the whole model, the way users set one today.

    For each split ``tp × dp`` of the group: every block with weights takes
    it (blocks without weights are data-parallel), optionally with expert
    blocks expert-parallel instead (``+ep``). Returns (name, modes) pairs.
    """
    k = p.layout.group_size
    families = []
    weighted = [b for b in p.blocks if any(p.cost[(b, 0, m)].param_bytes > 0 for m in p.modes[b])]
    for t in [d for d in range(1, k + 1) if k % d == 0]:
        # the split with tp = t a block with weights may take (replicas of whole sequences, or context parallel)
        wanted = next((m for b in weighted for m in p.modes[b] if m.tp == t and m.ep == 1), Mode(tp=t, dp=k // t))
        if weighted and not any(wanted in p.modes[b] for b in weighted):
            continue  # no block may take it (replicas would split a sequence): not a configuration to name
        for with_ep in (False, True):
            if with_ep and not any(m.ep > 1 for b in p.blocks for m in p.modes[b]):
                continue
            modes = {}
            for b in p.blocks:
                eps = [m for m in p.modes[b] if m.ep > 1]
                if with_ep and eps:
                    modes[b] = eps[0]
                elif wanted in p.modes[b]:
                    modes[b] = wanted
                else:
                    modes[b] = p.modes[b][0]  # blocks without weights: data-parallel only
            families.append((config_name(wanted, with_ep), modes))
    return families


def uniform_start(p: UpperProblem) -> tuple[str, Assignment] | None:
    """The best contiguous split under one uniform configuration (:func:`uniform_families`), or None if none fits."""
    best = None
    for name, modes in uniform_families(p):
        for a in (_proportional_cut(p, modes), _capped_cut(p, modes)):
            if a is None:
                continue
            est = estimate(p, a)
            if est["feasible"] and (best is None or est["step_time"] < best[0]):
                best = (est["step_time"], name, a)
    return None if best is None else (best[1], best[2])


def best_modes(p: UpperProblem, assignment: Assignment, solver: str = "cbc", time_limit: float = 5.0) -> Assignment | None:
    """The same slots with the best modes for them (the upper MIP with every block's slot fixed).

    ``assignment`` need not fit in memory; returns None when no choice of modes does.
    """
    fixed = replace(p, domain={b: [assignment[b][0]] for b in p.blocks})
    start = assignment if estimate(p, assignment)["feasible"] else None
    found, _, _ = _solve_once(fixed, time_limit, solver, start, 1)
    return found


def _fair_share_modes(p: UpperProblem, scale: float) -> dict[int, Mode]:
    """Each block's least-work mode whose memory stays within ``scale`` × its fair share of the devices' memory.

    The fair share of a block is the whole cluster's memory (limit × groups)
    divided by the number of blocks; activations count at the largest
    in-flight number. Blocks with no mode that small take their least-memory mode.
    """
    share = scale * p.memory_limit * p.layout.groups / len(p.blocks)
    most = p.in_flight(0)
    chosen = {}
    for b in p.blocks:
        mem = lambda m: p.cost[(b, 0, m)].param_bytes + most * p.cost[(b, 0, m)].act_bytes  # noqa: E731
        fitting = [m for m in p.modes[b] if mem(m) <= share]
        chosen[b] = min(fitting, key=_mode_key(p, b, "work")) if fitting else min(p.modes[b], key=mem)
    return chosen


def _mode_key(p: UpperProblem, b: int, pick: str):
    def key(m: Mode):
        c = p.cost[(b, 0, m)]
        return (c.work, c.param_bytes) if pick == "work" else (c.param_bytes + c.act_bytes, c.work)

    return key


def _proportional_cut(p: UpperProblem, chosen: dict[int, Mode]) -> Assignment:
    total = sum(p.cost[(b, 0, chosen[b])].work for b in p.blocks) or 1.0
    run, assignment = 0.0, {}
    for b in p.blocks:
        w = p.cost[(b, 0, chosen[b])].work
        assignment[b] = (min(p.slots - 1, int(math.floor((run + w / 2) / total * p.slots))), chosen[b])
        run += w
    return assignment


def _greedy_fill(p: UpperProblem, chosen: dict[int, Mode], cap: float) -> Assignment | None:
    """Fill slots in order, moving on when the slot's work would pass ``cap`` or its group's memory the limit."""
    mem = [0.0] * p.layout.groups
    slot, work, assignment = 0, 0.0, {}
    for b in p.blocks:
        while True:
            if slot >= p.slots:
                return None
            g = p.group(slot)
            c = p.cost[(b, g, chosen[b])]
            need = c.param_bytes + p.in_flight(slot) * c.act_bytes
            if (work == 0.0 or work + c.work <= cap) and mem[g] + need <= p.memory_limit:
                break
            slot, work = slot + 1, 0.0
        assignment[b] = (slot, chosen[b])
        work += c.work
        mem[g] += need
    return assignment


def _capped_cut(p: UpperProblem, chosen: dict[int, Mode]) -> Assignment | None:
    works = [p.cost[(b, 0, chosen[b])].work for b in p.blocks]
    lo, hi = max(works), sum(works)
    best = _greedy_fill(p, chosen, hi)
    if best is None:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        a = _greedy_fill(p, chosen, mid)
        if a is None:
            lo = mid
        else:
            best, hi = a, mid
    return best


def within_window(p: UpperProblem, center: Assignment, radius: int) -> UpperProblem:
    """The same problem with each block limited to slots within ``radius`` of its slot in ``center``."""
    domain = {
        b: list(range(max(0, center[b][0] - radius), min(p.slots, center[b][0] + radius + 1))) for b in p.blocks
    }
    return replace(p, domain=domain)


#: branch-and-bound nodes per upper MIP solve. A work budget, not a clock, so
#: the same input, solver and threads give the same plan; the time limit is
#: only a safety cap (the status is ``Status.TIME_LIMIT`` when it binds).
MAX_NODES = 20
#: neighbourhood rounds of the windowed search at most
MAX_WINDOW_ROUNDS = 10


def solve_upper(
    p: UpperProblem,
    time_limit: float = 30.0,
    solver: str = "cbc",
    start: Assignment | None = None,
    threads: int = 1,
    window: int | None = None,
) -> UpperSolution:
    """Solve the upper MIP; raises :class:`OpschedError` when no assignment fits in memory.

    ``start`` (default: :func:`contiguous_start`) warm-starts the solver, so
    the answer is never worse than it. With ``window`` the MIP is solved
    repeatedly over slots within ``window`` of the incumbent's (a large
    neighbourhood search) until it stops improving or time runs out; the
    solution is then ``windowed`` and its bound is not a global one (0).
    Each solve is limited to :data:`MAX_NODES` branch-and-bound nodes and the
    window search to :data:`MAX_WINDOW_ROUNDS` rounds, so the result is
    deterministic for a given solver and thread count; ``time_limit`` is a
    safety cap, and the status is ``Status.TIME_LIMIT`` when it bound.
    """
    t0 = time.perf_counter()
    if start is None:
        start = contiguous_start(p, solver=solver)
    windowed = window is not None and window < p.slots - 1
    if not windowed:
        found, status, bound = _solve_once(p, time_limit, solver, start, threads)
    else:
        found, status, bound = start, Status.FEASIBLE, 0.0
        for _ in range(MAX_WINDOW_ROUNDS):
            left = time_limit - (time.perf_counter() - t0)
            if found is None:
                break
            if left <= 0:
                status = Status.TIME_LIMIT
                break
            cand, state, _ = _solve_once(within_window(p, found, window), left, solver, found, threads)
            if state == Status.TIME_LIMIT:
                status = Status.TIME_LIMIT
            if cand is None or estimate(p, cand)["step_time"] >= estimate(p, found)["step_time"] * (1 - 1e-6):
                break
            found = cand
    seconds = time.perf_counter() - t0
    if found is None:
        raise OpschedError(
            f"no placement on layout {p.layout} fits in {bytes_text(p.memory_limit)} per device; "
            f"the smallest that fits is about {bytes_text(minimum_memory(p, solver=solver))}"
        )
    return UpperSolution(p.layout, found, estimate(p, found), status, bound, seconds, windowed)


def _solve_once(
    p: UpperProblem, time_limit: float, solver: str, start: Assignment | None, threads: int
) -> tuple[Assignment | None, Status, float]:
    """Build and solve the MIP over ``p``'s domain: (assignment or None, status, bound)."""
    model = new_model(solver, threads=threads, max_gap=1e-6)
    x = {}
    for b in p.blocks:
        for s, m in p.choices(b):
            x[b, s, m] = model.add_var(var_type=mip.BINARY, name=f"x_{b}_{s}_{p.modes[b].index(m)}")
    X = {(b, s): mip.xsum(x[b, s, m] for m in p.modes[b]) for b in p.blocks for s in p.allowed(b)}
    each_block_once(model, p, x)
    no_backward_flow(model, p, X)
    memory_per_device(model, p, x)
    y, tau = cut_edge_transfers(model, p, X)
    model.objective = mip.minimize(step_time_estimate(model, p, x, y, tau, _big_m(p)))
    if start is not None and all((b, s, m) in x for b, (s, m) in start.items()):
        # every binary gets a value: CBC has been seen to abort on partial starts
        # (python-mip issue 160); it completes the continuous variables itself
        model.start = [(var, 1.0 if start[b] == (s, m) else 0.0) for (b, s, m), var in x.items()]
    t0 = time.perf_counter()
    status = model.optimize(max_seconds=max(1.0, time_limit), max_nodes=MAX_NODES)
    capped = time.perf_counter() - t0 >= max(1.0, time_limit)
    if status == mip.OptimizationStatus.INFEASIBLE or model.num_solutions == 0:
        return start, Status.TIME_LIMIT if capped else Status.NO_SOLUTION, 0.0
    assignment = {b: max(p.choices(b), key=lambda sm: x[b, sm[0], sm[1]].x) for b in p.blocks}
    if start is not None and estimate(p, start)["step_time"] < estimate(p, assignment)["step_time"]:
        assignment = start  # never worse than the warm start
    state = Status.OPTIMAL if status == mip.OptimizationStatus.OPTIMAL else Status.TIME_LIMIT if capped else Status.FEASIBLE
    return assignment, state, float(model.objective_bound)


def minimum_memory(p: UpperProblem, solver: str = "cbc", time_limit: float = 10.0) -> float:
    """The least per-device memory any assignment on this layout needs (ignoring time).

    Solves min P s.t. each block once, no backward flow, P ≥ memory of each
    group. With the time limit reached, the incumbent is returned: an upper
    bound on the minimum, so a memory that large surely fits.
    """
    model = new_model(solver, max_gap=1e-6)
    x = {(b, s, m): model.add_var(var_type=mip.BINARY) for b in p.blocks for s, m in p.choices(b)}
    X = {(b, s): mip.xsum(x[b, s, m] for m in p.modes[b]) for b in p.blocks for s in p.allowed(b)}
    each_block_once(model, p, x)
    no_backward_flow(model, p, X)
    peak = model.add_var(lb=0.0)
    rows: dict[int, list] = {g: [] for g in range(p.layout.groups)}
    for (b, s, m), var in x.items():
        c = p.cost[(b, p.group(s), m)]
        rows[p.group(s)].append(var * ((c.param_bytes + p.in_flight(s) * c.act_bytes) * 1e-9))
    for terms in rows.values():
        model.add_constr(peak >= mip.xsum(terms))
    model.objective = mip.minimize(peak)
    model.optimize(max_seconds=time_limit, max_nodes=MAX_NODES)
    if model.num_solutions == 0:
        return math.inf
    return float(model.objective_value) * 1e9


def _big_m(p: UpperProblem) -> float:
    """An upper bound on any finish time e[s]: all work plus every transfer twice."""
    work = sum(
        max(p.cost[(b, g, m)].work for g in range(p.layout.groups) for m in p.modes[b]) for b in p.blocks
    )
    rate = p.links.max_rate()
    lat = p.links.latency_sum()
    return work + 2 * (lat + rate * sum(p.edges.values())) + 1e-9
