"""What a plan does, in words: which branches of its StageGraph run side by side, and what its overlapped pairs save.

The one home of these two figures; the ``plan`` summary, report.md, report.html
and every Gantt title say them through here.

**Branches.** The StageGraph is a DAG. A stage every other stage reaches or is
reached by is on the *trunk*: nothing runs beside it. The other stages fall
between two consecutive trunk stages (a *fork*); the stages between the same
two, joined by edges, form one *branch*, and the branches of one fork run side
by side (the two towers of CLIP, the experts of a layer placed apart). A
chain has no branch. DualPipe's second copy of the model (stages with a
``copy_of``) runs the same model on other microbatches: it is not a branch,
and is left out.

**Overlapped pairs.** An F&B pair (two events sharing a ``pair`` id) saves the
time its two passes would take one after the other minus the time it takes
(:func:`opsched.schedule.pair_duration` decides that time; the events carry it).
The saving is summed over pairs: device time, not step time (a pair off the
critical path shortens no step).

>>> from opsched.schedule.graph import Edge, Stage, StageGraph
>>> t = {"F": 1.0, "I": 1.0, "W": 1.0}
>>> towers = StageGraph([Stage(0, (0,), t), Stage(1, (0,), t), Stage(2, (1,), t), Stage(3, (0,), t)],
...                     [Edge(0, 1), Edge(0, 2), Edge(1, 3), Edge(2, 3)])
>>> shape = schedule_shape(Schedule(towers, 1, []))
>>> [(b.stages, b.devices) for b in shape.branches]
[((1,), (0,)), ((2,), (1,))]
>>> branches_text(shape)
'2 side by side: stage 1 on device 0; stage 2 on device 1'
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from opsched.schedule.actions import Event, Schedule
from opsched.schedule.graph import StageGraph
from opsched.units import plural, ranges_text, seconds_text

#: a pair shorter than its two passes by less than this share of them saves nothing (float sums, not overlap)
PAIR_TOLERANCE = 1e-9
#: branches named one by one in a line; more are counted
NAMED_BRANCHES = 4


@dataclass(frozen=True)
class Branch:
    """Stages of one fork joined by edges, and every device they run on."""

    stages: tuple[int, ...]
    devices: tuple[int, ...]

    def text(self) -> str:
        """``stages 1-2 on devices 0-3``."""
        return (f"{'stage' if len(self.stages) == 1 else 'stages'} {ranges_text(self.stages)} on "
                f"{'device' if len(self.devices) == 1 else 'devices'} {ranges_text(self.devices)}")


@dataclass(frozen=True)
class ScheduleShape:
    """The branches of the widest fork, how many forks have branches, and the schedule's F&B pairs.

    ``branches`` is empty for a chain; ``forks`` counts the forks with two
    branches or more. ``width`` is the most stages of the model no path joins
    (a largest antichain: at most that many may run at once); it exceeds the
    branches' count where edges cross between branches. ``pairs`` counts the schedule's F&B pairs, ``overlapped``
    those shorter than their two passes, and ``saving`` (seconds) what they
    save, summed over pairs.
    """

    branches: tuple[Branch, ...]
    forks: int
    width: int
    pairs: int
    overlapped: int
    saving: float
    #: edges (src, dst) of a graph of width 1 that pass over a stage (a ``--branches off`` plan's tensors skipping
    #: ahead): the stages run one after another, yet the graph is no chain a runtime passing only k -> k+1 runs
    skips: tuple[tuple[int, int], ...] = ()

    @property
    def share_devices(self) -> bool:
        """Whether two branches of the widest fork share a device (they then take turns on it)."""
        seen: set[int] = set()
        for b in self.branches:
            if seen & set(b.devices):
                return True
            seen |= set(b.devices)
        return False


def schedule_shape(schedule: Schedule) -> ScheduleShape:
    """The branches of ``schedule``'s StageGraph and what its overlapped pairs save (module docstring)."""
    branches, forks, width = side_by_side(schedule.stage_graph)
    pairs, overlapped, saving = pair_savings(schedule)
    skips = skip_edges(schedule.stage_graph) if width == 1 else ()
    return ScheduleShape(branches, forks, width, pairs, overlapped, saving, skips)


def skip_edges(sg: StageGraph) -> tuple[tuple[int, int], ...]:
    """The edges of the model's stages (not DualPipe's second copy) that pass over a stage in topological order.

    >>> from opsched.schedule.graph import Edge, Stage
    >>> t = {"F": 1.0, "I": 1.0, "W": 1.0}
    >>> skip_edges(StageGraph([Stage(k, (k,), t) for k in range(3)], [Edge(0, 1), Edge(1, 2), Edge(0, 2)]))
    ((0, 2),)
    """
    model = [sid for sid in sg.topological_order() if sg.stage(sid).copy_of is None]
    place = {sid: k for k, sid in enumerate(model)}
    return tuple(sorted((e.src, e.dst) for sid in model for e in sg.succs(sid)
                        if e.dst in place and place[e.dst] > place[sid] + 1))


def side_by_side(sg: StageGraph) -> tuple[tuple[Branch, ...], int, int]:
    """The branches of the fork with the most of them (none for a chain), how many forks have two or more, and the
    graph's width (:class:`ScheduleShape`)."""
    model = [sid for sid in sg.topological_order() if sg.stage(sid).copy_of is None]
    bit = {sid: 1 << k for k, sid in enumerate(model)}
    succs = {sid: [e.dst for e in sg.succs(sid) if e.dst in bit] for sid in model}
    below = {sid: 0 for sid in model}  # bitset of the stages each stage reaches
    for sid in reversed(model):
        for dst in succs[sid]:
            below[sid] |= bit[dst] | below[dst]
    above = {sid: 0 for sid in model}  # bitset of the stages that reach each stage
    for sid in model:
        for dst in succs[sid]:
            above[dst] |= bit[sid] | above[sid]
    everyone = (1 << len(model)) - 1
    trunk = {sid for sid in model if (above[sid] | below[sid] | bit[sid]) == everyone}
    trunk_bits = sum(bit[sid] for sid in trunk)
    # the branches: stages off the trunk joined by edges (union-find)
    parent = {sid: sid for sid in model if sid not in trunk}

    def root(sid: int) -> int:
        while parent[sid] != sid:
            parent[sid] = parent[parent[sid]]
            sid = parent[sid]
        return sid

    for sid in parent:
        for dst in succs[sid]:
            if dst in parent:
                parent[root(dst)] = root(sid)
    members: dict[int, list[int]] = {}
    for sid in parent:
        members.setdefault(root(sid), []).append(sid)
    # a fork is told by the trunk stages before it: its branches' stages come after the same ones
    forks: dict[int, list[Branch]] = {}
    for stages in members.values():
        fork = min((above[sid] & trunk_bits).bit_count() for sid in stages)
        devices = sorted({d for sid in stages for d in sg.stage(sid).devices})
        forks.setdefault(fork, []).append(Branch(tuple(sorted(stages)), tuple(devices)))
    wide = [sorted(found, key=lambda b: b.stages) for _, found in sorted(forks.items()) if len(found) > 1]
    widest = max(wide, key=len, default=[])  # the first of the widest, in the model's order
    return tuple(widest), len(wide), antichain_width(list(parent), below, bit) if parent else min(1, len(model))


def antichain_width(stages: list[int], below: dict[int, int], bit: dict[int, int]) -> int:
    """The most of ``stages`` no path joins (``below``: the bitset of the stages each reaches).

    Dilworth: the fewest chains covering them, ``len(stages)`` minus a largest
    matching of "u reaches v" pairs (Fulkerson's reduction; Hopcroft-Karp).
    """
    g = nx.Graph()
    top = [("reaches", u) for u in stages]
    g.add_nodes_from(top)
    g.add_nodes_from(("reached", v) for v in stages)
    g.add_edges_from((("reaches", u), ("reached", v)) for u in stages for v in stages if below[u] & bit[v])
    matching = nx.bipartite.hopcroft_karp_matching(g, top_nodes=top)
    return len(stages) - len(matching) // 2


def pair_savings(schedule: Schedule) -> tuple[int, int, float]:
    """(F&B pairs, those shorter than their two passes, seconds saved summed over pairs)."""
    sg = schedule.stage_graph
    halves: dict[int, list[Event]] = {}
    for e in schedule.events:
        if e.pair is not None:
            halves.setdefault(e.pair, []).append(e)
    pairs = overlapped = 0
    saving = 0.0
    for events in halves.values():
        if len(events) != 2:  # the validator refuses such a schedule; nothing to say of it here
            continue
        pairs += 1
        alone = sum(sg.stage(e.stage).duration(e.pass_) for e in events)
        taken = max(e.end for e in events) - min(e.start for e in events)
        if alone - taken > PAIR_TOLERANCE * alone:
            overlapped += 1
            saving += alone - taken
    return pairs, overlapped, saving


def branches_text(shape: ScheduleShape) -> str:
    """How many branches run side by side, and on which devices, in a line (the summary's and report.md's).

    >>> branches_text(ScheduleShape((), 0, 1, 0, 0, 0.0))
    'none side by side: the stages form one chain'
    """
    if not shape.branches and shape.width > 1:
        return (f"none apart, but up to {shape.width} stages may run side by side (the edges between them cross, so no "
                "two branches are apart)")
    if not shape.branches and shape.skips:
        first = shape.skips[0]
        verb = "passes" if len(shape.skips) == 1 else "pass"
        return (f"none side by side: the stages run one after another, but {plural(len(shape.skips), 'edge')} {verb} "
                f"over a stage (stage {first[0]} feeds stage {first[1]}), so a runtime passing activations only from "
                "stage k to k+1 cannot run it as it is")
    if not shape.branches:
        return "none side by side: the stages form one chain"
    named = "; ".join(b.text() for b in shape.branches[:NAMED_BRANCHES])
    more = len(shape.branches) - NAMED_BRANCHES
    line = f"{len(shape.branches)} side by side: {named}" + (f"; and {more} more" if more > 0 else "")
    if shape.share_devices:
        line += " (some share devices, and take turns on them)"
    if shape.forks > 1:
        line += f"; {shape.forks} forks have branches, the widest is shown"
    return line


def overlap_text(shape: ScheduleShape) -> str:
    """The overlapped F&B pairs and their total saving, in a line (the summary's and report.md's).

    >>> overlap_text(ScheduleShape((), 0, 1, 6, 4, 0.0032))
    '4 of 6 F&B pairs overlapped, 3.2 ms shorter in all than their passes one after the other'
    >>> overlap_text(ScheduleShape((), 0, 1, 3, 0, 0.0))
    '3 F&B pairs, none shorter than its two passes (the runtime runs each as F then B)'
    """
    if shape.pairs == 0:
        return "no F&B pair: every pass runs alone"
    if shape.overlapped == 0:
        return f"{plural(shape.pairs, 'F&B pair')}, none shorter than its two passes (the runtime runs each as F then B)"
    return (f"{shape.overlapped} of {plural(shape.pairs, 'F&B pair')} overlapped, {seconds_text(shape.saving)} shorter "
            "in all than their passes one after the other")


def shape_title(shape: ScheduleShape) -> str:
    """The two figures in a Gantt title's words.

    >>> shape_title(ScheduleShape((Branch((1,), (0,)), Branch((2,), (1,))), 1, 2, 6, 4, 0.0032))
    '2 branches side by side (devices 0 | 1); 4 overlapped F&B pairs save 3.2 ms'
    >>> shape_title(ScheduleShape((), 0, 1, 0, 0, 0.0))
    'one chain of stages; no overlapped F&B pair'
    """
    if shape.branches:
        groups = " | ".join(ranges_text(b.devices) for b in shape.branches[:NAMED_BRANCHES])
        more = " | ..." if len(shape.branches) > NAMED_BRANCHES else ""
        branches = f"{len(shape.branches)} branches side by side (devices {groups}{more})"
    elif shape.width > 1:
        branches = f"up to {shape.width} stages side by side"
    elif shape.skips:
        branches = f"stages one after another, {plural(len(shape.skips), 'edge')} passing over a stage"
    else:
        branches = "one chain of stages"
    if shape.overlapped:
        verb = "saves" if shape.overlapped == 1 else "save"
        pairs = f"{plural(shape.overlapped, 'overlapped F&B pair')} {verb} {seconds_text(shape.saving)}"
    else:
        pairs = "no overlapped F&B pair"
    return f"{branches}; {pairs}"


def shape_lines(schedule: Schedule) -> list[tuple[str, str]]:
    """(name, line) of both figures, as the ``plan`` summary and report.md print them.

    >>> from opsched.schedule import chain_stage_graph
    >>> shape_lines(Schedule(chain_stage_graph(2), 1, []))
    [('branches', 'none side by side: the stages form one chain'), ('F&B pairs', 'no F&B pair: every pass runs alone')]
    """
    shape = schedule_shape(schedule)
    return [("branches", branches_text(shape)), ("F&B pairs", overlap_text(shape))]


def shape_fields(schedule: Schedule) -> dict:
    """``plan --json``'s fields of both figures: ``branches`` (each with its ``stages`` and ``devices``; empty for a
    chain), ``width``, and ``pairs`` (``count``, ``overlapped``, ``saving_seconds``).

    >>> from opsched.schedule import chain_stage_graph
    >>> shape_fields(Schedule(chain_stage_graph(2), 1, []))
    {'branches': [], 'width': 1, 'pairs': {'count': 0, 'overlapped': 0, 'saving_seconds': 0.0}}
    """
    shape = schedule_shape(schedule)
    return {"branches": [{"stages": list(b.stages), "devices": list(b.devices)} for b in shape.branches],
            "width": shape.width,
            "pairs": {"count": shape.pairs, "overlapped": shape.overlapped, "saving_seconds": shape.saving}}
