"""The one place python-mip models are made, and the words both levels use for how a solve ended.

Both MIPs (the upper placement, the lower time-indexed schedule) get their
model from :func:`new_model`, so the backend choice (CBC or HiGHS), the
thread count, the seed and the gap are set in one way, and a missing HiGHS
is the same one-line error wherever it is found (:func:`require`, called
before any long work starts).

:class:`Status` says how a solve ended; :class:`Objective` is what the lower
level minimises. Both are ``str`` enums, so they print and serialise (JSON)
as their plain values.

>>> model = new_model("cbc")
>>> model.threads, model.seed
(1, 0)
>>> str(Status.TIME_LIMIT), Objective("zb-span").name
('time limit reached', 'ZB_SPAN')
"""

from __future__ import annotations

import enum
import functools
import logging

import mip

from opsched.errors import OpschedError
from opsched.model.graph import gc_paused

#: solver names the command line accepts -> python-mip's backend name
BACKENDS = {"cbc": mip.CBC, "highs": "HiGHS"}
#: the one install hint of each backend that is an extra of opsched (pyproject.toml)
INSTALL_HINTS = {"highs": 'pip install "opsched[highs]"'}

# python-mip logs a backend library it cannot load (two lines, with its own install hint) through logging's
# last-resort handler when nobody configured logging; new_model's error says the same in one line, so the
# library's record goes to a handler that drops it (an application that configures logging still gets it)
logging.getLogger("mip").addHandler(logging.NullHandler())
SOLVERS = tuple(BACKENDS)


class Status(str, enum.Enum):
    """How a solve ended, from best to worst news."""

    #: the result equals a proven lower bound
    OPTIMAL = "optimal"
    #: a result within the work budget (nodes, rounds, sub-MIPs), not proven optimal
    FEASIBLE = "feasible"
    #: a clock (the time limit, or a solve's own cap) stopped the work before its budget: the result is the best
    #: found by then and may depend on the machine
    TIME_LIMIT = "time limit reached"
    #: the budget ran out before the solver found any solution (a warm start, if given, is kept)
    NO_SOLUTION = "no solution"
    #: the model has no solution at all
    INFEASIBLE = "infeasible"
    #: the backend reported something else (unbounded, error), or crashed (a lower solve keeps what its search
    #: had sent before the crash)
    ERROR = "solver error"

    def __str__(self) -> str:
        return self.value

    @property
    def meaning(self) -> str:
        """What the status tells a reader of a progress line, in a few words.

        >>> Status.TIME_LIMIT.meaning
        'not proven optimal: its share of the time limit ran out first'
        """
        return _MEANINGS[self]

    @classmethod
    def of_mip(cls, status: mip.OptimizationStatus) -> "Status":
        """The status of a python-mip ``optimize`` result (the clock is judged by the caller).

        >>> Status.of_mip(mip.OptimizationStatus.NO_SOLUTION_FOUND)
        <Status.NO_SOLUTION: 'no solution'>
        """
        S = mip.OptimizationStatus
        return {
            S.OPTIMAL: cls.OPTIMAL,
            S.FEASIBLE: cls.FEASIBLE,
            S.NO_SOLUTION_FOUND: cls.NO_SOLUTION,
            S.CUTOFF: cls.NO_SOLUTION,
            S.LOADED: cls.NO_SOLUTION,
            S.INFEASIBLE: cls.INFEASIBLE,
            S.INT_INFEASIBLE: cls.INFEASIBLE,
        }.get(status, cls.ERROR)


_MEANINGS = {
    Status.OPTIMAL: "proven optimal",
    Status.FEASIBLE: "not proven optimal: its work budget ran out first",
    Status.TIME_LIMIT: "not proven optimal: its share of the time limit ran out first",
    Status.NO_SOLUTION: "nothing found within the work budget",
    Status.INFEASIBLE: "no solution exists",
    Status.ERROR: "the solver reported an error",
}


class Objective(str, enum.Enum):
    """What the lower level minimises."""

    #: the end of the last job
    MAKESPAN = "makespan"
    #: Zero Bubble's cost: the longest device span, from its first F to its last W or B
    ZB_SPAN = "zb-span"

    def __str__(self) -> str:
        return self.value


def objective_of(name: str | Objective) -> Objective:
    """The :class:`Objective` named ``name``; an unknown name is a one-line :class:`OpschedError`.

    >>> objective_of("makespan") is Objective.MAKESPAN
    True
    """
    try:
        return Objective(name)
    except ValueError:
        raise OpschedError(f"unknown objective {name!r}; choose {' or '.join(o.value for o in Objective)}") from None


def require(solver: str) -> None:
    """Raise :class:`OpschedError` at once when ``solver`` is unknown or its backend is not installed.

    >>> require("cbc")
    >>> require("gurobi")
    Traceback (most recent call last):
    ...
    opsched.errors.OpschedError: unknown solver 'gurobi'; choose cbc or highs
    """
    _backend_check(solver)


@functools.lru_cache(maxsize=None)
def _backend_check(solver: str) -> None:
    # creating one empty model is what loads the backend's shared library
    new_model(solver)


def new_model(solver: str, *, threads: int = 1, seed: int = 0, max_gap: float | None = None) -> mip.Model:
    """An empty minimisation model on ``solver``'s backend, silent, with a fixed seed.

    ``threads`` and ``seed`` fix what the backend may vary, so the same input
    gives the same answer; ``max_gap`` (relative) is the backend's stopping
    gap (``None``: python-mip's default).
    """
    backend = BACKENDS.get(solver)
    if backend is None:
        raise OpschedError(f"unknown solver {solver!r}; choose {' or '.join(SOLVERS)}")
    try:
        model = mip.Model(sense=mip.MINIMIZE, solver_name=backend)
    except Exception:  # python-mip raises plain exceptions (with its own hint) when a backend library is missing
        hint = INSTALL_HINTS.get(solver, "reinstall python-mip")
        raise OpschedError(f"solver {solver} is not available (its library did not load): {hint}, "
                           "or use --solver cbc") from None
    model.verbose = 0
    model.threads = threads
    model.seed = seed
    if max_gap is not None:
        model.max_mip_gap = max_gap
    return model


#: The garbage collector is kept out of a lower MIP solve (``with collector_paused():``):
#: python-mip frees a backend model in ``Model.__del__``, which the collector may run at any
#: allocation, also in the middle of another model's native calls; a test run was seen to hang
#: there while a warm start was being set. Paused for one solve, the collector frees old models
#: between solves instead, at a point where no native call is running.
collector_paused = gc_paused
