"""What the model's state costs and where it may go: the sizing rules and ts-planner's memory model applied
to the live model (``sizing``: host state bytes, the moment-dtype rule, the priced plan), the repeated
block stack (``blocks``) and the CUDA caching allocator's setting (``allocator``). The decisions built on
these are in ``trainstream.planning``; weights and activations have their own packages.
"""

from .blocks import find_blocks

__all__ = ["find_blocks"]
