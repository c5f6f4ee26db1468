"""Measured times -> opsched's cost model.

A calibration run (:func:`opsched.torchrun.launch.run_job` with timers on)
reports the median F, I, W (and fused B) compute time of every stage on the
rank that hosts it, and the one-way time of an activation-sized message. These
become a :class:`~opsched.schedule.StageGraph` that opsched's simulator, the
baselines and the lower MIP schedule, so a plan's predicted step time can be
compared with the measured one.

>>> times = {(0, "F"): 1.0, (0, "I"): 0.5, (0, "W"): 1.0, (1, "F"): 2.0, (1, "I"): 2.0, (1, "W"): 1.0}
>>> sg = stage_graph_from_times(times, {0: 0, 1: 1}, comm=0.1)
>>> [s.time["F"] for s in sg.stages], sg.edges[0].time
([1.0, 2.0], 0.1)
"""

from __future__ import annotations

from typing import Mapping, Sequence

from opsched.errors import OpschedError
from opsched.schedule import Edge, Stage, StageGraph


def stage_graph_from_times(
    times: Mapping[tuple[int, str], float],
    stage_ranks: Mapping[int, int],
    comm: float = 0.0,
    act_bytes: float = 1.0,
    act_w_bytes: float = 0.5,
) -> StageGraph:
    """A chain StageGraph with measured F, I, W per stage, stage s on device ``stage_ranks[s]``.

    ``comm`` is the transfer time of an edge between different ranks (0 on
    one rank: torch hands the tensor over locally). Activation sizes count
    microbatches (``act_bytes`` 1 per microbatch), so memory limits read as
    "microbatches of activations per device".
    """
    n = len(stage_ranks)
    missing = [f"{s}{p}" for s in range(n) for p in ("F", "I", "W") if (s, p) not in times]
    if missing:
        raise OpschedError(f"calibration lacks times for {', '.join(missing)}; run a schedule with split I/W")
    stages = [
        Stage(
            id=s,
            devices=(stage_ranks[s],),
            time={p: float(times[(s, p)]) for p in ("F", "I", "W")},
            act_bytes=act_bytes,
            act_w_bytes=act_w_bytes,
            name=f"stage{s}",
        )
        for s in range(n)
    ]
    edges = [Edge(s, s + 1, time=comm if stage_ranks[s] != stage_ranks[s + 1] else 0.0) for s in range(n - 1)]
    return StageGraph(stages, edges, num_devices=1 + max(stage_ranks.values()))


def merged_times(times: Mapping[tuple[int, str], float], groups: Sequence[Sequence[int]]) -> dict:
    """Times of coarser stages, each the consecutive fine stages of one group (sums per pass).

    >>> merged_times({(0, "F"): 1.0, (1, "F"): 2.0}, [[0, 1]])
    {(0, 'F'): 3.0}
    """
    out: dict[tuple[int, str], float] = {}
    for k, group in enumerate(groups):
        for (s, p), t in times.items():
            if s in group:
                out[(k, p)] = out.get((k, p), 0.0) + t
    return out
