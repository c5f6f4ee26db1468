"""Deepening the warm-up: one more forward where a device waits for its first backward.

A hand-written schedule fixes each device's warm-up (the forwards it runs
before its first backward) for a memory it assumes. At a larger memory, a
device deep in the pipeline still waits for its first backward to come back
from the loss, and a forward it runs in that wait moves its later work, and
the work downstream of it, earlier. Zero Bubble's V at DualPipeV's peak
memory is such a case: its peak is one F's activation below the limit, and
one more forward on the device at the V's tip, before its first backward,
shortens the step by one F (the DualPipe grid of docs/BENCHMARKS.md, F:I:W
= 1:1.5:0.5: 110 to 109 at D=8, M=16; 222 to 221 at D=16, M=32).

:func:`deepen_warmup` is a greedy over that one move: on each device, from
the last to the first (the deepest devices wait longest), the first forward
after the device's first backward moves to just before it, and the move is
kept when the order still fits in memory and times better (a lower
objective, or the same and a lower sum of job ends:
:func:`opsched.lower.lns.better`). Sweeps repeat while one keeps a move,
within a budget of simulations, so the result does not depend on the clock
unless a deadline cuts it (then ``cut`` says so).

>>> from opsched.schedule import Job, chain_stage_graph, simulate
>>> from opsched.lower.jobs import JobSet
>>> sg = chain_stage_graph(2, f=1, b=2, w=1)
>>> order = {0: [Job(0, 0, "F"), Job(0, 0, "I"), Job(0, 1, "F"), Job(0, 0, "W"), Job(0, 1, "I"), Job(0, 1, "W")],
...          1: [Job(1, 0, "F"), Job(1, 0, "I"), Job(1, 0, "W"), Job(1, 1, "F"), Job(1, 1, "I"), Job(1, 1, "W")]}
>>> max(e.end for e in simulate(sg, order, 2))
9.0
>>> deepened = deepen_warmup(JobSet(sg, 2), order, budgets=None)
>>> deepened.moves, deepened.incumbent.makespan  # device 0 runs its second F while the first backward is away
(1, 8.0)
>>> [str(a) for a in deepened.order[0]]
['0F0', '0F1', '0I0', '0W0', '0I1', '0W1']
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

from opsched.lower.jobs import JobSet, order_fits
from opsched.lower.lns import Incumbent, better, timed_incumbent
from opsched.errors import Deadlock
from opsched.schedule import Job, Order, PassKind, jobs_of, simulate
from opsched.solving.solver import Objective

#: simulations one deepening may spend (each tries one move; the grid's V needs 7-20)
DEEPEN_SIMULATIONS = 64


@dataclass(frozen=True)
class Deepened:
    """What :func:`deepen_warmup` gives: the order, as timed, and how many forwards it moved."""

    order: Order
    incumbent: Incumbent
    moves: int
    #: a deadline stopped it before a sweep kept nothing and before its budget was spent
    cut: bool = False


def deepen_warmup(js: JobSet, order: Order, budgets: Mapping[int, float] | None,
                  objective: Objective = Objective.MAKESPAN, *, deadline: float | None = None,
                  max_simulations: int = DEEPEN_SIMULATIONS, start: Incumbent | None = None) -> Deepened:
    """``order`` with forwards moved before each device's first backward wherever that fits and times better.

    Only single-device forwards move (a stage on a group of devices runs its
    action on all of them at once; moving it on one would break the group).
    The order is not modified. ``start``: ``order`` as timed for ``objective``
    (:func:`opsched.lower.lns.timed_incumbent`), when the caller has it.
    """
    best_order = {d: list(acts) for d, acts in order.items()}
    best = start if start is not None else timed_incumbent(js, best_order, simulate(js.sg, best_order,
                                                                                     js.microbatches), objective)
    moves = simulations = 0
    kept = True
    while kept:
        kept = False
        for d in sorted(best_order, reverse=True):
            if simulations >= max_simulations:
                return Deepened(best_order, best, moves)
            if deadline is not None and time.monotonic() > deadline:
                return Deepened(best_order, best, moves, cut=True)
            acts = _deeper(js, best_order[d])
            if acts is None or (budgets is not None and not order_fits(js.sg, {d: acts}, {d: budgets[d]})):
                continue
            trial = {**best_order, d: acts}
            simulations += 1
            try:
                inc = timed_incumbent(js, trial, simulate(js.sg, trial, js.microbatches), objective)
            except Deadlock:
                continue
            if better(inc, best):
                best_order, best, kept = trial, inc, True
                moves += 1
    return Deepened(best_order, best, moves)


def _deeper(js: JobSet, acts: list) -> list | None:
    """``acts`` with the first single-device forward after the first backward moved to just before it, or None."""
    first_backward = next((k for k, a in enumerate(acts) if any(j.pass_ != PassKind.F for j in jobs_of(a))), None)
    if first_backward is None:
        return None
    for k in range(first_backward + 1, len(acts)):
        a = acts[k]
        if isinstance(a, Job) and a.pass_ == PassKind.F and len(js.sg.stage(a.stage).devices) == 1:
            return acts[:first_backward] + [a] + acts[first_backward:k] + acts[k + 1:]
    return None
