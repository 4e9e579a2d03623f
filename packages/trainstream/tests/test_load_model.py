"""load_model(): a checkpoint read tensor by tensor, block weights quantized as they arrive."""

from __future__ import annotations

import types

import pytest
import torch
import trainstream
from ts_quant import QuantLinear
from ts_testing import tiny_llama

pytest.importorskip("transformers")
from trainstream.integrations import hf_loading
from trainstream.integrations.huggingface import load_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_llama().save_pretrained(folder)
    return str(folder)


def _qwen_with_biases(folder):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    return model


def _logits(model, seed=0):
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_load_equals_quantizing_the_loaded_model(llama_dir, fmt):
    streamed = load_model(llama_dir, quantize=fmt, dtype=torch.float32)
    full = load_model(llama_dir, quantize=None, dtype=torch.float32)
    full.requires_grad_(False)
    trainstream.quantize_model(full, fmt)
    assert sum(isinstance(m, QuantLinear) for m in streamed.modules()) == 14
    assert type(streamed.lm_head) is torch.nn.Linear  # the output layer stays
    assert streamed.trainstream_quantize == fmt
    assert torch.equal(_logits(streamed), _logits(full))


def test_unquantized_load_is_the_checkpoint_in_dtype(llama_dir):
    original = tiny_llama()
    loaded = load_model(llama_dir, quantize="none", dtype=torch.bfloat16)
    state = loaded.state_dict()
    for name, value in original.state_dict().items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], value.to(torch.bfloat16)), name
    assert not any(t.device.type == "meta" for t in [*loaded.parameters(), *loaded.buffers()])


def test_biases_and_tied_embeddings(tmp_path):
    original = _qwen_with_biases(tmp_path)
    loaded = load_model(str(tmp_path), quantize="int8", dtype=torch.float32)
    layer = loaded.model.layers[0].self_attn.q_proj
    assert isinstance(layer, QuantLinear)
    assert torch.equal(layer.bias, original.model.layers[0].self_attn.q_proj.bias)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    full = load_model(str(tmp_path), quantize=None, dtype=torch.float32)
    full.requires_grad_(False)
    trainstream.quantize_model(full, "int8")
    assert torch.equal(_logits(loaded), _logits(full))


def test_random_weights_with_config_overrides(llama_dir):
    model = load_model(llama_dir, quantize="nf4", random_weights=True, num_hidden_layers=3)
    assert len(model.model.layers) == 3
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 21
    assert not any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    assert torch.isfinite(_logits(model)).all()


def test_auto_quantizes_only_when_the_ram_is_short(llama_dir, monkeypatch):
    def available(nbytes):
        monkeypatch.setattr(hf_loading, "_pinned_core", types.SimpleNamespace(host_memory=lambda: {"available": nbytes}))

    available(1 << 40)
    assert load_model(llama_dir, dtype=torch.float32).trainstream_quantize is None
    bf16_bytes = 2 * sum(p.numel() for p in tiny_llama().parameters())
    available(int(bf16_bytes * 0.9 / 0.85))  # int8 blocks fit, bf16 does not
    assert load_model(llama_dir).trainstream_quantize == "int8"
    available(1)
    assert load_model(llama_dir).trainstream_quantize == "nf4"


def test_bad_arguments_are_refused(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="safetensors"):
        (tmp_path / "config.json").write_text((__import__("pathlib").Path(llama_dir) / "config.json").read_text())
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="dtype"):
        load_model(llama_dir, dtype=torch.int8)
    with pytest.raises(ValueError, match="quantize='fp4' is not valid"):
        load_model(llama_dir, quantize="fp4")
    with pytest.raises(ValueError, match="ram_fraction"):
        load_model(llama_dir, ram_fraction=0.0)


def test_peft_adapters_on_a_streamed_quantized_base(llama_dir):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(load_model(llama_dir, quantize="nf4", dtype=torch.float32),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert len(lora) == 4 and all(isinstance(m.base_layer, QuantLinear) for m in lora)
    assert all(m.lora_A["default"].weight.dtype == torch.float32 for m in lora)
    model.train()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(m.lora_B["default"].weight.grad is not None for m in lora)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
