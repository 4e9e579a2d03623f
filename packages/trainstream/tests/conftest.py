"""Makes ts_testing (the shared builders beside this file) importable under
pytest's importlib import mode; the fixtures tests share."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))


@pytest.fixture
def fresh_dynamo():
    """A test that compiles starts and ends with dynamo reset and its counters cleared: each test counts its
    own graphs and breaks (reset() keeps the counters), and later wraps in the process see nothing compiled
    (engine/guard.py)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
