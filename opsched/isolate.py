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
from dataclasses import dataclass
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
    try:
        ctx = mp.get_context("fork")
    except ValueError:  # no fork (Windows, some macOS setups)
        return fn(*args, **kwargs)
    receive, send = ctx.Pipe(duplex=False)
    out_read, out_write = os.pipe()
    # not daemonic: a daemonic process may not start children, and a solve isolated by the planner isolates its
    # own search; the finally below kills the child in every case, and the child dies with this process
    child = ctx.Process(target=_isolated_child, args=(send, out_write, fn, args, kwargs, os.getpid()), daemon=False)
    try:
        # a stop request waits until the fork is done (then the child is killed below), and the child
        # starts with it held until it has SIGTERM's default action
        with signals_held():
            child.start()
        send.close()
        os.close(out_write)
        message = _watch(child, receive, out_read, timeout, on_report)
    finally:
        if child.pid is not None:
            if child.is_alive():
                child.kill()
            child.join()
        for end in (send, receive):
            end.close()
        for fd in (out_read, out_write):
            with contextlib.suppress(OSError):
                os.close(fd)
    if message.ok:
        return message.value
    raise message.value from ChildTraceback(message.traceback)


def _watch(child, receive, out_read: int, timeout: float, on_report: Callable[[Any], None] | None) -> _Return:
    """Relay the child's output and reports until it returns; raise SolverCrash on a crash, a death or the timeout."""
    deadline = time.monotonic() + timeout
    watched: list = [receive, out_read]
    output = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimedOut(f"the solver did not return within {timeout:.0f} s and was stopped")
        ready = wait(watched, timeout=left)
        if out_read in ready:
            chunk = os.read(out_read, 65536)
            if not chunk:
                watched.remove(out_read)
            else:
                output = output[-_MARKER_WINDOW:] + chunk
                if any(marker in output for marker in CRASH_MARKERS):
                    raise SolverCrash("the solver crashed (native abort)")
                sys.stderr.write(chunk.decode("utf-8", "replace"))
        if receive in ready:
            try:
                message = receive.recv()
            except EOFError:
                raise SolverCrash(f"the solver process died (exit code {child.exitcode})") from None
            if isinstance(message, _Return):
                return message
            if on_report is not None:
                on_report(message.value)


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
