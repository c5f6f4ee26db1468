"""The lower level over several placements: solve each one at the same memory and keep the best.

A placement is a way the same chain of work sits on the devices (the chain,
the V, interleaved chunks, DualPipe's two copies); the caller builds each
one's StageGraph and warm orders (the lower level knows no hand-written
schedule: ``opsched compare`` uses
:func:`opsched.plan.placements.placements_to_try`) and :func:`solve_placements` runs
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
>>> chain = PlacementToTry("chain", chain_stage_graph(2, f=1, b=2, w=1))
>>> found = solve_placements([chain], 4, time_limit=5)
>>> found.placement, found.result.makespan, found.lower_bound_all
('chain', 13.0, 13.0)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from opsched.errors import MemoryTooSmall, OpschedError
from opsched.lower.jobs import noise
from opsched.lower.solve import LowerOptions, LowerResult, Prospect, prospect, solve, thin_pairs
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


@dataclass(frozen=True)
class PlacementToTry:
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
    candidates: list[PlacementToTry],
    microbatches: int,
    options: LowerOptions | None = None,
    /,
    *,
    solve_one: Callable[[StageGraph, int, LowerOptions], LowerResult] | None = None,
    thin_one: Callable[..., LowerResult] | None = None,
    **changes,
) -> PlacementSearch:
    """Solve each candidate placement at the same memory and keep the lowest objective (ties: the earliest).

    ``options`` (a :class:`~opsched.lower.solve.LowerOptions`, whose fields
    keyword ``changes`` replace) go to every :func:`opsched.lower.solve` call
    (``memory_limit``, ``solver``, ``objective``, ``search_budget``...), so each
    placement gets the work budget it would get alone; its ``time_limit`` is
    shared (see the module docstring), and each candidate's warm orders are its
    own. A placement that cannot run (a
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
    options = dataclasses.replace(options or LowerOptions(), **changes)
    thin = thin_pairs if solve_one is None and thin_one is None else thin_one
    started = time.monotonic()
    several = sum(1 for c in candidates if c.stage_graph is not None) > 1
    # (with one placement there is nothing to leave out, and it gets the whole limit exactly)
    hopes = _prospects(candidates, microbatches, options) if several else [None] * len(candidates)
    # each best result is thinned when it comes, with a share of its own (a solve's own thinning would take the
    # solve's share to the end)
    thin_here = several and thin is not None
    turns = _Turns(
        candidates, microbatches, float(options.time_limit), started + float(options.time_limit),
        solve if solve_one is None else solve_one, thin, several, thin_here,
        dataclasses.replace(options, thin=False) if thin_here else options, hopes,
        # the best schedule in hand, which its own placement's solve keeps
        min((_InHand(h.warm_value, f"{h.warm_name} on {c.placement}", c.placement)
             for c, h in zip(candidates, hopes) if h is not None and h.warm_value is not None), default=None),
        [None] * len(candidates),  # in the candidates' order
    )
    left_out: list[int] = []  # placements not solved because they could not beat in_hand
    for k, candidate in enumerate(candidates):
        if candidate.stage_graph is None:
            turns.tried[k] = Tried(candidate.placement, refused=candidate.refused)
        elif _cannot_win(candidate, hopes[k], turns.in_hand):
            turns.tried[k] = Tried(candidate.placement, lower_bound=hopes[k].lower_bound, refused=CANNOT_WIN.format(
                bound=hopes[k].lower_bound, value=turns.in_hand.value, what=turns.in_hand.what))
            left_out.append(k)
        else:
            turns.solve_in_turn(k, turns.contenders(range(k + 1, len(candidates))))
    # a placement left out was measured against a schedule its holder's solve keeps; should that solve have failed
    # or come back worse (a clock cut it before it timed its starts), one the result does not rule out is solved
    for n, k in enumerate(left_out):
        if turns.best is None or turns.best[1].value > hopes[k].lower_bound + noise(hopes[k].lower_bound):
            turns.solve_in_turn(k, left_out[n + 1:])
    if turns.best is None:
        raise _nothing_ran(turns.tried, turns.too_small)
    return PlacementSearch(turns.best[0], turns.best[1], tuple(turns.tried))


class _InHand(NamedTuple):
    """The best schedule the placement search has in hand: its value, what reaches it, and on which placement."""

    value: float
    what: str
    placement: str



@dataclass
class _Turns:
    """What :func:`solve_placements` knows while it solves the placements in turn: the options every solve shares,
    each placement's prospect, the best schedule in hand and the best result kept, and what each placement gave.

    Its methods are the search's steps; the state they share lives here rather than in closures over locals.
    """

    candidates: list[PlacementToTry]
    microbatches: int
    time_limit: float
    deadline: float  # time.monotonic() instant where the placements' shared time limit ends
    run: Callable[..., LowerResult]
    thin: Callable[..., LowerResult] | None
    several: bool  # more than one placement can run
    thin_here: bool  # each best result is thinned here, not by its own solve (whose options say thin=False)
    options: LowerOptions  # every solve's, but for its time limit, warm orders and fallback
    hopes: list[Prospect | None]
    in_hand: _InHand | None
    tried: list[Tried | None]
    too_small: list[MemoryTooSmall] = field(default_factory=list)
    best: tuple[str, LowerResult] | None = None

    def contenders(self, indices) -> list[int]:
        """The placements of ``indices`` that can run and whose bound does not rule them out against ``in_hand``."""
        return [j for j in indices if self.candidates[j].stage_graph is not None
                and not _cannot_win(self.candidates[j], self.hopes[j], self.in_hand)]

    def solve_in_turn(self, k: int, waiting: list[int]) -> None:
        """Solve placement ``k`` with its share of the time left, shared with those ``waiting`` after it."""
        candidate = self.candidates[k]
        # a placement alone gets the whole limit exactly; several share what is left (the prospects took some)
        left = self.deadline - time.monotonic() if self.several else self.time_limit
        if left <= 0 and self.best is not None:
            # the clock binds: placements not started are reported, and the search counts as cut
            self.tried[k] = Tried(candidate.placement, refused=NOT_STARTED)
            return
        share = left / (1 + len(waiting)) if left > 0 else LAST_RESORT_SHARE * self.time_limit
        need = 0.0 if self.hopes[k] is None else SOLVE_OVERHEAD_FACTOR * self.hopes[k].seconds
        if self.best is not None and share < need:
            # its solve would run past its share by what it needs besides the search
            self.tried[k] = Tried(candidate.placement, refused=TOO_LITTLE_TIME.format(share=share, need=need))
            return
        try:
            # with a schedule in hand, a search that found none in its share gives up the fallback start, whose
            # making would run past the share (a list schedule when no warm order fits: 11 s at p=64, m=256)
            result = self.run(candidate.stage_graph, self.microbatches, dataclasses.replace(
                self.options, time_limit=share, warm_orders=candidate.warm_orders, fallback=self.best is None))
        except OpschedError as exc:  # this placement does not fit (e.g. its minimum memory is over the limit)
            if isinstance(exc, MemoryTooSmall):
                self.too_small.append(exc)
            self.tried[k] = Tried(candidate.placement, refused=str(exc))
            return
        self.keep(k, result, waiting)

    def keep(self, k: int, result: LowerResult, waiting: list[int]) -> None:
        """Record placement ``k``'s ``result``; when it is the best so far, thin it now (with one more placement's
        share of the time left, before those ``waiting`` take the rest) and keep it in place of the last best."""
        candidate = self.candidates[k]
        self.tried[k] = Tried.of(candidate.placement, result)
        log.info("[placement] %s: %g (bound %g, %s)", candidate.placement, result.value, result.lower_bound,
                 result.status)
        if self.in_hand is None or result.value < self.in_hand.value - noise(self.in_hand.value):
            self.in_hand = _InHand(result.value, f"the search on {candidate.placement}", candidate.placement)
        if self.best is None or result.value < self.best[1].value - noise(self.best[1].value):
            if self.thin_here:  # the best so far, thinned now with one more placement's share of the time left
                o = self.options
                result = self.thin(candidate.stage_graph, self.microbatches, result, time_limit=max(
                    0.0, self.deadline - time.monotonic()) / (1 + len(self.contenders(waiting))),
                    memory_limit=o.memory_limit, solver=o.solver, threads=o.threads)
            self.best = (candidate.placement, result)  # only the best schedule is kept (they are large at scale)

def _cannot_win(candidate: PlacementToTry, hope: Prospect | None, in_hand: _InHand | None) -> bool:
    """Whether ``candidate``'s bound proves it cannot beat the schedule ``in_hand`` of another placement."""
    return (hope is not None and in_hand is not None and in_hand.placement != candidate.placement
            and hope.lower_bound >= in_hand.value - noise(in_hand.value))


def _prospects(candidates: list[PlacementToTry], microbatches: int, options: LowerOptions) -> list[Prospect | None]:
    """Each candidate's :class:`~opsched.lower.solve.Prospect` (``None``: refused, or its memory is too small, which
    its solve reports)."""
    out: list[Prospect | None] = []
    for c in candidates:
        began = time.monotonic()
        try:
            hope = None if c.stage_graph is None else prospect(c.stage_graph, microbatches, options,
                                                               warm_orders=c.warm_orders)
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
