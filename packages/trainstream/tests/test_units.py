"""trainstream._units: one formatter for sizes, rates and times, and the size parser the command's flags use."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trainstream._units import GiB, MiB, fmt_bytes, fmt_rate, fmt_seconds, parse_size

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1.5 * GiB, "1.50 GiB"), (10.24 * MiB, "10.2 MiB"),
    (368.2 * GiB, "368 GiB"), (1023.7 * MiB, "1.00 GiB"), (3 << 40, "3.00 TiB")])
def test_fmt_bytes_picks_the_unit_and_three_figures(n, text):
    assert fmt_bytes(n) == text


def test_fmt_bytes_in_a_given_unit_rates_and_times():
    assert fmt_bytes(3 << 30, "GiB") == "3.00 GiB" and fmt_bytes(0.01 * GiB, "GiB", 2) == "0.01 GiB"
    assert fmt_bytes(1.55 * GiB, "GiB", 1) == "1.6 GiB"
    with pytest.raises(ValueError, match="unit='GB'"):
        fmt_bytes(1, "GB")
    assert fmt_rate(2.5e9) == "2.33 GiB/s" and fmt_rate(GiB, "MiB", 0) == "1024 MiB/s"
    assert [fmt_seconds(s) for s in (0.0000123, 0.0123, 0.8e-3, 4.5, 200)] == [
        "12 us", "12.3 ms", "800 us", "4.5 s", "3 min 20 s"]


@pytest.mark.parametrize(("text", "n"), [
    ("24", 24 * GiB), ("24GiB", 24 * GiB), ("24 GiB", 24 * GiB), ("24gib", 24 * GiB), ("24G", 24 * GiB),
    ("24GB", 24 * 10**9), ("24 gb", 24 * 10**9), ("22.35GiB", round(22.35 * GiB)), ("512M", 512 * MiB),
    ("512MiB", 512 * MiB), ("1.5TB", 15 * 10**11), ("1e3 B", 1000), (" 2 ", 2 * GiB)])
def test_parse_size_reads_binary_and_decimal_units_and_a_bare_number_as_gib(text, n):
    assert parse_size(text) == n


def test_parse_size_takes_another_default_unit():
    assert parse_size("512", default_unit="MiB") == 512 * MiB and parse_size("7", default_unit="B") == 7


@pytest.mark.parametrize("text", ["", "-5", "nan", "inf", "24 XB", "GiB", "1,5GiB", "2 4", "1e400"])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError):
        parse_size(text)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 50))
def test_what_fmt_bytes_prints_parses_back_within_its_rounding(n):
    """Three significant figures: the text is within half a unit of its last figure of n (below 1 KiB: exact)."""
    text = fmt_bytes(n)
    back = parse_size(text.replace(" ", ""), default_unit="B")
    assert back == n if n < 1024 else abs(back - n) <= 0.005 * n + 1, (n, text, back)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 50), st.sampled_from(sorted(UNITS)), st.integers(0, 4))
def test_a_fixed_unit_and_digits_parse_back_within_half_a_last_digit(n, unit, digits):
    text = fmt_bytes(n, unit, digits)
    assert text.endswith(" " + unit)
    back = parse_size(text)
    step = UNITS[unit] / 10 ** (0 if unit == "B" else digits)
    assert abs(back - n) <= step / 2 + 1, (n, text, back)


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0, max_value=1e6, allow_nan=False), st.sampled_from(["", "B", "KiB", "MiB", "GiB", "TiB",
                                                                                  "KB", "MB", "GB", "TB", "K", "G"]),
       st.sampled_from(["", " "]))
def test_a_number_and_unit_parse_to_its_bytes(value, unit, space):
    scale = {"": GiB, "K": 1 << 10, "G": GiB, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, **UNITS}[unit]
    text = f"{value!r}{space}{unit}"
    assert parse_size(text) == round(value * scale)
    assert parse_size(text.lower()) == parse_size(text.upper())


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=1e-7, max_value=1e5, allow_nan=False))
def test_fmt_seconds_stays_within_its_rounding(s):
    text = fmt_seconds(s)
    if "min" in text:
        minutes, _, rest, _ = text.split()
        assert abs(int(minutes) * 60 + int(rest) - s) <= 0.5 + 1e-9
        return
    number, unit = text.split()
    scale = {"s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    assert math.isclose(float(number) * scale, s, rel_tol=0, abs_tol=(0.5 if unit == "us" else 0.05) * scale * (1 + 1e-9)), (s, text)
