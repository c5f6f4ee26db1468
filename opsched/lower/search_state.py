"""The state a lower :func:`opsched.lower.solve.solve` keeps while it searches: :class:`_Search`, what its search
process knows (the problem, the best order, the bounds, the work done); :class:`_News`, what that process sends the
solve each time it has news; and :class:`_Watch`, the solve's view of those news and its progress lines. The progress
lines go to the logger of :mod:`opsched.lower.solve`, the module whose solve they report."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from opsched.lower.jobs import JobSet, noise
from opsched.lower.lns import Incumbent
from opsched.schedule import Order
from opsched.solving.solver import Objective

#: the solve's own logger: its progress lines are the solve's
log = logging.getLogger("opsched.lower.solve")


@dataclass(frozen=True)
class _News:
    """What the search process sends the solve each time it has news, and as its return value at the end.

    Orders are large (49,152 jobs at p=64, m=256): ``order`` is sent only
    with the news that it changed; the solve keeps the last one it received.
    """

    #: the progress line's text ("" for news that is not logged: a start candidate valued, a better start found)
    what: str
    #: objective value of the best order so far (``None`` before any start candidate fitted)
    value: float | None
    #: the best order, when it changed with this news
    order: Order | None
    #: the start candidate the best order came from
    start: str
    #: start candidates valued since the last news: (name, objective value)
    tried: tuple[tuple[str, float], ...]
    #: proven for every schedule of the graph (the whole MIP may raise it)
    bound: float
    slot: float | None
    #: neighbourhood sub-MIPs solved so far
    solves: int
    #: what the first clock cap (a sub-MIP's, a step's share, the deadline) that cut work short was; "": none
    clock_cut: str
    #: the search's last news (its return value)
    done: bool = False


@dataclass
class _Search:
    """The state of one :func:`solve`'s search process: the problem, the best order, its bounds, the work done.

    ``report`` sends :class:`_News` to the solve (:func:`opsched.solving.isolate.run_isolated`'s ``report``).
    """

    js: JobSet
    budgets: dict[int, float] | None
    objective: Objective
    solver: str
    threads: int
    deadline: float  # time.monotonic() instant where the search stops itself (the solve stops it there anyway)
    bound: float  # holds for every schedule of the graph (what is reported)
    report: Callable[[_News], None]
    best: Incumbent | None = None  # None while the best order is not searched (pairs the search cannot move)
    #: the neighbourhood search may form and part overlapped pairs (see :func:`opsched.lower.starts._pairs_searched`)
    pairs: bool = False
    #: holds for the orders this search can reach: may be above ``bound``
    search_bound: float = -math.inf
    clock_cut: str = ""  # see _News
    slot: float | None = None
    solves: int = 0
    start: str = ""  # the start candidate the search began from
    value: float | None = None  # objective value of the best order so far
    order: Order | None = None  # the best order when it changed since the last news, else None
    tried: list[tuple[str, float]] = field(default_factory=list)  # start candidates valued since the last news

    def improved(self, order: Order, value: float) -> None:
        """A new best order (sent with the next news)."""
        self.order, self.value = order, value

    def news(self, what: str = "", done: bool = False) -> _News:
        """The news since the last one (which it clears)."""
        out = _News(what, self.value, self.order, self.start, tuple(self.tried), self.bound, self.slot,
                    self.solves, self.clock_cut, done)
        self.order, self.tried = None, []
        return out

    def send(self, what: str = "") -> None:
        self.report(self.news(what))

    def cut(self, what: str, happened: bool = True) -> None:
        """A clock cap cut some work short (when ``happened``), as ``what`` says: the result may then vary from
        machine to machine. The status names the first."""
        if happened and not self.clock_cut:
            self.clock_cut = what

    def proven(self) -> bool:
        return self.best is not None and _proven(self.best.value, self.bound)

    def searched_out(self) -> bool:
        """Whether no order this search can reach beats the best: proven, or at the search's own bound."""
        return self.proven() or (self.best is not None and _proven(self.best.value, self.search_bound))


@dataclass
class _Watch:
    """The solve's view of its search process: the last order and bounds it sent, and the progress lines."""

    started: float  # time.monotonic() at the start of the solve
    bound: float
    order: Order | None = None
    value: float | None = None
    start: str = ""
    candidates: dict[str, float] = field(default_factory=dict)
    slot: float | None = None
    solves: int = 0
    clock_cut: str = ""  # see _News
    done: float | None = None  # time.monotonic() when the search's last news came
    log: list[tuple[float, float, float]] = field(default_factory=list)

    def receive(self, news: _News) -> None:
        """Fold one piece of news in (``on_report`` of the search process), logging it when it says what happened."""
        if news.order is not None:
            if self.order is None and not news.what:  # the first order: say so, the start phase may take minutes
                log.info("[lower] %7.2fs  first start %s, %.6g", time.monotonic() - self.started, news.start,
                         news.value)
            self.order, self.start = news.order, news.start
        self.value = news.value
        self.candidates.update(news.tried)
        self.bound = max(self.bound, news.bound)  # only a bound the search proved and sent counts
        self.slot, self.solves = news.slot, news.solves
        self.clock_cut = self.clock_cut or news.clock_cut
        if news.done:
            self.done = time.monotonic()
        if news.what and news.value is not None:
            self.line(news.value, news.what)

    def line(self, value: float, what: str) -> None:
        elapsed = time.monotonic() - self.started
        self.log.append((elapsed, value, self.bound))
        log.info("[lower] %7.2fs  best %.6g  bound %.6g  %s", elapsed, value, self.bound, what)


def _proven(makespan: float, bound: float) -> bool:
    return makespan <= bound + noise(bound)
