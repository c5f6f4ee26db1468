"""Solving a :class:`~opsched.lower.timeindexed.SlotProblem`: the MIP start made from slotted start times (every
variable given a value, which CBC needs), the solve itself (:func:`solve_slot_problem`, a node budget and a clock cap),
and reading its solution back as start slots, overlapped pairs and a per-device order (:func:`starts_to_order`). The
model it solves is built by :func:`opsched.lower.timeindexed.build_model`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import mip

from opsched.lower.jobs import JobSet
from opsched.lower.timeindexed import SlotProblem, alone_slots, build_model
from opsched.schedule import Action, Pair, PassKind
from opsched.solving.solver import Objective, Status, collector_paused

# --------------------------------------------------------------------------- warm start


def warm_start(
    sp: SlotProblem, z: dict, starts: Mapping[int, int], pairs: frozenset[tuple[int, int]] = frozenset()
) -> list[tuple[mip.Var, float]]:
    """``model.start`` entries for slotted start times of the free jobs, ``pairs`` (forward, backward) paired."""
    paired = {j for pair in pairs for j in pair}
    out = [(z[j, t], 0.0 if j in paired else 1.0 if t >= starts[j] else 0.0)
           for j in sp.free for t in alone_slots(sp, j)]
    for q in sp.options:
        on = (q.forward, q.backward) in pairs
        out += [(z[q, t], 1.0 if on and t >= starts[q.forward] else 0.0) for t in range(q.es, q.ls + 1)]
    return out


def warm_start_fits(sp: SlotProblem, starts: Mapping[int, int], pairs: frozenset[tuple[int, int]] = frozenset()) -> bool:
    """Whether the slotted starts (and pairs) lie inside the free jobs' windows and pair options."""
    options = {(q.forward, q.backward): q for q in sp.options}
    paired = {j for pair in pairs for j in pair}
    for a, b in pairs:
        if a in sp.es or b in sp.es:
            q = options.get((a, b))
            if q is None or starts[a] != starts[b] or not q.es <= starts[a] <= q.ls:
                return False
    return all(sp.es[j] <= starts[j] <= sp.ls[j] for j in sp.free if j not in paired)


def complete_warm_start(
    model: mip.Model, sp: SlotProblem, z: dict, starts: Mapping[int, int],
    pairs: frozenset[tuple[int, int]] = frozenset(),
) -> list[tuple[mip.Var, float]]:
    """A MIP start with a value for every variable of ``model``, all within bounds.

    CBC has been seen to abort ("double free or corruption") on a start that
    gives values to only some variables (python-mip issue 160 reports the
    same kind of crash from a partial start), so the makespan ``C`` and the
    span variables ``Z``, ``A_d``, ``E_d`` get the values the starts imply.
    """
    js = sp.js
    at = {j: (sp.fixed[j] if j in sp.fixed else starts[j]) for j in range(len(js))}
    values = {v.name: x for v, x in warm_start(sp, z, starts, pairs)}
    lengths = {j: n for q in sp.options if (q.forward, q.backward) in pairs for j, n in
               ((q.forward, q.length), (q.backward, q.length))}
    values["C"] = float(max([at[j] + lengths.get(j, sp.length(j)) for j in js.sinks()] + [0]))
    spans = [0.0]
    for d, ks in js.on_device.items():
        firsts = [at[k] for k in ks if js.jobs[k].pass_ == PassKind.F]
        lasts = [at[k] + lengths.get(k, sp.length(k)) for k in ks if js.jobs[k].pass_ in (PassKind.W, PassKind.B)]
        if firsts and lasts:
            values[f"A_{d}"], values[f"E_{d}"] = float(min(firsts)), float(max(lasts))
            spans.append(max(lasts) - min(firsts))
    values["Z"] = float(max(spans))
    out = []
    for v in model.vars:
        x = values[v.name]  # a KeyError here is a variable this function does not know: a bug
        out.append((v, min(max(x, v.lb), v.ub)))
    return out


# --------------------------------------------------------------------------- solution


def _is_set(var) -> bool:
    return var.x is not None and var.x > 0.5


def solution_pairs(sp: SlotProblem, z: dict) -> list[tuple[int, int]]:
    """Every pair (forward, backward) of the solution: the fixed ones and the options it chose."""
    return list(sp.fixed_pairs) + [(q.forward, q.backward) for q in sp.options if _is_set(z[q, q.ls])]


def solution_starts(sp: SlotProblem, z: dict) -> dict[int, int]:
    """Start slot of every job (free ones read from the solution, in the mode it chose)."""
    out = dict(sp.fixed)
    for q in sp.options:
        if _is_set(z[q, q.ls]):
            s = next(t for t in range(q.es, q.ls + 1) if _is_set(z[q, t]))
            out[q.forward] = out[q.backward] = s
    for j in sp.free:
        if j in out:
            continue
        s = sp.ls[j]
        for t in range(sp.es[j], sp.ls[j]):
            if _is_set(z[j, t]):
                s = t
                break
        out[j] = s
    return out


def starts_to_order(
    js: JobSet, starts: Mapping[int, int], pairs: Iterable[tuple[int, int]] = ()
) -> dict[int, list[Action]]:
    """Per-device actions by start slot (ties by job number, which only zero-length jobs have).

    Each of ``pairs`` (forward, backward job numbers) is one overlapped
    :class:`~opsched.schedule.Pair` action, F first, where its jobs start.
    """
    partner = {a: b for a, b in pairs}
    in_pair = set(partner) | set(partner.values())
    order: dict[int, list[Action]] = {d: [] for d in js.on_device}
    for d, ks in js.on_device.items():
        acts: list[Action] = []
        for k in sorted(ks, key=lambda k: (starts[k], k)):
            if k in partner:
                acts.append(Pair(js.jobs[k], js.jobs[partner[k]]))
            elif k not in in_pair:
                acts.append(js.jobs[k])
        order[d] = acts
    return order



# --------------------------------------------------------------------------- driver


@dataclass
class MipOutcome:
    """What one MIP solve gave: the jobs' start slots (if any), the status and the bound in slots."""

    starts: dict[int, int] | None
    status: Status
    objective: float | None
    bound: float
    variables: int
    #: the solve stopped on its time limit (not its node limit): the outcome depends on the machine
    timed_out: bool = False
    #: the solution's overlapped pairs (forward, backward job numbers), fixed ones included
    pairs: list[tuple[int, int]] = field(default_factory=list)


def solve_slot_problem(
    sp: SlotProblem,
    *,
    incumbent: Mapping[int, int] | None = None,
    incumbent_pairs: frozenset[tuple[int, int]] = frozenset(),
    solver: str = "cbc",
    threads: int = 1,
    time_limit: float = 30.0,
    max_nodes: int | None = None,
    objective: Objective = Objective.MAKESPAN,
    flow: bool = False,
    weights: Mapping[int, float] | None = None,
    fewer_pairs: bool = False,
) -> MipOutcome:
    """Build and solve the MIP of ``sp``, warm-started from ``incumbent`` start slots when given.

    ``incumbent_pairs``: the incumbent's overlapped pairs (forward, backward job numbers).

    ``max_nodes`` is the deterministic work budget; ``time_limit`` is a
    safety cap, and the outcome says when it stopped the solve (``timed_out``).
    """
    with collector_paused():
        model, z, C = build_model(sp, solver=solver, threads=threads, objective=objective, flow=flow, weights=weights,
                                  fewer_pairs=fewer_pairs)
        if sp.options:
            # with pair options CBC's root cut loop took 4-5 s on 250-variable sub-MIPs and cut the bound
            # by little; without it the same sub-MIPs end in about 1 s with the same optimum
            model.cuts = 0
        if incumbent is not None and warm_start_fits(sp, incumbent, incumbent_pairs):
            model.start = complete_warm_start(model, sp, z, incumbent, incumbent_pairs)
        kwargs = {"max_seconds": max(0.01, time_limit)}
        if max_nodes is not None:
            kwargs["max_nodes"] = max_nodes
        began = time.monotonic()
        status = model.optimize(**kwargs)
        # a search cut by the clock ends without proving optimality at (about) the time limit
        timed_out = status != mip.OptimizationStatus.OPTIMAL and status != mip.OptimizationStatus.INFEASIBLE and (
            time.monotonic() - began >= 0.95 * kwargs["max_seconds"]
        )
        bound = model.objective_bound if model.objective_bound is not None else 0.0
        name = Status.of_mip(status)
        if status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) and model.num_solutions:
            return MipOutcome(solution_starts(sp, z), name, model.objective_value, bound, len(z), timed_out,
                              solution_pairs(sp, z))
        return MipOutcome(None, name, None, bound, len(z), timed_out)
