"""Large-neighbourhood search: re-solve a window of the incumbent as a time-indexed MIP.

The incumbent order is timed in slots (the simulator on the slotted
StageGraph). A neighbourhood frees the jobs that start inside a time window
(optionally only on some devices) and fixes every other job at its slotted
start; the freed jobs get start windows from the fixed jobs around them
(their heads and tails inside the neighbourhood). The small MIP minimises the
objective (the makespan, or the longest device span) and, as a tie-breaker, the starts of the freed jobs weighted by their
tails (urgent work first). Its per-device job order is spliced back, re-timed
in continuous time by :func:`opsched.schedule.simulate`, and accepted when it
lowers (objective, sum of job ends) and still fits in memory.

Thinning pairs (``fewer_pairs``): the same search, where each sub-MIP
minimises the overlapped pairs the freed jobs form between the objective and
the starts, and a result is accepted when it has a lower objective, or the
same and fewer pairs (:func:`thinner`). Run after the search proper (the
solve does), it keeps the makespan and parts pairs the makespan does not
need where parting alone (:mod:`opsched.lower.parting`) cannot: the window's
jobs move. It is not the search proper's rule because a pair that does not
shorten the step now may let a later window shorten it. ``patience`` stops
either search after that many sub-MIPs in a row were not accepted.

A sub-MIP already solved on the current incumbent is not solved again (the
same free jobs, windows and fixed jobs and the same start: the same answer,
which was not accepted). It counts as posed, as if solved, toward the budget
and the patience, so the search takes the steps it would take solving it
again, in less time. (A sweep after an accepted result repeats every window
after that result's; on few microbatches neighbouring windows free the same
jobs.)

Windows sweep the horizon from the end (where the makespan is decided)
towards the start, then device subsets; the sequence is fixed, and each MIP
has a node limit, and the number of sub-MIPs is capped, so the search is
deterministic unless a clock limit cuts it short (then it says so).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from opsched.lower.jobs import JobSet, noise, order_fits
from opsched.lower.timeindexed import (
    SlotProblem,
    add_pair_options,
    model_size,
    pair_length,
    slot_problem,
    slotted_stage_graph,
)
from opsched.lower.slot_solve import solve_slot_problem, starts_to_order
from opsched.schedule import Order, Pair, PassKind, StageGraph, simulate
from opsched.solving.solver import Objective

# globals where tested per job: a member lookup costs 14 globals' on Python 3.11
_F = PassKind.F
_LAST_PASSES = (PassKind.W, PassKind.B)  # the pass ending a stage's work on a microbatch, split or fused


#: a sub-MIP of the search stops after this many seconds by default (a clock cap; the node limit is the budget)
SECONDS_PER_SOLVE = 5.0
#: windows are sized for sub-MIPs of about this many variables by default (without pair options)
SUBMIP_VARIABLES = 800


@dataclass
class Incumbent:
    """An order (overlapped pairs allowed) with its objective value, makespan and sum of job ends (the acceptance key)."""

    order: Order
    value: float
    makespan: float
    total_end: float


def objective_value(js: JobSet, events, objective: Objective = Objective.MAKESPAN) -> float:
    """``MAKESPAN``: the last end. ``ZB_SPAN``: the longest device span from its first F to its last W or B."""
    if objective == Objective.MAKESPAN:
        return max(e.end for e in events)
    if objective == Objective.ZB_SPAN:
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        for e in events:
            for d in js.sg.stage(e.stage).devices:
                if e.pass_ == _F:
                    first[d] = min(first.get(d, e.start), e.start)
                elif e.pass_ in _LAST_PASSES:
                    last[d] = max(last.get(d, e.end), e.end)
        return max(last[d] - first[d] for d in last if d in first)
    raise ValueError(f"unknown objective {objective!r}")


def incumbent_of(js: JobSet, order: dict, objective: Objective = Objective.MAKESPAN) -> Incumbent:
    """Time ``order`` with the simulator and wrap it as an :class:`Incumbent`."""
    return timed_incumbent(js, order, simulate(js.sg, order, js.microbatches),
                           objective)


def timed_incumbent(js: JobSet, order: dict, events, objective: Objective = Objective.MAKESPAN) -> Incumbent:
    """``order`` as an :class:`Incumbent`, valued from its ``events`` (the simulator's)."""
    return Incumbent(order, objective_value(js, events, objective), max(e.end for e in events), sum(e.end for e in events))


def slotted_starts(js: JobSet, order: Order, slot: float) -> dict[int, int]:
    """Start slot of every job when ``order`` runs with slot-rounded durations."""
    return slotted_timing(js, order, slot).starts


@dataclass
class SlottedTiming:
    """An order timed on the slotted StageGraph: start slots, the horizon and its pairs (job numbers)."""

    starts: dict[int, int]
    horizon: int
    #: (forward, backward) -> the pair's length in slots
    pairs: dict[tuple[int, int], int]


def slotted_timing(js: JobSet, order: Order, slot: float, ssg: StageGraph | None = None) -> SlottedTiming:
    """Time ``order`` with slot-rounded durations (``ssg``: the slotted StageGraph, when the caller has it).

    Pair lengths are whole slots, rounded up (:func:`opsched.lower.timeindexed.pair_length`).
    """
    ssg = ssg or slotted_stage_graph(js.sg, slot)
    events = simulate(ssg, order, js.microbatches)
    pairs: dict[tuple[int, int], int] = {}
    for acts in order.values():
        for a in acts:
            if isinstance(a, Pair):
                forward, backward = (a.first, a.second) if a.first.pass_ == _F else (a.second, a.first)
                pairs[js.index[forward], js.index[backward]] = pair_length(ssg, forward, backward)
    return SlottedTiming({js.index[e.job]: int(round(e.start)) for e in events},
                         int(round(max(e.end for e in events))), pairs)


def neighbourhood(
    js: JobSet, base: SlotProblem, starts: dict[int, int], horizon: int, lo: int, hi: int,
    devices: set[int] | None = None, *, pairs: Mapping[tuple[int, int], int] | None = None,
    pair_graph: StageGraph | None = None,
) -> SlotProblem | None:
    """Free the jobs starting in ``[lo, hi)`` (on ``devices`` if given); fix the rest.

    Windows: a freed job starts no earlier than ``lo`` nor before its fixed
    predecessors allow, and late enough for its fixed successors and the
    horizon. Returns ``None`` when nothing is freed.

    ``pairs``: the incumbent's overlapped pairs ((forward, backward) -> length
    in slots); both jobs of a pair start together, so they are freed or fixed
    together, and a fixed pair keeps its length. With ``pair_graph`` (the
    slotted StageGraph) the freed jobs may form new pairs
    (:func:`opsched.lower.timeindexed.add_pair_options`).
    """
    free = {
        k for k, s in starts.items()
        if lo <= s < hi and (devices is None or set(js.devices[k]) <= devices)
    }
    if not free:
        return None
    sp = SlotProblem(js, base.p, base.preds, base.budgets)
    sp.fixed = {k: s for k, s in starts.items() if k not in free}
    sp.fix_pairs({pair: n for pair, n in (pairs or {}).items() if pair[0] in sp.fixed})
    es: dict[int, int] = {}
    ls: dict[int, int] = {}
    succs: dict[int, list[tuple[int, int]]] = {k: [] for k in free}
    for k in free:
        for i, c in base.preds[k]:
            if i in free:
                succs[i].append((k, c))
    topo = [k for k in js.topo if k in free]
    for k in topo:
        e = lo
        for i, c in base.preds[k]:
            e = max(e, es[i] + base.p[i] + c if i in free else sp.fixed[i] + sp.length(i) + c)
        es[k] = e
    fixed_succ: dict[int, list[tuple[int, int]]] = {k: [] for k in free}
    for j, ps in enumerate(base.preds):
        if j in sp.fixed:
            for i, c in ps:
                if i in free:
                    fixed_succ[i].append((j, c))
    for k in reversed(topo):
        late = horizon - base.p[k]
        for j, c in fixed_succ[k]:
            late = min(late, sp.fixed[j] - c - base.p[k])
        for j, c in succs[k]:
            late = min(late, ls[j] - c - base.p[k])
        ls[k] = late
    for k in free:
        if not es[k] <= starts[k] <= ls[k]:  # pragma: no cover - the incumbent is always inside
            return None
    sp.es, sp.ls = es, ls
    if pair_graph is not None:
        add_pair_options(sp, pair_graph, starts, (pairs or {}).keys())
    return sp


@dataclass
class SearchLog:
    """Progress of the search: (elapsed seconds, best objective) after each improvement."""

    entries: list[tuple[float, float]] = field(default_factory=list)
    solves: int = 0
    #: sub-MIPs not solved again: the same as one already solved on the same incumbent
    repeats: int = 0
    improvements: int = 0
    #: a clock limit (the overall deadline or a sub-MIP's time cap) cut the search short
    timed_out: bool = False

    @property
    def posed(self) -> int:
        """Sub-MIPs posed: solved, or repeats of one solved (what the budget and the patience count)."""
        return self.solves + self.repeats


@dataclass(frozen=True)
class SearchOptions:
    """How hard and how the neighbourhood search works (:func:`large_neighbourhood_search`): its budgets and modes."""

    #: the MIP solver of the sub-MIPs, and the threads each may use
    solver: str = "cbc"
    threads: int = 1
    #: a window's sub-MIP at most this many variables (its width follows), and its branch-and-bound nodes
    max_variables: int = SUBMIP_VARIABLES
    max_nodes: int = 500
    #: sweeps of windows without an improvement before the search stops
    rounds: int = 12
    #: a proven lower bound: the search stops once the incumbent reaches it
    target: float = 0.0
    objective: Objective = Objective.MAKESPAN
    #: sub-MIPs posed at most (a deterministic budget; None: no cap)
    max_solves: int | None = None
    #: each sub-MIP's clock cap (CBC's root can take long on wide windows; the node limit does not bound it)
    max_seconds_per_solve: float = SECONDS_PER_SOLVE
    #: the freed jobs of a window may form new overlapped pairs and part old ones
    pairs: bool = False
    #: sub-MIPs minimise the pairs between the objective and the flow; a result is accepted by :func:`thinner`
    fewer_pairs: bool = False
    #: stop after this many sub-MIPs in a row that gave nothing accepted (a deterministic budget too)
    patience: int | None = None


def large_neighbourhood_search(
    js: JobSet,
    incumbent: Incumbent,
    slot: float,
    budgets,
    *,
    deadline: float,
    options: SearchOptions = SearchOptions(),
    on_improve: Callable[[Incumbent], None] | None = None,
    on_solve: Callable[[SearchLog], None] | None = None,
    log: SearchLog | None = None,
) -> Incumbent:
    """Improve ``incumbent`` window by window until ``options.rounds`` sweeps give nothing or time runs out.

    ``budgets`` are the activation budgets per device (``None``: no limit). ``options.max_solves`` caps the
    sub-MIPs posed (:attr:`SearchLog.posed`) and ``options.max_nodes`` each one's branch-and-bound nodes
    (deterministic budgets). The clock stops work only when these do not: each sub-MIP also stops after
    ``options.max_seconds_per_solve`` and the search at ``deadline``; when either binds, the result depends on
    the machine and ``log.timed_out`` says so. ``on_improve`` gets each better incumbent, ``on_solve`` the log
    after each sub-MIP that found nothing better. The incumbent may hold overlapped pairs; with ``options.pairs``
    the slot must make every pair length whole (:func:`opsched.lower.timeindexed.exact_slot`).
    """
    o = options
    accept = thinner if o.fewer_pairs else better
    fruitless = 0  # sub-MIPs posed since the last accepted one
    tried: set[tuple] = set()  # signatures of the sub-MIPs solved on this incumbent
    log = log or SearchLog()
    base = slot_problem(js, slot, budgets)
    ssg = slotted_stage_graph(js.sg, slot)
    t0 = time.monotonic()
    width = None
    for _ in range(o.rounds):  # a round is one sweep of windows
        improved_round = False
        timing: SlottedTiming | None = slotted_timing(js, incumbent.order, slot, ssg)
        horizon = timing.horizon  # the windows of this sweep come from its first incumbent
        if width is None:
            width = base_width = _initial_width(js, base, horizon, o.max_variables)
        # windows much larger than the first sweep's make sub-MIPs CBC cannot finish: skipped
        size_cap = min(4 * o.max_variables, 2 * o.max_variables * (width / base_width) ** 2)
        for lo, hi, devices in _windows(js, horizon, width):
            if _search_done(incumbent, o.target, deadline, o.max_solves, log):
                return incumbent
            posed_before = log.posed
            # the incumbent's timing changes only with the incumbent
            timing = timing or slotted_timing(js, incumbent.order, slot, ssg)
            candidate = _window_candidate(
                js, base, timing, ssg if o.pairs else None, slot, (lo, hi, devices), size_cap, log, tried,
                solver=o.solver, threads=o.threads, max_nodes=o.max_nodes, objective=o.objective, fewer_pairs=o.fewer_pairs,
                time_limit=max(0.05, min(o.max_seconds_per_solve, deadline - time.monotonic())),
            )
            if candidate is not None and accept(candidate, incumbent) and order_fits(js.sg, candidate.order, budgets):
                incumbent, timing = candidate, None
                tried.clear()
                improved_round = True
                fruitless = 0
                log.improvements += 1
                log.entries.append((time.monotonic() - t0, incumbent.value))
                if on_improve is not None:
                    on_improve(incumbent)
            elif log.posed > posed_before:
                fruitless += 1
                if on_solve is not None:
                    on_solve(log)
                if o.patience is not None and fruitless >= o.patience:
                    return incumbent
        if not improved_round:
            if width >= horizon:
                break
            width = min(horizon, int(width * 1.5) + 1)  # nothing found: widen the neighbourhoods
    return incumbent


def _search_done(incumbent: Incumbent, target: float, deadline: float, max_solves: int | None,
                 log: SearchLog) -> bool:
    """The search stops: the target bound is reached, the deadline passed or the sub-MIP budget is spent."""
    if incumbent.value <= target + noise(target):
        return True
    if time.monotonic() >= deadline:
        log.timed_out = True
        return True
    return max_solves is not None and log.posed >= max_solves


def _window_candidate(js: JobSet, base: SlotProblem, timing: SlottedTiming, pair_graph: StageGraph | None,
                      slot: float, window: tuple[int, int, set[int] | None], size_cap: float, log: SearchLog,
                      tried: set[tuple], **solve_options) -> Incumbent | None:
    """Re-solve the jobs of one window of the incumbent (its slotted ``timing``) with everything else fixed;
    ``None`` when nothing was solved or found. A sub-MIP whose signature is in ``tried`` is not solved again (it
    counts in ``log.repeats``); one solved is added.

    With ``pair_graph`` (the slotted StageGraph) the freed jobs may form overlapped pairs.
    """
    lo, hi, devices = window
    sp = neighbourhood(js, base, timing.starts, timing.horizon, lo, hi, devices, pairs=timing.pairs,
                       pair_graph=pair_graph)
    size = 0 if sp is None else model_size(sp)
    if size == 0 or size > size_cap:
        return None
    signature = sp.signature()
    if signature in tried:
        log.repeats += 1
        return None
    tried.add(signature)
    # jobs with a long tail after them weigh more: moving them earlier shortens the rest of the schedule
    weights = {k: 1.0 + js.tail[k] / max(slot, 1e-12) for k in sp.es}
    out = solve_slot_problem(sp, incumbent=timing.starts, incumbent_pairs=frozenset(timing.pairs), flow=True,
                             weights=weights, **solve_options)
    log.solves += 1
    log.timed_out = log.timed_out or out.timed_out
    if out.starts is None:
        return None
    return incumbent_of(js, starts_to_order(js, out.starts, out.pairs), solve_options["objective"])


def better(a: Incumbent, b: Incumbent) -> bool:
    """``a`` has a lower objective than ``b``, or the same and a lower sum of job ends (beyond float noise)."""
    tol = noise(b.value)
    if a.value < b.value - tol:
        return True
    return abs(a.value - b.value) <= tol and a.total_end < b.total_end - noise(b.total_end)


def pair_count(order: Order) -> int:
    """How many overlapped pairs ``order`` runs."""
    return len({a for acts in order.values() for a in acts if isinstance(a, Pair)})


def thinner(a: Incumbent, b: Incumbent) -> bool:
    """``a`` has a lower objective than ``b``, or the same and fewer overlapped pairs (thinning pairs: work ending
    earlier alone is not progress there)."""
    if a.value < b.value - noise(b.value):
        return True
    return a.value <= b.value + noise(b.value) and pair_count(a.order) < pair_count(b.order)


def preferred(a: Incumbent, b: Incumbent) -> bool:
    """``a`` has a lower objective than ``b``, or the same and fewer overlapped pairs, or the same again and a lower
    sum of job ends (:func:`better`).

    A pair costs what overlap costs in a real run (two microbatches' kernels at
    once, activations held longer, a time that rests on the overlap gain's
    estimate: :mod:`opsched.lower.parting`), so at the same objective the
    schedule with fewer pairs is the better plan. The search for pairs
    (:func:`opsched.lower.pairing.pair_up`) keeps :func:`better`: a merge adds
    a pair by definition and is worth it when it ends work earlier.
    """
    if abs(a.value - b.value) <= noise(b.value):
        mine, theirs = pair_count(a.order), pair_count(b.order)
        if mine != theirs:
            return mine < theirs
    return better(a, b)


def _initial_width(js: JobSet, base: SlotProblem, horizon: int, budget: int) -> int:
    """A window width (slots) whose neighbourhoods have about ``budget`` variables."""
    devices = max(1, len(js.on_device))
    longest = max(base.p) if base.p else 1
    # jobs in a window of width w: about devices * w / mean p; each gets about w slots
    mean_p = max(1.0, sum(base.p) / len(base.p))
    width = int((budget * mean_p / devices) ** 0.5)
    return max(2 * longest, min(width, horizon))


def _windows(js: JobSet, horizon: int, width: int):
    """Time windows from the end backwards (half overlaps), then halves of the device set."""
    out = []
    step = max(1, width // 2)
    hi = horizon
    while hi > 0:
        out.append((max(0, hi - width), hi, None))
        hi -= step
    devices = sorted(js.on_device)
    if len(devices) >= 4:
        half = len(devices) // 2
        groups = [set(devices[:half]), set(devices[half:])]
        wide = 2 * width
        hi = horizon
        while hi > 0:
            for g in groups:
                out.append((max(0, hi - wide), hi, g))
            hi -= wide // 2
    return out
