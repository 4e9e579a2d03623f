"""One way to print and read sizes, rates and times: bytes in binary units (GiB, as every figure trainstream
prints), rates per second, times in the unit that keeps them readable.

``fmt_bytes(1.5 * 2**30) -> "1.50 GiB"``, ``fmt_rate(2.5e9) -> "2.33 GiB/s"``, ``fmt_seconds(0.0123) -> "12.3 ms"``,
``parse_size("24GB") -> 24_000_000_000``, ``parse_size("22.35") -> 22.35 GiB in bytes`` (a bare number is GiB).
"""

from __future__ import annotations

import math
import re

__all__ = ["GiB", "MiB", "fmt_bytes", "fmt_rate", "fmt_seconds", "parse_size"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
_BINARY = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
# Every spelling parse_size reads, lower-cased: binary (KiB, and the bare K / M / G / T that
# TRAINSTREAM_HOST_ARENA_SLAB takes) and decimal (KB, MB, GB, TB: 10**3 steps, as disks and cards are sold).
_SCALE = {"b": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB, "t": TiB, "tib": TiB,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def _figures(value: float, digits: int | None) -> str:
    """`value` with `digits` decimals, or (None) three significant figures: 1.50, 23.9, 368."""
    if digits is None:
        digits = 2 if abs(value) < 9.995 else 1 if abs(value) < 99.95 else 0
    return f"{value:.{digits}f}"


def fmt_bytes(n: float, unit: str | None = None, digits: int | None = None) -> str:
    """``n`` bytes as text: ``"1.50 GiB"``, ``"10.2 MiB"``, ``"368 GiB"``. ``unit``: "B", "KiB", "MiB", "GiB" or
    "TiB" (None: the largest binary unit that keeps the value at least 1; whole bytes below 1 KiB); give one to
    compare figures in one unit. ``digits``: decimals (None: three significant figures)."""
    if unit is None:
        unit = next((name for name, size in _BINARY if abs(n) >= size), "B")
        if unit == "B":
            return f"{n:.0f} B"
        bigger = {"KiB": "MiB", "MiB": "GiB", "GiB": "TiB"}.get(unit)
        if bigger and digits is None and round(abs(n) / dict(_BINARY)[unit]) >= 1024:
            unit = bigger  # 1023.7 MiB reads 1.00 GiB, not 1024 MiB
    scale = 1 if unit == "B" else dict(_BINARY).get(unit)
    if scale is None:
        raise ValueError(f"unit={unit!r}: use B, KiB, MiB, GiB or TiB")
    return f"{_figures(n / scale, digits)} {unit}"


def fmt_rate(bytes_per_s: float, unit: str | None = None, digits: int | None = None) -> str:
    """A rate in bytes per second: ``"2.33 GiB/s"`` (``unit`` and ``digits`` as fmt_bytes')."""
    return fmt_bytes(bytes_per_s, unit, digits) + "/s"


def fmt_seconds(s: float, digits: int = 1) -> str:
    """Seconds as text, in the unit that keeps them readable: ``"850 us"``, ``"12.3 ms"``, ``"4.2 s"``,
    ``"3 min 20 s"``. ``digits``: decimals of the ms and s forms."""
    if not math.isfinite(s):
        return f"{s} s"
    if abs(s) >= 120:
        minutes, rest = divmod(round(s), 60)
        return f"{minutes} min {rest} s"
    if abs(s) >= 1:
        return f"{s:.{digits}f} s"
    if abs(s) >= 1e-3 or s == 0:
        return f"{s * 1e3:.{digits}f} ms"
    return f"{s * 1e6:.0f} us"


def parse_size(text: str, default_unit: str = "GiB") -> int:
    """Bytes from a size: a number with an optional unit, upper or lower case, a space or none between:
    ``"24GB"`` (10**9 bytes each), ``"22.35 GiB"``, ``"512M"`` (binary, as ``MiB``), ``"1e3 B"``. A bare
    number is in ``default_unit``. ValueError for anything else (negative numbers, nan, unknown units)."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a size: give a number with an optional unit (24, 24GiB, 24GB, 512MiB)")
    number, unit = match.groups()
    scale = _SCALE.get((unit or default_unit).lower())
    if scale is None:
        raise ValueError(f"{text!r}: unknown unit {unit!r}; use B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB")
    value = float(number) * scale
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is too large")
    return round(value)
