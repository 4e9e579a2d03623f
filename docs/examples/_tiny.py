"""Shared by the examples: a random-init decoder (no download) or a Hub model, and byte-level batches."""

from __future__ import annotations

import torch


def load_model(name: str | None, dtype: torch.dtype):
    """A Hub causal LM when `name` is given, else trainstream's built-in tiny Qwen2 shape."""
    if name:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    from trainstream.cli import build_model

    return build_model("tiny", dtype)


def batches(steps: int, batch: int, seq: int, seed: int = 0):
    from trainstream._demo_text import byte_batches

    return byte_batches(batch, seq, steps, seed)
