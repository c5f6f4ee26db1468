"""Run a native solve in a child process, so that a crash or a hang costs one candidate, not the command.

The MIP solvers are native code: CBC has been seen to abort with a heap
corruption at the end of a time-limited search and then hang in its own
crash handler. :func:`run_isolated` runs a solve in a forked child and
watches it: a native abort, a child that dies or one that runs past its
timeout is a :class:`SolverCrash`, the one thing callers catch (and record
as a candidate's status). Any other exception in the child comes back as
itself, with the child's traceback as its cause, so a bug fails the command
with the place it happened.

>>> run_isolated(sum, [1, 2, 3], timeout=30)
6
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait

from opsched.fileio import signals_held


class SolverCrash(Exception):
    """A native solver aborted, died or hung in an isolated solve: that solve is lost, the command goes on."""


class ChildTraceback(Exception):
    """The traceback of an exception raised in the child process (shown as the re-raised exception's cause)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


#: text a native solver prints when it aborts (glibc heap checks, CBC's signal handler)
CRASH_MARKERS = (b"Signal SIGABRT caught", b"double free", b"corruption", b"Segmentation fault", b"SIGSEGV")


def run_isolated(fn, *args, timeout: float, **kwargs):
    """Run ``fn(*args, **kwargs)`` in a forked child process and return its result.

    The child's output is watched: a crash message, a child that dies, or one
    running past ``timeout`` seconds (wall clock) raises :class:`SolverCrash`
    at once and the child is killed; an exception in ``fn`` is re-raised
    here with the child's traceback as its ``__cause__``. Other output of the
    child is passed on to stderr. Whatever ends the wait (an interrupt, a
    SIGTERM that :mod:`opsched.cli` turns into an exception) kills the child first. Falls back to a direct call where fork is
    unavailable.
    """
    try:
        ctx = mp.get_context("fork")
    except ValueError:  # no fork (Windows, some macOS setups)
        return fn(*args, **kwargs)
    receive, send = ctx.Pipe(duplex=False)
    out_read, out_write = os.pipe()
    child = ctx.Process(target=_isolated_child, args=(send, out_write, fn, args, kwargs), daemon=True)
    try:
        # a stop request waits until the fork is done (then the child is killed below), and the child
        # starts with it held until it has SIGTERM's default action
        with signals_held():
            child.start()
        send.close()
        os.close(out_write)
        ok, value, child_traceback = _watch(child, receive, out_read, timeout)
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
    if ok:
        return value
    raise value from ChildTraceback(child_traceback)


def _watch(child, receive, out_read: int, timeout: float) -> tuple[bool, object, str]:
    """Relay the child's output until it sends its result; raise SolverCrash on a crash, a death or the timeout."""
    deadline = time.monotonic() + timeout
    watched: list = [receive, out_read]
    output = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SolverCrash(f"the solver did not return within {timeout:.0f} s and was stopped")
        ready = wait(watched, timeout=left)
        if out_read in ready:
            chunk = os.read(out_read, 65536)
            if not chunk:
                watched.remove(out_read)
            else:
                output += chunk
                if any(marker in output for marker in CRASH_MARKERS):
                    raise SolverCrash("the solver crashed (native abort)")
                sys.stderr.write(chunk.decode("utf-8", "replace"))
        if receive in ready:
            try:
                return receive.recv()
            except EOFError:
                raise SolverCrash(f"the solver process died (exit code {child.exitcode})") from None


def _isolated_child(send, out_write, fn, args, kwargs) -> None:
    # SIGTERM ends the child at once, even inside native code (the parent's handler unwinds Python
    # code only, and a job scheduler signals the whole process group); the parent kills it anyway
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # held by the parent's fork
    os.dup2(out_write, 1)  # the parent watches what native code prints
    os.dup2(out_write, 2)
    try:
        result = (True, fn(*args, **kwargs), "")
    except BaseException as exc:  # noqa: BLE001 - handed to the parent with its traceback
        result = (False, exc, traceback.format_exc())
    try:
        try:
            send.send(result)
        except Exception:  # the result or exception does not pickle: send what can be
            ok, value, text = result
            send.send((False, RuntimeError(f"the isolated call's {'result' if ok else 'exception'} "
                                           f"{type(value).__name__} cannot be sent back: {value!r}"[:500]), text))
    finally:
        send.close()
        os._exit(0)  # skip interpreter teardown: the parent owns every resource
