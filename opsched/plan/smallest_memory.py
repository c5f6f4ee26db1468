"""The least memory per device any layout needs, and the errors that report it when nothing fits.

Under the upper memory model (:func:`opsched.upper.mip.minimum_memory`, one small MIP per layout): the figure a
:class:`opsched.errors.MemoryTooSmall` of :func:`opsched.plan.search.plan_block_graph` reports, and
:func:`smallest_memory`, which ``opsched plan`` asks for other training settings. :func:`_reduced` is the
block graph those MIPs and the planner's placement MIP place.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import networkx as nx

from opsched.cost.cluster import Cluster, Training, memory_hint
from opsched.errors import MemoryTooSmall
from opsched.solving.isolate import SolverCrash, run_isolated
from opsched.units import bytes_text
from opsched.upper.constraints import floor_over, memory_floor
from opsched.upper.layouts import layouts
from opsched.upper.mip import CostTable, UpperProblem, minimum_memory, upper_problem
from opsched.upper.reduce import reduce_block_graph

if TYPE_CHECKING:
    from opsched.plan.search import Clock


def _too_small(what: str, smallest: float, limit: float, cluster: Cluster) -> MemoryTooSmall:
    """The error for a memory limit nothing fits in (``what`` it, e.g. "no layout fits in"), with the smallest that works."""
    return MemoryTooSmall(f"{what} {bytes_text(limit)} per device; the smallest memory "
                          f"that works is about {bytes_text(smallest)} ({memory_hint(smallest, cluster)})", smallest)


#: the time limit of each layout's least-memory MIP, when nothing fits (the hint of the error)
SMALLEST_MEMORY_SECONDS = 2.0


def _reduced(bg: nx.DiGraph, all_layouts: list, target_blocks: int | None,
             whole_layers: bool = False) -> tuple[nx.DiGraph, dict]:
    """``bg`` reduced to the blocks the placement MIP places (default: 3 per pipeline slot of the largest layout,
    at least 24), with the members of each reduced block; with ``whole_layers``, each numbered layer in one."""
    return reduce_block_graph(bg, target_blocks or max(24, 3 * max(lay.slots for lay in all_layouts)),
                              whole_layers=whole_layers)


def smallest_memory(bg: nx.DiGraph, cluster: Cluster, training: Training, solver: str = "cbc",
                    target_blocks: int | None = None, deadline: float | None = None,
                    limit: float | None = None) -> float:
    """The least memory per device any layout of :func:`plan_block_graph` needs for ``bg`` with ``training``, under
    the upper memory model: the figure :class:`MemoryTooSmall` reports, for other training settings (``opsched plan``
    asks it with Adam's state in BF16 when nothing fits in FP32). Past ``deadline`` the layouts not yet tried are
    left out (infinite when none was tried). With ``limit`` (the question is only whether something fits in it),
    a layout whose :func:`~opsched.upper.constraints.memory_floor` is over it is not solved; when no layout is left,
    the least floor is returned, itself over the limit.
    """
    # the deepest pipelines first: they spread the parameters' state most, so a look cut short by ``deadline`` has
    # tried the layouts most likely to need the least
    all_layouts = sorted(layouts(cluster), key=lambda lay: (-lay.groups, lay.virtual))
    small, _ = _reduced(bg, all_layouts, target_blocks)
    table = CostTable(small, cluster, training)  # the least memory is its own MIP: no memory limit is needed
    problems = {str(lay): upper_problem(small, lay, cluster, training, table=table) for lay in all_layouts}
    if limit is not None:
        fitting = {name: p for name, p in problems.items() if not floor_over(p, limit)}
        if not fitting:
            return min(memory_floor(p) for p in problems.values())  # proven: nothing fits in ``limit``, no MIP solved
        problems = fitting
    return _smallest_memory(problems, solver, deadline)[0]


def _smallest_memory(problems: dict[str, UpperProblem], solver: str,
                     deadline: float | None = None) -> tuple[float, int]:
    """(the least memory per device the layouts tried need under the upper memory model, how many were tried):
    every layout, unless ``deadline`` (a :func:`time.monotonic` instant) passes first."""
    best, tried = math.inf, 0
    for p in problems.values():
        left = math.inf if deadline is None else deadline - time.monotonic()
        if left <= 0.0:
            break
        tried += 1
        try:
            best = min(best, run_isolated(minimum_memory, p, solver=solver,
                                          time_limit=min(SMALLEST_MEMORY_SECONDS, left), timeout=min(30.0, left + 5)))
        except SolverCrash:
            continue
    return best, tried


def _nothing_fits(problems: dict[str, UpperProblem], solver: str, clock: Clock, limit: float,
                  cluster: Cluster) -> MemoryTooSmall:
    """The error when no layout fits in ``limit``: with the smallest memory that works, as far as the time limit
    lets the layouts be tried."""
    smallest, tried = _smallest_memory(problems, solver, clock.deadline)
    if problems and tried == len(problems):
        return _too_small("no layout fits in", smallest, limit, cluster)
    if tried == 0 or smallest == math.inf:
        return MemoryTooSmall(f"no layout fits in {bytes_text(limit)} per device (the time limit was spent before "
                              "the least memory that works was found)", math.inf)
    return MemoryTooSmall(f"no layout fits in {bytes_text(limit)} per device; the least memory among the "
                          f"{tried} of {len(problems)} layouts tried before the time limit is about "
                          f"{bytes_text(smallest)} ({memory_hint(smallest, cluster)})", smallest)
