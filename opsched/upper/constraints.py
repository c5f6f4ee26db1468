"""The constraint families of the upper MIP (:mod:`opsched.upper.mip`), one function each, named as in
``docs/formulation.md`` (section "Upper level"): each block once, no backward flow, memory per device, the
transfers of cut edges, and the step-time estimate that is the objective.

Each function adds its rows to a python-mip model over an :class:`~opsched.upper.mip.UpperProblem` and the
binaries ``x[b,s,m]`` (or their sums ``X[b,s]``); :func:`opsched.upper.mip.solve_upper` builds the model from
them. The symbols are those of :mod:`opsched.upper.mip`'s docstring. Beside its rows, the memory family has
:func:`memory_floor`, the bound its rows imply with no model built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mip

if TYPE_CHECKING:
    from opsched.upper.mip import UpperProblem


def each_block_once(model: mip.Model, p: UpperProblem, x) -> None:
    """Σ_{s,m} x[b,s,m] = 1 for every block b."""
    for b in p.blocks:
        model.add_constr(mip.xsum(x[b, s, m] for s, m in p.choices(b)) == 1, name=f"once_{b}")


def no_backward_flow(model: mip.Model, p: UpperProblem, X) -> None:
    """For each edge (u, v) and slot s: Σ_{s' ≤ s} X[v,s'] ≤ Σ_{s' ≤ s} X[u,s'].

    v never sits in an earlier slot than u, so stage edges only go forward and
    the StageGraph is a DAG. Mutually unreachable blocks are not constrained
    against each other: they may take different slots (groups). Rows that
    hold whatever x is (v cannot be at or before s, or u surely is) are left out.
    """
    for u, v in p.edges:
        du, dv = p.allowed(u), p.allowed(v)
        for s in range(p.slots - 1):
            lhs = [X[v, t] for t in dv if t <= s]
            if not lhs or du[-1] <= s:
                continue
            model.add_constr(mip.xsum(lhs) <= mip.xsum(X[u, t] for t in du if t <= s), name=f"flow_{u}_{v}_{s}")


def memory_per_device(model: mip.Model, p: UpperProblem, x) -> None:
    """For each group g: Σ_{s∈g} Σ_{b,m} x[b,s,m]·(par[b,g,m] + n(s)·act[b,g,m]) ≤ memory limit."""
    rows: dict[int, list] = {g: [] for g in range(p.layout.groups)}
    for (b, s, m), var in x.items():
        g = p.group(s)
        c = p.cost[(b, g, m)]
        # scaled to GB so the row's coefficients stay well conditioned
        rows[g].append(var * ((c.param_bytes + p.in_flight(s) * c.act_bytes) * 1e-9))
    for g, terms in rows.items():
        if terms:
            model.add_constr(mip.xsum(terms) <= p.memory_limit * 1e-9, name=f"memory_{g}")


def memory_floor(p: UpperProblem) -> float:
    """A lower bound on the per-device memory of every assignment of ``p``, with no MIP: summed over the groups,
    the memory rows (:func:`memory_per_device`) hold each block at its least memory over
    the slots and modes it may take, so the fullest of the layout's groups holds at least that sum over their count.

    A layout whose floor is over the memory limit has no assignment that fits: the search skips it at once (the
    starts it would build cost seconds on a large MoE model, and the time is the fallbacks', e.g. recomputation).
    """
    least = 0.0
    for b in p.blocks:
        least += min(p.cost[(b, p.group(s), m)].param_bytes + p.in_flight(s) * p.cost[(b, p.group(s), m)].act_bytes
                     for s, m in p.choices(b))
    return least / p.layout.groups


def floor_over(p: UpperProblem, limit: float) -> bool:
    """Whether :func:`memory_floor` proves that no assignment of ``p`` fits in ``limit`` bytes per device (a
    relative tolerance of 1e-9 keeps a floor equal to the limit, up to rounding, as fitting)."""
    return memory_floor(p) > limit * (1 + 1e-9)


def cut_edge_transfers(model: mip.Model, p: UpperProblem, X):
    """Linearised transfers between slots a < c.

    z[u,v,a,c] ≥ X[u,a] + X[v,c] - 1 (edge (u, v) crosses from slot a to c, on
    distinct groups); y[a,c] ≥ z (slots a and c are joined by a stage edge;
    for slots on one group y ≥ X[u,a] + X[v,c] - 1 directly, the transfer is 0);
    τ[a,c] = lat[a,c]·y[a,c] + Σ_(u,v) bytes_uv·rate[a,c]·z[u,v,a,c].
    Returns (y, τ) as dicts over the slot pairs some edge can join.
    """
    y, terms = {}, {}
    for (u, v), nbytes in p.edges.items():
        for a in p.allowed(u):
            for c in p.allowed(v):
                if c <= a:
                    continue
                if (a, c) not in y:
                    y[a, c] = model.add_var(lb=0.0, ub=1.0, name=f"y_{a}_{c}")
                    terms[a, c] = []
                rate, lat = p.links.rate(a, c), p.links.latency(a, c)
                if rate > 0 or lat > 0:
                    z = model.add_var(lb=0.0, ub=1.0, name=f"z_{u}_{v}_{a}_{c}")
                    model.add_constr(z >= X[u, a] + X[v, c] - 1)
                    model.add_constr(y[a, c] >= z)
                    terms[a, c].append(nbytes * rate * z)
                else:
                    model.add_constr(y[a, c] >= X[u, a] + X[v, c] - 1)
    tau = {ac: p.links.latency(*ac) * y[ac] + mip.xsum(terms[ac]) for ac in y}
    return y, tau


def step_time_estimate(model: mip.Model, p: UpperProblem, x, y, tau, big_m: float):
    """Objective rows: T = (M - 1)·B + C + R.

    B ≥ Σ_{s∈g,b,m} work[b,g,m]·x[b,s,m] for each group (bottleneck load per
    microbatch) and B ≥ 2τ[a,c] (a link carries activations and gradients);
    e[s] ≥ P_s = Σ_{b,m} (F + I)[b,g(s),m]·x[b,s,m],
    e[c] ≥ e[a] + P_c + 2τ[a,c] - big_m·(1 - y[a,c]) (fill and drain: the
    longest path through the stage DAG, forward and input-gradient backward;
    W passes can be deferred into bubbles, as Zero Bubble schedules do);
    C ≥ e[s]; R ≥ Σ_{s∈g,b,m} sync[b,g,m]·x[b,s,m] (gradient all-reduce).
    Returns the objective expression.
    """
    B = model.add_var(lb=0.0, name="bottleneck")
    C = model.add_var(lb=0.0, name="critical_path")
    R = model.add_var(lb=0.0, name="grad_sync")
    work_terms: dict[int, list] = {s: [] for s in range(p.slots)}
    path_terms: dict[int, list] = {s: [] for s in range(p.slots)}
    sync_terms: dict[int, list] = {g: [] for g in range(p.layout.groups)}
    for (b, s, m), var in x.items():
        c = p.cost[(b, p.group(s), m)]
        work_terms[s].append(c.work * var)
        path_terms[s].append((c.F + c.I) * var)
        if c.grad_sync > 0:
            sync_terms[p.group(s)].append(c.grad_sync * var)
    slot_work = {s: mip.xsum(t) for s, t in work_terms.items()}
    slot_path = {s: mip.xsum(t) for s, t in path_terms.items()}
    for g in range(p.layout.groups):
        slots = p.layout.slots_of_group(g)
        model.add_constr(B >= mip.xsum(slot_work[s] for s in slots), name=f"load_{g}")
        model.add_constr(R >= mip.xsum(sync_terms[g]), name=f"sync_{g}")
    e = {s: model.add_var(lb=0.0, name=f"finish_{s}") for s in range(p.slots)}
    for s in range(p.slots):
        model.add_constr(e[s] >= slot_path[s])
        model.add_constr(C >= e[s])
    for a, c in tau:
        model.add_constr(B >= 2 * tau[a, c])
        model.add_constr(e[c] >= e[a] + slot_path[c] + 2 * tau[a, c] - big_m * (1 - y[a, c]))
    return (p.microbatches - 1) * B + C + R
