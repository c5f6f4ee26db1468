"""Measured times -> opsched's cost model.

A calibration run (:func:`opsched.torchrun.launch.run_job` with timers on)
reports the median F, I, W (and fused B) compute time of every stage on the
rank that hosts it, and the one-way time of an activation-sized message. These
become a :class:`~opsched.schedule.StageGraph` that opsched's simulator, the
baselines and the lower MIP schedule, so a plan's predicted step time can be
compared with the measured one.

The runtime also spends time around every action outside the timed compute
(Python bookkeeping, posting sends and receives, waking up). A schedule with
few idle gaps cannot hide it, so it is modelled as one ``overhead`` added to
every action, a fused B paying it once and a split I + W twice;
:func:`fit_overhead` fits it to measured step times.

>>> times = {(0, "F"): 1.0, (0, "I"): 0.5, (0, "W"): 1.0, (1, "F"): 2.0, (1, "I"): 2.0, (1, "W"): 1.0}
>>> sg = stage_graph_from_times(times, {0: 0, 1: 1}, comm=0.1)
>>> [s.time["F"] for s in sg.stages], sg.edges[0].time
([1.0, 2.0], 0.1)
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from opsched.errors import OpschedError
from opsched.schedule import Edge, Stage, StageGraph


def stage_graph_from_times(
    times: Mapping[tuple[int, str], float],
    stage_ranks: Mapping[int, int],
    comm: float = 0.0,
    act_bytes: float = 1.0,
    act_w_bytes: float = 0.5,
    overhead: float = 0.0,
) -> StageGraph:
    """A chain StageGraph with measured F, I, W per stage, stage s on device ``stage_ranks[s]``.

    ``comm`` is the transfer time of an edge between different ranks (0 on
    one rank: torch hands the tensor over locally). A measured fused backward
    ``times[(s, "B")]`` is kept when every stage has one (else B costs I + W).
    ``overhead`` is added to every action (F, I, W and B alike). Activation
    sizes count microbatches (``act_bytes`` 1 per microbatch), so memory limits
    read as "microbatches of activations per device".
    """
    n = len(stage_ranks)
    missing = [f"{s}{p}" for s in range(n) for p in ("F", "I", "W") if (s, p) not in times]
    if missing:
        raise OpschedError(f"calibration lacks times for {', '.join(missing)}; run a schedule with split I/W")
    passes = ("F", "I", "W", "B") if all((s, "B") in times for s in range(n)) else ("F", "I", "W")
    stages = [
        Stage(
            id=s,
            devices=(stage_ranks[s],),
            time={p: float(times[(s, p)]) + overhead for p in passes},
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


def fit_overhead(
    predict: Callable[[float], Sequence[float]],
    measured: Sequence[float],
    largest: float,
) -> float:
    """The per-action overhead in [0, ``largest``] whose predictions best match ``measured``.

    ``predict(overhead)`` returns the simulated step time of each measured run
    with that overhead in the calibrated StageGraph. The result minimises the
    sum of squared relative errors: the best of a 50-point grid, refined by a
    golden-section search between its neighbours.

    >>> from opsched.schedule import Job, simulate
    >>> def predict(o):
    ...     sg = stage_graph_from_times({(0, "F"): 1.0, (0, "I"): 1.0, (0, "W"): 1.0}, {0: 0}, overhead=o)
    ...     return [max(e.end for e in simulate(sg, order, 1))]
    >>> order = {0: [Job(0, 0, "F"), Job(0, 0, "I"), Job(0, 0, "W")]}
    >>> round(fit_overhead(predict, [3.6], largest=1.0), 6)
    0.2
    """
    def error(overhead: float) -> float:
        return sum(((p - m) / m) ** 2 for p, m in zip(predict(overhead), measured))

    step = largest / 50
    best = min((k * step for k in range(51)), key=error)
    lo, hi = max(0.0, best - step), min(largest, best + step)
    ratio = (5 ** 0.5 - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = error(a), error(b)
    for _ in range(40):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = error(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = error(b)
    return min((best, (lo + hi) / 2), key=error)
