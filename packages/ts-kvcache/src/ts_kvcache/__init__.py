"""A paged KV cache for generation during training: resident layers keep their keys and
values in VRAM, offloaded layers keep them in page-locked host pages (ts-pinned) that are
copied into a device slot on a copy stream while earlier layers run."""

from ._cache import PagedKVCache
from ._pool import HostPagePool

__all__ = ["HostPagePool", "PagedKVCache"]
__version__ = "0.7.0"
