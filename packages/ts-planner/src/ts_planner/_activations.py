"""Saved activations of one decoder block, from its shapes: the tensors autograd keeps for backward in a
Hugging Face Llama / Qwen2 decoder layer with SDPA attention (RMSNorm in fp32, rotary embeddings,
grouped-query attention without repeating k/v, gated SiLU MLP), full fine-tuning or LoRA.

Each saved tensor is listed with the storage it lives in, so the same list gives what the saved-tensor
hooks see (``packed``: what paging copies, what trainstream's probe counts) and what VRAM holds
(``unique``: a tensor saved by three projections is stored once)."""

from __future__ import annotations

from ._formats import DTYPE_BYTES
from ._shape import LORA_TARGETS, ModelShape

__all__ = ["block_backward_bytes", "block_saved_tensors", "checkpoint_bytes", "saved_activation_bytes"]


def _norm(out: list, tag: str, tokens: int, h: int, a: int, trained: bool) -> None:
    # x.float() saved by pow and by the mul with rsqrt; rsqrt saved by its own backward and the mul.
    out += [(f"{tag}.x32", tokens * h * 4)] * 2 + [(f"{tag}.rsqrt", tokens * 4)] * 2
    if trained:  # weight * normed keeps normed for the weight's gradient
        out.append((f"{tag}.normed", tokens * h * a))


def _projection(out: list, name: str, source: str, tokens: int, fan_in: int, a: int, train: str,
                rank: int, targets, adapter: int, compact: bool) -> None:
    """What one projection saves: its input when its weight is trained; with LoRA, the adapter's input
    (a cast copy when the adapter dtype differs, or with ``compact`` the input it was cast from, shared
    by the projections reading it) and the rank-sized middle. A frozen base saves nothing."""
    if train == "full":
        out.append((source, tokens * fan_in * a))
    elif train == "lora" and name in targets:
        if adapter == a or compact:
            out.append((source, tokens * fan_in * a))
        else:
            out.append((f"{name}.cast", tokens * fan_in * adapter))
        out.append((f"{name}.lora_mid", tokens * rank * adapter))


def block_saved_tensors(shape: ModelShape, batch: int, seq: int, *, train: str = "full", lora_rank: int = 16,
                        lora_targets=LORA_TARGETS, adapter_dtype: str = "float32", dtype: str = "bfloat16",
                        first: bool = False, compact_lora_inputs: bool = False) -> list[tuple[str, int]]:
    """(storage, bytes) of every tensor one block saves for backward, in forward order. ``first``: the first
    block under LoRA, whose input (from the frozen embedding) needs no gradient: its input norm saves nothing.
    ``compact_lora_inputs``: trainstream's option of that name (LoRA layers save their 16-bit input)."""
    if train not in ("full", "lora", "frozen"):
        raise ValueError(f"train={train!r} is not valid; use 'full', 'lora' or 'frozen'")
    a, ad = DTYPE_BYTES[dtype], DTYPE_BYTES[adapter_dtype]
    h, i, d = shape.hidden_size, shape.mlp_width, shape.dim_per_head
    tokens = batch * seq
    out: list[tuple[str, int]] = []
    args = dict(tokens=tokens, a=a, train=train, rank=lora_rank, targets=tuple(lora_targets), adapter=ad,
                compact=compact_lora_inputs)
    if train == "full" or not first:
        _norm(out, "attn_norm", tokens, h, a, train == "full")
    for name in ("q_proj", "k_proj", "v_proj"):
        _projection(out, name, "attn_in", fan_in=h, **args)
    out += [("cos", seq * d * a)] * 2 + [("sin", seq * d * a)] * 2  # rotary tables, shared by q and k
    out += [("q", tokens * shape.q_dim * a), ("k", tokens * shape.kv_dim * a), ("v", tokens * shape.kv_dim * a),
            ("attn_out", tokens * shape.q_dim * a), ("lse", tokens * shape.num_attention_heads * 4)]
    _projection(out, "o_proj", "attn_out", fan_in=shape.q_dim, **args)  # a view of the attention output
    _norm(out, "mlp_norm", tokens, h, a, train == "full")
    for name in ("gate_proj", "up_proj"):
        _projection(out, name, "mlp_in", fan_in=h, **args)
    out += [("gate_out", tokens * i * a), ("silu_out", tokens * i * a), ("up_out", tokens * i * a)]
    _projection(out, "down_proj", "mlp_mid", fan_in=i, **args)
    if train == "frozen":  # nothing trained in or before the block still needs no activations
        return []
    return out


def saved_activation_bytes(shape: ModelShape, batch: int, seq: int, *, unique: bool = True, min_bytes: int = 0,
                           **kwargs) -> int:
    """Bytes one block saves for backward: ``unique`` counts each storage once (VRAM held), otherwise every
    saved tensor (what saved-tensor hooks see). ``min_bytes`` drops smaller tensors (trainstream's probe and
    pager ignore tensors under 1 MiB). Keyword arguments as in ``block_saved_tensors``."""
    tensors = [t for t in block_saved_tensors(shape, batch, seq, **kwargs) if t[1] >= min_bytes]
    if not unique:
        return sum(n for _, n in tensors)
    return sum(dict(tensors).values())


def checkpoint_bytes(shape: ModelShape, batch: int, seq: int, dtype: str = "bfloat16") -> int:
    """What a recomputed block keeps between forward and backward: its input hidden states."""
    return batch * seq * shape.hidden_size * DTYPE_BYTES[dtype]


def block_backward_bytes(shape: ModelShape, batch: int, seq: int, dtype: str = "bfloat16") -> int:
    """Transient VRAM of one block's backward beyond its saved tensors: gradients of the MLP intermediates
    (three I-wide), of the fp32 norm, and of q/k/v with the attention's own (an estimate, not measured)."""
    a = DTYPE_BYTES[dtype]
    tokens = batch * seq
    return tokens * (3 * shape.mlp_width * a + 2 * shape.hidden_size * 4
                     + 2 * (shape.q_dim + 2 * shape.kv_dim) * a)
