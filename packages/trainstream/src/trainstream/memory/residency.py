"""param_offload='auto' at the batch's real size: which streamed blocks may stay in VRAM.

wrap() does not see the batch, so it plans the streamed blocks for PLAN_BATCH x PLAN_SEQ tokens
(``plan.py``). The first training forward tells the real count; the plan for that count needs fewer
blocks to stream when the batch is smaller, and the others stay resident from then on
(``WeightStreamer.keep``): bytes that no longer cross the link twice a step (H200, 14B LoRA at
1 x 512: 27 blocks planned at 2048 tokens, link-bound at 0.72 s/step).

Rules:
  - Decided before the forward's first block runs (a forward pre-hook on the model, ahead of the
    activation policy's hooks), so the activation tuner measures with the kept blocks in VRAM.
  - Like the activation watchdog: a later forward with more tokens than any before re-plans and streams
    more before it runs; a shorter one never keeps more again (it fits in what the longer one did).
  - Never more kept than the plan at wrap() streamed: blocks only come back, none newly stream, so
    host memory stays what wrap() planned.
  - Forwards without gradients (evaluation, generation) and recomputations inside backward are not
    training forwards: they change nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .tuner import spread

__all__ = ["FOLLOW_TOKENS", "WeightResidency", "batch_tokens"]

# Off until the choice leaves the activation policy room: on the H200 (14B LoRA, bf16 base, 1 x 512,
# 24 GB cap, 2026-12-02) keeping 7 of 27 blocks left 0.11 GiB after the peak, every block's activations
# were paged and the step took 1.18 s against 0.88 s streaming all 27
# (docs/results/lora14b-bf16-residency-h200-2026-12-02.log). wrap() attaches it only when True.
FOLLOW_TOKENS = False


def batch_tokens(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(batch, sequence length) of a model's forward from its inputs: ``input_ids`` (or the first
    positional tensor) of integer tokens, else ``inputs_embeds`` / a float input of shape [..., T, H].
    None when no input says."""
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    shape = list(x.shape) if not x.is_floating_point() else list(x.shape[:-1])
    if not shape:
        return None
    seq = shape[-1]
    batch = 1
    for n in shape[:-1]:
        batch *= n
    return (batch, seq) if batch > 0 and seq > 0 else None


class WeightResidency:
    """Keeps the streamed blocks the plan at the real token count does not need to stream.

    ``streamed_for(batch, seq)``: how many blocks must stream at that size (the planner's fewest;
    wrap()'s own search). ``streamer``: the WeightStreamer; only its ``keepable()`` blocks can stay."""

    def __init__(self, streamer, streamed_for: Callable[[int, int], int], event: Callable[[str], None]):
        self.streamer = streamer
        self.streamed_for = streamed_for
        self._event = event
        self.tokens: int | None = None  # the most tokens a training forward has carried so far

    def before_forward(self, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() >= 0:
            return
        size = batch_tokens(args, kwargs)
        if size is None or (self.tokens is not None and size[0] * size[1] <= self.tokens):
            return
        first = self.tokens is None
        self.tokens = size[0] * size[1]
        self.plan(*size, first=first)

    def plan(self, batch: int, seq: int, first: bool = False) -> list[int]:
        """Keeps what the plan at batch x seq tokens leaves resident; returns the kept blocks."""
        streamer = self.streamer
        keepable = streamer.keepable()
        always = len(streamer.streamed) - len(keepable)  # streamed trained weights cannot stay
        count = min(len(streamer.streamed), max(self.streamed_for(batch, seq), always))
        streaming = [keepable[i] for i in spread(count - always, len(keepable))]
        keep = [i for i in keepable if i not in set(streaming)]
        before = sorted(streamer.kept)
        if keep != before:
            streamer.keep(keep)
        if first or keep != before:
            self._event(f"param_offload='auto' at {batch} x {seq} tokens: {count} of the {len(streamer.streamed)} "
                        f"blocks planned for streaming stream, {len(keep)} stay in VRAM"
                        + (f" (was {len(before)})" if not first else ""))
        return keep
