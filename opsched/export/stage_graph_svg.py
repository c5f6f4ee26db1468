"""The StageGraph drawn as a graph, in inline SVG: one node per stage, in its device group's colour.

Stages stand in columns by depth (the longest path of edges from a first
stage), so a stage's inputs are always to its left; the stages of one column
stack, the branches that run side by side (:mod:`opsched.schedule.shape`) in
lanes of their own, so each tower reads as a row. A long chain wraps into bands
of at most :data:`COLUMNS` columns, so the drawing never needs more than about
1,200 pixels across. A node's colour is its device group's, as the Gantt's row
strips show it (:func:`opsched.export.gantt_bars.device_groups`); a copy of
another stage (DualPipe's second direction) has a dashed outline. Hovering a
node shows its devices, pass times and what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Mapping

from opsched.export.gantt_bars import device_groups
from opsched.schedule import Schedule, StageGraph
from opsched.schedule.shape import schedule_shape
from opsched.units import ranges_text, seconds_text

NODE_W, NODE_H = 104, 38  # a node, in pixels
COLUMN, LANE = 132, 52  # the distance between columns and between lanes
COLUMNS = 9  # columns per band: 9 x 132 px plus margins stays under 1,200 px
MARGIN = 10
BAND_GAP = 26  # between two bands of a wrapped chain


@dataclass(frozen=True)
class NodeSpot:
    """Where a stage is drawn: its column (depth) and lane, and the band the column wraps into."""

    column: int
    lane: int
    band: int


def depths(sg: StageGraph) -> dict[int, int]:
    """Each stage's depth: the most edges on a path from a stage with no input.

    >>> from opsched.schedule import chain_stage_graph
    >>> depths(chain_stage_graph(3))
    {0: 0, 1: 1, 2: 2}
    """
    depth: dict[int, int] = {}
    for sid in sg.topological_order():
        depth[sid] = max((depth[e.src] + 1 for e in sg.preds(sid)), default=0)
    return depth


def node_spots(schedule: Schedule) -> dict[int, NodeSpot]:
    """Every stage's spot: columns by depth; in a column, stages on branches by their branch, the others by id."""
    sg = schedule.stage_graph
    depth = depths(sg)
    branch_of = {sid: k for k, b in enumerate(schedule_shape(schedule).branches) for sid in b.stages}
    by_column: dict[int, list[int]] = {}
    for sid in sorted(depth, key=lambda s: (branch_of.get(s, -1), s)):
        by_column.setdefault(depth[sid], []).append(sid)
    return {sid: NodeSpot(col % COLUMNS, lane, col // COLUMNS)
            for col, stages in by_column.items() for lane, sid in enumerate(stages)}


def stage_graph_svg(schedule: Schedule, notes: Mapping[int, str] | None = None) -> str:
    """The inline ``<svg id="stage-graph">``; ``notes`` (stage id -> what it holds) join each node's hover text."""
    sg = schedule.stage_graph
    spots = node_spots(schedule)
    lanes = {}  # band -> most lanes in a column of it
    for spot in spots.values():
        lanes[spot.band] = max(lanes.get(spot.band, 0), spot.lane + 1)
    tops, y = {}, MARGIN
    for band in sorted(lanes):
        tops[band] = y
        y += lanes[band] * LANE + BAND_GAP
    height = max(y - BAND_GAP + MARGIN, NODE_H + 2 * MARGIN)
    columns = min(COLUMNS, 1 + max((s.column for s in spots.values()), default=0))
    width = 2 * MARGIN + (columns - 1) * COLUMN + NODE_W

    def corner(sid: int) -> tuple[float, float]:
        spot = spots[sid]
        return MARGIN + spot.column * COLUMN, tops[spot.band] + spot.lane * LANE

    colours = device_groups(schedule)
    out = [f'<svg id="stage-graph" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'style="max-width:100%;height:auto" role="img" font-family="sans-serif" font-size="11">',
           '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" '
           'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#666"/></marker></defs>']
    for e in sg.edges:
        (x0, y0), (x1, y1) = corner(e.src), corner(e.dst)
        tip = f"<title>stage {e.src} to stage {e.dst}: {seconds_text(e.time)} per transfer</title>"
        band = spots[e.dst].band  # an edge to a later band runs back left in the gap above it
        between = tops[band] - BAND_GAP / 2 if band > spots[e.src].band else None
        out.append(f'<path class="stage-edge" d="{edge_path(x0 + NODE_W, y0 + NODE_H / 2, x1, y1 + NODE_H / 2, between)}" '
                   f'fill="none" stroke="#666" marker-end="url(#arrow)">{tip}</path>')
    for st in sg.stages:
        x, y = corner(st.id)
        copy = f" (copy of stage {st.copy_of})" if st.copy_of is not None else ""
        times = ", ".join(f"{p} {seconds_text(st.duration(p))}" for p in st.timed_passes())
        held = f"; {notes[st.id]}" if notes and st.id in notes else ""
        tip = escape(f"stage {st.id}{copy} on devices {ranges_text(st.devices)}: {times}{held}")
        dash = ' stroke-dasharray="4 3"' if st.copy_of is not None else ""
        devices = ("dev " if len(st.devices) == 1 else "devs ") + ranges_text(st.devices)
        devices = devices if len(devices) <= 17 else devices[:16] + "…"
        out.append(f'<g class="stage-node" data-stage="{st.id}"><title>{tip}</title>'
                   f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="5" fill="{colours[st.devices]}" '
                   f'stroke="#333"{dash}/>'
                   f'<text x="{x + NODE_W / 2}" y="{y + 15}" text-anchor="middle" font-weight="bold">stage {st.id}</text>'
                   f'<text x="{x + NODE_W / 2}" y="{y + 30}" text-anchor="middle">{escape(devices)}</text></g>')
    out.append("</svg>")
    return "\n".join(out)


def edge_path(x0: float, y0: float, x1: float, y1: float, between: float | None = None) -> str:
    """An edge from a node's right side to another's left side. One that skips columns runs along its source's
    lane (a branch's own lane, free past its end) and bends into its target in the last gap; one to a later band
    of a wrapped chain (``between``: the height of the gap above that band) runs back left in that gap.

    >>> edge_path(0, 10, 28, 10)
    'M0.0,10.0 C30.0,10.0 -2.0,10.0 28.0,10.0'
    >>> edge_path(0, 10, 292, 60)
    'M0.0,10.0 H264.0 C278.0,10.0 278.0,60.0 292.0,60.0'
    """
    gap = COLUMN - NODE_W
    if between is not None:
        step = MARGIN - 2  # out of the node and back in, within the drawing's margins
        return f"M{x0:.1f},{y0:.1f} h{step} V{between:.1f} H{x1 - step:.1f} V{y1:.1f} H{x1:.1f}"
    if x1 - x0 > COLUMN:  # across at least one column, in the same band
        return (f"M{x0:.1f},{y0:.1f} H{x1 - gap:.1f} C{x1 - gap / 2:.1f},{y0:.1f} {x1 - gap / 2:.1f},{y1:.1f} "
                f"{x1:.1f},{y1:.1f}")
    bend = max(30.0, abs(x1 - x0) / 2)
    return f"M{x0:.1f},{y0:.1f} C{x0 + bend:.1f},{y0:.1f} {x1 - bend:.1f},{y1:.1f} {x1:.1f},{y1:.1f}"
