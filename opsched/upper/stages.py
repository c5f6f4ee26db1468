"""Turn an upper assignment into a :class:`opsched.schedule.StageGraph`.

Each non-empty slot becomes one stage on its group's devices, numbered in
slot order (which is a topological order, since blocks never flow back).
A stage's pass times, parameter and activation bytes are the sums over its
blocks under their modes; a stage edge joins two slots whose blocks share a
block edge, carrying the sum of those bytes in ``latency + bytes / bandwidth``
(0 when both stages sit on one group). Figures are exactly those the upper
objective used, so the lower level schedules the same costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from opsched.errors import OpschedError
from opsched.schedule import Edge, Stage, StageGraph
from opsched.upper.mip import Assignment, UpperProblem


@dataclass
class StagePlan:
    """The StageGraph plus what it leaves out: which blocks each stage holds, and the per-step gradient sync."""

    stage_graph: StageGraph
    blocks_of_stage: dict[int, list[int]]  # stage id -> block ids
    modes_of_stage: dict[int, dict[int, str]]  # stage id -> block id -> mode name
    slot_of_stage: dict[int, int]
    grad_sync_seconds: float  # max over groups of the data-parallel all-reduce, once per step


def build_stage_graph(p: UpperProblem, assignment: Assignment) -> StagePlan:
    """The StageGraph of an assignment (see the module docstring).

    >>> import networkx as nx
    >>> from opsched.graph import Block
    >>> from opsched.cluster import preset, Training
    >>> from opsched.cost import Mode
    >>> from opsched.upper.layouts import Layout
    >>> from opsched.upper.mip import upper_problem
    >>> bg = nx.DiGraph(kind="BlockGraph")
    >>> for i in range(3):
    ...     bg.add_node(i, block=Block(i, f"b{i}", (), (), flops=1e12))
    >>> bg.add_edges_from([(0, 1), (0, 2)], bytes=1e6)
    >>> p = upper_problem(bg, Layout(2, 2), preset("h100-sxm", 2), Training())
    >>> plan = build_stage_graph(p, {0: (0, Mode()), 1: (0, Mode()), 2: (1, Mode())})
    >>> [(e.src, e.dst, e.bytes) for e in plan.stage_graph.edges]
    [(0, 1, 1000000.0)]
    """
    for u, v in p.edges:
        if assignment[u][0] > assignment[v][0]:
            raise OpschedError(f"block {v} sits in an earlier slot than its producer {u}; the stages would not form a DAG")
    used = sorted({s for s, _ in assignment.values()})
    stage_of_slot = {s: i for i, s in enumerate(used)}
    stages, blocks_of, modes_of = [], {}, {}
    sync_per_group: dict[int, float] = {}
    for s in used:
        sid = stage_of_slot[s]
        g = p.group(s)
        members = [b for b in p.blocks if assignment[b][0] == s]
        costs = [p.cost[(b, g, assignment[b][1])] for b in members]
        sync_per_group[g] = sync_per_group.get(g, 0.0) + sum(c.grad_sync for c in costs)
        stages.append(
            Stage(
                id=sid,
                devices=p.layout.devices_of_group(g),
                time={"F": sum(c.F for c in costs), "I": sum(c.I for c in costs), "W": sum(c.W for c in costs)},
                param_bytes=sum(c.param_bytes for c in costs),
                act_bytes=sum(c.act_bytes for c in costs),
                act_w_bytes=sum(c.act_w_bytes for c in costs),
                name="+".join(p.names.get(b, str(b)) for b in members)[:120],
            )
        )
        blocks_of[sid] = members
        modes_of[sid] = {b: str(assignment[b][1]) for b in members}
    pair_bytes: dict[tuple[int, int], float] = {}
    for (u, v), nbytes in p.edges.items():
        a, c = assignment[u][0], assignment[v][0]
        if a != c:
            pair_bytes[(a, c)] = pair_bytes.get((a, c), 0.0) + nbytes
    edges = [
        Edge(
            stage_of_slot[a],
            stage_of_slot[c],
            time=p.transfer_latency[(a, c)] + nbytes * p.transfer_rate[(a, c)],
            bytes=nbytes,
        )
        for (a, c), nbytes in sorted(pair_bytes.items())
    ]
    sg = StageGraph(stages, edges, num_devices=p.layout.devices)
    return StagePlan(
        stage_graph=sg,
        blocks_of_stage=blocks_of,
        modes_of_stage=modes_of,
        slot_of_stage={sid: s for s, sid in stage_of_slot.items()},
        grad_sync_seconds=max(sync_per_group.values(), default=0.0),
    )
