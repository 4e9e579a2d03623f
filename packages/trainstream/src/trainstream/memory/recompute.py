"""Recompute: a block's activations are not kept but recomputed in backward (non-reentrant
checkpointing, RNG state restored so dropout recomputes bit for bit).

The block's ``forward`` is replaced by an instance attribute that runs the original under
``torch.utils.checkpoint``; removing it restores what was there. A copy of the model
(``copy.deepcopy``, ``torch.save``) gets the plain forward back.
"""

from __future__ import annotations

import types

import torch
import torch.utils.checkpoint

__all__ = ["Recompute", "uses_hf_checkpointing"]

_MISSING = object()


def _plain_forward(block: torch.nn.Module):
    return types.MethodType(type(block).forward, block)


class Recompute:
    """Installed as ``block.forward``: checkpoints the original forward when gradients are on."""

    def __init__(self, block: torch.nn.Module):
        self.block = block
        self.previous = block.__dict__.get("forward", _MISSING)
        self.original = self.previous if self.previous is not _MISSING else _plain_forward(block)
        self.calls = 0
        self.enabled = True  # the automatic policy switches blocks between steps

    def __call__(self, *args, **kwargs):
        if not self.enabled or not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        self.calls += 1
        return torch.utils.checkpoint.checkpoint(self.original, *args, use_reentrant=False,
                                                 preserve_rng_state=True, **kwargs)

    def install(self) -> Recompute:
        self.block.forward = self
        return self

    def remove(self) -> None:
        if self.block.__dict__.get("forward") is self:
            if self.previous is _MISSING:
                del self.block.forward
            else:
                self.block.forward = self.previous

    def __reduce__(self):  # copies of the model run the plain forward
        return (_plain_forward, (self.block,))


def uses_hf_checkpointing(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> bool:
    """True when Hugging Face gradient checkpointing is on (``gradient_checkpointing_enable()``)."""
    if getattr(model, "is_gradient_checkpointing", False) is True:
        return True
    return any(getattr(b, "gradient_checkpointing", False) is True for b in blocks)
