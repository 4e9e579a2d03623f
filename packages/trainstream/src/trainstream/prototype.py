"""Prototype features: built and tested for correctness, off by default until a same-run A/B on a GPU
(engines alternated in rounds, one host) shows a win beyond the run-to-run spread.

Each is a ``wrap()`` option; pass it to turn the feature on (``"auto"`` lets its own rule decide where
it applies). ``FEATURES`` lists them with what would graduate each; the option tables of docs/options.md and
``trainstream.plan()`` use the same names.
"""

from __future__ import annotations

import dataclasses

__all__ = ["FEATURES", "PrototypeFeature", "feature"]


@dataclasses.dataclass(frozen=True)
class PrototypeFeature:
    """A feature that is off by default: its ``wrap()`` option, the value that leaves it off, what it does,
    and the measurement that would turn it on by default."""

    option: str
    off: object
    what: str
    graduates_when: str


FEATURES: tuple[PrototypeFeature, ...] = (
    PrototypeFeature(
        "compact_lora_inputs", False,
        "PEFT LoRA layers save their 16-bit input for backward instead of PEFT's float32 copy",
        "a LoRA run whose activation policy keeps more blocks with it is faster in a same-run A/B on a GPU"),
    PrototypeFeature(
        "stream_packing", False,
        "streamed bf16 weights cross the host link exponent-packed (lossless, about 0.75 of the bytes)",
        "a link-bound streamed run is faster with it than without in a same-run A/B on a GPU"),
    PrototypeFeature(
        "host_embedding", False,
        "a frozen, untied input embedding stays in page-locked host memory; looked-up rows are copied up",
        "a LoRA run that fits only with it, or runs faster with it, in a same-run A/B on a GPU"),
    PrototypeFeature(
        "peer", False,
        "data parallel on one machine: streamed frozen blocks pooled in the other GPUs' memory (ts-peer)",
        "a two-GPU run is faster fetching from the peer pool than from host memory in a same-run A/B"),
    PrototypeFeature(
        "mapped_trial", False,
        "offload='auto' with the state in host memory: a few steps of CUDA AdamW over mapped host memory "
        "are timed against host AdamW, and the faster stays",
        "the trial's choice beats host AdamW beyond the spread in a same-run A/B on a GPU"),
    PrototypeFeature(
        "recompute_variant", "full",
        "recompute_variant='selective': recomputed blocks keep their matmul outputs and recompute the rest",
        "a run that recomputes blocks is faster with it at the same peak in a same-run A/B on a GPU"),
)


def feature(option: str) -> PrototypeFeature:
    """The prototype feature behind `option` (KeyError when it is not one)."""
    for f in FEATURES:
        if f.option == option:
            return f
    raise KeyError(f"{option!r} is not a prototype feature; they are {', '.join(f.option for f in FEATURES)}")
