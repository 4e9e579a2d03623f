"""What happens at which optimizer step: the one owner of the run-time adaptations of the plan.

``wrap()`` applies a plan decided before anything ran; what only the first steps can measure changes it
afterwards, through these named transitions, checked after each optimizer step in this order (``due``).
Each returns what it changed; the session makes the next plan from it (``Plan.adapted``, a
``planning.plan.Transition``), so ``memory_report(model)["plan"]["transitions"]`` lists every one with
its step, reason and changes, and the events log says the same:

  peer_pools           at step PEER_SETUP_STEP: streamed frozen blocks pooled in the data-parallel ranks'
                       GPUs (collective). Off with peer=False (the default: a prototype).
  optimizer_placement  the first step after the activation policy settled: the optimizer state moves into
                       the VRAM the measured peak left (offload="auto", or part of it with
                       optimizer_mode="auto"). Off with offload=True and optimizer_mode other than "auto".
  mapped_trial         each step of a running mapped-AdamW trial (started by optimizer_placement when the
                       state did not fit): its timing, then keep or revert. Off with mapped_trial=False
                       (the default: a prototype).
  attention_agreement  steps 1 to ATTENTION_AGREE_STEPS under data parallel: every rank adopts the mean of
                       all ranks' attention timings, so all pin the same kernels (collective). Off with
                       an attention mode other than "auto".

The activation policy's own probe and trials run inside the steps (``activations/autotune.py``: its
state machine); this schedule starts once it has settled.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ATTENTION_AGREE_STEPS", "PEER_SETUP_STEP", "TRANSITIONS", "StepFacts", "due"]

PEER_SETUP_STEP = 10  # late enough that the activation policy has settled and the VRAM left is known
ATTENTION_AGREE_STEPS = 3  # steps whose attention timings every rank shares (the first shapes are seen then)
TRANSITIONS = ("peer_pools", "optimizer_placement", "mapped_trial", "attention_agreement")


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """What the schedule reads after an optimizer step."""

    step: int  # optimizer steps done, this one included
    period: float | None  # seconds since the previous step ended (None after the first)
    settled: bool  # the activation policy had settled before this step
    adapting: bool  # the optimizer placement still waits for a settled policy
    trial: bool  # a mapped-AdamW trial is running
    world: int  # data-parallel ranks


def due(f: StepFacts) -> list[str]:
    """The transitions to run after this step, in order (a pure function of the facts)."""
    out = []
    if f.step == PEER_SETUP_STEP:
        out.append("peer_pools")
    if f.adapting and f.settled:
        out.append("optimizer_placement")
    elif f.trial and f.period is not None:  # the placement may start a trial: it is timed from the next step
        out.append("mapped_trial")
    if f.world > 1 and f.step <= ATTENTION_AGREE_STEPS:
        out.append("attention_agreement")
    return out
