"""Shared test builders: a small Llama-shaped model and a reproducible batch stream."""

from __future__ import annotations

import copy

import torch


def tiny_llama(seed: int = 0, layers: int = 2, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config).to(dtype)


def batches(count: int, seed: int = 1, batch: int = 2, seq: int = 16, vocab: int = 97, distinct: int | None = 3):
    """`count` batches of random ids cycling through `distinct` different ones (None: all
    different), so a short run can learn them and the loss falls."""
    generator = torch.Generator().manual_seed(seed)
    unique = [torch.randint(0, vocab, (batch, seq), generator=generator) for _ in range(distinct or count)]
    return [unique[i % len(unique)] for i in range(count)]


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def train(model, opt, data, device=None) -> list[float]:
    """One step per batch of ``data`` (moved to ``device`` when given); the losses. Waits for a wrapped
    model's host updates, so its parameters can be compared right after."""
    losses = []
    for ids in data:
        loss = loss_of(model, ids if device is None else ids.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    session = getattr(model, "_trainstream_session", None)
    if session is not None:
        session.synchronize()
    return losses


def model_pair():
    """Two identical tiny Llamas (fp32, CPU)."""
    model = tiny_llama()
    return model, copy.deepcopy(model)


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((pa.detach().float() - pb.detach().float()).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters()))
