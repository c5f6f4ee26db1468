"""The ``opsched`` command.

Each subcommand lives in ``opsched/commands/<name>.py`` and exposes two
functions: ``add_arguments(parser)`` and ``run(args) -> int``; its docstring
is the ``--help`` description and an optional ``EPILOG`` string follows the
options. Modules are
imported only when their subcommand runs, so ``opsched --help`` stays fast and
a missing optional dependency only affects the command that needs it.

Output: what a command is asked for (tables, summaries, paths written) goes
to stdout; progress goes through :mod:`logging` (each module has
``log = logging.getLogger(__name__)``), shown on stderr by :func:`main` at
INFO, or from WARNING with ``-q/--quiet``. Errors the user can fix are one
``opsched: error:`` line on stderr and exit code 2.

Stopping: Ctrl-C (SIGINT) and SIGTERM (what Slurm, Kubernetes and ``kill``
send) both unwind the command: a running solver child is killed, temporary
files are removed, nothing partial is left, and one line says so; the exit
code is 130 or 143 (128 + the signal number), as a shell reports it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import signal
import sys
import threading
from typing import Iterator

from opsched.commands.args import Parser
from opsched.errors import OpschedError

#: subcommand name -> one-line help. Order is the order shown in ``--help``.
COMMANDS = {
    "onnx": "write the ONNX graph of a Hugging Face model from its config.json (no weights, no download)",
    "inspect": "summarise an ONNX model: operators, parameters, FLOPs, branches, blocks",
    "plan": "plan a model on a cluster: device groups, parallel modes and a pipeline schedule",
    "evaluate": "predict the step time, MFU and memory of a given tp/pp/vpp/ep/dp layout",
    "compare": "time hand-written pipeline schedules (and the MIP) on one pipeline",
    "gantt": "draw a plan.json as a Gantt timeline (.svg, .png, .html or Perfetto .json)",
    "export": "write a plan for torch.distributed.pipelining (CSV), Megatron-LM (arguments) or torchtitan (TOML)",
    "run": "execute a plan on CPU processes with torch.distributed.pipelining",
}

EPILOG = """\
examples:
  opsched onnx --hf-config llama/config.json -o models/llama.onnx --seq-len 4096
  opsched inspect models/mixtral_8x7b.onnx --dim batch=1 --dim seq=4096
  opsched compare --stages 8 --microbatches 16 --f 1 --b 2 --w 1
  opsched plan models/mixtral_8x7b.onnx --devices 16 -o out/
  opsched gantt out/plan.json -o out/gantt.png

Run `opsched COMMAND --help` for the options of one command.
"""


def _command_module(name: str):
    return importlib.import_module(f"opsched.commands.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``opsched`` parser; with ``only``, the other subcommands get no options (their modules stay unimported).

    >>> build_parser(only="gantt").parse_args(["gantt", "plan.json", "-o", "g.svg", "-q"]).quiet
    True
    """
    parser = Parser(
        prog="opsched",
        description="Plan how to train a branch-rich model (MoE, multimodal) across many accelerators.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from opsched import __version__

    parser.add_argument("--version", action="version", version=f"opsched {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        module = _command_module(name)
        p = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            epilog=getattr(module, "EPILOG", None),  # a command's longer reference, after its options
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr, only warnings and errors")
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (pytest's capsys swaps it between tests)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass  # StreamHandler.__init__ assigns a stream; this handler always looks it up


@contextlib.contextmanager
def progress_on_stderr(quiet: bool = False) -> Iterator[None]:
    """Show the ``opsched`` loggers' records on stderr, one plain line each, while a command runs.

    INFO and above, or WARNING and above when ``quiet``. Undone afterwards, so
    calling :func:`main` twice in one process (as the tests do) prints each line once.
    """
    logger = logging.getLogger("opsched")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like KeyboardInterrupt (``except Exception`` does not catch it)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While a command runs, SIGTERM raises :class:`Terminated` (in the main thread only; restored afterwards)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Run one ``opsched`` command; returns its exit code (2 for an error the user can fix)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Only the chosen subcommand's module is imported; with none chosen (``opsched --help``), none is.
    chosen = next((a for a in argv if a in COMMANDS), "")
    try:
        parser = build_parser(only=chosen)
        args = parser.parse_args(argv)
        if args.command is None:  # a usage error like any other: one line on stderr, nothing on stdout
            raise OpschedError(f"give a command: opsched COMMAND [options], COMMAND one of {', '.join(COMMANDS)} "
                               "(opsched --help describes them)")
        with sigterm_unwinds(), progress_on_stderr(args.quiet):
            return int(_command_module(args.command).run(args) or 0)
    except OpschedError as exc:
        print(f"opsched: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("opsched: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("opsched: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
