"""Re-placing a chain of stages the way a hand-written schedule needs it.

Every baseline is defined on a *chain* of logical stages (stage k feeds stage
k+1) with one device per stage. A user's chain may have more or fewer stages
than a method needs, so :func:`regroup` merges consecutive stages (summing
times and memory) or splits each stage into equal parts, and the result is
put on devices by the method's own rule: every baseline module states its
placement as ``stages_per_device(devices, stages)`` (logical stages per
device it regroups the chain into) and ``devices_of(stage, devices)`` (the
devices of logical stage ``stage``, a tuple: DualPipe puts a copy of each
stage on two devices). The builders here only apply such a rule:

* :func:`placed_chain`: one copy of each logical stage (:func:`place_chain`,
  stage k on device k, is the rule of GPipe, 1F1B, ZB-H1 and ZB-H2);
* :func:`dual_graph`: two copies running in opposite directions, copy c of
  logical stage j on the c-th device of its rule (DualPipe).

A branching StageGraph (two towers joining, experts side by side) is not a
chain; :func:`linearize` gives the chain a chain-only runtime would run
instead, its stages one after another in topological order.

Transfer times: an edge between two stages on one device costs nothing. An
edge between different devices keeps the time it had in the input when that
was non-zero; otherwise (the ends shared a device in the input, or the edge is
new because a stage was split) it takes ``comm``, by default the largest edge
time of the input graph (a chain has one link speed).

>>> from opsched.schedule import chain_stage_graph
>>> sg = chain_stage_graph(4, f=[1, 2, 3, 4], comm=0.5, devices=2, placement="interleaved")
>>> placed = place_chain(sg, microbatches=8)
>>> [(s.devices, s.time["F"]) for s in placed.stages]
[((0,), 3.0), ((1,), 7.0)]
>>> [e.time for e in placed.edges]
[0.5]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from opsched.errors import OpschedError, Unsupported
from opsched.cost.overlap import PassStreams, compact
from opsched.schedule.actions import Schedule
from opsched.schedule.graph import Edge, Stage, StageGraph

#: a placement rule: (logical stage, devices) -> the devices that stage's copies run on
DevicesOf = Callable[[int, int], tuple[int, ...]]


def interleaved_device(stage: int, devices: int) -> int:
    """The device of ``stage`` when stages go round the devices (Megatron's interleaved 1F1B): k mod D.

    >>> [interleaved_device(k, 3) for k in range(6)]
    [0, 1, 2, 0, 1, 2]
    """
    return stage % devices


@dataclass(frozen=True)
class Placement:
    """How a placement puts the stages of a chain on devices: the one record every level asks."""

    #: its name on the command line and in plan.json
    name: str
    #: the rule in words, for tables and docs
    rule: str
    #: copies of each logical stage (DualPipe's bidirectional placement: two, fed from both ends)
    copies: int = 1

    def device_of(self, stage: int, devices: int) -> int:
        """The device (group) of logical stage ``stage`` of one copy, on ``devices`` devices (groups).

        >>> [PLACEMENTS["v"].device_of(k, 2) for k in range(4)], PLACEMENTS["interleaved"].device_of(5, 2)
        ([0, 1, 1, 0], 1)
        """
        if self.name == "v":
            return v_device(stage, devices)
        if self.name == "interleaved":
            return interleaved_device(stage, devices)
        return stage  # chain; and the bidirectional placement's copy 0 (copy 1, DualPipe's, runs the other way)


#: every placement, by name, in the order ``--placement auto`` tries them (ties keep the earliest)
PLACEMENTS: dict[str, Placement] = {p.name: p for p in (
    Placement("chain", "chain, stage k on device k"),
    Placement("v", "V, device i holds stages i and 2D-1-i"),
    Placement("interleaved", "interleaved, stage k on device k mod D"),
    Placement("bidirectional", "two copies, device r holds stages r and PP-1-r", copies=2),
)}



def chain_stage_graph(
    stages: int,
    f: float | Sequence[float] = 1.0,
    b: float | Sequence[float] = 2.0,
    w: float | Sequence[float] = 1.0,
    *,
    devices: int | None = None,
    placement: str = "chain",
    comm: float = 0.0,
    act: float | Sequence[float] = 1.0,
    act_w: float | Sequence[float] = 0.5,
    param_bytes: float | Sequence[float] = 0.0,
    overlap_gain: float = 0.0,
) -> StageGraph:
    """A synthetic chain of ``stages`` stages (B is the full backward, so I = B - W).

    ``placement`` maps stage k to a device: ``chain`` (k, needs devices == stages),
    ``interleaved`` (k mod D) or ``v`` (:func:`v_device`; needs stages == 2D).
    ``comm`` is the transfer time of an edge between different devices.

    >>> sg = chain_stage_graph(4, devices=2, placement="v")
    >>> [s.devices for s in sg.stages]
    [(0,), (1,), (1,), (0,)]
    """
    d = stages if devices is None else devices
    per = lambda x: _per_stage(x, stages)  # noqa: E731
    fs, bs, ws, acts, act_ws, params = map(per, (f, b, w, act, act_w, param_bytes))
    for k in range(stages):
        if ws[k] > bs[k]:
            raise OpschedError(f"stage {k}: W={ws[k]} exceeds the full backward B={bs[k]}; B includes W")
    place = stage_placement(stages, d, placement)
    stage_list = [
        Stage(
            id=k,
            devices=(place[k],),
            time={"F": fs[k], "I": bs[k] - ws[k], "W": ws[k]},
            param_bytes=params[k],
            act_bytes=acts[k],
            act_w_bytes=act_ws[k],
            name=f"stage{k}",
        )
        for k in range(stages)
    ]
    edges = [
        Edge(k, k + 1, time=(comm if place[k] != place[k + 1] else 0.0)) for k in range(stages - 1)
    ]
    return StageGraph(stage_list, edges, num_devices=d, overlap_gain=overlap_gain)


def stage_placement(stages: int, devices: int, placement: str) -> list[int]:
    """Device of each stage under a named placement (see :func:`chain_stage_graph`)."""
    if devices < 1 or stages < 1:
        raise OpschedError("stages and devices must be at least 1")
    if placement == "chain":
        if stages != devices:
            raise OpschedError(
                f"placement chain puts one stage per device: {stages} stages on {devices} devices; "
                "use --placement interleaved or v"
            )
    elif placement == "interleaved":
        if stages % devices:
            raise OpschedError(f"placement interleaved needs stages ({stages}) divisible by devices ({devices})")
    elif placement == "v":
        if stages != 2 * devices:
            raise OpschedError(f"placement v needs stages = 2 x devices, got {stages} stages on {devices} devices")
    else:
        raise OpschedError(f"unknown placement {placement!r}; choose chain, interleaved or v")
    return [PLACEMENTS[placement].device_of(k, devices) for k in range(stages)]


def v_device(stage: int, devices: int) -> int:
    """The device of ``stage`` when 2D stages sit on D devices in a V: k for k < D, else 2D-1-k.

    The V goes down the devices and back up, so device i holds stages i and
    2D-1-i, and the first and last stage share device 0 (Zero Bubble V,
    DualPipeV).

    >>> [v_device(k, 3) for k in range(6)]
    [0, 1, 2, 2, 1, 0]
    """
    if not 0 <= stage < 2 * devices:
        raise OpschedError(f"a V on {devices} devices has stages 0..{2 * devices - 1}, not {stage}")
    return stage if stage < devices else 2 * devices - 1 - stage


def v_stages(device: int, devices: int) -> tuple[int, int]:
    """The two stages a device holds in a V (:func:`v_device` read backwards): down i, up 2D-1-i.

    >>> v_stages(1, 3), [v_device(k, 3) for k in v_stages(1, 3)]
    ((1, 4), [1, 1])
    """
    if not 0 <= device < devices:
        raise OpschedError(f"a V on {devices} devices has devices 0..{devices - 1}, not {device}")
    return device, 2 * devices - 1 - device


def _per_stage(value, stages: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * stages
    values = [float(v) for v in value]
    if len(values) == 1:
        return values * stages
    if len(values) != stages:
        raise OpschedError(f"expected 1 or {stages} per-stage values, got {len(values)}: {values}")
    return values


@dataclass(frozen=True)
class Part:
    """One logical stage after regrouping, before it is given a device.

    ``link_in`` is the transfer time of the edge that feeds it when it crosses
    devices (``None`` for the first part).
    """

    time: dict
    param_bytes: float
    act_bytes: float
    act_w_bytes: float
    name: str
    link_in: float | None
    bytes_in: float = 0.0
    streams: PassStreams | None = None


def chain_stages(sg: StageGraph) -> list[Stage]:
    """The stages of ``sg`` in chain order; raises Unsupported if ``sg`` is not a simple chain.

    A chain has edges exactly k -> k+1 and every stage on one device; every
    microbatch runs on every stage.
    """
    n = len(sg.stages)
    if n == 0:
        raise Unsupported("the stage graph is empty; give at least one stage")
    if not is_chain(sg):
        raise Unsupported(
            "hand-written schedules need a chain of stages (edges 0->1->...->P-1); "
            "this stage graph branches, so compare it with the MIP only"
        )
    for s in sg.stages:
        if len(s.devices) != 1:
            raise Unsupported(f"hand-written schedules need one device per stage; stage {s.id} has {s.devices}")
        if s.microbatches is not None or s.copy_of is not None:
            raise Unsupported(
                f"stage {s.id} is already a direction copy (microbatches or copy_of set); "
                "give the plain chain of logical stages"
            )
    return list(sg.stages)


def on_group_devices(sg: StageGraph) -> tuple[StageGraph, list[tuple[int, ...]]]:
    """``sg`` with each device group as one pseudo-device, and the groups in order of first use.

    A plan's stages may run on groups of devices (tensor or data parallel
    inside a group); the hand-written schedules place stages on single
    devices, so they run on the groups as pseudo-devices
    (:func:`onto_groups` maps the result back). Groups must not overlap.
    When every stage runs on one device, ``sg`` is returned as it is, with
    each device its own group.

    >>> from opsched.schedule import Stage, StageGraph
    >>> t = {"F": 1.0, "I": 1.0, "W": 1.0}
    >>> sg = StageGraph([Stage(0, (2, 3), t), Stage(1, (0, 1), t)], [Edge(0, 1)])
    >>> pseudo, groups = on_group_devices(sg)
    >>> [s.devices for s in pseudo.stages], groups
    ([(0,), (1,)], [(2, 3), (0, 1)])
    """
    if all(len(s.devices) == 1 for s in sg.stages):
        return sg, [(d,) for d in range(sg.num_devices)]
    groups: list[tuple[int, ...]] = []
    for sid in sg.topological_order():
        group = tuple(sg.stage(sid).devices)
        if group not in groups:
            groups.append(group)
    seen: dict[int, tuple[int, ...]] = {}
    for group in groups:
        for d in group:
            if d in seen:
                raise Unsupported(
                    f"device {d} is in two device groups, {seen[d]} and {group}; hand-written schedules need "
                    "disjoint groups"
                )
            seen[d] = group
    index = {group: k for k, group in enumerate(groups)}
    stages = [replace(s, devices=(index[tuple(s.devices)],)) for s in sg.stages]
    return StageGraph(stages, list(sg.edges), num_devices=len(groups), overlap_gain=sg.overlap_gain), groups


def onto_groups(schedule: Schedule, groups: list[tuple[int, ...]], num_devices: int) -> Schedule:
    """A schedule on pseudo-devices (one per group) moved onto the groups' real devices."""
    real = graph_onto_groups(schedule.stage_graph, groups, num_devices)
    return Schedule(real, schedule.microbatches, list(schedule.events), memory_limit=schedule.memory_limit,
                    name=schedule.name)


def graph_onto_groups(sg: StageGraph, groups: list[tuple[int, ...]], num_devices: int) -> StageGraph:
    """A StageGraph on pseudo-devices (one per group, :func:`on_group_devices`) moved onto the groups' devices."""
    stages = [replace(s, devices=tuple(d for g in s.devices for d in groups[g])) for s in sg.stages]
    return StageGraph(stages, list(sg.edges), num_devices=num_devices, overlap_gain=sg.overlap_gain)


def is_chain(sg: StageGraph) -> bool:
    """Whether the edges of ``sg`` are exactly 0 -> 1 -> ... -> P-1 (no branches)."""
    return sorted((e.src, e.dst) for e in sg.edges) == [(k, k + 1) for k in range(len(sg.stages) - 1)]


def linearize(sg: StageGraph) -> StageGraph:
    """The chain a chain-only schedule runs for a branching ``sg``: its stages in topological order.

    Each stage feeds the next one in that order, so parallel branches run one
    after the other (what pipelining a multi-tower model with a chain-only
    runtime does). A chain edge takes the largest transfer time and size of
    the edges into its later stage, or, where that stage had no input (a
    second tower's first stage), of the whole graph. Stage k of the result is
    the k-th stage of the order, on one device (the first of its group), so
    the baselines' placements can re-place it.

    >>> from opsched.schedule import Edge, Stage, StageGraph
    >>> t = {"F": 1.0, "I": 1.0, "W": 1.0}
    >>> towers = StageGraph([Stage(k, (k,), t) for k in range(3)], [Edge(0, 2, 0.5), Edge(1, 2, 0.25)])
    >>> chain = linearize(towers)
    >>> [(e.src, e.dst, e.time) for e in chain.edges]
    [(0, 1, 0.5), (1, 2, 0.5)]
    """
    copies = [s.id for s in sg.stages if s.microbatches is not None or s.copy_of is not None]
    if copies:
        raise Unsupported(f"stages {copies} are direction copies; linearize the plain graph of logical stages")
    order = sg.topological_order()
    widest = max(sg.edges, key=lambda e: (e.time, e.bytes), default=None)
    stages = [replace(sg.stage(old), id=k, devices=(sg.stage(old).devices[0],)) for k, old in enumerate(order)]
    edges = []
    for k in range(1, len(order)):
        into = sg.preds(order[k]) or ([widest] if widest is not None else [])
        edges.append(Edge(k - 1, k, time=max((e.time for e in into), default=0.0),
                          bytes=max((e.bytes for e in into), default=0.0)))
    return StageGraph(stages, edges, num_devices=sg.num_devices)


def _default_comm(sg: StageGraph) -> float:
    return max((e.time for e in sg.edges), default=0.0)


def regroup(sg: StageGraph, count: int, comm: float | None = None) -> list[Part]:
    """The chain of ``sg`` as ``count`` logical stages.

    More stages than ``count``: consecutive stages are merged into ``count``
    groups whose sizes differ by at most one (larger groups first), summing
    pass times and memory. Fewer: each stage is split into ``count / P``
    equal parts (needs ``count`` to be a multiple of P). Raises Unsupported
    otherwise.

    >>> from opsched.schedule import chain_stage_graph
    >>> [p.time["F"] for p in regroup(chain_stage_graph(2, f=[2, 4]), 4)]
    [1.0, 1.0, 2.0, 2.0]
    """
    stages = chain_stages(sg)
    link = _default_comm(sg) if comm is None else float(comm)
    edge_into = {e.dst: e for e in sg.edges}
    p = len(stages)
    if count < 1:
        raise Unsupported(f"need at least one stage, got {count}")
    if p >= count:
        base, extra = divmod(p, count)
        parts, k = [], 0
        for g in range(count):
            size = base + (1 if g < extra else 0)
            group = stages[k : k + size]
            first = edge_into.get(group[0].id)
            parts.append(
                Part(
                    time=_summed_times(group),
                    streams=_merged_streams(group),
                    param_bytes=sum(s.param_bytes for s in group),
                    act_bytes=sum(s.act_bytes for s in group),
                    act_w_bytes=sum(s.act_w_bytes for s in group),
                    name="+".join(s.name or f"stage{s.id}" for s in group),
                    link_in=None if first is None else (first.time or link),
                    bytes_in=0.0 if first is None else first.bytes,
                )
            )
            k += size
        return parts
    if count % p:
        raise Unsupported(
            f"cannot turn {p} stages into {count}: splitting needs {count} to be a multiple of {p}; "
            f"give {count} stages or a multiple of it"
        )
    pieces = count // p
    parts = []
    for s in stages:
        into = edge_into.get(s.id)
        for j in range(pieces):
            if j == 0:
                link_in = None if into is None else (into.time or link)
                bytes_in = 0.0 if into is None else into.bytes
            else:
                # a new edge inside a split stage: same link, and its activation
                # is as large as what the stage itself receives (best estimate)
                link_in, bytes_in = link, (into.bytes if into is not None else 0.0)
            parts.append(
                Part(
                    time={x: float(s.time[x]) / pieces for x in s.timed_passes()},
                    streams=None if s.streams is None else s.streams.scaled(1 / pieces),
                    param_bytes=s.param_bytes / pieces,
                    act_bytes=s.act_bytes / pieces,
                    act_w_bytes=s.act_w_bytes / pieces,
                    name=f"{s.name or f'stage{s.id}'}/{j + 1}of{pieces}",
                    link_in=link_in,
                    bytes_in=bytes_in,
                )
            )
    return parts


def _build(
    parts: list[Part],
    on_device: list[int],
    num_devices: int,
    overlap_gain: float,
    *,
    first_id: int = 0,
    microbatches: tuple[int, ...] | None = None,
    copy: bool = False,
) -> tuple[list[Stage], list[Edge]]:
    """Stages ``first_id ..`` for ``parts``, part k on device ``on_device[k]``, chained by edges."""
    stages = [
        Stage(
            id=first_id + k,
            devices=(on_device[k],),
            time=dict(part.time),
            param_bytes=part.param_bytes,
            act_bytes=part.act_bytes,
            act_w_bytes=part.act_w_bytes,
            name=part.name,
            microbatches=microbatches,
            streams=part.streams,
            copy_of=k if copy else None,
        )
        for k, part in enumerate(parts)
    ]
    edges = [
        Edge(
            first_id + k - 1,
            first_id + k,
            time=0.0 if on_device[k - 1] == on_device[k] else float(parts[k].link_in or 0.0),
            bytes=parts[k].bytes_in,
        )
        for k in range(1, len(parts))
    ]
    return stages, edges


def chain_devices(stage: int, devices: int) -> tuple[int, ...]:
    """The chain placement: logical stage k on device k (one stage per device)."""
    return (stage,)


def one_stage_per_device(devices: int, stages: int) -> int:
    """The chain placement's logical stages per device: 1, whatever the input chain."""
    return 1


def place_chain(sg: StageGraph, microbatches: int, comm: float | None = None) -> StageGraph:
    """The chain regrouped into one stage per device, stage k on device k.

    The ``place`` of every one-stage-per-device method (GPipe, 1F1B, ZB-H1, ZB-H2).
    """
    return placed_chain(sg, one_stage_per_device(sg.num_devices, len(sg.stages)), chain_devices, comm)


def placed_chain(sg: StageGraph, per_device: int, devices_of: DevicesOf, comm: float | None = None) -> StageGraph:
    """The chain regrouped into ``per_device`` x D stages, logical stage k on ``devices_of(k, D)``.

    ``devices_of`` must give each stage one device (two copies: :func:`dual_graph`).

    >>> from opsched.schedule import chain_stage_graph
    >>> placed = placed_chain(chain_stage_graph(4, devices=2, placement="interleaved"), 2, lambda k, d: (k % d,))
    >>> [s.devices for s in placed.stages]
    [(0,), (1,), (0,), (1,)]
    """
    d = sg.num_devices
    parts = regroup(sg, per_device * d, comm)
    stages, edges = _build(parts, [single_device(devices_of, k, d) for k in range(len(parts))], d, sg.overlap_gain)
    return StageGraph(stages, edges, num_devices=d, overlap_gain=sg.overlap_gain)


def single_device(devices_of: DevicesOf, stage: int, devices: int) -> int:
    """The one device a placement rule gives ``stage`` (a rule with two copies is refused)."""
    devices_ = devices_of(stage, devices)
    if len(devices_) != 1:
        raise ValueError(f"this placement puts stage {stage} on devices {devices_}; expected exactly one")
    return devices_[0]


def dual_graph(sg: StageGraph, microbatches: int, devices_of: DevicesOf, comm: float | None = None) -> StageGraph:
    """DualPipe's two directions on D devices.

    The chain is regrouped into PP = D logical stages; ``devices_of(j, D)``
    gives the two devices of logical stage j, one per copy. Stages 0..D-1
    (the first copy, direction 0) run microbatches 0 .. M/2-1, each on the
    first device of its rule; stages D..2D-1 (the second copy, direction 1,
    ``copy_of`` = its logical stage) run microbatches M/2 .. M-1, each on
    the second device.
    """
    d = sg.num_devices
    parts = regroup(sg, d, comm)
    half = microbatches // 2
    copies = [devices_of(j, d) for j in range(d)]
    down, down_edges = _build(
        parts, [c[0] for c in copies], d, sg.overlap_gain, microbatches=tuple(range(half))
    )
    up, up_edges = _build(
        parts,
        [c[1] for c in copies],
        d,
        sg.overlap_gain,
        first_id=d,
        microbatches=tuple(range(half, microbatches)),
        copy=True,
    )
    return StageGraph(down + up, down_edges + up_edges, num_devices=d, overlap_gain=sg.overlap_gain)


# ----------------------------------------------------------------------- checks


def expect_single_devices(sg: StageGraph, method: str) -> None:
    """Every stage on exactly one device, else Unsupported."""
    for s in sg.stages:
        if len(s.devices) != 1:
            raise Unsupported(f"{method} needs one device per stage; stage {s.id} runs on {s.devices}")


def expect_chain_edges(sg: StageGraph, ids: list[int], method: str) -> None:
    """The stages ``ids`` form a chain in that order, else Unsupported."""
    have = {(e.src, e.dst) for e in sg.edges}
    need = {(ids[k], ids[k + 1]) for k in range(len(ids) - 1)}
    if not need <= have:
        missing = sorted(need - have)
        raise Unsupported(f"{method} needs stages {ids} chained in order; edges {missing} are missing")


def expect_placement(sg: StageGraph, count: int, devices_of: DevicesOf, method: str, rule: str) -> None:
    """``count`` stages chained in order, stage k on ``devices_of(k, D)``, else Unsupported naming ``rule``."""
    d = sg.num_devices
    place = [single_device(devices_of, k, d) for k in range(count)]
    expect_single_devices(sg, method)
    if len(sg.stages) != len(place):
        raise Unsupported(
            f"{method} needs {len(place)} stages on {sg.num_devices} devices ({rule}), got {len(sg.stages)}; "
            "use baselines.placed_stage_graph to re-place the chain"
        )
    wrong = [s.id for s in sg.stages if s.devices[0] != place[s.id]]
    if wrong:
        raise Unsupported(
            f"{method} needs {rule}; stages {wrong} are elsewhere; use baselines.placed_stage_graph"
        )
    expect_chain_edges(sg, list(range(len(place))), method)


def _merged_streams(group: list[Stage]) -> PassStreams | None:
    """The stream operations of consecutive stages run as one (None unless every stage has them)."""
    if any(s.streams is None for s in group):
        return None
    merged = group[0].streams
    for s in group[1:]:
        merged = merged.then(s.streams)
    return PassStreams(*(compact(merged.chain(p)) for p in ("F", "I", "W")))


def _summed_times(group) -> dict:
    """Pass times of consecutive stages merged into one: sums (B only when every stage measured one)."""
    passes = ("F", "I", "W", "B") if all("B" in s.time for s in group) else ("F", "I", "W")
    return {x: sum(float(s.time[x]) for s in group) for x in passes}
