"""Shared helpers for the ts-pinned tests, as fixtures (with --import-mode=importlib
test modules cannot import conftest)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch


def random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor (bit-exact comparisons, NaN-safe)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def run_python(code: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (for process-wide state: the staging ring,
    the default arena, exit behaviour); fails the test on a non-zero exit."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        pytest.fail(f"subprocess failed ({proc.returncode}):\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


class Helpers:
    random_bytes = staticmethod(random_bytes)
    as_bytes = staticmethod(as_bytes)
    run_python = staticmethod(run_python)


@pytest.fixture
def helpers() -> type[Helpers]:
    return Helpers
