"""Numbers as a person reads them: times, memory sizes and counts, each with a unit chosen for its size.

The one home of these rules. report.md, the ``plan`` summary and progress
lines, error messages about memory, and every Gantt timeline format (title,
axis, hover text, tables) format through here, so a time or a size reads the
same everywhere and never as ``2.52613e+10`` or ``0.0 GiB``.

* Times (seconds in) get µs, ms or s, whichever puts the figure at 1 or more
  and below 1000 (s from 1 s up: a 90 s step reads ``90 s``).
* Memory (bytes in) gets B, KiB, MiB, GiB or TiB the same way. The units are
  binary, like the ``--memory-limit 80GiB`` opsched asks for, so a report's
  limit and its peaks compare at a glance.
* Figures keep 4 significant digits for times and 3 for sizes, never in
  exponent notation.

A table picks one unit per column (:func:`time_unit`, :func:`size_unit` of
its largest value) so its rows compare digit by digit.

>>> seconds_text(3.541e-05), seconds_text(0.7422), seconds_text(119.4)
('35.41 µs', '742.2 ms', '119.4 s')
>>> bytes_text(2.52613e10), bytes_text(5e6), bytes_text(0)
('23.5 GiB', '4.77 MiB', '0 B')
>>> plural(1, "stage"), plural(8, "stage"), plural(2, "sample", "samples")
('1 stage', '8 stages', '2 samples')
>>> si_text(46.7e9), si_text(2.4e12, "FLOP")
('46.7 G', '2.4 TFLOP')
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: time units, largest first: (name, seconds per unit)
TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6))
#: memory units, largest first: (name, bytes per unit)
SIZE_UNITS = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10), ("B", 1.0))
#: significant digits of a time and of a memory size
TIME_DIGITS = 4
SIZE_DIGITS = 3


def plain(x: float, digits: int = 4) -> str:
    """``x`` to ``digits`` significant digits, without exponent or trailing zeros.

    Figures of more integer digits than that are rounded to a whole number
    with thousands separators; non-finite ones print as Python does.

    >>> plain(0.74219), plain(20.20), plain(3.0), plain(21534.2), plain(-0.000012345)
    ('0.7422', '20.2', '3', '21,534', '-0.00001234')
    >>> plain(0.0), plain(999.96), plain(float("inf"))
    ('0', '1,000', 'inf')
    """
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) < 10 ** (digits - 1):
        x = float(f"{x:.{digits}g}")  # round first, so 999.96 at 4 digits is 1,000 and not 1000.0
    exponent = math.floor(math.log10(abs(x))) if x else 0
    if exponent >= digits - 1:
        return f"{round(x):,}"
    decimals = digits - 1 - exponent
    text = f"{x:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


@dataclass(frozen=True)
class Unit:
    """A unit and how many base units (seconds, bytes) it holds; :meth:`number` writes a figure in it."""

    name: str
    size: float
    digits: int

    def number(self, x: float) -> str:
        """``x`` (in base units) as a figure in this unit, without the unit's name.

        >>> time_unit(0.5).number(0.0123)
        '12.3'
        """
        return plain(x / self.size, self.digits)

    def text(self, x: float) -> str:
        """``x`` (in base units) as a figure and this unit's name.

        >>> size_unit(2**30).text(3 * 2**29)
        '1.5 GiB'
        """
        return f"{self.number(x)} {self.name}"


def _pick(x: float, units: tuple[tuple[str, float], ...], digits: int) -> Unit:
    """The largest unit in which ``x`` reads as 1 or more (after rounding to ``digits``), else the smallest."""
    if not math.isfinite(x) or x == 0:
        name, size = next((n, s) for n, s in units if s == 1.0)  # zero and inf read best in the base unit
        return Unit(name, size, digits)
    for name, size in units:
        # judged on the figure as printed, so 999.96 ms (1.000 s at 4 digits) reads as 1 s
        if abs(float(f"{x / size:.{digits}g}")) >= 1:
            return Unit(name, size, digits)
    name, size = units[-1]
    return Unit(name, size, digits)


def time_unit(seconds: float) -> Unit:
    """The unit a time of ``seconds`` reads best in: µs, ms or s.

    >>> time_unit(0.0009999).name, time_unit(0.00099999).name, time_unit(0.99996).name, time_unit(3600).name
    ('µs', 'ms', 's', 's')
    """
    return _pick(seconds, TIME_UNITS, TIME_DIGITS)


def size_unit(num_bytes: float) -> Unit:
    """The unit a memory size of ``num_bytes`` reads best in: B, KiB, MiB, GiB or TiB.

    >>> size_unit(80e9).name, size_unit(5e6).name, size_unit(12).name
    ('GiB', 'MiB', 'B')
    """
    return _pick(num_bytes, SIZE_UNITS, SIZE_DIGITS)


def seconds_text(seconds: float) -> str:
    """A time with its unit, e.g. ``742.2 ms`` (see the module docstring)."""
    return time_unit(seconds).text(seconds)


def bytes_text(num_bytes: float) -> str:
    """A memory size with its unit, e.g. ``74.5 GiB`` (see the module docstring)."""
    return size_unit(num_bytes).text(num_bytes)


def column_time_unit(values) -> Unit:
    """One time unit for a table column: the one its largest value reads best in (``None`` entries skipped).

    >>> u = column_time_unit([0.7422, 21.53, None])
    >>> u.name, u.number(0.7422)
    ('s', '0.7422')
    """
    return time_unit(max((abs(v) for v in values if v is not None), default=0.0))


def column_size_unit(values) -> Unit:
    """One memory unit for a table column: the one its largest value reads best in (``None`` entries skipped).

    >>> column_size_unit([5e6, 3e8]).name
    'MiB'
    """
    return size_unit(max((abs(v) for v in values if v is not None), default=0.0))


#: decimal prefixes of counts and FLOPs, largest first
SI_PREFIXES = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def si_text(x: float, unit: str = "") -> str:
    """A count (parameters, FLOPs) with a decimal prefix and 3 significant digits, e.g. ``46.7 G``.

    >>> si_text(999), si_text(1000, "FLOP"), si_text(0)
    ('999', '1 kFLOP', '0')
    """
    for prefix, size in SI_PREFIXES:
        if abs(float(f"{x / size:.3g}")) >= 1:
            return f"{plain(x / size, 3)} {prefix}{unit}"
    return f"{plain(x, 3)} {unit}".rstrip()


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and the noun, singular for exactly one (``nouns`` when the plural is not noun + s)."""
    return f"{count:,} {noun if count == 1 else (nouns or noun + 's')}"


def ranges_text(numbers) -> str:
    """Whole numbers in a line, runs of consecutive ones as ranges.

    >>> ranges_text([0, 1, 2, 5, 7, 8])
    '0-2, 5, 7-8'
    """
    runs: list[list[int]] = []  # [first, last] of each run
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
