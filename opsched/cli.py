"""The ``opsched`` command.

Each subcommand lives in ``opsched/commands/<name>.py`` and exposes two
functions: ``add_arguments(parser)`` and ``run(args) -> int``. Modules are
imported only when their subcommand runs, so ``opsched --help`` stays fast and
a missing optional dependency only affects the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from opsched.errors import OpschedError

#: subcommand name -> one-line help. Order is the order shown in ``--help``.
COMMANDS = {
    "inspect": "summarise an ONNX model: operators, parameters, FLOPs, branches, blocks",
    "plan": "plan a model on a cluster: device groups, parallel modes and a pipeline schedule",
    "compare": "time hand-written pipeline schedules (and the MIP) on one pipeline",
    "gantt": "draw a plan.json as a Gantt timeline (.svg, .png, .html or Perfetto .json)",
    "export": "write a plan as a schedule file for torch.distributed.pipelining",
    "run": "execute a plan on CPU processes with torch.distributed.pipelining",
}

EPILOG = """\
examples:
  opsched inspect models/mixtral_8x7b.onnx --dim batch=1 --dim seq=4096
  opsched compare --stages 8 --microbatches 16 --f 1 --b 2 --w 1
  opsched plan models/mixtral_8x7b.onnx --devices 16 -o out/
  opsched gantt out/plan.json -o out/gantt.png

Run `opsched COMMAND --help` for the options of one command.
"""


def _command_module(name: str):
    return importlib.import_module(f"opsched.commands.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        try:
            module = _command_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != f"opsched.commands.{name}":
                raise
            sub.add_parser(name, help=help_text + " (not available yet)")
            continue
        p = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Only the chosen subcommand's module is imported.
    chosen = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(only=chosen)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        module = _command_module(args.command)
    except ModuleNotFoundError as exc:
        if exc.name == f"opsched.commands.{args.command}":
            print(f"opsched: error: `{args.command}` is not implemented yet", file=sys.stderr)
            return 2
        raise
    try:
        return int(module.run(args) or 0)
    except OpschedError as exc:
        print(f"opsched: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("opsched: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
