"""Run a native solve in a child process, so that a crash or a hang costs one candidate, not the command."""

from __future__ import annotations

import time

from opsched.errors import OpschedError


#: text a native solver prints when it aborts (glibc heap checks, CBC's signal handler)
CRASH_MARKERS = (b"Signal SIGABRT caught", b"double free", b"corruption", b"Segmentation fault", b"SIGSEGV")


def run_isolated(fn, *args, timeout: float, **kwargs):
    """Run ``fn(*args, **kwargs)`` in a forked child process and return its result.

    The MIP solvers are native code: CBC has been seen to abort with a heap
    corruption at the end of a time-limited search and then hang in its own
    crash handler, which would hang the whole planner. In a child it costs
    one solve: the child's output is watched, and a crash message, a child
    that dies, or one running past ``timeout`` seconds raises
    :class:`OpschedError` at once; an exception in ``fn`` is re-raised here.
    Other output of the child is passed on to stderr. Falls back to a direct
    call where fork is unavailable.
    """
    import multiprocessing as mp
    import os
    import sys
    from multiprocessing.connection import wait

    try:
        ctx = mp.get_context("fork")
    except ValueError:  # no fork (Windows, some macOS setups)
        return fn(*args, **kwargs)
    receive, send = ctx.Pipe(duplex=False)
    out_read, out_write = os.pipe()
    child = ctx.Process(target=_isolated_child, args=(send, out_write, fn, args, kwargs), daemon=True)
    child.start()
    send.close()
    os.close(out_write)
    deadline = time.monotonic() + timeout
    watched: list = [receive, out_read]
    output = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OpschedError(f"the solver did not return within {timeout:.0f} s and was stopped")
            ready = wait(watched, timeout=left)
            if out_read in ready:
                chunk = os.read(out_read, 65536)
                if not chunk:
                    watched.remove(out_read)
                else:
                    output += chunk
                    if any(marker in output for marker in CRASH_MARKERS):
                        raise OpschedError("the solver crashed (native abort); this candidate is skipped")
                    sys.stderr.write(chunk.decode("utf-8", "replace"))
            if receive in ready:
                try:
                    ok, value = receive.recv()
                except EOFError:
                    raise OpschedError(f"the solver process died (exit code {child.exitcode}); this candidate is skipped") from None
                break
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
        os.close(out_read)
    if ok:
        return value
    raise value


def _isolated_child(send, out_write, fn, args, kwargs) -> None:
    import os

    os.dup2(out_write, 1)  # the parent watches what native code prints
    os.dup2(out_write, 2)
    try:
        result = (True, fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent as is
        result = (False, exc)
    try:
        send.send(result)
    finally:
        send.close()
        os._exit(0)  # skip interpreter teardown: the parent owns every resource
