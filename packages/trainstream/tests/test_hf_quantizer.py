"""from_pretrained(quantization_config=TrainStreamQuantConfig(...)): block linears quantized as each
tensor loads, the same layers wrap(quantize=...) makes, host memory below the bf16 size, and training."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import trainstream
from ts_quant import QuantLinear
from ts_testing import tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from trainstream.integrations.huggingface import (  # noqa: E402
    TrainStreamQuantConfig,
    TrainStreamTrainer,
    load_model,
    wrap_hf,
)
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_llama(dtype=torch.bfloat16).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """Biases on q/k/v and tied embeddings: the other shape of decoder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("qwen")
    torch.manual_seed(3)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


def _load(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kwargs)


def _logits(model, seed=0):
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _state(layer: QuantLinear) -> dict:
    return layer.qweight.to_state_dict()


def _load_then_wrap(folder, fmt):
    """The reference: the bf16 model loaded whole, its base frozen (norms left trainable, so wrap()
    has something to train), then quantized by wrap(quantize=fmt)."""
    model = _load(folder)
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    model, _ = trainstream.wrap(model, None, quantize=fmt, lr=1e-3)
    return model


@pytest.mark.parametrize(("fmt", "which"), [("nf4", "llama_dir"), ("int8", "llama_dir"), ("nf4", "qwen_dir"),
                                            ("fp8", "llama_dir"), ("nvfp4", "llama_dir")])
def test_quantized_load_equals_load_then_wrap(fmt, which, request):
    folder = request.getfixturevalue(which)
    loaded = _load(folder, quantization_config=TrainStreamQuantConfig(fmt))
    reference = _load_then_wrap(folder, fmt)
    try:
        ours = {n: m for n, m in loaded.named_modules() if isinstance(m, QuantLinear)}
        theirs = {n: m for n, m in reference.named_modules() if isinstance(m, QuantLinear)}
        assert len(ours) == 14 and ours.keys() == theirs.keys()  # 7 linears a block, the output layer stays
        assert type(loaded.lm_head) is torch.nn.Linear and loaded.trainstream_quantize == fmt
        for name, layer in ours.items():
            a, b = _state(layer), _state(theirs[name])
            assert a.keys() == b.keys(), name
            for key, value in a.items():  # codes and scales, bit for bit
                same = torch.equal(value, b[key]) if isinstance(value, torch.Tensor) else value == b[key]
                assert same, f"{name}: {key}"
            assert (layer.bias is None) == (theirs[name].bias is None)
            if layer.bias is not None:
                assert torch.equal(layer.bias, theirs[name].bias)
        rest = dict(reference.named_parameters())
        for name, p in loaded.named_parameters():  # everything else as transformers loads it
            assert torch.equal(p, rest[name]), name
        assert torch.equal(_logits(loaded), _logits(reference))
        if which == "qwen_dir":
            assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    finally:
        trainstream.unwrap(reference)


def test_block_size_and_modules_to_not_convert(llama_dir):
    config = TrainStreamQuantConfig("int8", block_size=32, modules_to_not_convert=["down_proj"])
    model = _load(llama_dir, quantization_config=config)
    full = _load(llama_dir)
    for name, module in model.named_modules():
        if name.endswith("down_proj"):
            assert type(module) is torch.nn.Linear
            assert torch.equal(module.weight, full.get_submodule(name).weight)
        elif isinstance(module, QuantLinear):
            assert module.qweight.block_size == 32
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 12
    # Whole dotted parts of a name: a block, or one attention; a name matching nothing is a warning.
    with pytest.warns(UserWarning, match=r"\['lm_head'\] match no linear layer of the blocks"):
        model = _load(llama_dir, quantization_config=TrainStreamQuantConfig(
            "nf4", modules_to_not_convert=["layers.0", "model.layers.1.self_attn", "lm_head"]))
    kept = sorted(n for n, m in model.named_modules() if type(m) is torch.nn.Linear)
    assert len(kept) == 7 + 4 + 1 and all(n.startswith(("model.layers.0.", "model.layers.1.self_attn.", "lm_head"))
                                          for n in kept)


def test_a_block_weight_missing_from_the_checkpoint_is_initialized_then_quantized(llama_dir, tmp_path):
    import safetensors.torch

    shutil_copy(llama_dir, tmp_path)
    tensors = safetensors.torch.load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = _load(str(tmp_path), quantization_config=TrainStreamQuantConfig("nf4"))
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14
    assert torch.isfinite(_logits(model)).all()


def test_a_shard_index_naming_the_wrong_shard_is_refused_before_loading(tmp_path):
    """transformers would leave that tensor at its random initialization ("newly initialized"); load_model
    and the quantizer refuse the checkpoint, naming the tensor and the shard."""
    tiny_llama(dtype=torch.bfloat16).save_pretrained(tmp_path, max_shard_size="60KB")
    path = tmp_path / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    moved = next(k for k, v in index["weight_map"].items() if v != shards[1] and "mlp.up_proj" in k)
    model = _load(str(tmp_path), quantization_config=TrainStreamQuantConfig("int8"))  # as saved: loads
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14
    index["weight_map"][moved] = shards[1]
    path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"do not hold the tensor: {re.escape(moved)} \\(in {shards[1]}\\)"):
        _load(str(tmp_path), quantization_config=TrainStreamQuantConfig("int8"))
    with pytest.raises(ValueError, match=f"do not hold the tensor: {re.escape(moved)}"):
        load_model(str(tmp_path), quantize="int8")


def test_config_is_validated_and_round_trips_as_a_dict(llama_dir):
    for bad, match in [({"format": "fp4"}, "format='fp4' is not valid; use one of 'int8', 'nf4'"),
                       ({"format": None}, "leave quantization_config out"),
                       ({"block_size": 0}, "block_size=0"), ({"block_size": True}, "block_size=True"),
                       # the format's own rule, at construction (before: a generic error midway through loading)
                       ({"format": "nf4", "block_size": 7}, "must be even for nf4"),
                       ({"format": "nvfp4", "block_size": 32}, "always 16 values"),
                       ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
                       ({"quantize": "nf4"}, "no option 'quantize'")]:
        with pytest.raises(ValueError, match=match):
            TrainStreamQuantConfig(**bad)
    config = TrainStreamQuantConfig("nf4", block_size=32)
    as_dict = config.to_dict()
    assert as_dict == {"quant_method": "trainstream", "format": "nf4", "block_size": 32, "modules_to_not_convert": []}
    # A plain dict names the registered method: transformers builds the config itself (TRL's model_init_kwargs).
    model = _load(llama_dir, quantization_config=as_dict)
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)
    assert model.model.layers[0].mlp.up_proj.qweight.block_size == 32
    assert isinstance(model.config.quantization_config, TrainStreamQuantConfig)


def test_a_checkpoint_claiming_trainstream_quantization_is_refused(llama_dir, tmp_path):
    shutil_copy(llama_dir, tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = TrainStreamQuantConfig("nf4").to_dict()
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not save quantized checkpoints"):
        _load(str(tmp_path))


def shutil_copy(src, dst):
    import shutil

    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), dst)


def test_saving_the_quantized_model_is_refused_with_what_to_do(llama_dir, tmp_path):
    """Before: transformers' generic "is not serializable - check out the warnings" with no way out."""
    model = _load(llama_dir, quantization_config=TrainStreamQuantConfig("nf4"))
    with pytest.raises(ValueError, match="cannot be saved with save_pretrained") as refused:
        model.save_pretrained(tmp_path / "out")
    assert "Save the adapters instead" in str(refused.value) and "merge_and_unload" in str(refused.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing half written


def _wrap_quantized(folder):
    model = _load(folder)
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    return trainstream.wrap(model, None, quantize="nf4", lr=1e-3)[0]


@pytest.mark.parametrize("how", ["wrap", "load_model", "peft_merged"])
def test_save_pretrained_of_a_model_quantized_another_way_is_refused_with_what_to_do(llama_dir, tmp_path, how):
    """Before: AttributeError: 'dict' object has no attribute 'device' inside huggingface_hub's sharding.
    A PEFT model still saves its adapters; the base it merges into refuses."""
    if how == "wrap":
        model = _wrap_quantized(llama_dir)
    elif how == "load_model":
        model = load_model(llama_dir, quantize="nf4")
    else:
        lora = _lora(load_model(llama_dir, quantize="nf4"))
        lora.save_pretrained(tmp_path / "adapters")
        assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()
        with pytest.warns(UserWarning, match="rounding"):
            model = lora.merge_and_unload()
    with pytest.raises(ValueError, match="cannot be saved with save_pretrained"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    if how == "wrap":
        trainstream.unwrap(model)  # the layers stay quantized: still refused
        with pytest.raises(ValueError, match="cannot be saved with save_pretrained"):
            model.save_pretrained(tmp_path / "out")


def test_a_failed_wrap_takes_the_save_refusal_back_with_the_layers(llama_dir, monkeypatch):
    model = _load(llama_dir)
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    import trainstream._wrap as wrapping

    def fail(*args, **kwargs):
        raise RuntimeError("injected after quantize_model")

    monkeypatch.setattr(wrapping.TrainStreamSession, "__init__", fail)
    with pytest.raises(RuntimeError, match="injected"):
        trainstream.wrap(model, None, quantize="nf4", lr=1e-3)
    assert "save_pretrained" not in vars(model) and not any(isinstance(m, QuantLinear) for m in model.modules())


class _Rows(torch.utils.data.Dataset):
    def __init__(self, count=8, seq=12):
        self.ids = torch.randint(0, 97, (count, seq), generator=torch.Generator().manual_seed(5))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _lora(model):
    transformers.set_seed(0)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                      target_modules=["q_proj", "v_proj", "down_proj"]))


def test_lora_on_the_quantized_load_trains_with_wrap(llama_dir):
    model = _lora(_load(llama_dir, quantization_config=TrainStreamQuantConfig("nf4")))
    assert isinstance(model.base_model.model.model.layers[0].mlp.down_proj.base_layer, QuantLinear)
    codes = {n: _state(m)["data"].clone() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora" in n for n in adapters)
    model, optimizer = wrap_hf(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    try:
        ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        model._trainstream_session.synchronize()
        assert losses[-1] < losses[0]
        assert all(not torch.equal(p, adapters[n]) for n, p in model.named_parameters() if n in adapters)
        for name, module in model.named_modules():  # the frozen base stays as loaded
            if isinstance(module, QuantLinear):
                assert torch.equal(_state(module)["data"], codes[name])
    finally:
        trainstream.unwrap(model)


def test_the_stock_trainer_accepts_it_and_trainstream_trainer_trains_it(llama_dir, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, logging_steps=1,
                             learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    bare = _load(llama_dir, quantization_config=TrainStreamQuantConfig("nf4"))
    with pytest.raises(ValueError, match="purely quantized"):  # transformers' own rule: adapters first
        Trainer(model=bare, args=args, train_dataset=_Rows())
    Trainer(model=_lora(bare), args=args, train_dataset=_Rows())  # its is_trainable check passes
    trainer = TrainStreamTrainer(model=_lora(_load(llama_dir, quantization_config=TrainStreamQuantConfig("nf4"))),
                                 args=args, train_dataset=_Rows())
    trainer.train()
    assert trainer.model._trainstream_session.steps == 2
    assert all(h["loss"] > 0 for h in trainer.state.log_history if "loss" in h)
    trainstream.unwrap(trainer.model)


_MEASURE = textwrap.dedent("""
    import gc, json, sys, threading, time
    import torch
    from transformers import AutoModelForCausalLM
    from trainstream.integrations.huggingface import TrainStreamQuantConfig

    def anon():  # bytes of anonymous memory: what the process allocated (file pages are page cache)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))

    def peak_while(load):
        gc.collect()
        peak, done = [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], anon())
                time.sleep(0.0005)

        base = anon()
        sampler = threading.Thread(target=sample)
        sampler.start()
        model = load()
        done.set()
        sampler.join()
        return max(peak[0], anon()) - base

    folder, warm = sys.argv[1], sys.argv[2]
    options = {"nf4": {"quantization_config": TrainStreamQuantConfig("nf4")}, "none": {}}
    for kwargs in options.values():  # lazy imports and caches, not counted
        AutoModelForCausalLM.from_pretrained(warm, dtype=torch.bfloat16, **kwargs)
    print(json.dumps({name: peak_while(lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                                                    **kwargs))
                      for name, kwargs in options.items()}))
""")


def _peak_load_bytes(folder, warm) -> dict[str, int]:
    """Peak extra anonymous memory of from_pretrained with and without the quantizer, in a fresh process
    whose freed blocks go back to the OS at once (glibc's mmap threshold), so the resident size follows
    what is live."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _MEASURE, folder, warm], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_host_memory_while_loading_stays_below_the_bf16_size(tmp_path, llama_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    # 13 M block weights, saved in fp32 (as many checkpoints are) and loaded as bf16: a plain load makes
    # a bf16 copy of every tensor; the quantized load holds one at a time beside the NF4 codes.
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with torch.device("meta"):
        bf16_bytes = sum(p.numel() * 2 for p in LlamaForCausalLM(config).parameters())
    peaks = _peak_load_bytes(str(tmp_path), llama_dir)
    assert peaks["none"] > 0.9 * bf16_bytes, (peaks, bf16_bytes)  # the measurement sees a bf16 model
    assert peaks["nf4"] < 0.5 * bf16_bytes, (peaks, bf16_bytes)


@pytest.mark.cuda
def test_loading_onto_the_gpu_quantizes_there_below_the_bf16_size(llama_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=256, max_position_embeddings=64)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    with torch.device("meta"):
        bf16_bytes = sum(p.numel() * 2 for p in LlamaForCausalLM(config).parameters())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    model = _load(str(tmp_path), quantization_config=TrainStreamQuantConfig("nf4"), device_map="cuda")
    peak = torch.cuda.max_memory_allocated() - start
    loaded = torch.cuda.memory_allocated() - start
    # The bf16 model never exists on the GPU: the peak stays below its size. What the loader holds in flight
    # besides the quantized model varies with transformers' loading (H200: 220 and 130 MB in two runs, H100:
    # 174 MB, against 269 MB of bf16 weights), so the bound is the bf16 size, not a fraction of it.
    assert loaded < 0.35 * bf16_bytes, (loaded, bf16_bytes)  # NF4: about 0.28 of bf16, scales included
    assert peak < bf16_bytes, (peak, bf16_bytes)
    layer = model.model.layers[0].mlp.up_proj
    assert isinstance(layer, QuantLinear) and layer.qweight.device.type == "cuda"
    # The same codes as quantize_model gives the bf16 model on the same device.
    reference = _load(str(tmp_path), device_map="cuda").requires_grad_(False)
    trainstream.quantize_model(reference, "nf4")
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            theirs = _state(reference.get_submodule(name))
            for key, value in _state(module).items():
                assert (torch.equal(value, theirs[key]) if isinstance(value, torch.Tensor) else value == theirs[key])
    ids = torch.randint(0, 256, (2, 16), device="cuda")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.cuda
def test_lora_on_a_gpu_quantized_load_trains(llama_dir):
    model = _lora(_load(llama_dir, quantization_config=TrainStreamQuantConfig("nf4"), device_map="cuda"))
    model, optimizer = wrap_hf(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    try:
        ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
        losses = []
        for _ in range(3):
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
    finally:
        trainstream.unwrap(model)
