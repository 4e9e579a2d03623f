"""reference_logprobs(): the adapters-off base, in eval mode, without gradients, as DPO's reference."""

from __future__ import annotations

import pytest
import torch
from trainstream.integrations.huggingface import causal_lm_logprobs, reference_logprobs
from ts_testing import tiny_llama


def _batches(count=3, batch=2, seq=10):
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(count):
        ids = torch.randint(0, 97, (batch, seq), generator=gen)
        labels = ids.clone()
        labels[:, :4] = -100  # the prompt does not count
        out.append({"input_ids": ids, "labels": labels} if i % 2 == 0 else {"input_ids": ids})
    return out


def test_reference_is_the_base_with_adapters_off():
    peft = pytest.importorskip("peft")
    base = tiny_llama()
    with torch.no_grad():
        plain = [causal_lm_logprobs(base, b["input_ids"], b.get("labels")) for b in _batches()]
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # adapters that change the output
    model.train()
    ref = reference_logprobs(model, _batches())
    assert ref.dtype == torch.float32 and ref.device.type == "cpu" and ref.shape == (6,)
    assert not ref.requires_grad
    torch.testing.assert_close(ref, torch.cat(plain), rtol=1e-6, atol=1e-6)
    adapted = torch.cat([causal_lm_logprobs(model, b["input_ids"], b.get("labels")) for b in _batches()])
    assert (adapted.detach() - ref).abs().max() > 1e-3  # the adapters were really off
    assert model.training  # mode restored


def test_plain_model_average_and_empty():
    model = tiny_llama().eval()
    ref = reference_logprobs(model, _batches(), average=True)
    counted = torch.cat([(b.get("labels", b["input_ids"])[:, 1:] != -100).sum(1) for b in _batches()])
    total = reference_logprobs(model, _batches())
    torch.testing.assert_close(ref * counted, total, rtol=1e-5, atol=1e-5)
    assert not model.training
    assert reference_logprobs(model, []).numel() == 0
    with pytest.raises(ValueError, match="input_ids"):
        reference_logprobs(model, [{"labels": torch.zeros(1, 4, dtype=torch.long)}])
