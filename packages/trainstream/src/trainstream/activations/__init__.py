"""Saved activations: each block keeps, pages to host memory (``offload``) or recomputes (``recompute``)
what its backward needs; ``policy`` applies the choice, ``autotune`` and ``tuner`` measure and choose it
for "auto", ``lora_inputs`` and ``compiled_forward`` change what a block saves or how it runs."""

from .offload import ActivationOffloader

__all__ = ["ActivationOffloader"]
