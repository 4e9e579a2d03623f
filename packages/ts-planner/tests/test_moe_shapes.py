"""Mixture-of-experts shapes (Mixtral, Qwen-MoE): every expert's weights are stored, the experts a token takes
are what it computes; counted against the published sizes and, where transformers is installed, against the
models transformers builds from the same config."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_planner import ModelShape, Options, estimate_memory

# Published configs (config.json on the Hub), the fields the planner reads.
MIXTRAL_8X7B = dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                    num_experts_per_tok=2, tie_word_embeddings=False)
QWEN15_MOE_A27B = dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                       shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                       num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
                       tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])


def test_mixtral_counts_every_expert():
    shape = ModelShape.from_config(MIXTRAL_8X7B)
    assert shape.num_experts == 8 and shape.experts_per_token == 2
    assert shape.total_params == pytest.approx(46.7e9, rel=0.005)  # "46.7B total parameters" (Mistral AI)
    dense = ModelShape.from_config({k: v for k, v in MIXTRAL_8X7B.items() if k not in ("num_local_experts", "model_type")})
    assert dense.total_params == pytest.approx(7.24e9, rel=0.01)  # what the hand parser said before
    # A token runs 2 of the 8 experts: about 12.9 B active parameters (Mistral AI's figure).
    active = shape.num_hidden_layers * sum(i * o for i, o, _ in shape.linears().values())
    assert active + shape.embedding_params + shape.head_params == pytest.approx(12.9e9, rel=0.02)


def test_qwen_moe_counts_its_shared_expert_and_router():
    shape = ModelShape.from_config(QWEN15_MOE_A27B)
    assert shape.expert_width == 1408 and shape.shared_expert_intermediate_size == 5632
    assert shape.mlp_width == 4 * 1408 + 5632
    assert shape.total_params == pytest.approx(14.3e9, rel=0.01)  # Qwen1.5-MoE-A2.7B: 14.3 B in all


def test_a_mixed_dense_and_expert_stack_is_refused():
    with pytest.raises(ValueError, match="mixes dense and expert blocks"):
        ModelShape.from_config({**QWEN15_MOE_A27B, "mlp_only_layers": [0]})


def test_expert_config_read_from_a_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    assert ModelShape.from_config(tmp_path) == ModelShape.from_config(MIXTRAL_8X7B)


@settings(max_examples=40, deadline=None)
@given(experts=st.integers(2, 16), data=st.data())
def test_more_experts_store_more_but_compute_the_same(experts, data):
    top = data.draw(st.integers(1, experts))
    base = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000, num_experts_per_tok=top)
    small, big = (ModelShape.from_config({**base, "num_local_experts": n}) for n in (experts, experts + 1))
    assert big.total_params > small.total_params
    options = Options(train="lora", seq=128, quantize=None)
    e_small, e_big = estimate_memory(small, options), estimate_memory(big, options)
    assert e_big.flops == e_small.flops  # the same experts per token
    assert e_big.vram["frozen_weights"] > e_small.vram["frozen_weights"]
    assert e_big.trained_params > e_small.trained_params  # LoRA on every expert's projections


def _transformers_model(config_fields: dict):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.AutoConfig.for_model(**config_fields)
    with torch.device("meta"):
        return config, transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("fields", [
    dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, vocab_size=211, num_local_experts=4, num_experts_per_tok=2),
    dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
         shared_expert_intermediate_size=80, num_experts=6, num_experts_per_tok=2, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, vocab_size=211),
], ids=["mixtral", "qwen2_moe"])
def test_the_shape_counts_what_transformers_builds(fields):
    config, model = _transformers_model(fields)
    shape = ModelShape.from_config(config)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    # Read from the bare dict, the model type's defaults fill the rest (AutoConfig), to the same shape.
    assert ModelShape.from_config(fields) == shape
