"""Trained weights streamed with their blocks on a GPU (issue 11): bit for bit against keeping them
resident with the same host AdamW, with accumulation across forwards (a gradient in VRAM while its
weight is back in host memory), recompute and paging; VRAM holds only the resident blocks."""

from __future__ import annotations

import pytest
import torch
import trainstream
from ts_testing import batches, loss_of

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _llama(layers=8, hidden=1024):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=4096,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config).cuda().to(torch.bfloat16)


def _train(model, opt, data, micro: int) -> list[float]:
    losses = []
    for start in range(0, len(data), micro):
        for ids in data[start:start + micro]:
            loss = loss_of(model, ids.cuda())
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    model._trainstream_session.synchronize()
    return losses


@pytest.mark.parametrize("options", [
    {},
    {"recompute": True},
    {"activation_offload": True, "min_offload_bytes": 0},
    {"accumulation_steps": 2, "max_grad_norm": 0.5},
    {"guard_params": False, "max_grad_norm": 0.5},
])
def test_streamed_trained_weights_match_resident_ones_on_cuda(options):
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        data = batches(6, vocab=4096, batch=2, seq=256)
        micro = options.get("accumulation_steps", 1)
        runs = {}
        for name, extra in (("resident", {}), ("streamed", {"param_offload": True, "prefetch_depth": 2})):
            model = _llama()
            chosen = {"recompute": False, "activation_offload": False, **options, **extra}
            ours, opt = trainstream.wrap(model, lr=1e-4, optimizer_mode="cpu", offload=True, **chosen)
            # Parameters on the GPU right after wrap(): streamed blocks' weights are in host memory until fetched.
            # (Not memory_allocated(): the previous case's garbage moved it by hundreds of MB either way.)
            after_wrap = sum(p.numel() * p.element_size() for p in ours.parameters() if p.is_cuda)
            if name == "streamed":
                assert ours._trainstream_session.weights.trained_blocks == list(range(8))
            losses = _train(ours, opt, data, micro)
            report = trainstream.memory_report(ours)
            runs[name] = (losses, [p.detach().clone().cpu() for p in ours.parameters()], after_wrap, report)
            trainstream.unwrap(ours)
            del ours, opt, model
            torch.cuda.empty_cache()
        assert runs["streamed"][0] == runs["resident"][0]
        assert all(torch.equal(a, b) for a, b in zip(runs["streamed"][1], runs["resident"][1]))
        layer_bytes = 12 * 1024 * 1024 * 2  # one layer's bf16 weights, about
        assert runs["resident"][2] - runs["streamed"][2] > 4 * layer_bytes  # most blocks left the GPU
        streaming = runs["streamed"][3]["params"]["streaming"]
        assert streaming["update_waits"] > 0 and streaming["peak_resident_blocks"] <= 4
    finally:
        torch.use_deterministic_algorithms(False)
