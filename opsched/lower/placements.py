"""The lower level over several placements: solve each one at the same memory and keep the best.

A placement is a way the same chain of work sits on the devices (the chain,
the V, interleaved chunks, DualPipe's two copies); the caller builds each
one's StageGraph and warm orders (the lower level knows no hand-written
schedule: ``opsched compare`` uses
:func:`opsched.placements.candidates`) and :func:`solve_placements` runs
:func:`opsched.lower.solve` on each, in the order given, at the same memory
limit. The schedule with the lowest objective wins (ties keep the earliest).

Budgets: each placement gets the work budget a solve of that placement alone
would get (same sub-MIP and node counts), so when no clock binds the result
is exactly the best of the fixed placements' results, deterministically. The
time limit is shared: each placement may use the time left divided by the
placements left, so time one did not need passes to the next; a placement
whose turn comes after the limit is not tried (:attr:`PlacementSearch.cut`).
Each solve's own work past its share (building the job set, re-timing and
validating its result) is what the whole can overrun the limit by.

Bounds: a solve's lower bound holds for every schedule *of its placement*.
:attr:`PlacementSearch.lower_bound_all` is the least bound over the
placements tried, the bound that holds for the search as a whole (not for
placements it did not try).

>>> from opsched.schedule import chain_stage_graph
>>> chain = Candidate("chain", chain_stage_graph(2, f=1, b=2, w=1))
>>> found = solve_placements([chain], 4, time_limit=5)
>>> found.placement, found.result.makespan, found.lower_bound_all
('chain', 13.0, 13.0)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from opsched.errors import MemoryTooSmall, OpschedError
from opsched.lower.jobs import noise
from opsched.lower.solve import LowerResult, solve
from opsched.schedule import Order, StageGraph
from opsched.solver import Status

log = logging.getLogger(__name__)

#: why a placement has no result when the time limit ran out before its turn
NOT_STARTED = "not tried: the time limit ran out before its turn"


@dataclass(frozen=True)
class Candidate:
    """One placement to try: its name, the stage graph placed that way, and warm orders on exactly that graph.

    ``refused`` (with no stage graph) records a placement that cannot hold
    this pipeline, and why; it is reported, never solved.
    """

    placement: str
    stage_graph: StageGraph | None
    warm_orders: dict[str, Order] = field(default_factory=dict)
    refused: str = ""


@dataclass(frozen=True)
class Tried:
    """What one placement gave: its solve's figures (not its schedule: only the winner's is kept), or why not.

    ``value``, ``lower_bound``, ``status`` and ``seconds`` are ``None`` when
    the placement did not run; ``refused`` then says why.
    """

    placement: str
    value: float | None = None
    lower_bound: float | None = None
    status: Status | None = None
    seconds: float | None = None
    refused: str = ""

    @classmethod
    def of(cls, placement: str, result: LowerResult) -> "Tried":
        return cls(placement, result.value, result.lower_bound, result.status, result.solve_seconds)


@dataclass(frozen=True)
class PlacementSearch:
    """The best placement's result and every placement tried, in the order tried."""

    placement: str
    result: LowerResult
    tried: tuple[Tried, ...]

    @property
    def seconds(self) -> float:
        """Seconds the placements' solves took, together (each solve's own wall clock)."""
        return sum(t.seconds for t in self.tried if t.seconds is not None)

    @property
    def cut(self) -> bool:
        """Whether the time limit ran out before every placement was tried."""
        return any(t.refused == NOT_STARTED for t in self.tried)

    @property
    def lower_bound_all(self) -> float:
        """The least lower bound over the placements that ran: a bound on every schedule of any of them."""
        return min(t.lower_bound for t in self.tried if t.lower_bound is not None)


def solve_placements(
    candidates: list[Candidate],
    microbatches: int,
    *,
    time_limit: float = 30.0,
    solve_one: Callable[..., LowerResult] | None = None,
    **solve_options,
) -> PlacementSearch:
    """Solve each candidate placement at the same memory and keep the lowest objective (ties: the earliest).

    ``solve_options`` go to every :func:`opsched.lower.solve` call as they
    are (``memory_limit``, ``solver``, ``objective``, ``search_budget``...),
    so each placement gets the work budget it would get alone; ``time_limit``
    is shared (see the module docstring). A placement that cannot run (a
    memory limit below its minimum, a refusal from its builder) is recorded
    in ``tried`` with the reason; when none runs, the first reason is raised
    as :class:`~opsched.errors.OpschedError` naming every placement's reason.
    ``solve_one`` replaces :func:`opsched.lower.solve` (tests, callers that
    isolate it).
    """
    if not candidates:
        raise ValueError("solve_placements needs at least one candidate placement")
    run = solve if solve_one is None else solve_one
    started = time.monotonic()
    deadline = started + float(time_limit)
    tried: list[Tried] = []
    too_small: list[MemoryTooSmall] = []
    best: tuple[str, LowerResult] | None = None
    attempted = False
    for k, candidate in enumerate(candidates):
        if candidate.stage_graph is None:
            tried.append(Tried(candidate.placement, refused=candidate.refused))
            continue
        # the first solve gets its share of the whole limit exactly; later ones share what is left
        left = deadline - time.monotonic() if attempted else float(time_limit)
        if left <= 0:  # the clock binds: placements not started are reported, and the search counts as cut
            tried.append(Tried(candidate.placement, refused=NOT_STARTED))
            continue
        share = left / sum(1 for c in candidates[k:] if c.stage_graph is not None)
        attempted = True
        try:
            result = run(candidate.stage_graph, microbatches, time_limit=share,
                         warm_orders=candidate.warm_orders, **solve_options)
        except OpschedError as exc:  # this placement does not fit (e.g. its minimum memory is over the limit)
            if isinstance(exc, MemoryTooSmall):
                too_small.append(exc)
            tried.append(Tried(candidate.placement, refused=str(exc)))
            continue
        tried.append(Tried.of(candidate.placement, result))
        log.info("[placement] %s: %g (bound %g, %s)", candidate.placement, result.value, result.lower_bound,
                 result.status)
        if best is None or result.value < best[1].value - noise(best[1].value):
            best = (candidate.placement, result)  # only the best schedule is kept (they are large at scale)
    if best is None:
        raise _nothing_ran(tried, too_small)
    return PlacementSearch(best[0], best[1], tuple(tried))


def _nothing_ran(tried: list[Tried], too_small: list[MemoryTooSmall]) -> OpschedError:
    """The error when no placement ran: each one's reason; when some were below their minimum memory, the least."""
    reasons = "; ".join(f"{t.placement}: {t.refused}" for t in tried)
    if too_small:  # raising the limit to the least minimum lets that placement run
        least = min(exc.minimum for exc in too_small)
        return MemoryTooSmall(f"the memory limit is below what every placement needs ({reasons}); "
                              f"raise it to at least {least:g}", least)
    return OpschedError(f"no placement could be scheduled ({reasons})")
