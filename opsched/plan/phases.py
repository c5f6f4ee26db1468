"""A step split as DeepSeek reports DualPipe's (ISCA'25 "Insights into DeepSeek-V3", arXiv 2505.09343, Table 4).

On the busiest pipeline rank (the one :func:`opsched.plan.layouts._breakdown` reads): the time its forwards run
alone, its overlapped forward-and-backward pairs (one pair counted once), its backwards alone (whole B or input
gradient I), its weight-gradient passes alone (W), its idle time before the last job ends (the bubble), and what
follows the pipeline (exposed gradient sync and the optimizer step). The six sum to the step.

>>> from opsched.schedule import Event, Schedule, chain_stage_graph
>>> events = [Event(0, 0, "F", 0.0, 1.0), Event(0, 1, "F", 1.0, 3.0, pair=0), Event(0, 0, "B", 1.0, 3.0, pair=0),
...           Event(0, 1, "B", 4.0, 5.0)]
>>> step_phases(Schedule(chain_stage_graph(1), 2, events), rank=0, step_time=5.5)
StepPhases(forward_only=1.0, pairs=2.0, backward_only=1.0, w_only=0.0, bubble=1.0, optimizer=0.5)
"""

from __future__ import annotations

from typing import NamedTuple

from opsched.schedule import Schedule


class StepPhases(NamedTuple):
    """Seconds of one step on one pipeline rank, DeepSeek's six parts (see the module docstring)."""

    forward_only: float
    pairs: float
    backward_only: float
    w_only: float
    bubble: float
    optimizer: float  # after the pipeline: exposed gradient sync and the optimizer step


def step_phases(sched: Schedule, rank: int, step_time: float) -> StepPhases:
    """The split of ``sched``'s step on pipeline rank ``rank``; ``step_time`` includes what follows the pipeline."""
    forward = pairs = backward = w = 0.0
    seen_pairs: set[int] = set()
    for e in sched.events:
        if rank not in sched.stage_graph.stage(e.stage).devices:
            continue
        length = e.end - e.start
        if e.pair is not None:
            if e.pair not in seen_pairs:
                seen_pairs.add(e.pair)
                pairs += length
        elif e.pass_ == "F":
            forward += length
        elif e.pass_ == "W":
            w += length
        else:
            backward += length
    makespan = max((e.end for e in sched.events), default=0.0)
    busy = forward + pairs + backward + w
    return StepPhases(forward, pairs, backward, w, makespan - busy, step_time - makespan)
