"""A streamed block's weights, as the WeightStreamer (``weights.py``) packs them: which tensors of a block
stream (its frozen weights, ts-quant codes as stored, and its trained weights where they are most of its
bytes), and where each sits in the block's one flat host / device buffer."""

from __future__ import annotations

import torch

__all__ = ["StreamedBlock", "align", "frozen_params_of", "nbytes_of", "quantized_tensors", "streams_trained",
           "tensors_in", "trained_params_of", "view_in"]


def tensors_in(value, depth: int = 0):
    """The tensors in a module's output (nested tuples, lists and dicts, two levels deep)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)) and depth < 2:
        for v in value:
            yield from tensors_in(v, depth + 1)
    elif isinstance(value, dict) and depth < 2:
        for v in value.values():
            yield from tensors_in(v, depth + 1)

_ALIGN = 256  # bytes: each parameter's view starts aligned for vectorized kernels


def align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def view_in(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of flat uint8 `buffer` from `offset` seen as a tensor of `like`'s dtype and shape."""
    n = like.numel() * like.element_size()
    return buffer[offset:offset + n].view(like.dtype).view(like.shape)


def quantized_tensors(q, prefix: str):
    """(name, tensor) of every tensor a ts-quant QuantizedTensor holds (codes, scales, nested scales)."""
    return q.named_tensors(f"{prefix}.")


def frozen_params_of(block: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(owner module, name, tensor) of each frozen weight of `block`, each once: frozen parameters,
    and the codes and scales of ts-quant ``QuantLinear`` weights (``qweight``), which stream as stored.
    The owner module is the one that holds the tensor (``load_state_dict`` and ``after_load`` find it there)."""
    from ts_quant import QuantizedTensor

    seen, out = set(), []
    for module in block.modules():
        for name, p in module.named_parameters(recurse=False):
            if p is not None and not p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((module, name, p))
        q = module.__dict__.get("qweight")
        if isinstance(q, QuantizedTensor):
            for name, t in quantized_tensors(q, "qweight"):
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append((module, name, t))
    return out


def trained_params_of(block: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(owner module, name, parameter) of each trained parameter of `block`, each once."""
    seen, out = set(), []
    for module in block.modules():
        for name, p in module.named_parameters(recurse=False):
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((module, name, p))
    return out


def nbytes_of(params) -> int:
    return sum(t.numel() * t.element_size() for _m, _n, t in params)


def streams_trained(block: torch.nn.Module, trained: bool | None) -> bool:
    """Whether a streamed block's trained weights stream with it: `trained`, or (None) when they are most
    of its bytes, as in a full fine-tune (small adapters stay in VRAM, their updates fused on the GPU)."""
    if trained is not None:
        return trained and bool(trained_params_of(block))
    mine = trained_params_of(block)
    return bool(mine) and nbytes_of(mine) >= nbytes_of(frozen_params_of(block))


class StreamedBlock:
    __slots__ = ("device", "host", "index", "nbytes", "offsets", "params", "pinned", "ready", "slots", "trained",
                 "used", "versions")

    def __init__(self, index: int, params, trained: int = 0):
        self.index = index
        self.params = params  # [(module, name, param)]: the frozen ones, then the `trained` last ones
        self.trained = trained
        self.slots = []  # the engine's slots of the trained weights (bind_updates)
        self.versions = []  # the trained weights' versions when fetched (invariant 5: edits while resident)
        self.offsets, offset = [], 0
        for _m, _n, p in params:
            self.offsets.append(offset)
            offset += align(p.numel() * p.element_size())
        self.nbytes = offset
        self.host = None  # flat uint8 host buffer
        self.pinned = False  # whether `host` is page-locked (else it streams through the staging ring)
        self.device = None  # flat uint8 device buffer; storage size 0 when not resident
        self.ready = None  # event after its copy
        self.used = False  # handed to the compute stream since the fetch

    @property
    def trained_params(self):
        """(module, name, param) of the trained weights streaming with the block (the last `trained`)."""
        return self.params[len(self.params) - self.trained:]

    @property
    def trained_offsets(self) -> list[int]:
        return self.offsets[len(self.params) - self.trained:]
