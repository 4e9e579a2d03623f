"""A block's forward compiled on its own (``torch.compile`` of the forward, not of the module's call), so
what wraps it stays eager: the block's hooks (activation paging enters saved-tensor hooks from them) and
a recompute wrapper's checkpoint. Used by ``compile_blocks`` (``_compile.py``) and ``Recompute.compile``.
"""

from __future__ import annotations

import types

import torch

__all__ = ["CompiledForward", "plain_forward", "runs_compiled"]


def plain_forward(block: torch.nn.Module):
    return types.MethodType(type(block).forward, block)


def runs_compiled() -> bool:
    """Whether a block's compiled forward runs now. Not under a TorchFunctionMode (the attention chooser
    watches a new input signature's first forward through one): the graph traced under it would differ
    from the one traced without it, and a recomputation in backward (traced without it) would save other
    tensors than the forward did, which checkpoint refuses. The eager forward saves the same either way."""
    return not torch._C._is_torch_function_mode_enabled()


class CompiledForward:
    """``forward`` of ``block`` compiled with ``options``; it runs eagerly where ``runs_compiled()`` says
    no. Copies of the block (``copy.deepcopy``, ``torch.save``) get the plain forward."""

    def __init__(self, block: torch.nn.Module, forward, options: dict):
        self.block, self.original, self.options = block, forward, options
        self.compiled = torch.compile(forward, **options)

    def now(self):
        """The function to run for a call starting now. A checkpoint must recompute with the one its forward
        ran (chosen again inside backward, with no mode there, the graphs would differ)."""
        return self.compiled if runs_compiled() else self.original

    def __call__(self, *args, **kwargs):
        return self.now()(*args, **kwargs)

    def __reduce__(self):
        return (plain_forward, (self.block,))
