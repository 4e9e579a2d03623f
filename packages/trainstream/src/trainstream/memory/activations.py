"""The activation policy of each block: keep (in VRAM), offload (page to host memory), recompute.

``wrap(activation_offload=..., recompute=...)`` each name a set of blocks (``True``: all, ``False``:
none, a fraction: that share of the blocks, the earliest first (backward reaches them last, so their
pages have the longest to come back), or a list of block indices); a block cannot be in both.
"""

from __future__ import annotations

import numbers

import torch

from .blocks import find_blocks
from .offload import ActivationOffloader
from .recompute import Recompute, uses_hf_checkpointing

__all__ = ["ActivationPolicy", "check_block_choice"]


def check_block_choice(name: str, value):
    """Validates the form of activation_offload= / recompute= (the block count is checked later)."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    if value == "auto":
        raise ValueError(f"{name}='auto' is not available yet (the measuring planner is being built); use True, "
                         f"False, a fraction in [0, 1] or a list of block indices")
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        if 0.0 <= value <= 1.0:
            return float(value)
    elif isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                  for i in value) and len(set(value)) == len(value):
        return list(value)
    raise ValueError(f"{name}={value!r} is not valid; use True, False, a fraction in [0, 1] or a list of distinct "
                     f"block indices >= 0")


def _blocks_of(name: str, value, count: int) -> list[int]:
    if value is True:
        return list(range(count))
    if value is False:
        return []
    if isinstance(value, float):
        return list(range(round(value * count)))
    bad = [i for i in value if i >= count]
    if bad:
        raise ValueError(f"{name}={value!r}: the model has {count} blocks, indices {bad} do not exist")
    return sorted(value)


class ActivationPolicy:
    """Applies the policy to the model's blocks; ``remove()`` undoes it; ``report()`` describes it."""

    def __init__(self, model: torch.nn.Module, options, device: torch.device, arena, events):
        self.blocks = list(options.blocks) if options.blocks is not None else find_blocks(model)
        offload, recompute = options.activation_offload, options.recompute
        wanted = offload is not False or recompute is not False
        if wanted and not self.blocks:
            raise ValueError("activation_offload= / recompute= need the model's repeated blocks, and find_blocks() "
                             "found none: pass blocks=[...]")
        n = len(self.blocks)
        self.offloaded = _blocks_of("activation_offload", offload, n)
        self.recomputed = _blocks_of("recompute", recompute, n)
        both = sorted(set(self.offloaded) & set(self.recomputed))
        if both:
            raise ValueError(f"blocks {both} are asked both to page their activations and to recompute them; "
                             f"give each block one policy")
        if wanted and uses_hf_checkpointing(model, self.blocks):
            raise ValueError("the model has Hugging Face gradient checkpointing on (gradient_checkpointing_enable()) "
                             "and trainstream was asked to page or recompute activations too; use one: "
                             "model.gradient_checkpointing_disable(), or leave activation_offload/recompute False")
        self._recompute: list[Recompute] = []
        self.offloader = None
        self._config, self._use_cache = getattr(model, "config", None), None
        self._events = events
        try:
            if self.recomputed and getattr(self._config, "use_cache", False) is True:
                # A recomputed layer would append its keys and values to the cache a second time.
                self._use_cache, self._config.use_cache = True, False
                events.add("activations", "recompute: the model's KV cache is off while wrapped (use_cache=False), "
                                          "as Hugging Face does for gradient checkpointing")
            for i in self.recomputed:
                self._recompute.append(Recompute(self.blocks[i]).install())
            if self.offloaded:
                self.offloader = ActivationOffloader(self.blocks, self.offloaded, device=device,
                                                     prefetch_depth=options.prefetch_depth,
                                                     max_inflight_bytes=options.max_inflight_bytes,
                                                     min_bytes=options.min_offload_bytes, arena=arena).attach()
        except BaseException:
            self.remove()
            raise
        self.decision = (f"{len(self.offloaded)} of {n} blocks page their activations to host memory, "
                         f"{len(self.recomputed)} recompute them, {n - len(self.offloaded) - len(self.recomputed)} "
                         f"keep them in VRAM (as asked: activation_offload={offload!r}, recompute={recompute!r})")
        if wanted:
            events.add("activations", self.decision)

    def policy(self) -> list[str]:
        kinds = ["keep"] * len(self.blocks)
        for i in self.offloaded:
            kinds[i] = "offload"
        for i in self.recomputed:
            kinds[i] = "recompute"
        return kinds

    def sweep(self) -> None:
        """At each step: frees host pages whose copies are done, and grows the page pool to what the
        step needed (page-locking between steps, not inside them)."""
        if self.offloader is None:
            return
        self.offloader._sweep()
        try:
            grown = self.offloader.grow_pool()
        except MemoryError as error:
            self.offloader.peak_live_bytes = 0
            self._events.add("activations", f"the page pool could not grow ({error}); pages beyond it are "
                                            f"page-locked one by one, or pageable")
            return
        if grown:
            self._events.add("activations", f"reserved {grown / 2**30:.2f} GiB more page-locked memory for "
                                            f"activation pages (the most the last step held at once)")

    def remove(self) -> None:
        for r in self._recompute:
            r.remove()
        self._recompute = []
        if self._use_cache is not None:
            self._config.use_cache, self._use_cache = self._use_cache, None
        if self.offloader is not None:
            self.offloader.detach()
            self.offloader.synchronize()

    def report(self) -> dict:
        stats = self.offloader.stats() if self.offloader is not None else {}
        return {"policy": self.policy(), "offloaded_blocks": list(self.offloaded),
                "recompute_blocks": list(self.recomputed),
                "block_bytes": list(self.offloader.block_bytes) if self.offloader else [0] * len(self.blocks),
                "decision": self.decision, "paging": stats}
