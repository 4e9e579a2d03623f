"""LoRA on every linear layer of mixture-of-experts shapes (Mixtral, Qwen2-MoE: routers, fused experts,
a shared expert), in float32 and under bf16 autocast, with accumulation and clipping: wrap() trains the
adapters as torch's AdamW and clip_grad_norm_ do on the unwrapped PEFT model."""

from __future__ import annotations

import copy

import pytest
import torch
import trainstream

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CLIP = 0.05
SHAPE = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**SHAPE, num_local_experts=4,
                                                                      num_experts_per_tok=2))


def _qwen2_moe():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24))


# float32: the same bits up to host AdamW's rounding. bf16 autocast: the clipping coefficients differ in the
# 7th digit (the engine sums squares in float64), which moves the next forward's bf16 roundings and can flip
# a router's top-k; measured up to 8e-4 on Qwen2-MoE after 3 steps at lr 1e-2 (3e-7 in float32).
@pytest.mark.parametrize(("autocast", "atol"), [(False, 1e-6), (True, 2e-3)], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("build", [_mixtral, _qwen2_moe], ids=["mixtral", "qwen2-moe"])
def test_all_linear_lora_on_moe_shapes_trains_as_torch(build, autocast, atol):
    torch.manual_seed(0)
    base = build()
    transformers.set_seed(0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear"))
    reference = copy.deepcopy(model)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trained) >= 28  # q, k, v, o and the dense MLP / shared expert linears of both layers
    before = {n: p.detach().clone() for n, p in reference.named_parameters() if n in trained}
    model, opt = trainstream.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                           lr=1e-2), max_grad_norm=CLIP, accumulation_steps=2)
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2)
    for step in range(3):
        for micro in range(2):
            ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(2 * step + micro))
            for m in (model, reference):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = m(input_ids=ids, labels=ids).loss / 2
                loss.backward()
        opt.step()
        opt.zero_grad()
        norm = trainstream._habits._ORIGINALS["clip_grad_norm_"](ref_params, CLIP)
        assert norm > CLIP and opt.stats()["last_grad_norm"] == pytest.approx(float(norm), rel=1e-3)  # clipping
        ref_opt.step()
        ref_opt.zero_grad()
    model._trainstream_session.synchronize()
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    for name in trained:
        assert not torch.equal(theirs[name], before[name]) or "lora_B" not in name  # it trained
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=atol, msg=name)
    trainstream.unwrap(model)
