"""The lower level over several placements: solve each one at the same memory and keep the best.

A placement is a way the same chain of work sits on the devices (the chain,
the V, interleaved chunks, DualPipe's two copies); the caller builds each
one's StageGraph and warm orders (the lower level knows no hand-written
schedule: ``opsched compare`` uses
:func:`opsched.plan.placements.candidates`) and :func:`solve_placements` runs
:func:`opsched.lower.solve` on each, in the order given, at the same memory
limit. The schedule with the lowest objective wins (ties keep the earliest).

Budgets: each placement gets the work budget a solve of that placement alone
would get (same sub-MIP and node counts), so when no clock binds the result
is exactly the best of the fixed placements' results, deterministically. The
time limit is shared: each placement may use the time left divided by the
placements left, so time one did not need passes to the next; a placement
whose turn comes after the limit is not tried (:attr:`PlacementSearch.cut`),
nor, once a schedule is in hand, one whose share is less than its solve
needs besides the search (:data:`SOLVE_OVERHEAD_FACTOR` times its
prospect's seconds): on a busy machine that work alone would run past the
limit.
With overlapped pairs, each result that is the best so far has its pairs
thinned right away (:func:`opsched.lower.solve.thin_pairs`), within the
share of one more placement: the thinning stops on its own budget, mostly
well before that, and the time it leaves passes on.
Each solve's own work past its share (building the job set, re-timing and
validating its result) is what the whole can overrun the limit by.

Placements that cannot win get no time: before any search, each
placement's proven lower bound and its best warm order are known
(:func:`opsched.lower.solve.prospect`), and a placement whose bound is not
below what some placement already has in hand (a warm order that fits, or
a result solved before its turn) is recorded with its bound, not solved
(:data:`CANNOT_WIN`); its share of the time goes to the others. No schedule
is lost: its solve could at best tie, and a solve's result is never worse
than a warm order of its own placement. Should the solve holding that
schedule fail or come back worse (a clock cut it before it timed its
starts), each placement left out that the result does not rule out is
solved after all, with the time left. (On issue 11's DualPipe grid the
chain's bound is at or above what Zero Bubble's V or DualPipeV reach on the
V in 30 of the 36 cases with a gain.)

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
from typing import Callable, NamedTuple

from opsched.errors import MemoryTooSmall, OpschedError
from opsched.lower.jobs import noise
from opsched.lower.solve import LowerResult, Prospect, prospect, solve, thin_pairs
from opsched.schedule import Order, StageGraph
from opsched.solving.solver import Status

log = logging.getLogger(__name__)

#: why a placement has no result when the time limit ran out before its turn
NOT_STARTED = "not tried: the time limit ran out before its turn"
#: why a placement has no result when its share of the time left is less than its solve needs besides its search
TOO_LITTLE_TIME = ("not tried: its share of the time left, {share:.3g} s, is less than its solve needs besides the "
                   "search (about {need:.3g} s)")
#: how the reasons of placements a clock cut begin (the search then counts as cut); "no schedule" is
#: :class:`~opsched.errors.NoScheduleInTime`'s, a placement whose search found none in its share
CUT_REASONS = ("not tried", "no schedule")
#: a solve's own work besides its search (its job set and bound, its first start, re-timing and validating the
#: result) in seconds of its prospect's: 7.2 s against 4.0 s on the V at p=64, m=256 on 2 cores at load 7
SOLVE_OVERHEAD_FACTOR = 2.0
#: the share of the limit a placement gets when the clock ran out before any placement had a result (the prospects
#: can take a whole short limit: 1.5 s at p=16, m=64 on a loaded CI machine); its solve then returns about its first
#: start, so the search returns a schedule, over the limit by at most this share and that solve's setup
LAST_RESORT_SHARE = 0.1
#: why a placement has no result when its lower bound proves it cannot beat what is in hand (module docstring)
CANNOT_WIN = "not solved: its lower bound {bound:g} is not below the {value:g} that {what} already reaches"
#: the solve options a prospect reads (the rest are the search's own)
_PROSPECT_OPTIONS = ("memory_limit", "split_backward", "allow_pairs", "objective")


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
    the placement did not run; ``refused`` then says why. A placement whose
    bound proved it could not win (:data:`CANNOT_WIN`) keeps that bound.
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
        return any(t.refused.startswith(CUT_REASONS) for t in self.tried)

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
    thin_one: Callable[..., LowerResult] | None = None,
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

    With several placements, their solves leave out the search that thins
    overlapped pairs at the best makespan (``thin=False``): it only matters
    for the placement kept, and it would hold each solve's share to the end.
    Instead each result that is the best so far is thinned as soon as it is
    in hand (``thin_one``, :func:`opsched.lower.solve.thin_pairs` by default;
    with another ``solve_one`` and no ``thin_one``, not at all), with the
    share of the time left one more placement would get: the winner's is
    thinned before the placements after it take the rest of the limit.
    """
    if not candidates:
        raise ValueError("solve_placements needs at least one candidate placement")
    run = solve if solve_one is None else solve_one
    thin = thin_pairs if solve_one is None and thin_one is None else thin_one
    started = time.monotonic()
    deadline = started + float(time_limit)
    tried: list[Tried | None] = [None] * len(candidates)  # in the candidates' order
    too_small: list[MemoryTooSmall] = []
    best: tuple[str, LowerResult] | None = None
    several = sum(1 for c in candidates if c.stage_graph is not None) > 1
    # each best result is thinned when it comes, with a share of its own (a solve's own thinning would take the
    # solve's share to the end)
    thin_options = {"thin": False} if several and thin is not None else {}
    thin_with = {k: v for k, v in solve_options.items() if k in ("memory_limit", "solver", "threads")}
    # (with one placement there is nothing to leave out, and it gets the whole limit exactly)
    hopes = _prospects(candidates, microbatches, solve_options) if several else [None] * len(candidates)
    # the best schedule in hand, which its own placement's solve keeps
    in_hand = min((_InHand(h.warm_value, f"{h.warm_name} on {c.placement}", c.placement)
                   for c, h in zip(candidates, hopes) if h is not None and h.warm_value is not None), default=None)
    left_out: list[int] = []  # placements not solved because they could not beat in_hand

    def contenders(indices) -> list[int]:
        """The placements of ``indices`` that can run and whose bound does not rule them out against ``in_hand``."""
        return [j for j in indices if candidates[j].stage_graph is not None
                and not _cannot_win(candidates[j], hopes[j], in_hand)]

    def solve_in_turn(k: int, waiting: list[int]) -> None:
        """Solve placement ``k`` with its share of the time left, shared with those ``waiting`` after it."""
        nonlocal best, in_hand
        candidate = candidates[k]
        # a placement alone gets the whole limit exactly; several share what is left (the prospects took some)
        left = deadline - time.monotonic() if several else float(time_limit)
        if left <= 0 and best is not None:  # the clock binds: placements not started are reported, and the search
            tried[k] = Tried(candidate.placement, refused=NOT_STARTED)  # counts as cut
            return
        share = left / (1 + len(waiting)) if left > 0 else LAST_RESORT_SHARE * float(time_limit)
        need = 0.0 if hopes[k] is None else SOLVE_OVERHEAD_FACTOR * hopes[k].seconds
        if best is not None and share < need:  # its solve would run past its share by what it needs besides the
            tried[k] = Tried(candidate.placement, refused=TOO_LITTLE_TIME.format(share=share, need=need))  # search
            return
        try:
            # with a schedule in hand, a search that found none in its share gives up the fallback start, whose
            # making would run past the share (a list schedule when no warm order fits: 11 s at p=64, m=256)
            result = run(candidate.stage_graph, microbatches, time_limit=share, warm_orders=candidate.warm_orders,
                         fallback=best is None, **thin_options, **solve_options)
        except OpschedError as exc:  # this placement does not fit (e.g. its minimum memory is over the limit)
            if isinstance(exc, MemoryTooSmall):
                too_small.append(exc)
            tried[k] = Tried(candidate.placement, refused=str(exc))
            return
        tried[k] = Tried.of(candidate.placement, result)
        log.info("[placement] %s: %g (bound %g, %s)", candidate.placement, result.value, result.lower_bound,
                 result.status)
        if in_hand is None or result.value < in_hand.value - noise(in_hand.value):
            in_hand = _InHand(result.value, f"the search on {candidate.placement}", candidate.placement)
        if best is None or result.value < best[1].value - noise(best[1].value):
            if thin_options:  # the best so far, thinned now with one more placement's share of the time left
                result = thin(candidate.stage_graph, microbatches, result, time_limit=max(
                    0.0, deadline - time.monotonic()) / (1 + len(contenders(waiting))), **thin_with)
            best = (candidate.placement, result)  # only the best schedule is kept (they are large at scale)

    for k, candidate in enumerate(candidates):
        if candidate.stage_graph is None:
            tried[k] = Tried(candidate.placement, refused=candidate.refused)
        elif _cannot_win(candidate, hopes[k], in_hand):
            tried[k] = Tried(candidate.placement, lower_bound=hopes[k].lower_bound, refused=CANNOT_WIN.format(
                bound=hopes[k].lower_bound, value=in_hand.value, what=in_hand.what))
            left_out.append(k)
        else:
            solve_in_turn(k, contenders(range(k + 1, len(candidates))))
    # a placement left out was measured against a schedule its holder's solve keeps; should that solve have failed
    # or come back worse (a clock cut it before it timed its starts), one the result does not rule out is solved
    for n, k in enumerate(left_out):
        if best is None or best[1].value > hopes[k].lower_bound + noise(hopes[k].lower_bound):
            solve_in_turn(k, left_out[n + 1:])
    if best is None:
        raise _nothing_ran(tried, too_small)
    return PlacementSearch(best[0], best[1], tuple(tried))


class _InHand(NamedTuple):
    """The best schedule the placement search has in hand: its value, what reaches it, and on which placement."""

    value: float
    what: str
    placement: str


def _cannot_win(candidate: Candidate, hope: Prospect | None, in_hand: _InHand | None) -> bool:
    """Whether ``candidate``'s bound proves it cannot beat the schedule ``in_hand`` of another placement."""
    return (hope is not None and in_hand is not None and in_hand.placement != candidate.placement
            and hope.lower_bound >= in_hand.value - noise(in_hand.value))


def _prospects(candidates: list[Candidate], microbatches: int, solve_options: dict) -> list[Prospect | None]:
    """Each candidate's :class:`~opsched.lower.solve.Prospect` (``None``: refused, or its memory is too small, which
    its solve reports)."""
    options = {k: v for k, v in solve_options.items() if k in _PROSPECT_OPTIONS}
    out: list[Prospect | None] = []
    for c in candidates:
        began = time.monotonic()
        try:
            hope = None if c.stage_graph is None else prospect(c.stage_graph, microbatches, warm_orders=c.warm_orders,
                                                               **options)
        except MemoryTooSmall:
            hope = None
        out.append(None if hope is None else hope._replace(seconds=time.monotonic() - began))
    return out


def _nothing_ran(tried: list[Tried], too_small: list[MemoryTooSmall]) -> OpschedError:
    """The error when no placement ran: each one's reason; when some were below their minimum memory, the least."""
    reasons = "; ".join(f"{t.placement}: {t.refused}" for t in tried)
    if too_small:  # raising the limit to the least minimum lets that placement run
        least = min(exc.minimum for exc in too_small)
        return MemoryTooSmall(f"the memory limit is below what every placement needs ({reasons}); "
                              f"raise it to at least {least:g}", least)
    return OpschedError(f"no placement could be scheduled ({reasons})")
