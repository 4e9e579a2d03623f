"""offload='auto' when the optimizer state does not fit in VRAM: host AdamW against mapped CUDA AdamW.

Host AdamW (placement "host") takes each gradient off the GPU during backward with a hook per tensor
and overlaps the updates with backward: right for large tensors, but each hook costs some 0.2 ms of
host time, which for LoRA's hundreds of small tensors is most of a step (issue 13). CUDA AdamW over
mapped page-locked memory (placement "mapped") has no hooks: the gradients stay in VRAM until
``step()``, where one fused kernel reads them and updates the state in host memory over the link
(24 bytes per value with fp32 moments). Which is faster depends on the tensor count, the link and the
host cores, so it is measured: ``steps`` step periods on each placement (after one warm-up period on
the new one), and mapped is kept only when its median is faster by ``margin``.

The session feeds ``record(period)`` the time between successive ``step()`` calls and acts on the
answer; this class only counts and decides (no torch), so the decision is testable on its own.
"""

from __future__ import annotations

import statistics

__all__ = ["MappedTrial"]


class MappedTrial:
    """Phases: "host" (the period holding the switch to host is skipped, then ``steps`` periods),
    "mapped" (one warm-up period skipped: the first fused launch prepares its arguments, then
    ``steps`` periods), "done". ``record`` answers "switch" (place the slots mapped now), "keep"
    (mapped won), "revert" (host won: place them back) or None (keep measuring)."""

    def __init__(self, steps: int = 2, margin: float = 0.03):
        if steps < 1 or not 0.0 <= margin < 1.0:
            raise ValueError(f"steps={steps!r} must be >= 1 and margin={margin!r} in [0, 1)")
        self.steps = steps
        self.margin = margin
        self.phase = "host"
        self.periods: dict[str, list[float]] = {"host": [], "mapped": []}
        self._skip = 1

    def record(self, period: float) -> str | None:
        if self.phase == "done":
            return None
        if self._skip:
            self._skip -= 1
            return None
        measured = self.periods[self.phase]
        measured.append(float(period))
        if len(measured) < self.steps:
            return None
        if self.phase == "host":
            self.phase, self._skip = "mapped", 1
            return "switch"
        self.phase = "done"
        return "keep" if self.median("mapped") < self.median("host") * (1.0 - self.margin) else "revert"

    def median(self, phase: str) -> float:
        return statistics.median(self.periods[phase])

    def summary(self) -> str:
        return (f"median step {self.median('mapped'):.3f} s mapped against {self.median('host'):.3f} s on host "
                f"({self.steps} steps each)")
