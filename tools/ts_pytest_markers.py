"""pytest plugin shared by every package's tests: skips `cuda` / `multigpu`
tests where the hardware is missing, so one command runs everywhere."""

from __future__ import annotations

import pytest


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    devices = _cuda_devices()
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    one_gpu = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        if "cuda" in item.keywords and devices == 0:
            item.add_marker(no_gpu)
        if "multigpu" in item.keywords and devices < 2:
            item.add_marker(one_gpu)
