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

import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from opsched.cost.blocks import Mode, expert_count, stage_streams
from opsched.errors import OpschedError
from opsched.schedule import Edge, Stage, StageGraph
from opsched.upper.layouts import config_name
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
    >>> from opsched.model.graph import Block
    >>> from opsched.cost.cluster import preset, Training
    >>> from opsched.cost.blocks import Mode
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
                streams=stage_streams(costs) if p.overlap_pairs else None,
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
            time=p.links.latency(a, c) + nbytes * p.links.rate(a, c),
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


# --------------------------------------------------------------------------- what a stage holds, as layers


#: a module path component that numbers a repeated layer (transformers' ``layers.3``, GPT-2's ``h.3``, ...)
LAYER_COMPONENT = re.compile(r"^(layers?|h|blocks?|resblocks)\.(\d+)$")


class HeldBlock(NamedTuple):
    """One of a stage's blocks: its name (ONNX scopes), its parallel mode's name and what it holds.

    ``holds`` is ``"weights"`` (parameters of its own), ``"experts"`` (routed
    experts' parameters) or ``"none"`` (no parameters: norms without scale,
    softmax, residual adds, ...); it decides what the block says about the
    stage's configuration (:func:`stage_config`).
    """

    name: str
    mode: str
    holds: str = "weights"


def held_block(block, mode: str) -> HeldBlock:
    """A model block (:class:`opsched.model.graph.Block`) in a stage, with what it holds: every caller that names a
    stage's configuration from its blocks must tell the experts apart, or their mode counts as dense weights'."""
    holds = "experts" if expert_count(block) > 0 else "weights" if block.param_count > 0 else "none"
    return HeldBlock(block.name, mode, holds)



@dataclass
class StageContents:
    """What one stage holds: its layers in a line, their module paths, its parallel modes, each block with its mode.

    ``config`` is the stage's configuration as a user sets one (``tp2.dp2``,
    ``dp4+ep``; :func:`stage_config`), None when its blocks with weights use
    different modes.
    """

    layers: str  # e.g. "model.layers.0-3, lm_head"
    modules: list[str]  # module paths of the layers (or top-level modules) it holds, in model order
    blocks: list[str]  # "block name [mode]" for every block it holds
    modes: dict[str, str]  # parallel mode -> the layers with blocks in that mode, in a line
    config: str | None = None

    @property
    def modes_text(self) -> str:
        """``dp2`` for one mode, else ``dp2: model.layers.0; ep2: model.layers.1-2``."""
        if len(self.modes) == 1:
            return next(iter(self.modes))
        return "; ".join(f"{mode}: {layers}" for mode, layers in self.modes.items())

    def to_dict(self) -> dict:
        return {"layers": self.layers, "modules": self.modules, "modes": self.modes, "blocks": self.blocks,
                "config": self.config}


def stage_config(blocks: Sequence[HeldBlock]) -> str | None:
    """The configuration a stage's blocks add up to, in the layout notation (``tp2.dp2``, ``dp4+ep``), or None.

    The rule a training framework's settings follow: every block with weights
    of its own in one mode M (tensor x data parallel), the expert blocks in M
    too or expert-parallel over the whole group (then ``M+ep``). Blocks
    without weights do not count: they take the only mode they have,
    data-parallel over the group, and split their work as their neighbours
    do. The non-expert weights of a block in an expert-parallel mode
    (a router, say) run data-parallel over the group, as the cost model has
    them (docs/cost-model.md), so they count as ``dpK``. None when the blocks
    with weights disagree.

    >>> stage_config([HeldBlock("attn", "tp2.dp2"), HeldBlock("softmax", "dp4", "none"),
    ...               HeldBlock("experts.0", "ep4", "experts")])
    'tp2.dp2+ep'
    >>> stage_config([HeldBlock("layers.0", "dp4"), HeldBlock("lm_head", "tp4")]) is None
    True
    >>> stage_config([HeldBlock("layers.0/router+experts", "ep4"), HeldBlock("layers.1", "dp4")])
    'dp4'
    """
    modes = [(Mode.parse(b.mode), b.holds) for b in blocks]
    dense = {_as_dense(m) for m, holds in modes if holds == "weights"}
    expert = {m for m, holds in modes if holds == "experts"}
    if len(dense) > 1 or len(expert) > 1:
        return None
    if not dense and not expert:
        weightless = {m for m, _ in modes}
        return str(weightless.pop()) if len(weightless) == 1 else None
    if dense:
        base = dense.pop()
    else:
        only = next(iter(expert))
        base = _as_dense(only)
    if not expert or expert == {base}:
        return str(base)
    experts = expert.pop()
    if experts == Mode(ep=base.size):  # "+ep" says the experts spread over the whole group, nothing else
        return config_name(base, experts_parallel=True)
    return None


def _as_dense(mode: Mode) -> Mode:
    """The mode a block's non-expert weights run in: an expert-parallel mode runs them data-parallel."""
    return Mode(dp=mode.size) if mode.ep > 1 else mode


def layer_path(block_name: str) -> str:
    """The module path of the layer a block belongs to: up to its first numbered layer component.

    Block names are ONNX scopes joined by ``/`` (a ``#k`` suffix tells apart
    blocks of one scope); a block outside every numbered layer keeps its whole path.

    >>> layer_path("model/layers.3/block_sparse_moe/experts.1#2")
    'model.layers.3'
    >>> layer_path("lm_head"), layer_path("(root)")
    ('lm_head', '(root)')
    """
    parts = block_name.split("#", 1)[0].split("/")
    for k, part in enumerate(parts):
        if LAYER_COMPONENT.match(part):
            return ".".join(parts[: k + 1])
    return ".".join(parts)


def summarize_layers(paths: list[str]) -> str:
    """Module paths in a line, runs of consecutive numbered layers as ranges.

    >>> summarize_layers(["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.5", "lm_head"])
    'model.layers.0-2, model.layers.5, lm_head'
    """
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # (prefix, first index, last index)

    def flush() -> None:
        if run is not None:
            prefix, first, last = run
            out.append(f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}")

    for path in paths:
        head, _, last_part = path.rpartition(".")
        number = last_part.isdigit() and LAYER_COMPONENT.match(path.split(".")[-2] + "." + last_part) if head else None
        if number:
            prefix = head + "."
            index = int(last_part)
            if run is not None and run[0] == prefix and index == run[2] + 1:
                run = (prefix, run[1], index)
                continue
            flush()
            run = (prefix, index, index)
        else:
            flush()
            run = None
            out.append(path)
    flush()
    return ", ".join(out)


def stage_contents(blocks: Sequence[HeldBlock | tuple[str, str] | tuple[str, str, str]]) -> StageContents:
    """The :class:`StageContents` of a stage holding ``blocks`` (:class:`HeldBlock`, or (name, mode) pairs of
    blocks with weights), in model order.

    >>> c = stage_contents([("model/layers.0", "tp2"), ("model/layers.1/mlp", "tp2"), ("lm_head", "dp2")])
    >>> c.layers, c.modes_text, c.config
    ('model.layers.0-1, lm_head', 'tp2: model.layers.0-1; dp2: lm_head', None)
    """
    held = [HeldBlock(*b) for b in blocks]
    modules: list[str] = []
    by_mode: dict[str, list[str]] = {}
    for name, mode, _holds in held:
        path = layer_path(name)
        if path not in modules:
            modules.append(path)
        paths = by_mode.setdefault(mode, [])
        if path not in paths:
            paths.append(path)
    modes = {mode: summarize_layers(paths) for mode, paths in by_mode.items()}
    return StageContents(summarize_layers(modules), modules, [f"{b.name} [{b.mode}]" for b in held], modes,
                         stage_config(held))
