"""Byte sizes written as integers or with a K / M / G / T suffix."""

from __future__ import annotations

import math

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_MAX_BYTES = 1 << 62  # beyond any host; keeps every later sum inside 64 bits


def _bad(what: str, value: object) -> ValueError:
    return ValueError(f"{what}={value!r} is not a size; write bytes or a number with K, M, G or T (e.g. 1G, 512M)")


def parse_bytes(value: int | str, what: str) -> int:
    """Bytes from an int or a string like ``"512M"`` / ``"1.5G"`` / ``"64k"`` (powers of 1024;
    a trailing ``B`` / ``iB`` is accepted). Fractions of a byte are dropped."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a byte count, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, (str, float)):
        text = str(value).strip().upper()
        if text.endswith("IB"):
            text = text[:-2]
        elif text.endswith("B"):
            text = text[:-1]
        suffix = text[-1] if text and text[-1] in _SUFFIXES else ""
        number = text[: len(text) - len(suffix)].strip()
        try:
            size = int(number) * _SUFFIXES[suffix]  # exact for whole numbers
        except ValueError:
            try:
                real = float(number)
            except ValueError:
                raise _bad(what, value) from None
            if not math.isfinite(real):
                raise _bad(what, value) from None
            size = int(real * _SUFFIXES[suffix])
    else:
        raise ValueError(f"{what} must be an int or a string like '512M', got {type(value).__name__}")
    if size < 0:
        raise ValueError(f"{what} must not be negative, got {value!r}")
    if size > _MAX_BYTES:
        raise ValueError(f"{what}={value!r} is larger than any host can hold")
    return size
