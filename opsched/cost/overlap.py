"""Operator-level overlap: how long an F and a backward of another microbatch take when run as one pair.

DualPipe's gain comes from pairing the forward of one microbatch with the
backward of another on the same devices, so that one pass's communication
(expert all-to-all, tensor-parallel all-reduce) runs while the other pass
computes. This module derives that pair time from the passes' operators
instead of assuming a gain:

* each pass of a stage is a chain of **stream operations**
  (:class:`StreamOp`): a length of time on the compute stream, on the
  communication stream. A
  pass runs its chain in order; alone it takes the sum of its lengths
  (the cost model's pass time);
* a pair runs two chains at once, one operation per stream at a time,
  neither chain reordered. Its shortest length is the two-job job shop's
  optimum, found exactly by the geometric method of Akers (1956), as
  Brucker (*Scheduling Algorithms*, section 6.4.1) gives it: the shortest
  path from one corner of a rectangle to the other, the first chain's time
  on one axis and the second's on the other, around the obstacles where the
  two chains would use the same stream (:func:`pair_length`);
* chains of more than :data:`EXACT_OPS` operations get the length of the
  greedy list schedule instead (:func:`greedy_pair_length`): achievable,
  and within 1-2 % of the exact optimum on the bundled MoE models' stages;
* a stage keeps at most :data:`STORED_OPS` operations per pass: longer
  chains run each run on one stream as one operation (:func:`compact`), a
  restriction that keeps every length achievable.

Pipeline transfers are not stream operations here: the simulator already
runs them off the devices (an edge's time delays the consumer without
occupying either group).

>>> f = (StreamOp(COMPUTE, 2.0), StreamOp(COMM, 1.0))
>>> b = (StreamOp(COMM, 1.0), StreamOp(COMPUTE, 4.0))
>>> pair_length(f, b)  # the F's all-to-all runs under the backward's compute, and the other way round
6.0
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

COMPUTE = 1  #: the compute stream
COMM = 2  #: the communication stream

#: longest chain (operations) paired exactly: 48 take a few ms (cached per pair of chains); 128 about 0.1 s
EXACT_OPS = 48
#: longest chain a stage keeps as it is; longer ones run each run on one stream as one operation (compact)
STORED_OPS = 1024

#: stream masks as plan.json names them
STREAM_NAMES = {COMPUTE: "compute", COMM: "comm"}


class StreamOp(NamedTuple):
    """One operation of a pass: ``seconds`` on the stream ``streams`` (:data:`COMPUTE` or :data:`COMM`)."""

    streams: int
    seconds: float


Chain = tuple[StreamOp, ...]


@dataclass(frozen=True)
class PassStreams:
    """A stage's passes as chains of stream operations: F in forward order, I and W in backward order.

    The chains of a pass sum to the stage's time for that pass. A fused B
    runs the I chain, then the W chain.
    """

    F: Chain = ()
    I: Chain = ()  # noqa: E741 (the pass is called I)
    W: Chain = ()

    def chain(self, pass_: str) -> Chain:
        """The operations of ``pass_`` (F, I, W, or B = I then W)."""
        if pass_ == "B":
            return self.I + self.W
        return {"F": self.F, "I": self.I, "W": self.W}[pass_]

    def total(self, pass_: str) -> float:
        return sum(op.seconds for op in self.chain(pass_))

    def then(self, later: "PassStreams") -> "PassStreams":
        """This stage's operations merged with those of the ``later`` stage of a chain (F runs this first)."""
        return PassStreams(self.F + later.F, later.I + self.I, later.W + self.W)

    def scaled(self, factor: float | Mapping[str, float]) -> "PassStreams":
        """Every length times ``factor`` (one number, or one per pass F, I, W)."""
        per_pass = factor if isinstance(factor, Mapping) else {p: float(factor) for p in ("F", "I", "W")}
        return PassStreams(*(tuple(StreamOp(op.streams, op.seconds * per_pass[p]) for op in self.chain(p))
                             for p in ("F", "I", "W")))

    def to_dict(self) -> dict[str, list[list]]:
        """plan.json's form: ``{"F": [["compute", s], ["comm", s], ...], "I": ..., "W": ...}``."""
        return {p: [[STREAM_NAMES[op.streams], op.seconds] for op in self.chain(p)] for p in ("F", "I", "W")}


@functools.lru_cache(maxsize=1 << 14)
def pair_length(first: Chain, second: Chain) -> float:
    """The shortest time to run two chains at once, one operation per stream at a time, each in its order.

    Between the longer chain's total and the sum of both. Exact
    (:func:`exact_pair_length`) when each chain has at most
    :data:`EXACT_OPS` operations; longer chains get the greedy list
    schedule's length (:func:`greedy_pair_length`), which is achievable but
    may exceed the exact optimum (by 1-2 % on the bundled MoE models' stages).

    >>> c = (StreamOp(COMPUTE, 1.0),)
    >>> pair_length(c, c), pair_length(c, (StreamOp(COMM, 3.0),))
    (2.0, 3.0)
    """
    a = tuple(op for op in first if op.seconds > 0)
    b = tuple(op for op in second if op.seconds > 0)
    if len(a) <= EXACT_OPS and len(b) <= EXACT_OPS:
        return exact_pair_length(a, b)
    return greedy_pair_length(a, b)


def greedy_pair_length(a: Sequence[StreamOp], b: Sequence[StreamOp]) -> float:
    """The length of the non-delay list schedule of two chains: the next operation that can start first runs.

    On a tie the chain with more time left goes first. Each stream runs one
    operation at a time and each chain keeps its order, so the length is
    achievable; it takes time linear in the chains' length.

    >>> f = (StreamOp(COMPUTE, 2.0), StreamOp(COMM, 1.0))
    >>> greedy_pair_length(f, (StreamOp(COMM, 1.0), StreamOp(COMPUTE, 4.0)))
    6.0
    """
    i = j = 0
    ready_a = ready_b = 0.0  # when each chain's next operation may start
    free = {COMPUTE: 0.0, COMM: 0.0}  # when each stream is next free
    left_a, left_b = sum(op.seconds for op in a), sum(op.seconds for op in b)
    while i < len(a) or j < len(b):
        start_a = max(ready_a, free[a[i].streams]) if i < len(a) else math.inf
        start_b = max(ready_b, free[b[j].streams]) if j < len(b) else math.inf
        if start_a < start_b or (start_a == start_b and left_a >= left_b):
            ready_a = free[a[i].streams] = start_a + a[i].seconds
            left_a -= a[i].seconds
            i += 1
        else:
            ready_b = free[b[j].streams] = start_b + b[j].seconds
            left_b -= b[j].seconds
            j += 1
    return max(ready_a, ready_b)


def compact(chain: Sequence[StreamOp], most: int = STORED_OPS) -> Chain:
    """``chain`` without empty operations and, when longer than ``most``, with each run on one stream as one.

    A run held together cannot let the other chain's operation in between,
    so a pair of compacted chains is achievable by the originals.

    >>> compact([StreamOp(COMPUTE, 1.0), StreamOp(COMPUTE, 2.0), StreamOp(COMM, 0.0)], most=1)
    (StreamOp(streams=1, seconds=3.0),)
    """
    ops = [op for op in chain if op.seconds > 0]
    if len(ops) <= most:
        return tuple(ops)
    runs: list[StreamOp] = []
    for op in ops:
        if runs and runs[-1].streams == op.streams:
            runs[-1] = StreamOp(op.streams, runs[-1].seconds + op.seconds)
        else:
            runs.append(op)
    return tuple(runs)


def exact_pair_length(a: Chain, b: Chain) -> float:
    """The two-job shop's optimum for chains ``a`` and ``b`` of positive lengths (Akers' geometric method).

    A path from corner ``(0, 0)`` to ``(len(a), len(b))`` of the grid whose
    lines are the chains' operation boundaries; its length is the time. From
    each corner it reaches, the path goes diagonally (both chains progress)
    to the first obstacle, then around it on either side
    (:func:`_around_first_obstacle`); a shortest path over those corners is
    an optimal schedule (Brucker, section 6.4.1).
    """
    xs, ys = _cumulative(a), _cumulative(b)
    end = (len(a), len(b))
    best: dict[tuple[int, int], float] = {(0, 0): 0.0}
    heap = [(0.0, 0, 0)]
    while heap:
        dist, i, j = heapq.heappop(heap)
        if (i, j) == end:
            return dist
        if dist > best[(i, j)]:
            continue
        for ti, tj in _around_first_obstacle(a, b, xs, ys, i, j):
            step = max(xs[ti] - xs[i], ys[tj] - ys[j])
            if dist + step < best.get((ti, tj), float("inf")):
                best[(ti, tj)] = dist + step
                heapq.heappush(heap, (dist + step, ti, tj))
    raise AssertionError("the far corner is always reachable")  # pragma: no cover


def _cumulative(chain: Chain) -> list[float]:
    out = [0.0]
    for op in chain:
        out.append(out[-1] + op.seconds)
    return out


def _around_first_obstacle(a: Chain, b: Chain, xs: list[float], ys: list[float], i: int,
                           j: int) -> list[tuple[int, int]]:
    """Where a path from grid corner ``(i, j)`` goes next: around the first obstacle its diagonal meets.

    Going diagonally both chains progress; cell ``(ci, cj)`` (operation ci of
    ``a`` against operation cj of ``b``) is an obstacle when the two share a
    stream. At the obstacle the path passes either above it (``a`` waits
    before operation ci: its top-left corner) or to its right (``b`` waits
    before cj: its bottom-right corner). A diagonal that meets no obstacle
    reaches the far edge, and the path ends at the far corner.
    """
    n, m = len(a), len(b)
    ci, cj = i, j
    x, y = xs[i], ys[j]
    while ci < n and cj < m:
        if a[ci].streams & b[cj].streams:
            return [(ci, cj + 1), (ci + 1, cj)]
        dx, dy = xs[ci + 1] - x, ys[cj + 1] - y
        step = min(dx, dy)
        x, y = x + step, y + step
        tol = 1e-12 * max(1.0, xs[-1], ys[-1])
        if dx - step <= tol:
            ci += 1
            x = xs[ci]
        if dy - step <= tol:
            cj += 1
            y = ys[cj]
    return [(n, m)]
