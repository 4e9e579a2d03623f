"""Plain-PyTorch references the tests hold the native code and the cache to."""

from __future__ import annotations

import torch

__all__ = ["ConcatCache", "copy_pages_reference"]


class ConcatCache:
    """The KV cache every paged result must equal: ``torch.cat`` along the tokens."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:
            keys, values = k.clone(), v.clone()
        else:
            keys, values = torch.cat([keys, k], dim=-2), torch.cat([values, v], dim=-2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def seq_length(self, layer: int = 0) -> int:
        keys = self.keys[layer]
        return 0 if keys is None else keys.shape[-2]


def copy_pages_reference(
    pages: list[torch.Tensor],
    slot: torch.Tensor,
    page_tokens: int,
    first_page: int,
    to_pages: bool,
    offset: int = 0,
    tokens: int | None = None,
) -> None:
    """What ``ts_kvcache._native.copy_pages`` does, with tensor slicing: each page (raw bytes)
    is ``[2, batch, kv_heads, page_tokens, head_dim]`` of the slot's tokens
    ``[(first_page + i) * page_tokens, ...)``; tokens ``offset .. offset + tokens`` of each move."""
    two, batch, heads, _capacity, head_dim = slot.shape
    stop = page_tokens if tokens is None else offset + tokens
    for i, raw in enumerate(pages):
        page = raw.view(slot.dtype).view(two, batch, heads, page_tokens, head_dim)[:, :, :, offset:stop]
        start = (first_page + i) * page_tokens
        window = slot[:, :, :, start + offset : start + stop]
        if to_pages:
            page.copy_(window)
        else:
            window.copy_(page)
