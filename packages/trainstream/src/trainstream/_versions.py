"""What is installed: trainstream's version and its cores' (``trainstream --version``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import torch

DISTRIBUTIONS = ("trainstream", "ts-pinned", "ts-adamw", "ts-quant", "ts-planner", "ts-kvcache", "ts-peer")


def installed_versions() -> str:
    """One line per distribution, then torch's."""
    lines = []
    for name in DISTRIBUTIONS:
        try:
            lines.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            lines.append(f"{name} (not installed as a distribution)")
    return "\n".join([*lines, f"torch {torch.__version__}"])
