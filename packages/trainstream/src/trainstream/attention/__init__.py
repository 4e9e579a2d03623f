"""Attention backend choice (``wrap(attention=...)``): measures the scaled-dot-product-attention
kernels (cuDNN, flash, memory-efficient, math) on the model's own call shapes, pins the fastest one
that agrees with the math backend around the model's forward and backward (recomputation included),
and reports the timings and every skipped backend with its reason."""

from ._chooser import (
    ATTENTION_MODES,
    WRAP_DEFAULT,
    AttentionChooser,
    AttentionHandle,
    check_attention_mode,
    resolve_wrap_default,
)
from ._measure import BACKENDS, Measurement, deterministic_backends

__all__ = ["ATTENTION_MODES", "BACKENDS", "WRAP_DEFAULT", "AttentionChooser", "AttentionHandle", "Measurement",
           "check_attention_mode", "deterministic_backends", "resolve_wrap_default"]
