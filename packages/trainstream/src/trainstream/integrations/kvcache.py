"""TrainStreamCache: ts-kvcache's PagedKVCache as a transformers ``Cache`` for ``model.generate()``.

Written against the layer-based cache API of transformers 5 (one ``CacheLayerMixin`` per layer
with ``update``, ``get_seq_length``, ``get_mask_sizes``, ``lazy_initialization``, ``reset``),
which 4.56 introduced; ``get_mask_sizes`` takes ``cache_position`` (4.x) or ``query_length``
(5.x). Tested with transformers 5.24. ts-kvcache is imported when a cache is built, so
trainstream imports without it.
"""

from __future__ import annotations

import torch

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError("trainstream.integrations.kvcache needs transformers: pip install 'trainstream[hf]'") from error

__all__ = ["TrainStreamCache"]

_UNSUPPORTED = (
    "TrainStreamCache supports greedy and sampling generation only: {what} rearranges or crops the cache "
    "({detail}); use transformers' DynamicCache for it"
)


def _layer_types(config) -> list[str]:
    """Attention type of each decoder layer, as transformers' own caches read it."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # transformers 4.x: no per-layer helper
        get_layer_types_and_kwargs = None
    if get_layer_types_and_kwargs is not None:
        return list(get_layer_types_and_kwargs(config)[0])
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


class _PagedLayer(CacheLayerMixin):
    """One decoder layer's view of the shared PagedKVCache (it holds no tensors itself)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, kv, index: int, events=None):
        super().__init__()
        self.kv = kv
        self.index = index
        self.events = events  # a wrapped model's decision log, told of each new plan

    @property
    def batch_size(self) -> int:
        if self.kv._geometry is None:
            raise AttributeError("batch_size is known after the first update")
        return self.kv._geometry[0]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plans = self.kv.plan.get("plans")
        out = self.kv.update(self.index, key_states, value_states)
        if self.events is not None and self.kv.plan.get("plans") != plans:
            self.events.add("kvcache", self.kv.plan["message"])
        return out

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers 4.x passes cache_position
            query_length = query_length.shape[0]
        return self.kv.seq_length(self.index) + query_length, 0

    def get_seq_length(self, *args) -> int:
        return self.kv.seq_length(self.index)

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers 4.x name of get_max_length
        return -1

    def reset(self) -> None:
        self.is_initialized = False  # the cache resets the shared PagedKVCache once

    def offload(self) -> None:  # the paged cache moves its own pages
        return None

    def prefetch(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError(_UNSUPPORTED.format(what="beam search", detail="reorder_cache"))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError(_UNSUPPORTED.format(what="assisted or speculative decoding", detail="crop"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length():  # an empty cache has nothing to repeat (num_return_sequences)
            raise ValueError(_UNSUPPORTED.format(what="expanding a filled cache", detail="batch_repeat_interleave"))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length():
            raise ValueError(_UNSUPPORTED.format(what="selecting batch rows", detail="batch_select_indices"))


def generation_working_bytes(text_config, max_tokens: int = 0):
    """A function of a forward's keys ``[batch, kv_heads, tokens, head_dim]`` that estimates the VRAM
    a decoder's forward needs beside its cache and weights at its peak: one MLP's three intermediate
    tensors and four residual-stream tensors for every token of the forward, and the last token's
    logits in float32 twice (the logits and the copy sampling makes). With eager attention, also its
    score matrices (float32, twice: scores and softmax) against up to ``max_tokens`` keys, which the
    fused attention kernels never materialize. (With SDPA on a Qwen2.5-7B shape the estimate matched
    the measured working set to about 1 %; docs/kvcache.md.)"""
    hidden = int(getattr(text_config, "hidden_size", 0) or 0)
    intermediate = int(getattr(text_config, "intermediate_size", 0) or 4 * hidden)
    vocab = int(getattr(text_config, "vocab_size", 0) or 0)
    heads = int(getattr(text_config, "num_attention_heads", 0) or 0)
    eager = getattr(text_config, "_attn_implementation", None) == "eager"

    def estimate(keys: torch.Tensor) -> int:
        batch, _heads, tokens, _dim = keys.shape
        per_token = (3 * intermediate + 4 * hidden) * keys.element_size()
        scores = 2 * batch * heads * tokens * max(tokens, max_tokens) * 4 if eager else 0
        return batch * tokens * per_token + 2 * batch * vocab * 4 + scores

    return estimate


def _trainstream_streams(device: torch.device):
    """TrainStream's own H2D and D2H streams of ``device``, so the cache's copies queue with its others."""
    from ..engine.channel import channel_for

    channel = channel_for(device)
    return channel.h2d, channel.d2h


class TrainStreamCache(Cache):
    """A ``transformers`` cache whose keys and values are partly in host RAM, for
    ``model.generate(past_key_values=cache)`` (``cache=cache`` in transformers 5).

    ``model``: a decoder with full attention in every layer (sliding-window, chunked,
    linear-attention and KV-sharing layers are refused). ``max_tokens``: prompt plus new
    tokens expected. Other arguments as ``ts_kvcache.PagedKVCache`` (``kv_options`` are passed
    on: ``slots``, ``copy``, ``streams``, ``arena``, ``working_bytes``); on CUDA the copies use
    TrainStream's H2D / D2H streams unless ``streams`` is given. ``"auto"`` takes ``vram_fraction``
    of the free VRAM but leaves 1.25 x the model's own forward free (its MLP and residual tensors
    for the tokens of the first forward, and the logits: ``working_bytes``, estimated from the
    config). Greedy or sampling; beam search is refused.
    Call ``reset()`` before the next prompts; ``.kv`` is the PagedKVCache. On a wrapped model
    each plan (which layers stay in VRAM, and why) is a ``"kvcache"`` event of its session.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_tokens: int,
        *,
        resident_layers: str | int | list[int] = "auto",
        page_tokens: int = 256,
        vram_fraction: float = 0.5,
        **kv_options,
    ):
        try:
            from ts_kvcache import PagedKVCache
        except ImportError as error:
            raise ImportError("TrainStreamCache needs ts-kvcache: pip install ts-kvcache") from error
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "get_text_config"):
            raise ValueError(f"TrainStreamCache needs a transformers model with a config, got {type(model).__name__}")
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError("TrainStreamCache supports decoder-only models; this one is an encoder-decoder")
        text = config.get_text_config(decoder=True)
        types = _layer_types(text)
        other = sorted({t for t in types if t != "full_attention"})
        if other:
            layers = [i for i, t in enumerate(types) if t != "full_attention"]
            raise ValueError(
                f"TrainStreamCache needs full attention in every layer; layers {layers} of this model are "
                f"{', '.join(other)}: use transformers' DynamicCache for it"
            )
        beams = getattr(getattr(model, "generation_config", None), "num_beams", 1) or 1
        if beams > 1:
            raise ValueError(
                f"the model's generation_config has num_beams={beams}: "
                + _UNSUPPORTED.format(what="beam search", detail="reorder_cache")
            )
        kv_options.setdefault("streams", _trainstream_streams)
        kv_options.setdefault("working_bytes", generation_working_bytes(text, max_tokens))
        self.kv = PagedKVCache(
            len(types),
            max_tokens,
            resident_layers=resident_layers,
            page_tokens=page_tokens,
            vram_fraction=vram_fraction,
            **kv_options,
        )
        session = getattr(model, "_trainstream_session", None)
        events = getattr(session, "events", None)
        super().__init__(layers=[_PagedLayer(self.kv, i, events) for i in range(len(types))])

    def reset(self) -> None:
        """Forgets every token (buffers and host pages are kept for the next prompts)."""
        self.kv.reset()
        for layer in self.layers:
            layer.reset()

    def release(self) -> None:
        """Forgets every token and frees the cache's VRAM and host pages (for training)."""
        self.kv.release()
        for layer in self.layers:
            layer.reset()

    def __repr__(self) -> str:
        return f"TrainStreamCache({self.kv!r})"
