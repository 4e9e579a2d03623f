"""load_model(): a checkpoint read tensor by tensor, block weights quantized as they arrive."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import threading
import types
import warnings

import pytest
import torch
import trainstream
from ts_quant import QuantLinear
from ts_testing import tiny_llama

pytest.importorskip("transformers")
import safetensors
import safetensors.torch as safetensors_torch
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


# --- from_pretrained semantics: shapes, the shard index, missing and unexpected keys, paths, overrides ---

def _sharded(folder, seed=0):
    """A tiny Llama saved as several shards with their index; returns the model."""
    model = tiny_llama(seed=seed)
    model.save_pretrained(folder, max_shard_size="60KB")
    index = json.loads((pathlib.Path(folder) / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    return model


def _assert_same_weights(loaded, original):
    state = loaded.state_dict()
    for name, value in original.state_dict().items():
        assert torch.equal(state[name], value), name


def test_unquantized_load_computes_what_from_pretrained_computes(llama_dir):
    from transformers import AutoModelForCausalLM

    # The rotary frequencies are buffers computed on the CPU after the meta build: wrong ones change logits.
    loaded = load_model(llama_dir, quantize=None, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    assert torch.equal(loaded.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert torch.equal(_logits(loaded), _logits(reference))


def test_a_vocab_that_disagrees_with_the_checkpoint_is_an_error(tmp_path):
    _qwen_with_biases(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: checkpoint \[97, 64\], model \[200, 64\]"):
        load_model(str(tmp_path), quantize=None)


def test_a_hidden_size_override_that_disagrees_is_an_error(llama_dir):
    with pytest.raises(ValueError, match=r"q_proj\.weight: checkpoint \[64, 64\], model \[64, 32\]") as raised:
        load_model(llama_dir, quantize="int8", hidden_size=32)
    assert "hidden_size" in str(raised.value)  # the override is named as the likely cause


def test_the_index_decides_which_files_and_which_shard(tmp_path):
    original = _sharded(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    garbage = {name: torch.full_like(value, 7.0) for name, value in list(original.state_dict().items())[:4]}
    # A shard left over from an older save with more shards, and Mistral's consolidated file beside them:
    # neither is listed, so neither is opened (the second is not even a safetensors file).
    safetensors_torch.save_file(garbage, str(tmp_path / "model-00009-of-00009.safetensors"))
    (tmp_path / "consolidated.safetensors").write_bytes(b"not a safetensors file")
    # A listed shard that also holds a stale copy of a tensor the index puts in another shard.
    moved = next(k for k, v in index.items() if v == shards[0])
    last = tmp_path / shards[-1]
    tensors = safetensors_torch.load_file(str(last))
    safetensors_torch.save_file({**tensors, moved: torch.full_like(original.state_dict()[moved], 7.0)}, str(last),
                                metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the stray files give no unexpected-key warning either
        loaded = load_model(str(tmp_path), quantize=None, dtype=torch.float32)
    _assert_same_weights(loaded, original)


def test_index_errors_name_the_shard(tmp_path):
    _sharded(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted(set(index.values()))[1]
    (tmp_path / shard).rename(tmp_path / "elsewhere.safetensors")
    with pytest.raises(FileNotFoundError, match=shard):
        load_model(str(tmp_path))
    (tmp_path / "elsewhere.safetensors").rename(tmp_path / shard)
    moved = next(k for k, v in index.items() if v != shard)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**index, moved: shard}}))
    with pytest.raises(ValueError, match=re.escape(f"do not hold the tensor: {moved} (in {shard})")):
        load_model(str(tmp_path))
    tiny_llama().save_pretrained(tmp_path / "single")
    (tmp_path / "single" / "model.safetensors").rename(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"both model\.safetensors and model\.safetensors\.index\.json"):
        load_model(str(tmp_path))


def test_unexpected_keys_are_listed_in_a_warning(tmp_path):
    original = tiny_llama()
    original.save_pretrained(tmp_path)
    tensors = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    tensors["model.extra_head.weight"] = torch.ones(3, 3)
    tensors["model.rotary_emb.inv_freq"] = torch.ones(8)  # a buffer older versions saved: ignored quietly
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"1 checkpoint tensors .* not read: model\.extra_head\.weight$"):
        loaded = load_model(str(tmp_path), quantize=None, dtype=torch.float32)
    _assert_same_weights(loaded, original)


def test_a_missing_tensor_is_an_error_before_any_tensor_is_read(tmp_path, monkeypatch):
    tiny_llama().save_pretrained(tmp_path)
    tensors = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reads = []
    real_open = safetensors.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_tensor(self, key):
            reads.append(key)
            return self.file.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self.file, name)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    with pytest.raises(ValueError, match=r"no values for 1 tensors of LlamaForCausalLM: model\.layers\.1\.mlp\.up_proj"):
        load_model(str(tmp_path), quantize="int8")
    assert reads == []
    with pytest.raises(ValueError, match=r"no values for \d+ tensors .*model\.layers\.2\."):
        load_model(str(tmp_path), num_hidden_layers=3)  # more layers than the checkpoint has


def test_tied_weights_are_not_missing_and_fewer_layers_warn(tmp_path):
    original = _qwen_with_biases(tmp_path)  # tied: the checkpoint holds no lm_head.weight
    with pytest.warns(UserWarning, match=r"model\.layers\.1\."):
        loaded = load_model(str(tmp_path), quantize=None, dtype=torch.float32, num_hidden_layers=1)
    assert len(loaded.model.layers) == 1 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_tokens.weight, original.model.embed_tokens.weight)


@pytest.mark.parametrize("name", ["{tmp}/missing", "./no-such-model-folder", "~/no-such-model-folder-xyz",
                                  "no/such/model/folder"])
def test_a_missing_local_folder_is_no_such_folder(tmp_path, name):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_model(name.format(tmp=tmp_path))


def test_a_file_or_a_bad_name_is_refused(llama_dir, tmp_path):
    with pytest.raises(NotADirectoryError, match="is a file"):
        load_model(str(pathlib.Path(llama_dir) / "config.json"))
    with pytest.raises(ValueError, match="neither a local folder nor a Hub id"):
        load_model("not a repo id!")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"num_hidden_layers": -1}, "num_hidden_layers=-1 is not valid; use an integer >= 1"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0 is not valid"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True is not valid"),
    ({"hidden_size": "64"}, "hidden_size='64' is not valid"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan is not valid; use a finite number"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings=1 is not valid; tie_word_embeddings is True or False"),
    ({"num_hiden_layers": 2}, "has no field 'num_hiden_layers'; did you mean 'num_hidden_layers'"),
])
@pytest.mark.parametrize("random_weights", [False, True])
def test_invalid_overrides_are_refused(llama_dir, overrides, message, random_weights):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(llama_dir, random_weights=random_weights, **overrides)


def test_the_meta_build_is_local_to_the_loading_thread(llama_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    register, default_dtype = torch.nn.Module.register_parameter, torch.get_default_dtype()
    seen = {}
    real_from_config = AutoModelForCausalLM.from_config

    def from_config(config, **kwargs):
        # While load_model builds its skeleton, another thread builds a module of its own.
        seen["register_parameter"] = torch.nn.Module.register_parameter
        other = threading.Thread(target=lambda: seen.setdefault("weight", torch.nn.Linear(3, 3).weight))
        other.start()
        other.join()
        return real_from_config(config, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", from_config)
    model = load_model(llama_dir, quantize=None, dtype=torch.bfloat16)
    assert seen["register_parameter"] is register  # nothing process-wide is patched
    assert seen["weight"].device.type == "cpu" and seen["weight"].dtype == default_dtype
    assert torch.nn.Module.register_parameter is register and torch.get_default_dtype() == default_dtype
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_a_hub_id_downloads_only_the_files_the_index_lists(tmp_path, monkeypatch):
    import fnmatch

    import huggingface_hub

    remote = tmp_path / "remote"
    original = _sharded(remote)
    (remote / "consolidated.safetensors").write_bytes(b"x" * 1000)
    cache = tmp_path / "cache"
    asked = []

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        asked.append((repo_id, list(allow_patterns)))
        cache.mkdir(exist_ok=True)
        for file in remote.iterdir():
            if any(fnmatch.fnmatch(file.name, p) for p in allow_patterns):
                shutil.copy(file, cache / file.name)
        return str(cache)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loaded = load_model("someone/tiny-llama", quantize=None, dtype=torch.float32)
    _assert_same_weights(loaded, original)
    assert asked[0] == ("someone/tiny-llama", ["*.json"])
    assert not (cache / "consolidated.safetensors").exists()
    assert loaded.config._name_or_path == "someone/tiny-llama"


def test_rotary_buffers_are_rebuilt_from_the_config_when_init_weights_skips_them(llama_dir, monkeypatch):
    # transformers < 5 (and older remote code) do not compute rotary frequencies in _init_weights.
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    real = LlamaForCausalLM._init_weights
    monkeypatch.setattr(LlamaForCausalLM, "_init_weights",
                        lambda self, module: None if "Rotary" in type(module).__name__ else real(self, module))
    loaded = load_model(llama_dir, quantize=None, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    assert torch.equal(loaded.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
