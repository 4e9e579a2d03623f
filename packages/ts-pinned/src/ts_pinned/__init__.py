"""Page-locked host memory for PyTorch: slab arena, tagged blocks, stats, staging ring,
stream memory operations (a device counter one stream writes and another waits on), and row
lookups the GPU makes straight from a page-locked host table."""

from ._arena import PinnedArena, default_arena, empty, pinned_stats, reserve_pinned
from ._budget import PageLockBudget, page_lock_budget
from ._gather import gather_rows
from ._staging import copy_to_device, staging_stats

__all__ = [
    "PageLockBudget",
    "PinnedArena",
    "copy_to_device",
    "default_arena",
    "empty",
    "gather_rows",
    "page_lock_budget",
    "pinned_stats",
    "reserve_pinned",
    "staging_stats",
]
__version__ = "0.7.0"
