"""What every subcommand's arguments share: argparse ``type=`` callables and a parser that fails in one line.

A type turns the text of one flag into its value or raises
:class:`argparse.ArgumentTypeError` with a short reason; argparse puts the
flag's name in front. :class:`Parser` (the class of ``opsched`` and of every
subcommand's parser) raises that message as a :class:`UsageError`, which
:func:`opsched.cli.main` prints as one ``opsched: error:`` line with exit
code 2, like every other user error; argparse alone would print its usage
block and exit the process.

>>> positive_int("8"), non_negative_float("0.5"), per_stage("1,2.5")
(8, 0.5, [1.0, 2.5])
>>> fraction("2")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: must be a finite number between 0 and 1, got 2
>>> parser = Parser(prog="opsched demo")
>>> _ = parser.add_argument("--stages", type=positive_int)
>>> parser.parse_args(["--stages", "x"])
Traceback (most recent call last):
...
opsched.commands.args.UsageError: --stages: expected a whole number, got 'x'
>>> parser.parse_args(["--stages", "-5x"])
Traceback (most recent call last):
...
opsched.commands.args.UsageError: --stages: expected a whole number, got '-5x'
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import NoReturn

from opsched.cost.cluster import DEFAULT_PRESET, DTYPE_BYTES, PRESETS
from opsched.errors import OpschedError


class UsageError(OpschedError):
    """A flag the parser refused (unknown, missing, or a value of the wrong kind)."""


class Parser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose errors raise :class:`UsageError` instead of exiting.

    ``--help`` and ``--version`` still print and exit as usual. Subparsers
    made by ``add_subparsers().add_parser`` are of the same class.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes "-5GiB" (a value that starts with a minus and is no bare number) for an unknown option and
        # says "expected one argument"; no opsched option starts with "-" and a digit, so such a word is a value, and
        # its flag's type refuses it with a line that says why
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        # argparse says "argument --stages: ..."; the flag alone reads as the rest of opsched's errors do
        raise UsageError(message.removeprefix("argument "))


@dataclass(frozen=True)
class WholeNumber:
    """An integer flag of at least ``minimum`` and, when ``maximum`` is set, at most that (``why`` says why).

    >>> WholeNumber(0)("0")
    0
    >>> WholeNumber(1, 8, "the demo has 8 slots")("9")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be at most 8 (the demo has 8 slots), got 9
    """

    minimum: int = 1
    maximum: int | None = None
    why: str = ""

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < self.minimum:
            raise argparse.ArgumentTypeError(f"must be at least {self.minimum}, got {value}")
        if self.maximum is not None and value > self.maximum:
            reason = f" ({self.why})" if self.why else ""
            raise argparse.ArgumentTypeError(f"must be at most {self.maximum:,}{reason}, got {value:,}")
        return value


@dataclass(frozen=True)
class RealNumber:
    """A finite number flag from ``minimum`` (excluded when ``above``) up to ``maximum`` (``None``: no bound).

    >>> RealNumber(0.0, above=True)("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a finite number > 0, got 0
    """

    minimum: float = 0.0
    maximum: float | None = None
    above: bool = False

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = value > self.minimum if self.above else value >= self.minimum
        if not (low_ok and math.isfinite(value)) or (self.maximum is not None and value > self.maximum):
            raise argparse.ArgumentTypeError(f"must be a finite number {self._bounds()}, got {text}")
        return value

    def _bounds(self) -> str:
        if self.maximum is not None:
            return f"between {self.minimum:g} and {self.maximum:g}"
        return f"{'>' if self.above else '>='} {self.minimum:g}"


#: counts without a natural bound: steps, blocks, sizes
positive_int = WholeNumber(1)

# Bounded counts. The search grows with each of these, so a mistyped value
# (an extra zero or three) would run silently for hours; the bounds are far
# above any real training job and each error says why it is there.

#: the most devices `plan` and `compare` accept
MAX_DEVICES = 65_536
#: the most microbatches per step
MAX_MICROBATCHES = 4_096
#: the most pipeline stages of `compare`'s synthetic chain
MAX_STAGES = 1_024

#: devices of a cluster
device_count = WholeNumber(1, MAX_DEVICES, "larger than any cluster a pipeline spans; the layout search grows with it")
#: microbatches per step
microbatch_count = WholeNumber(
    1, MAX_MICROBATCHES, "the schedule has a job per microbatch and stage, so a larger step would take hours to plan"
)
#: pipeline stages
stage_count = WholeNumber(
    1, MAX_STAGES, "the schedule has a job per microbatch and stage, so a deeper pipeline would take hours to plan"
)
#: levels and the like, where 0 means "none"
non_negative_int = WholeNumber(0)
#: times, transfer costs, memory in abstract units
non_negative_float = RealNumber(0.0)
#: solver budgets, timeouts, factors that scale something
positive_float = RealNumber(0.0, above=True)
#: shares such as the overlap gain of an F&B pair
fraction = RealNumber(0.0, 1.0)


def per_stage(text: str) -> float | list[float]:
    """One number >= 0, or a comma list of them with one value per stage.

    >>> per_stage("2")
    2.0
    """
    values = [non_negative_float(item.strip()) for item in str(text).split(",")]
    return values[0] if len(values) == 1 else values


#: a memory size without a unit below this many bytes is taken for a missing unit
BARE_BYTES_AT_LEAST = 2**20


def byte_size(text: str) -> float:
    """A memory size such as ``80GiB``, ``80GB`` or ``8e10`` (see :func:`opsched.cost.cluster.parse_bytes`).

    A bare number is bytes, so one below a MiB (no model trains in that) is
    refused as a forgotten unit:

    >>> byte_size("1.5 GB")
    1500000000.0
    >>> byte_size("80")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 80 without a unit is 80 bytes; did you mean 80GiB? (write a unit: GiB, GB, MiB; or all the bytes, e.g. 8e10)
    >>> byte_size("-5GiB")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: a memory size cannot be negative, got -5GiB; write e.g. 80GiB
    """
    from opsched.cost.cluster import parse_bytes

    if str(text).strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"a memory size cannot be negative, got {text}; write e.g. 80GiB")
    try:
        value = parse_bytes(text)
    except OpschedError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    bare = str(text).strip()
    if value < BARE_BYTES_AT_LEAST and bare and bare[-1].isdigit():
        raise argparse.ArgumentTypeError(
            f"{bare} without a unit is {bare} bytes; did you mean {bare}GiB? "
            "(write a unit: GiB, GB, MiB; or all the bytes, e.g. 8e10)"
        )
    return value


def dimension(text: str) -> dict[str, int]:
    """One ``NAME=VALUE`` symbolic dimension with a positive value (see :func:`opsched.model.onnx_import.parse_dim`).

    >>> dimension("seq=4096")
    {'seq': 4096}
    """
    from opsched.model.onnx_dims import parse_dim

    try:
        return parse_dim(text)  # argparse names the flag in front
    except OpschedError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def merged_dims(items: list[dict[str, int]]) -> dict[str, int]:
    """Every ``--dim`` given, later ones winning.

    >>> merged_dims([{"seq": 16}, {"batch": 2}, {"seq": 32}])
    {'seq': 32, 'batch': 2}
    """
    out: dict[str, int] = {}
    for item in items:
        out.update(item)
    return out


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """``--devices N`` and the machine, ``--cluster FILE`` or ``--preset NAME`` (one of them), as plan and evaluate take them.

    :func:`opsched.cost.cluster.resolve_cluster` turns the three into a cluster.
    """
    parser.add_argument("--devices", type=device_count, metavar="N",
                        help=f"number of devices, at most {MAX_DEVICES:,} (default: the cluster file's)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--cluster", metavar="FILE", help="cluster description, .json or .toml (see docs/cost-model.md)")
    source.add_argument("--preset", metavar="NAME",
                        help="named cluster: " + ", ".join(f"{name} (default)" if name == DEFAULT_PRESET else name
                                                           for name in PRESETS)
                             + " (docs/cost-model.md lists each one's figures and sources)")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` as evaluate and plan take it: the compute precision the cost model prices (peak FLOP/s per dtype;
    FP8 runs its GEMMs in FP8 and attention in BF16, :func:`opsched.cost.cluster.attention_dtype`)."""
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPE_BYTES),
                        help="compute dtype: the peak FLOP/s the cost model and MFU use; fp8 runs the GEMMs in FP8 "
                             "and attention in BF16, as Transformer Engine's FP8 recipes do (default bf16)")


def add_optimizer_state_argument(parser: argparse.ArgumentParser, auto: bool = False) -> None:
    """``--optimizer-state fp32|bf16`` as evaluate takes it (:data:`opsched.cost.cluster.OPTIMIZER_STATE_BYTES`); with
    ``auto``, plan's ``fp32|bf16|auto`` (default auto: FP32, and BF16 only when nothing fits in FP32)."""
    from opsched.cost.cluster import OPTIMIZER_STATE_BYTES

    parser.add_argument("--optimizer-state", choices=(*OPTIMIZER_STATE_BYTES, *(("auto",) if auto else ())),
                        default="auto" if auto else "fp32",
                        help="precision of Adam's state: fp32 an FP32 master weight and moments, 12 bytes "
                             "per parameter; bf16 BF16 moments and the master weight as the 16 bits FP32 adds to "
                             "the BF16 weight, 6 bytes (Megatron-Core's --use-precision-aware-optimizer)"
                             + ("; auto (default) fp32, and bf16 only when nothing fits in fp32 (the plan's "
                                "warnings say so)" if auto else " (default fp32)"))
