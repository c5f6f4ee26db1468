"""opsched.units: every time and memory size a user reads (issue 15 item 3)."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opsched.units import SIZE_UNITS, TIME_UNITS, bytes_text, plain, plural, seconds_text

TIMES = st.floats(min_value=1e-9, max_value=1e6, allow_nan=False, allow_infinity=False)
SIZES = st.floats(min_value=1.0, max_value=1e15, allow_nan=False, allow_infinity=False)
SCALE = {name: size for name, size in TIME_UNITS + SIZE_UNITS}


def _read_back(text: str) -> tuple[float, str, float]:
    """(figure, unit, value in base units) of a ``seconds_text`` / ``bytes_text`` string."""
    figure, unit = text.split(" ")
    value = float(figure.replace(",", ""))
    return value, unit, value * SCALE[unit]


@given(TIMES)
def test_a_time_reads_between_1_and_1000_of_its_unit_and_means_the_same(seconds):
    text = seconds_text(seconds)
    assert "e" not in text.split(" ")[0], text
    figure, unit, back = _read_back(text)
    assert 1 <= figure < 1000 or unit in ("s", "µs"), text
    assert back == pytest.approx(seconds, rel=1e-3), text


@given(SIZES)
def test_a_size_reads_between_1_and_1024_of_its_unit_and_means_the_same(num_bytes):
    text = bytes_text(num_bytes)
    assert "e" not in text.split(" ")[0], text
    figure, unit, back = _read_back(text)
    assert 1 <= figure < 1024 or unit in ("TiB", "B"), text
    assert back == pytest.approx(num_bytes, rel=1e-2), text


@pytest.mark.parametrize("num_bytes", [1.0, 5e5, 2**20 - 1, 3e7])
def test_a_small_nonzero_size_is_never_zero_gib(num_bytes):
    assert not re.match(r"0(\.0*)? ", bytes_text(num_bytes))


@given(st.floats(allow_nan=False, allow_infinity=False), st.integers(min_value=1, max_value=6))
def test_plain_never_writes_an_exponent(x, digits):
    assert "e" not in plain(x, digits)


def test_plural():
    assert plural(0, "stage") == "0 stages" and plural(1, "stage") == "1 stage" and plural(1200, "device") == "1,200 devices"
