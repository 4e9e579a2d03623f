"""PyTorch's CUDA caching allocator, set so the plan's numbers hold: expandable segments.

The plan and the activation tuner count allocated bytes. With the allocator's default fixed-size
segments, memory freed inside a partly used segment serves only requests that fit in it: a full
fine-tune under a VRAM cap ran out of memory asking for its fp32 logits while more than that was
reserved but unallocated (measured: docs/benchmarks.md).
Expandable segments map physical pages into segments that grow, so freed memory serves any size.

The setting is process-wide and applies to segments made after it; it is switched once, at the first
wrap() of a model on a GPU, and stays (unwrap() leaves it: other models may rely on it). A user who
set PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) with expandable_segments keeps that choice.
"""

from __future__ import annotations

import os

import torch

__all__ = ["ALLOCATOR_ENV", "use_expandable_segments"]

ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_switched = [False]  # this process switched the setting (once)


def _setter():
    """torch's run-time allocator switch: the accelerator-generic one (2.9+), else the CUDA one."""
    return getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        getattr(torch.cuda.memory, "_set_allocator_settings", None)


def use_expandable_segments(device: torch.device) -> str | None:
    """Turns expandable segments on for a model trained on `device` (a CUDA device); returns the
    event text (None: nothing to say, e.g. on the CPU or when already switched)."""
    if device.type != "cuda" or _switched[0]:
        return None
    for name in ALLOCATOR_ENV:
        if "expandable_segments" in os.environ.get(name, ""):
            return f"allocator: {name}={os.environ[name]!r} sets expandable segments; left as set"
    setter = _setter()
    if setter is None:
        return ("allocator: this torch cannot switch expandable segments at run time; freed VRAM may not serve "
                "larger requests (fragmentation): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    try:
        setter("expandable_segments:True")
    except (RuntimeError, ValueError) as error:  # a platform without them (torch refuses the key)
        _switched[0] = True  # asked once; the answer will not change
        return f"allocator: expandable segments not available here ({error}); PyTorch's default segments stay"
    _switched[0] = True
    return ("allocator: expandable segments on (process-wide), so VRAM freed inside a segment serves requests "
            "of any size and the plan's counts hold; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False "
            "keeps PyTorch's default")
