"""Write output files atomically: to a temporary name beside the target, then rename.

A crash or a refused plan never leaves a partial file that looks complete.
Commands check where they will write before any long work
(:func:`check_output_dir`, :func:`check_output_file`), so a place that cannot
be written is one error line at once, not after the search.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from pathlib import Path
from typing import Iterator

from opsched.errors import OpschedError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` on success.

    >>> with atomic_path("out.svg") as tmp:      # doctest: +SKIP
    ...     figure.savefig(tmp, format="svg")
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        # mkstemp creates 0600; give the file the mode a plain open() would.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Atomically write ``data`` to ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def check_output_dir(path: str | os.PathLike, flag: str) -> None:
    """Refuse, before any work, a directory ``flag`` names that cannot be written; leave nothing behind.

    Missing directories are created to try a file in them, then removed again.

    >>> check_output_dir("opsched/fileio.py", "-o")
    Traceback (most recent call last):
    ...
    opsched.errors.OpschedError: -o opsched/fileio.py: is a file; give a directory for the output files
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise OpschedError(f"{flag} {path}: is a file; give a directory for the output files")
    _try_writing_in(target, flag, path)


def check_output_file(path: str | os.PathLike, flag: str, example: str = "out.csv") -> None:
    """Refuse, before any work, a file ``flag`` names that cannot be written (a directory, under a file, read-only).

    >>> check_output_file("opsched", "--torch-csv")
    Traceback (most recent call last):
    ...
    opsched.errors.OpschedError: --torch-csv opsched: is a directory; give a file name in it, e.g. opsched/out.csv
    """
    target = Path(path)
    if target.is_dir():
        raise OpschedError(f"{flag} {path}: is a directory; give a file name in it, e.g. {target / example}")
    _try_writing_in(target.parent, flag, path)


def _try_writing_in(directory: Path, flag: str, shown) -> None:
    """Create ``directory`` (and missing parents) and a temporary file in it; undo both; OpschedError if that fails."""
    missing = []
    existing = directory
    while not existing.exists() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise OpschedError(f"{flag} {shown}: {existing} is a file, not a directory")
    created: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
        fd, name = tempfile.mkstemp(prefix=".opsched-probe-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise OpschedError(f"{flag} {shown}: cannot write there ({reason.lower()}); choose another place") from None
    finally:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while the block runs (the last renames of a set of files), then deliver them.

    A stop request then never leaves half of a set of outputs in place.
    """
    held = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - Windows
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def check_not_input(output: str | os.PathLike, inputs: list, flag: str) -> None:
    """Refuse an output path that is one of the command's input files (it would be overwritten before it is read).

    >>> check_not_input("opsched/../opsched/fileio.py", ["opsched/fileio.py"], "-o")
    Traceback (most recent call last):
    ...
    opsched.errors.OpschedError: -o opsched/../opsched/fileio.py: is the input opsched/fileio.py; give another file name for the output
    """
    out = Path(output)
    for given in inputs:
        source = Path(given)
        same = out.exists() and source.exists() and os.path.samefile(out, source)
        if same or out.resolve() == source.resolve():
            raise OpschedError(f"{flag} {output}: is the input {given}; give another file name for the output")
