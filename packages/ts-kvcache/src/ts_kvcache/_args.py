"""Argument checks shared by PagedKVCache and the adapters: each error names the
argument, what it got and what it accepts."""

from __future__ import annotations

import operator

__all__ = ["check_fraction", "check_int", "check_resident"]


def check_int(value: object, what: str, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int in [minimum, maximum]; bools and floats are refused."""
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r} must be an integer >= {minimum}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{what}={value!r} must be an integer >= {minimum}") from None
    if number < minimum or (maximum is not None and number > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{what}={value!r} must be an integer {bound}")
    return number


def check_fraction(value: object, what: str) -> float:
    """A float in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what}={value!r} must be a number in (0, 1]")
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise ValueError(f"{what}={value!r} must be a number in (0, 1]")
    return number


def check_resident(value: object, num_layers: int) -> list[int] | None:
    """``resident_layers`` as a sorted list of layer indices, or ``None`` for ``"auto"``.

    An integer n keeps n layers resident and spreads the offloaded ones through the stack.
    """
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f'resident_layers={value!r} is not valid; use "auto", an integer or a list of layers')
        return None
    if isinstance(value, (list, tuple, set, frozenset, range)):
        layers = [check_int(v, "resident_layers entry", 0, num_layers - 1) for v in value]
        if len(set(layers)) != len(layers):
            raise ValueError(f"resident_layers={value!r} names a layer twice")
        return sorted(layers)
    try:
        count = check_int(value, "resident_layers", 0, num_layers)
    except ValueError:
        raise ValueError(
            f'resident_layers={value!r} is not valid; use "auto", an integer from 0 to {num_layers} '
            f"or a list of layer indices below {num_layers}"
        ) from None
    offloaded = set(spread(num_layers, num_layers - count))
    return [i for i in range(num_layers) if i not in offloaded]


def spread(num_layers: int, count: int) -> list[int]:
    """``count`` layer indices spread evenly through ``num_layers`` (centred in equal
    shares), so resident layers run between offloaded ones while their pages arrive."""
    return [int((i + 0.5) * num_layers / count) for i in range(count)]
