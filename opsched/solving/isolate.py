"""Run a native solve in a child process, so that a crash or a hang costs one candidate, not the command.

The MIP solvers are native code: CBC has been seen to abort with a heap
corruption at the end of a time-limited search and then hang in its own
crash handler. :func:`run_isolated` runs a solve in a forked child and
watches it: a native abort, a child that dies or one that runs past its
timeout is a :class:`SolverCrash` (:class:`TimedOut` for the timeout), the
one thing callers catch (and record as a candidate's status). Any other
exception in the child comes back as itself, with the child's traceback as
its cause, so a bug fails the command with the place it happened.

A long search can also hand over what it has so far: with ``on_report``,
the child gets a ``report`` function that sends a value to the parent at
once. When the child then crashes, hangs or runs out of time, the caller
still holds the last report (the lower level keeps its best schedule so).
Isolated calls nest: a solve isolated by the planner isolates its own search.

>>> run_isolated(sum, [1, 2, 3], timeout=30)
6
>>> got = []
>>> run_isolated(_count_to, 3, timeout=30, on_report=got.append), got
('done', [1, 2, 3])
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Callable

from opsched.fileio import signals_held


class SolverCrash(Exception):
    """A native solver aborted, died or hung in an isolated solve: that solve is lost, the command goes on."""


class TimedOut(SolverCrash):
    """An isolated call ran past its timeout and was stopped: a hang, or a search cut at its deadline."""


class ChildTraceback(Exception):
    """The traceback of an exception raised in the child process (shown as the re-raised exception's cause)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


#: text a native solver prints when it aborts (glibc heap checks, CBC's signal handler)
CRASH_MARKERS = (b"Signal SIGABRT caught", b"double free", b"corruption", b"Segmentation fault", b"SIGSEGV")
#: output kept to find a marker split between two reads (longer than every marker)
_MARKER_WINDOW = 256


@dataclass(frozen=True)
class _Report:
    """A value the child sent with ``report`` while it runs."""

    value: Any


@dataclass(frozen=True)
class _Return:
    """The child's last message: ``fn``'s result, or the exception it raised with its traceback text."""

    ok: bool
    value: Any
    traceback: str


def run_isolated(fn, *args, timeout: float, on_report: Callable[[Any], None] | None = None, **kwargs):
    """Run ``fn(*args, **kwargs)`` in a forked child process and return its result.

    The child's output is watched: a crash message, a child that dies, or one
    running past ``timeout`` seconds (wall clock) raises :class:`SolverCrash`
    (:class:`TimedOut` for the timeout) at once and the child is killed; an
    exception in ``fn`` is re-raised here with the child's traceback as its
    ``__cause__``. Other output of the child is passed on to stderr. Whatever
    ends the wait (an interrupt, a SIGTERM that :mod:`opsched.cli` turns into
    an exception) kills the child first; a child whose parent dies is killed
    too (Linux), so a nested child never outlives the solve that started it.

    With ``on_report``, ``fn`` gets one more keyword argument, ``report``: a
    function that sends a picklable value to this process at once, where
    ``on_report`` receives it (here, while watching; keep it quick). Falls
    back to a direct call where fork is unavailable (then ``report`` is
    ``on_report`` itself and nothing is watched).
    """
    if on_report is not None:
        kwargs = dict(kwargs, report=on_report)
    if not _can_fork():  # Windows, some macOS setups
        return fn(*args, **kwargs)
    child = _Child(fn, args, kwargs, timeout, on_report)
    try:
        while child.message is None:
            child.take(wait(child.handles(), timeout=child.left()))
    finally:
        child.close()
    return child.result()


@dataclass(frozen=True)
class Call:
    """One call for :func:`run_isolated_all`: ``fn(*args, **kwargs)``, stopped after ``timeout`` seconds."""

    fn: Callable[..., Any]
    args: tuple = ()
    timeout: float = 60.0
    kwargs: dict = field(default_factory=dict)


def run_isolated_all(next_call: Callable[[int, int], Call | None], count: int, jobs: int = 1,
                     on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Run calls ``0 .. count-1`` like :func:`run_isolated`, at most ``jobs`` at once; their results in order.

    ``next_call(k, running)`` makes call ``k`` when a worker is free for it,
    with ``running`` calls still in flight (so its timeout can use the time
    left then), or returns ``None`` to skip it (its result is ``None``). A call that crashes, dies or times out gives its
    :class:`SolverCrash` as its result; any other exception stops every call
    and is raised here with its child's traceback. Calls start in order and
    each result is its own call's, so which results come back does not
    depend on ``jobs`` unless a clock stops a call. ``on_result(k, result)``
    hears of each result as it comes (progress lines; the order it comes in
    may depend on ``jobs``).

    >>> run_isolated_all(lambda k, running: Call(sum, ([k, k],), timeout=30), 3, jobs=2)
    [0, 2, 4]
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    results: list[Any] = [None] * count
    running: dict[int, _Child] = {}
    started = 0
    fork = _can_fork()  # else each call runs here, directly (no process to watch)
    try:
        while started < count or running:
            while started < count and len(running) < jobs:
                call = next_call(started, len(running))
                if call is not None:
                    running[started] = (_Child(call.fn, call.args, call.kwargs, call.timeout, None) if fork
                                        else _Done(call))
                started += 1
            if not running:
                continue
            ready = wait([h for c in running.values() for h in c.handles()],
                         timeout=min(c.left() for c in running.values()))
            for k, child in list(running.items()):
                try:
                    child.take(ready)
                except SolverCrash as exc:
                    results[k] = exc
                else:
                    if child.message is None:
                        continue
                    results[k] = child.result()
                child.close()
                del running[k]
                if on_result is not None:
                    on_result(k, results[k])
    finally:
        for child in running.values():
            child.close()
    return results


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one), at least 1.

    >>> usable_cores() >= 1
    True
    """
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1  # pragma: no cover - systems without affinity


def _can_fork() -> bool:
    try:
        mp.get_context("fork")
    except ValueError:
        return False
    return True


class _Done:
    """A call made directly where fork is unavailable, shaped like a finished :class:`_Child`."""

    def __init__(self, call: Call):
        try:
            self.message = _Return(True, call.fn(*call.args, **call.kwargs), "")
        except SolverCrash:
            raise
        except Exception as exc:  # noqa: BLE001 - raised by result() like a child's
            self.message = _Return(False, exc, "")

    def handles(self) -> list:
        return []

    def left(self) -> float:
        return 0.0

    def take(self, ready) -> None:
        return None

    def result(self):
        if self.message.ok:
            return self.message.value
        raise self.message.value

    def close(self) -> None:
        return None


class _Child:
    """One isolated call in flight: its process, what it printed, and its last message once it came."""

    def __init__(self, fn, args: tuple, kwargs: dict, timeout: float, on_report: Callable[[Any], None] | None):
        ctx = mp.get_context("fork")
        self.timeout, self.on_report = timeout, on_report
        self.deadline = time.monotonic() + timeout
        self.receive, self.send = ctx.Pipe(duplex=False)
        self.out_read, out_write = os.pipe()
        self.output = b""
        self.message: _Return | None = None
        # not daemonic: a daemonic process may not start children, and a solve isolated by the planner isolates
        # its own search; close() kills the child in every case, and the child dies with this process
        self.process = ctx.Process(target=_isolated_child,
                                   args=(self.send, out_write, fn, args, kwargs, os.getpid()), daemon=False)
        try:
            # a stop request waits until the fork is done (then the child is killed by close()), and the
            # child starts with it held until it has SIGTERM's default action
            with signals_held():
                self.process.start()
        finally:
            self.send.close()
            os.close(out_write)
        self.watched: list = [self.receive, self.out_read]

    def handles(self) -> list:
        return self.watched

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def take(self, ready: list) -> None:
        """Relay what is ready of this child's output and reports; raise SolverCrash on a crash, death or timeout."""
        if self.out_read in ready:
            chunk = os.read(self.out_read, 65536)
            if not chunk:
                self.watched.remove(self.out_read)
            else:
                self.output = self.output[-_MARKER_WINDOW:] + chunk
                if any(marker in self.output for marker in CRASH_MARKERS):
                    raise SolverCrash("the solver crashed (native abort)")
                sys.stderr.write(chunk.decode("utf-8", "replace"))
        if self.receive in ready:
            try:
                message = self.receive.recv()
            except EOFError:
                raise SolverCrash(f"the solver process died (exit code {self.process.exitcode})") from None
            if isinstance(message, _Return):
                self.message = message
            elif self.on_report is not None:
                self.on_report(message.value)
        if self.message is None and time.monotonic() >= self.deadline:
            raise TimedOut(f"the solver did not return within {self.timeout:.0f} s and was stopped")

    def result(self):
        """The child's return value, or its exception re-raised with the child's traceback as the cause."""
        if self.message.ok:
            return self.message.value
        raise self.message.value from ChildTraceback(self.message.traceback)

    def close(self) -> None:
        """Kill the child if it still runs, and close its pipes."""
        if self.process.pid is not None:
            if self.process.is_alive():
                self.process.kill()
            self.process.join()
        for end in (self.send, self.receive):
            end.close()
        with contextlib.suppress(OSError):
            os.close(self.out_read)


def _isolated_child(send, out_write, fn, args, kwargs, parent: int) -> None:
    # SIGTERM ends the child at once, even inside native code (the parent's handler unwinds Python
    # code only, and a job scheduler signals the whole process group); the parent kills it anyway
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # held by the parent's fork
    _die_with(parent)
    os.dup2(out_write, 1)  # the parent watches what native code prints
    os.dup2(out_write, 2)
    if "report" in kwargs:
        kwargs = dict(kwargs, report=lambda value: send.send(_Report(value)))
    try:
        result = _Return(True, fn(*args, **kwargs), "")
    except BaseException as exc:  # noqa: BLE001 - handed to the parent with its traceback
        result = _Return(False, exc, traceback.format_exc())
    try:
        try:
            send.send(result)
        except Exception:  # the result or exception does not pickle: send what can be
            send.send(_Return(False, RuntimeError(
                f"the isolated call's {'result' if result.ok else 'exception'} {type(result.value).__name__} "
                f"cannot be sent back: {result.value!r}"[:500]), result.traceback))
    finally:
        send.close()
        os._exit(0)  # skip interpreter teardown: the parent owns every resource


#: Linux's prctl option that signals a process when its parent dies
_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux; elsewhere the parent's kill must do).

    The parent kills its child on every way out of :func:`run_isolated`, but
    it may itself be killed at once: the planner stops a hung solve with
    SIGKILL, and that solve's own search process must not live on.
    """
    if not sys.platform.startswith("linux"):  # pragma: no cover - other systems
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _count_to(n: int, report: Callable[[Any], None]) -> str:
    """Report 1..n, then return (the module docstring's example)."""
    for k in range(1, n + 1):
        report(k)
    return "done"
