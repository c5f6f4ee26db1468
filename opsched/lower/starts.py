"""The start phase of a lower solve's search: the start candidates (the caller's warm orders, then the
list-scheduler variants), those that run the graph's jobs and fit in memory, the best of them paired up
(:func:`opsched.lower.pairing.pair_up`), its W placed lazily and its warm-up deepened, each new best sent to the
solve as it comes; the first start that fits, the solve's own fallback; and :func:`split_fused_backward`, which
turns a warm order with fused backwards into one of the split job set."""

from __future__ import annotations

import time

from opsched.errors import Deadlock
from opsched.lower.jobs import JobSet, order_fits
from opsched.lower.lazy_w import place_w_lazily
from opsched.lower.listsched import Variant, default_variants, list_schedule
from opsched.lower.lns import Incumbent, better, pair_count, preferred, timed_incumbent
from opsched.lower.pairing import PAIR_UP_SIMULATIONS, pair_up
from opsched.lower.search_state import _Search
from opsched.lower.warmup import deepen_warmup
from opsched.schedule import Job, Order, Pair, PassKind, jobs_of, simulate
from opsched.solving.solver import Objective

#: the share of the start phase's remaining time that pairing up its starts may take (the rest is the search's):
#: on the DualPipe grid pairing up Zero Bubble's V shortens it more than the search does in that time (D=8, M=32,
#: 2:2:1, gain 0.5: 4.7 s to 292 from 334, where half the V's share under --placement auto cut it)
PAIR_UP_SHARE = 0.8
#: simulations the start phase's all-at-once pair-up may run (a deterministic budget): on the DualPipe grid its
#: batches shortened Zero Bubble's V within 3-33 simulations wherever they did; where they fail from the start
#: (1:1.5:0.5 at gain 0.5) it goes one merge at a time, as the next pair-up does anyway, and ran out its 1,000
#: (76 s at D=16, M=64), or took 464 at D=16, M=32, 1:1:1, gain 0.5 (5.6 s) to end above DualPipeV's order
TOGETHER_SIMULATIONS = 64


def _pairs_searched(js: JobSet, allow_pairs: bool) -> bool:
    """Whether the search may use overlapped F&B pairs: allowed, and a positive overlap gain (for either
    objective: a device's span ends at the end of a pair whose backward is its last W or B)."""
    return allow_pairs and js.sg.may_overlap


def _same_jobs(js: JobSet, order: Order) -> bool:
    """Whether the order runs exactly the job set (pairs split), each job once per device of its stage."""
    seen: dict[Job, int] = {}
    for acts in order.values():
        for a in acts:
            for j in jobs_of(a):
                seen[j] = seen.get(j, 0) + 1
    if set(seen) != set(js.index):
        return False
    return all(seen[j] == len(js.devices[js.index[j]]) for j in seen)


def _start_pool(js: JobSet, budgets, allow_pairs: bool, warm_orders: dict[str, Order] | None):
    """The start candidates in the order that breaks ties, warm orders first: (name, order or list variant)."""
    pool: list[tuple[str, Order | Variant]] = [
        (name, split_fused_backward(order) if js.split_backward else order)
        for name, order in (warm_orders or {}).items()
    ]
    return pool + [(v.name, v) for v in default_variants(js, allow_pairs, budgets)]


def _fitting(js: JobSet, budgets, allow_pairs: bool, order: Order) -> list | None:
    """The order's events when it runs exactly ``js``'s jobs, fits in memory and does not deadlock, else None."""
    if not _same_jobs(js, order) or (pair_count(order) and not allow_pairs) or not order_fits(js.sg, order, budgets):
        return None
    try:
        return simulate(js.sg, order, js.microbatches)
    except Deadlock:  # a warm order may deadlock on this graph
        return None


def _best_start(run: _Search, allow_pairs: bool, warm_orders: dict[str, Order] | None) -> tuple[str, Order, float]:
    """The best order among warm orders and list-scheduler variants that fit in memory; (name, order, value).

    Every candidate runs and ties keep the earliest in :func:`_start_pool`'s
    order, so the result is deterministic; each new best goes to the solve at
    once (the first candidate that fits is there within a simulation of the
    start). Only the deadline may skip candidates after the first that fits
    (then ``run.clock_cut``).

    With pairs searched (makespan objective), the warm orders come first and
    the best of them, and the best of them without pairs, are paired up
    (:func:`pair_up`) before the list-scheduler variants run; then the best
    and best without pairs of all, if they are new. Warm orders are the
    baselines, whose pair-ups were the best starts on the DualPipe grid, so a
    clock that cuts the start phase cuts the variants first. The best start
    of each phase, pairs merged or not, then has its W placed lazily and its warm-up deepened
    (:func:`_reshape_start`).
    """
    js, budgets = run.js, run.budgets
    pool = _start_pool(js, budgets, allow_pairs, warm_orders)
    pairing_up = _pairs_searched(js, allow_pairs) and run.objective == Objective.MAKESPAN
    best: tuple[str, Order, Incumbent] | None = None
    best_unpaired: tuple[str, Order, Incumbent] | None = None  # what pair_up starts from
    paired_up: set[tuple[str, bool]] = set()  # (start, together) paired up, and what that gave
    reshaped: set[str] = set()  # starts whose W and warm-up were reshaped, and what that gave
    for phase in ([c for c in pool if not isinstance(c[1], Variant)], [c for c in pool if isinstance(c[1], Variant)]):
        for name, made in phase:
            if best is not None and time.monotonic() > run.deadline:
                run.cut("the deadline stopped the start candidates")
                break
            order = list_schedule(js, budgets, made) if isinstance(made, Variant) else made
            events = _fitting(js, budgets, allow_pairs, order)
            if events is None:
                continue
            inc = timed_incumbent(js, order, events, run.objective)
            best = _offer(run, best, name, order, inc)
            if not pair_count(order) and (best_unpaired is None or better(inc, best_unpaired[2])):
                best_unpaired = (name, order, inc)
        if pairing_up and best is not None:
            best = _pair_up_starts(run, best, best_unpaired, paired_up)
        if best is not None and best[0] not in reshaped:
            best = _reshape_start(run, best, reshaped)
    assert best is not None, "the list scheduler always gives an order"
    return best[0], best[1], best[2].value


def _reshape_start(run: _Search, best: tuple[str, Order, Incumbent], reshaped: set[str]):
    """The best start with its W placed lazily (:func:`place_w_lazily`), its warm-up deepened
    (:func:`deepen_warmup`) and its W placed lazily again, each kept when it times better; each start once.

    A warm order's warm-up was written for the memory its method assumes: where the limit allows more, a device
    waiting for its first backward may run one more forward. And its W were placed for the costs it assumes: with
    I longer than W, W kept for the drain fill the gaps there. The two work together: Zero Bubble's V at
    F:I:W = 1:1.5:0.5 gains one F from each (the DualPipe grid: 110, 108.5 with lazy W, 107.5 after deepening, at
    D=8, M=16), the deeper warm-up only once the W wait. The best warm order is reshaped before the
    list-scheduler variants run (a clock that cuts the start phase cuts the variants first), and the best of all
    if it is new."""
    name = best[0]
    reshaped.add(name)
    if time.monotonic() > run.deadline:
        run.cut("the deadline came before reshaping the start")
        return best
    best = _lazy_w_start(run, best, reshaped)
    if time.monotonic() > run.deadline:
        run.cut("the deadline came before deepening the start's warm-up")
        return best
    name, order, inc = best
    found = deepen_warmup(run.js, order, run.budgets, run.objective, deadline=run.deadline, start=inc)
    run.cut("the deadline stopped deepening the start's warm-up", found.cut)
    if not found.moves:
        return best
    made = f"{name}, warm-up deepened (+{found.moves} forwards)"
    reshaped.add(made)
    best = _offer(run, best, made, found.order, found.incumbent)
    return _lazy_w_start(run, best, reshaped) if best[0] == made else best


def _lazy_w_start(run: _Search, best: tuple[str, Order, Incumbent], reshaped: set[str]):
    """``best`` or, when it times better, its order with every W placed lazily (:func:`place_w_lazily`)."""
    name, order, _ = best
    lazy = place_w_lazily(run.js, order, run.budgets)
    # the lazy order has exactly the pairs of ``order``, which was admitted as a start with them
    events = None if lazy is None else _fitting(run.js, run.budgets, allow_pairs=True, order=lazy)
    if events is None:
        return best
    made = f"{name}, W placed lazily"
    reshaped.add(made)
    return _offer(run, best, made, lazy, timed_incumbent(run.js, lazy, events, run.objective))


def _pair_up_starts(run: _Search, best: tuple[str, Order, Incumbent],
                    best_unpaired: tuple[str, Order, Incumbent] | None, paired_up: set[tuple[str, bool]]):
    """More pairs on the critical path of the best start, and of the best without pairs (few pairs, placed where
    they shorten it; and all that could help at once, a quick pass that may end shorter), each once, within
    :data:`PAIR_UP_SHARE` of the time left; the best start after that."""
    deadline = time.monotonic() + PAIR_UP_SHARE * max(0.0, run.deadline - time.monotonic())
    tries = [(best, False)]
    if best_unpaired is not None:
        # all at once first: within its budget it is quick (1.5 s at D=16, M=64 on the DualPipe grid, where one
        # merge at a time would need 80 s); at the same makespan one at a time's fewer pairs are preferred when it
        # finishes
        tries = [(best_unpaired, True)] + tries + ([(best_unpaired, False)] if best_unpaired[0] != best[0] else [])
    for (name, order, _), together in tries:
        if (name, together) in paired_up:
            continue
        paired = pair_up(run.js, order, run.budgets, deadline=deadline, together=together,
                         max_simulations=TOGETHER_SIMULATIONS if together else PAIR_UP_SIMULATIONS)
        run.cut("pairing up the start stopped at its share of the time", paired.cut)
        paired_up.add((name, together))
        if paired.merges:
            made = f"{name} paired up{' together' if together else ''} (+{paired.merges} pairs)"
            paired_up.update({(made, False), (made, True)})
            best = _offer(run, best, made, paired.order, paired.incumbent)
    return best


def _offer(run: _Search, best: tuple[str, Order, Incumbent] | None, name: str, order: Order, inc: Incumbent):
    """``best`` or the start candidate ``name`` (``order``, valued as ``inc``), whichever is better; the candidate's
    value goes to the solve, and so does the order when it is the new best."""
    run.tried.append((name, inc.value))
    if best is None or preferred(inc, best[2]):
        best = (name, order, inc)
        run.start = name
        run.improved(order, inc.value)
    run.send()
    return best


def _first_start(js: JobSet, budgets, allow_pairs: bool, warm_orders: dict[str, Order] | None) -> tuple[str, Order]:
    """The first start candidate that fits (name, order): the solve's own fallback when its search sent nothing.

    A warm order costs one simulation; without one that fits, the first
    list-scheduler variant is made here.
    """
    for name, made in _start_pool(js, budgets, allow_pairs, warm_orders):
        order = list_schedule(js, budgets, made) if isinstance(made, Variant) else made
        if _fitting(js, budgets, allow_pairs, order) is not None:
            return name, order
    raise AssertionError("the list scheduler always gives an order")  # pragma: no cover


def split_fused_backward(order: Order) -> Order:
    """``order`` with every fused backward B replaced by its I then its W, in place of the B.

    The result has the same dependencies (the I waits for what the B waited
    for; the W follows the I on the same device) and never more memory at any
    point (the I frees part of the activation as the B would free all of it,
    and the W frees the rest right after). A B inside an overlapped pair
    becomes the pair's backward I, followed by the W.

    >>> from opsched.schedule import Job
    >>> [str(j) for j in split_fused_backward({0: [Job(0, 0, PassKind.F), Job(0, 0, PassKind.B)]})[0]]
    ['0F0', '0I0', '0W0']
    """
    out: Order = {}
    for d, actions in order.items():
        acts = []
        for a in actions:
            if isinstance(a, Pair) and PassKind.B in (a.first.pass_, a.second.pass_):
                fused = [j for j in (a.first, a.second) if j.pass_ == PassKind.B]
                acts.append(Pair(_input_part(a.first), _input_part(a.second)))
                acts += [Job(j.stage, j.microbatch, PassKind.W) for j in fused]
            elif isinstance(a, Job) and a.pass_ == PassKind.B:
                acts += [Job(a.stage, a.microbatch, PassKind.I), Job(a.stage, a.microbatch, PassKind.W)]
            else:
                acts.append(a)
        out[d] = acts
    return out


def _input_part(job: Job) -> Job:
    """The I of a fused backward B; any other job unchanged."""
    return Job(job.stage, job.microbatch, PassKind.I) if job.pass_ == PassKind.B else job
