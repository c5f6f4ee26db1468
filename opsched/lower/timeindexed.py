"""The time-indexed MIP of the lower level, in "started-by" (step) variables.

Time is cut into slots of length ``slot``; every duration and transfer time
is rounded up to whole slots (``p[j]``, ``c[i, j]``), so any slotted
schedule is a valid continuous one, and the solved order is re-timed by the
simulator at the end. A job ``j`` is *free* inside a window
``[es[j], ls[j]]`` of start slots or *fixed* at a start slot.

Variables: ``z[j, t]`` = 1 when job ``j`` has started by slot ``t``
(``es[j] <= t < ls[j]``; before ``es[j]`` it is 0, from ``ls[j]`` on it
is 1), and ``C`` the makespan. ``x[j, t] = z[j, t] - z[j, t-1]`` is the
classic "starts at t" variable; the step form keeps the memory rows sparse
(one term per job instead of one per job and earlier slot) and gives the
strong (disaggregated) precedence rows. The formulation is written out in
``docs/formulation.md`` with the same symbols.

Overlapped F&B pairs (DualPipe's) are decisions: a :class:`PairOption`
joins a free F with a free backward (I or B) of a stage on the same devices;
its step variables ``z[q, t]`` say the pair has started by ``t``, and a job
with options runs in exactly one mode, alone or in one of its pairs. A pair
lasts its own length (:func:`opsched.schedule.pair_duration` in slots) and
both its jobs start and end with it. Pairs fixed in a neighbourhood keep
their start and length.

Constraint families, one function each:
:func:`each_job_starts_once`, :func:`one_job_per_device_per_slot`,
:func:`precedence_with_transfers`, :func:`activation_memory_limit`,
:func:`makespan_definition`, :func:`symmetry_breaking`. Warm starts, the
solve and reading its solution back are in :mod:`opsched.lower.slot_solve`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import mip

from opsched.errors import OpschedError
from opsched.lower.jobs import PAIRED_BACKWARDS, JobSet, topological_order
from opsched.schedule import Edge, Job, Pair, PassKind, Stage, StageGraph, pair_duration
from opsched.solving.solver import Objective, new_model


class HorizonTooShort(Exception):
    """No slotted schedule fits in the horizon a caller chose (internal: the caller falls back)."""


# --------------------------------------------------------------------------- slots


def to_slots(value: float, slot: float) -> int:
    """``value`` rounded up to whole slots (a tiny tolerance absorbs float noise)."""
    return int(math.ceil(value / slot - 1e-7)) if value > 0 else 0


def slotted_stage_graph(sg: StageGraph, slot: float) -> StageGraph:
    """The StageGraph with every pass and transfer time rounded up to whole slots (in slot units).

    Simulating an order on it gives the slotted start times of that order.
    """
    stages = [
        Stage(
            id=s.id,
            devices=s.devices,
            time={p: float(to_slots(float(s.time[p]), slot)) for p in s.timed_passes()},
            param_bytes=s.param_bytes,
            act_bytes=s.act_bytes,
            act_w_bytes=s.act_w_bytes,
            name=s.name,
            microbatches=s.microbatches,
            copy_of=s.copy_of,
            streams=s.streams,  # in seconds: pair_duration times pairs in slots of ``pair_slot``
        )
        for s in sg.stages
    ]
    edges = [Edge(e.src, e.dst, float(to_slots(e.time, slot)), e.bytes) for e in sg.edges]
    return StageGraph(stages, edges, num_devices=sg.num_devices, overlap_gain=sg.overlap_gain, pair_slot=slot)


def slotted_times(sg: StageGraph, pairs: bool = False) -> list[float]:
    """The positive times a slot must divide for slotting to lose nothing: every pass and transfer time, and with
    ``pairs`` (and a positive overlap gain) ``gain x`` for every pass time ``x`` (so pair lengths are whole too),
    and every pair length of stages with stream operations."""
    values = [float(s.time[p]) for s in sg.stages for p in s.timed_passes() if float(s.time[p]) > 0]
    if pairs and sg.overlap_gain > 0:
        values += [sg.overlap_gain * v for v in values]
    if pairs:
        values += [pair_duration(sg, pair) for pair in sg.stream_pairs()]
    return values + [e.time for e in sg.edges if e.time > 0]


def exact_slot(sg: StageGraph, pairs: bool = False) -> float | None:
    """The largest slot that divides every pass and transfer time exactly, if a sensible one exists.

    With ``pairs`` (and a positive overlap gain) it also divides ``gain x``
    for every pass time ``x``, so every overlapped pair's length
    (``a + b - gain * min(a, b)``) is a whole number of slots too.

    >>> from opsched.schedule import chain_stage_graph
    >>> sg = chain_stage_graph(2, f=1, b=2, w=1, overlap_gain=0.5)
    >>> exact_slot(sg), exact_slot(sg, pairs=True)
    (1.0, 0.5)
    """
    values = slotted_times(sg, pairs)
    if not values:
        return None
    scale = 1
    while scale <= 10**6:
        ints = [v * scale for v in values]
        # every (positive) time must be a whole number of at least one slot: a time below the tolerance is not 0
        if all(round(x) >= 1 and abs(x - round(x)) <= 1e-6 * max(1.0, x) for x in ints):
            g = 0
            for x in ints:
                g = math.gcd(g, int(round(x)))
            return g / scale
        scale *= 10
    return None


def auto_slot(sg: StageGraph, horizon: float, budget: int = 400, pairs: bool = False) -> float:
    """Slot length: exact when the times share a divisor, else the shortest pass cut evenly.

    The slot is the largest exact divisor of all times when the horizon then
    needs at most ``budget`` slots; otherwise the shortest pass divided into
    ``q`` equal parts, with ``q`` the largest whole number keeping the horizon
    within ``budget`` slots (at least 1). ``pairs``: see :func:`exact_slot`.
    """
    g = exact_slot(sg, pairs)
    if g is not None and horizon / g <= budget:
        return g
    shortest = min((float(s.time[p]) for s in sg.stages for p in s.timed_passes() if float(s.time[p]) > 0),
                   default=None)
    if shortest is None:  # commands refuse such a pipeline up front; a library caller gets a reason, not min()'s
        raise OpschedError("every pass of the pipeline lasts 0: there is no work to schedule")
    q = max(1, int(budget * shortest / max(horizon, shortest)))
    return shortest / q


# --------------------------------------------------------------------------- problem


@dataclass(frozen=True)
class PairOption:
    """A free F and a free backward (I or B) of stages on the same devices that may run as one overlapped pair.

    The pair starts both jobs at once, occupies the devices for ``length``
    slots and both jobs end with it; ``es``..``ls`` is its start window.
    """

    forward: int
    backward: int
    length: int
    es: int
    ls: int


@dataclass
class SlotProblem:
    """A (sub)problem in slots: free jobs with start windows, fixed jobs with start slots.

    ``options`` are the overlapped pairs the free jobs may form (none: every
    job runs alone); ``fixed_pairs`` are pairs (forward, backward) among the
    fixed jobs, which keep their common start and the pair's length.
    """

    js: JobSet
    p: list[int]
    #: preds[j] = [(i, c)]: j starts at least p[i] + c slots after i starts
    preds: list[list[tuple[int, int]]]
    budgets: Mapping[int, float] | None
    es: dict[int, int] = field(default_factory=dict)
    ls: dict[int, int] = field(default_factory=dict)
    fixed: dict[int, int] = field(default_factory=dict)
    #: pairs (a, b) of free jobs where a must start no later than b (symmetry breaking)
    before: list[tuple[int, int]] = field(default_factory=list)
    #: set through :meth:`set_options` (it indexes them by job)
    options: list[PairOption] = field(default_factory=list)
    #: fixed pairs: (forward, backward) -> length in slots; set through :meth:`fix_pairs`
    fixed_pairs: dict[tuple[int, int], int] = field(default_factory=dict)
    _options_by_job: dict[int, list[PairOption]] = field(default_factory=dict, repr=False)
    _fixed_length: dict[int, int] = field(default_factory=dict, repr=False)
    _fixed_backwards: set[int] = field(default_factory=set, repr=False)

    @property
    def free(self) -> list[int]:
        return sorted(self.es)

    def set_options(self, options: list[PairOption]) -> None:
        self.options = list(options)
        self._options_by_job = {}
        for q in self.options:
            self._options_by_job.setdefault(q.forward, []).append(q)
            self._options_by_job.setdefault(q.backward, []).append(q)

    def fix_pairs(self, pairs: Mapping[tuple[int, int], int]) -> None:
        self.fixed_pairs = dict(pairs)
        self._fixed_length = {j: n for pair, n in self.fixed_pairs.items() for j in pair}
        self._fixed_backwards = {b for _, b in self.fixed_pairs}

    def signature(self) -> tuple:
        """What makes this the MIP it is, given its JobSet, job lengths and budgets (which a search's windows
        share): two windows of one incumbent with the same signature are the same sub-MIP."""
        return (tuple(sorted(self.es.items())), tuple(sorted(self.ls.items())), tuple(sorted(self.fixed.items())),
                tuple(self.before), tuple(self.options), tuple(sorted(self.fixed_pairs.items())))

    def options_of(self, j: int) -> list[PairOption]:
        """The pair options job ``j`` takes part in."""
        return self._options_by_job.get(j, [])

    def length(self, j: int) -> int:
        """How long fixed job ``j`` keeps its devices and its successors waiting: its pair's length, or its own."""
        return self._fixed_length.get(j, self.p[j])

    def counted_busy(self, j: int) -> bool:
        """Whether fixed job ``j``'s device time is counted on its own: a fixed pair counts once, with its F."""
        return j not in self._fixed_backwards

    def alone_started_by(self, z: dict, j: int, t: int):
        """0, 1 or the variable saying whether job ``j`` has started by slot ``t`` running alone.

        From ``ls[j]`` on it is 1 for a job without pair options, else the
        variable ``z[j, ls[j]]`` (1 exactly when it runs alone).
        """
        if j in self.fixed:
            return 1 if t >= self.fixed[j] else 0
        if t < self.es[j]:
            return 0
        if t >= self.ls[j]:
            return z[j, self.ls[j]] if self.options_of(j) else 1
        return z[j, t]

    def option_started_by(self, z: dict, q: PairOption, t: int):
        """0 or the variable saying whether pair ``q`` runs and has started by slot ``t``."""
        return 0 if t < q.es else z[q, min(t, q.ls)]

    def started_by(self, z: dict, j: int, t: int):
        """0, 1, a variable or an expression: job ``j`` has started by slot ``t`` (alone or in a pair)."""
        return _combine([self.alone_started_by(z, j, t)] + [self.option_started_by(z, q, t) for q in self.options_of(j)])

    def done_by(self, z: dict, j: int, t: int):
        """0, 1, a variable or an expression: job ``j`` has ended by slot ``t`` (alone or in a pair)."""
        if j in self.fixed:
            return 1 if t >= self.fixed[j] + self.length(j) else 0
        terms = [self.alone_started_by(z, j, t - self.p[j])]
        return _combine(terms + [self.option_started_by(z, q, t - q.length) for q in self.options_of(j)])

    def start_range(self, j: int) -> tuple[int, int]:
        """Earliest and latest start slot of free job ``j`` over its modes."""
        opts = self.options_of(j)
        return min([self.es[j]] + [q.es for q in opts]), max([self.ls[j]] + [q.ls for q in opts])

    def end_range(self, j: int) -> tuple[int, int]:
        """Earliest and latest end slot of free job ``j`` over its modes."""
        opts = self.options_of(j)
        return (min([self.es[j] + self.p[j]] + [q.es + q.length for q in opts]),
                max([self.ls[j] + self.p[j]] + [q.ls + q.length for q in opts]))


def _combine(terms: list):
    """The sum of ``terms`` (ints, variables, expressions): an int when every term is one."""
    constant = sum(x for x in terms if isinstance(x, int))
    variables = [x for x in terms if not isinstance(x, int)]
    if not variables:
        return constant
    if len(variables) == 1 and constant == 0:
        return variables[0]
    return mip.xsum(variables) + constant


def slot_problem(js: JobSet, slot: float, budgets: Mapping[int, float] | None) -> SlotProblem:
    """Durations and transfers of ``js`` in slots, with no job placed yet."""
    p = [to_slots(d, slot) for d in js.duration]
    preds = [[(i, to_slots(delay, slot)) for i, delay in js.preds[k]] for k in range(len(js))]
    return SlotProblem(js, p, preds, budgets)


def symmetric_forward_chains(js: JobSet) -> list[list[int]]:
    """Forwards of the first source stage, per class of interchangeable microbatches, in microbatch order.

    Microbatches that run the same set of stages are interchangeable, so
    renaming them to start the first source stage in microbatch order loses
    nothing (only one stage can be ordered this way: one renaming).
    """
    sg = js.sg
    sources = [s for s in sg.topological_order() if not sg.preds(s)]
    if not sources:
        return []
    s0 = sources[0]
    classes: dict[tuple[int, ...], list[int]] = {}
    for m in range(js.microbatches):
        if not sg.stage(s0).runs(m):
            continue
        key = tuple(s.id for s in sg.stages if s.runs(m))
        classes.setdefault(key, []).append(js.index[Job(s0, m, PassKind.F)])
    return [ks for ks in classes.values() if len(ks) > 1]


def full_windows(sp: SlotProblem, horizon: int, symmetry: bool = True) -> None:
    """Make every job free with the widest window that can still end by ``horizon`` slots.

    Windows come from slotted heads and tails (longest dependency paths),
    tightened by the symmetry chains when ``symmetry`` is on.
    """
    js = sp.js
    chains = symmetric_forward_chains(js) if symmetry else []
    extra_pred: dict[int, list[int]] = {}
    extra_succ: dict[int, list[int]] = {}
    sp.before = []
    for ks in chains:
        for a, b in zip(ks, ks[1:]):
            extra_pred.setdefault(b, []).append(a)
            extra_succ.setdefault(a, []).append(b)
            sp.before.append((a, b))
    succs: list[list[tuple[int, int]]] = [[] for _ in range(len(js))]
    for k, ps in enumerate(sp.preds):
        for i, c in ps:
            succs[i].append((k, c))
    order = topological_order([[i for i, _ in js.preds[k]] + list(extra_pred.get(k, ())) for k in range(len(js))])
    es = [0] * len(js)
    for k in order:
        for i, c in sp.preds[k]:
            es[k] = max(es[k], es[i] + sp.p[i] + c)
        for i in extra_pred.get(k, ()):
            es[k] = max(es[k], es[i] + sp.p[i])
    ls = [horizon - sp.p[k] for k in range(len(js))]
    for k in reversed(order):
        for s, c in succs[k]:
            ls[k] = min(ls[k], ls[s] - c - sp.p[k])
        for s in extra_succ.get(k, ()):
            ls[k] = min(ls[k], ls[s] - sp.p[k])
    for k in range(len(js)):
        if ls[k] < es[k]:
            raise HorizonTooShort(f"no schedule fits in {horizon} slots")
    sp.fixed = {}
    sp.es = {k: es[k] for k in range(len(js))}
    sp.ls = {k: ls[k] for k in range(len(js))}


def pair_length(ssg: StageGraph, forward: Job, backward: Job) -> int:
    """The slots an overlapped pair lasts on the slotted StageGraph ``ssg``.

    The one rule is :func:`opsched.schedule.pair_duration`, rounded up to
    whole slots on the slotted graph (never shorter than the pair); with an
    exact slot for pairs (:func:`exact_slot` with ``pairs``) nothing is lost.
    """
    return int(round(pair_duration(ssg, Pair(forward, backward))))


def add_pair_options(sp: SlotProblem, ssg: StageGraph, starts: Mapping[int, int],
                     pairs: Iterable[tuple[int, int]] = ()) -> None:
    """Let the free jobs pair: F and backward (I or B) of stages on the same devices, as DualPipe pairs them.

    Every pair of ``pairs`` (the incumbent's, forward and backward job
    numbers) among the free jobs, and each free F with the free backward
    whose incumbent start (``starts``) is nearest to its own, and each free
    backward with the nearest free F. Offering every F with every backward
    makes sub-MIPs CBC cannot finish (their relaxation splits jobs between
    modes); the search moves the pairing step by step instead. An option's
    window is where both jobs may start and the pair still ends within both
    jobs' latest ends; options whose window is empty, or whose length is not
    a whole number of slots, are left out.
    """
    js = sp.js
    groups: dict[frozenset, tuple[list[int], list[int]]] = {}
    for k in sp.free:
        forwards, backwards = groups.setdefault(frozenset(js.devices[k]), ([], []))
        if js.jobs[k].pass_ == PassKind.F:
            forwards.append(k)
        elif js.jobs[k].pass_ in PAIRED_BACKWARDS:
            backwards.append(k)
    wanted = {(a, b) for a, b in pairs if a in sp.es and b in sp.es}
    for forwards, backwards in groups.values():
        for mine, theirs, flip in ((forwards, backwards, False), (backwards, forwards, True)):
            for k in mine:
                candidates = [x for x in theirs if js.may_pair(k, x)]
                if candidates:
                    x = min(candidates, key=lambda x: (abs(starts[x] - starts[k]), x))
                    wanted.add((x, k) if flip else (k, x))
    options = []
    for a, b in sorted(wanted):
        n = pair_length(ssg, js.jobs[a], js.jobs[b])
        es = max(sp.es[a], sp.es[b])
        ls = min(sp.ls[a] + sp.p[a], sp.ls[b] + sp.p[b]) - n
        if es <= ls:
            options.append(PairOption(a, b, n, es, ls))
    sp.set_options(options)


# --------------------------------------------------------------------------- constraint families


def each_job_starts_once(model: mip.Model, sp: SlotProblem, z: dict) -> None:
    """Started-by is a step: ``z[j,t] <= z[j,t+1]``; with ``z[j,ls]=1`` each job starts exactly once.

    A job with pair options runs in one mode: ``z[j,ls_j] + sum_q z[q,ls_q] = 1``
    (alone, or in one of its pairs), each mode's variables a step.
    """
    for j in sp.free:
        last = sp.ls[j] if sp.options_of(j) else sp.ls[j] - 1
        for t in range(sp.es[j], last):
            model.add_constr(z[j, t] <= z[j, t + 1], name=f"once_{j}_{t}")
        if sp.options_of(j):
            modes = [z[j, sp.ls[j]]] + [z[q, q.ls] for q in sp.options_of(j)]
            model.add_constr(mip.xsum(modes) == 1, name=f"mode_{j}")
    for q in sp.options:
        for t in range(q.es, q.ls):
            model.add_constr(z[q, t] <= z[q, t + 1], name=f"pair_once_{q.forward}_{q.backward}_{t}")


def one_job_per_device_per_slot(model: mip.Model, sp: SlotProblem, z: dict) -> None:
    """At most one job runs on a device in a slot: ``sum_j z[j,t] - z[j,t-p_j] <= 1``.

    A stage on a device group appears in the row of every device of the group.
    A pair option counts as one job of its own length (``z[q,t] - z[q,t-L_q]``);
    its two jobs count only when they run alone; a fixed pair counts once.
    """
    js = sp.js
    for d, ks in sorted(js.on_device.items()):
        free = [k for k in ks if k in sp.es]
        if not free:
            continue
        free_set = set(free)
        options = [q for q in sp.options if q.forward in free_set]
        lo = min(sp.es[k] for k in free)
        hi = max([sp.ls[k] + sp.p[k] for k in free] + [q.ls + q.length for q in options])
        fixed_busy = [0] * (hi - lo)
        for k in ks:
            if k in sp.fixed and sp.counted_busy(k):
                for t in range(max(lo, sp.fixed[k]), min(hi, sp.fixed[k] + sp.length(k))):
                    fixed_busy[t - lo] += 1
        for t in range(lo, hi):
            terms = []
            for k in free:
                if sp.p[k] == 0 or t < sp.es[k] or t >= sp.ls[k] + sp.p[k]:
                    continue
                terms.append(sp.alone_started_by(z, k, t))
                terms.append(-sp.alone_started_by(z, k, t - sp.p[k]))
            for q in options:
                if q.es <= t < q.ls + q.length:
                    terms.append(sp.option_started_by(z, q, t))
                    terms.append(-sp.option_started_by(z, q, t - q.length))
            variables = [x for x in terms if not isinstance(x, int)]
            if not variables:
                continue
            constant = sum(x for x in terms if isinstance(x, int))
            model.add_constr(
                mip.xsum(variables) <= 1 - fixed_busy[t - lo] - constant, name=f"device_{d}_{t}"
            )


def precedence_with_transfers(model: mip.Model, sp: SlotProblem, z: dict) -> None:
    """``z[j,t] <= z[i, t - p_i - c_ij]``: j can have started by t only if i had by then.

    ``c_ij`` is the transfer time in slots (0 on shared devices): F along the
    StageGraph, I backwards along it, W after I, and a stage's backward after
    its own F.
    With pairs, "i has ended" counts i's pair length when it runs in one.
    """
    for j, ps in enumerate(sp.preds):
        if j in sp.fixed:
            times = [sp.fixed[j]]
        elif j in sp.es:
            first, last = sp.start_range(j)
            times = list(range(first, last + 1))
        else:
            continue
        for i, c in ps:
            if i not in sp.es and j not in sp.es:
                continue
            for t in times:
                lhs = sp.started_by(z, j, t)
                rhs = sp.done_by(z, i, t - c)
                if isinstance(lhs, int) and isinstance(rhs, int):
                    if lhs > rhs:
                        raise AssertionError("fixed jobs violate a dependency")  # a bug in the caller
                    continue
                if isinstance(lhs, int) and lhs == 0 or isinstance(rhs, int) and rhs == 1:
                    continue
                model.add_constr(lhs <= rhs, name=f"prec_{i}_{j}_{t}")


def activation_memory_limit(model: mip.Model, sp: SlotProblem, z: dict) -> None:
    """Activation held on a device at every slot stays within its budget.

    Held at slot t = sum over F started by t of ``act`` minus, for each
    backward finished by t (started by ``t - p``), what it frees (I:
    ``act - act_w``, W: ``act_w``, B: ``act``). Rows are needed only where a
    free F could start, since only starts of F raise the level. In a pair the
    F allocates at the pair's start and the backward frees at its end.
    """
    if sp.budgets is None:
        return
    js = sp.js
    for d, ks in sorted(js.on_device.items()):
        free_forwards = [k for k in ks if k in sp.es and js.mem[k] > 0]
        if not any(k in sp.es for k in ks):
            continue
        slots = {t for k in free_forwards for t in range(sp.start_range(k)[0], sp.start_range(k)[1] + 1)}
        # a fixed F starting where a free backward might now end later also needs a row
        lo = min(sp.es[k] for k in ks if k in sp.es)
        hi = max(sp.end_range(k)[1] for k in ks if k in sp.es)
        slots |= {sp.fixed[k] for k in ks if k in sp.fixed and js.mem[k] > 0 and lo <= sp.fixed[k] <= hi}
        slots = sorted(slots)
        # bytes can be ~1e10: rows are scaled to the largest change so the solver sees O(1) numbers
        unit = max(abs(js.mem[k]) for k in ks) or 1.0
        for t in slots:
            terms, constant = [], 0.0
            for k in ks:
                if k not in sp.es and k not in sp.fixed:
                    continue
                s = sp.started_by(z, k, t) if js.mem[k] > 0 else sp.done_by(z, k, t)
                if isinstance(s, int):
                    constant += js.mem[k] * s
                else:
                    terms.append((js.mem[k] / unit) * s)
            if not terms:
                continue
            model.add_constr(
                mip.xsum(terms) <= (sp.budgets[d] - constant) / unit + 1e-9, name=f"mem_{d}_{t}"
            )


def makespan_definition(model: mip.Model, sp: SlotProblem, z: dict, C: mip.Var) -> None:
    """``C >= S_j + p_j`` for every job without successors, ``S_j = es_j + sum_t (1 - z[j,t])``."""
    js = sp.js
    for j in js.sinks():
        if j in sp.fixed:
            model.add_constr(C >= sp.fixed[j] + sp.length(j), name=f"span_{j}")
        elif j in sp.es:
            model.add_constr(C >= end_expr(sp, z, j), name=f"span_{j}")


def device_span_definition(model: mip.Model, sp: SlotProblem, z: dict) -> mip.Var:
    """``Z >= E_d - A_d`` per device: ``A_d <= S_j`` for its F jobs, ``E_d >= S_j + p_j`` for its W/B jobs
    (the end of the pair, for a job that runs in an overlapped pair).

    ``Z`` is the Zero Bubble paper's cost (the longest device span from its
    first F to its last W or B); returned for use as an objective.
    """
    js = sp.js
    Z = model.add_var(name="Z", lb=0.0)

    def start(j):
        return sp.fixed[j] if j in sp.fixed else start_expr(sp, z, j)

    def end(j):
        return sp.fixed[j] + sp.length(j) if j in sp.fixed else end_expr(sp, z, j)

    for d, ks in sorted(js.on_device.items()):
        forwards = [k for k in ks if js.jobs[k].pass_ == PassKind.F]
        lasts = [k for k in ks if js.jobs[k].pass_ in (PassKind.W, PassKind.B)]
        if not forwards or not lasts:
            continue
        A = model.add_var(name=f"A_{d}", lb=0.0)
        E = model.add_var(name=f"E_{d}", lb=0.0)
        for k in forwards:
            model.add_constr(A <= start(k), name=f"first_{d}_{k}")
        for k in lasts:
            model.add_constr(E >= end(k), name=f"last_{d}_{k}")
        model.add_constr(Z >= E - A, name=f"spanZ_{d}")
    return Z


def symmetry_breaking(model: mip.Model, sp: SlotProblem, z: dict) -> None:
    """Interchangeable microbatches start the first source stage in microbatch order."""
    for a, b in sp.before:
        if a in sp.es and b in sp.es:
            first, last = sp.start_range(b)
            for t in range(first, last):
                model.add_constr(sp.started_by(z, b, t) <= sp.started_by(z, a, t), name=f"sym_{a}_{b}_{t}")


def start_expr(sp: SlotProblem, z: dict, j: int):
    """Start slot of free job ``j`` as a linear expression (whatever its mode)."""
    if not sp.options_of(j):
        return sp.es[j] + mip.xsum(1 - z[j, t] for t in range(sp.es[j], sp.ls[j]))
    first, last = sp.start_range(j)
    return first + mip.xsum(1 - sp.started_by(z, j, t) for t in range(first, last))


def end_expr(sp: SlotProblem, z: dict, j: int):
    """End slot of free job ``j`` as a linear expression (whatever its mode)."""
    if not sp.options_of(j):
        return start_expr(sp, z, j) + sp.p[j]
    first, last = sp.end_range(j)
    return first + mip.xsum(1 - sp.done_by(z, j, t) for t in range(first, last))


# --------------------------------------------------------------------------- model


def build_model(
    sp: SlotProblem, *, solver: str = "cbc", threads: int = 1, objective: Objective = Objective.MAKESPAN,
    flow: bool = False, weights: Mapping[int, float] | None = None, fewer_pairs: bool = False,
) -> tuple[mip.Model, dict, mip.Var]:
    """The MIP of ``sp``: variables, every constraint family and the objective.

    ``objective``: minimise the makespan C or the longest device span Z.
    With ``flow``, the weighted start times of the free jobs are added as a
    tie-breaker that pushes work early (used by the neighbourhood search).
    With ``fewer_pairs`` too (the search that thins pairs), the overlapped
    pairs the free jobs form come between the two: at the same objective,
    fewer pairs is the better plan (:func:`opsched.lower.lns.preferred`).
    The tie-breakers together stay below one slot.
    """
    model = new_model(solver, threads=threads)
    z = {(j, t): model.add_var(var_type=mip.BINARY, name=f"z_{j}_{t}") for j in sp.free for t in alone_slots(sp, j)}
    for q in sp.options:
        for t in range(q.es, q.ls + 1):
            z[q, t] = model.add_var(var_type=mip.BINARY, name=_pair_var(q, t))
    horizon = max([sp.end_range(j)[1] for j in sp.free] + [sp.fixed[j] + sp.length(j) for j in sp.fixed] + [0])
    C = model.add_var(name="C", lb=0.0, ub=horizon)
    each_job_starts_once(model, sp, z)
    one_job_per_device_per_slot(model, sp, z)
    precedence_with_transfers(model, sp, z)
    activation_memory_limit(model, sp, z)
    makespan_definition(model, sp, z, C)
    symmetry_breaking(model, sp, z)
    main = C if objective == Objective.MAKESPAN else device_span_definition(model, sp, z)
    if not flow:
        model.objective = mip.minimize(main)
    else:
        w = weights or {}
        free = sp.free
        flow_terms = mip.xsum(w.get(j, 1.0) * start_expr(sp, z, j) for j in free)
        # the flow term stays below one slot (below flow_room before scaling), so it never trades against the main
        # objective
        flow_room = 1 + sum(w.get(j, 1.0) * sp.start_range(j)[1] for j in free)
        if not fewer_pairs:
            model.objective = mip.minimize(main + (1.0 / flow_room) * flow_terms)
        else:
            # lexicographic within one slot: each pair outweighs the whole flow term, and the pairs (each F in one
            # at most) stay below pair_room
            pairs = mip.xsum(z[q, t] for q in sp.options for t in range(q.es, q.ls + 1))
            pair_room = 1 + len({q.forward for q in sp.options})
            model.objective = mip.minimize(main + (1.0 / (flow_room * pair_room)) * (flow_room * pairs + flow_terms))
    return model, z, C


def alone_slots(sp: SlotProblem, j: int) -> range:
    """The slots of free job ``j``'s alone variables (with pair options, ``ls`` too: 1 when it runs alone)."""
    return range(sp.es[j], sp.ls[j] + 1 if sp.options_of(j) else sp.ls[j])


def _pair_var(q: PairOption, t: int) -> str:
    return f"y_{q.forward}_{q.backward}_{t}"


def model_size(sp: SlotProblem) -> int:
    """Number of step variables the model would have."""
    return sum(len(alone_slots(sp, j)) for j in sp.free) + sum(q.ls - q.es + 1 for q in sp.options)
