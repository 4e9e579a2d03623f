"""Where the model's weights live: the block stack's weights streamed from host memory (``streamer``, with
its host copies in ``streamed_block``, ``sources``, ``packed_source``, ``shared_host`` and the peer-GPU
pools in ``peer``), the input embedding kept in host memory (``host_embedding``) and frozen weights stored
quantized (``quantize``)."""

from .quantize import quantize_model

__all__ = ["quantize_model"]
