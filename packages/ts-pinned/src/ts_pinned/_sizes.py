"""Byte sizes written as integers or with a K / M / G suffix."""

from __future__ import annotations

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(value: int | str, what: str) -> int:
    """Bytes from an int or a string like ``"512M"`` / ``"1G"`` (powers of 1024)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a byte count, got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        text = str(value).strip().upper().removesuffix("B").removesuffix("I")
        suffix = text[-1] if text and text[-1] in _SUFFIXES else ""
        number = text[: len(text) - len(suffix)].strip()
        try:
            size = int(float(number) * _SUFFIXES[suffix])
        except ValueError:
            raise ValueError(
                f"{what}={value!r} is not a size; write bytes or a number with K, M or G (e.g. 1G)"
            ) from None
    if size < 0:
        raise ValueError(f"{what} must not be negative, got {value!r}")
    return size
