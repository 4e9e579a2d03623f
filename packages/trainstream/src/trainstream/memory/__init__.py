"""Where the model's bytes live: sizing and placement decisions (``plan``), the repeated block
stack (``blocks``) and frozen weights stored quantized (``quantize``). Weight streaming,
activation paging and recomputation, and the planner's application land here.
"""

from .blocks import find_blocks
from .offload import ActivationOffloader
from .quantize import quantize_model

__all__ = ["ActivationOffloader", "find_blocks", "quantize_model"]
