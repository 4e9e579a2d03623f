"""The reference's documented names (issue 19): profile_hardware, the session attributes,
quantize_model's pin_budget, decoder_layers, TrainStreamCallback and TrainStreamTrainer's keys."""

from __future__ import annotations

import json

import pytest
import torch
import trainstream
import ts_pinned
import ts_planner
from ts_testing import batches, loss_of, tiny_llama

# ---- profile_hardware ------------------------------------------------------------------


def test_profile_hardware_measures_caches_and_summarizes(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path))
    profile = trainstream.profile_hardware(threads=1)
    assert isinstance(profile, trainstream.HardwareProfile) and isinstance(profile, ts_planner.HardwareProfile)
    assert profile.host_adamw_params_per_s > 1e6 and profile.host_adamw_threads == 1
    assert profile.host_copy_gbps > 0 and profile.host_cores >= 1
    text = profile.summary()
    assert "host AdamW" in text and "G params/s on 1 threads" in text and "host copy" in text
    if not torch.cuda.is_available():
        assert profile.matmul_bf16_tflops is None and profile.link_h2d_gbps is None
    # The second call reads the cache; force measures again.
    (rates,) = tmp_path.glob("trainstream-rates-*-t1.json")
    data = json.loads(rates.read_text())
    data["host_adamw_params_per_s"] = 7.0
    rates.write_text(json.dumps(data))
    assert trainstream.profile_hardware(threads=1).host_adamw_params_per_s == 7.0
    assert trainstream.profile_hardware(threads=1, force=True).host_adamw_params_per_s != 7.0
    rates.write_text("{broken")
    assert trainstream.profile_hardware(threads=1).host_adamw_params_per_s > 1e6  # measured again


@pytest.mark.parametrize("kwargs, match", [({"threads": 0}, "threads=0"), ({"device": "cpu"}, "not a GPU"),
                                           ({"device": 1.5}, "device=1.5")])
def test_profile_hardware_refuses_bad_arguments(tmp_path, monkeypatch, kwargs, match):
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=match):
        trainstream.profile_hardware(**kwargs)


@pytest.mark.cuda
def test_profile_hardware_on_a_gpu(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path))
    profile = trainstream.profile_hardware(0, force=True)
    assert profile.gpu and profile.link_h2d_gbps > 1 and profile.matmul_bf16_tflops > 10
    assert "bf16 matmul" in profile.summary()


# ---- the session's attributes --------------------------------------------------------------


def test_session_attributes():
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-3, max_grad_norm=1.0)
    session = model._trainstream_session
    assert isinstance(session, trainstream.TrainStreamSession)
    assert session.config.max_grad_norm == 1.0 and session.config.lr == 1e-3  # the options in effect
    assert session.adapting is False  # on the CPU nothing is left to tune
    assert session.peer is None
    assert session.steps == 0
    kinds = [event.kind for event in session.events]
    assert "plan" in kinds and "optimizer" in kinds and len(session.events) == len(kinds)
    for ids in batches(3):
        loss_of(model, ids).backward()
        opt.step()
        opt.zero_grad()
    assert session.steps == 3
    assert trainstream.memory_report(model)["events"] == session.events.lines()
    trainstream.unwrap(model)


# ---- quantize_model(block_size=, pin_budget=) ---------------------------------------------------


def _frozen_llama():
    model = tiny_llama()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def test_quantize_model_block_size_and_pin_budget():
    before = ts_pinned.pinned_stats()["by_tag"].get("weights", 0)
    model = _frozen_llama()
    reference = _frozen_llama()
    result = trainstream.quantize_model(model, "int8", block_size=32, pin_budget=10_000)
    plain = trainstream.quantize_model(reference, "int8", block_size=32)
    layers = [m for m in model.modules() if hasattr(m, "qweight")]
    assert all(m.qweight.block_size == 32 for m in layers)
    assert "pinned_bytes" not in plain
    pinned = result["pinned_bytes"]
    assert 0 < pinned <= 10_000
    assert ts_pinned.pinned_stats()["by_tag"].get("weights", 0) - before >= pinned
    # Same codes and outputs as an unpinned quantization.
    x = torch.randint(0, 97, (1, 8))
    assert torch.equal(model(input_ids=x).logits, reference(input_ids=x).logits)
    every = trainstream.quantize_model(_frozen_llama(), "nf4", pin_budget=1 << 40)
    assert every["pinned_bytes"] == every["bytes_after"]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="pin_budget"):
            trainstream.quantize_model(_frozen_llama(), "int8", pin_budget=bad)


def test_the_rates_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    """Beside ts-planner's cache: TRAINSTREAM_CACHE_DIR, else $XDG_CACHE_HOME/trainstream, else ~/.cache."""
    import types

    from trainstream._hardware import _cache_file

    base = types.SimpleNamespace(gpu=None, host_cores=4, host_ram_bytes=8 << 30)
    monkeypatch.delenv("TRAINSTREAM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _cache_file(base, True, None).parent == tmp_path / "xdg" / "trainstream"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _cache_file(base, True, None).parent == tmp_path / "home" / ".cache" / "trainstream"
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path / "own"))
    assert _cache_file(base, True, None).parent == tmp_path / "own"


# ---- Hugging Face: decoder_layers, TrainStreamCallback, TrainStreamTrainer keys ---------------------


class _Rows(torch.utils.data.Dataset):
    def __init__(self, count=8, seq=12, vocab=97):
        self.ids = torch.randint(0, vocab, (count, seq), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(tmp_path, **overrides):
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, learning_rate=2e-3, max_steps=4,
                logging_steps=2, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    base.update(overrides)
    return TrainingArguments(**base)


def test_decoder_layers_through_peft():
    from trainstream.integrations.huggingface import decoder_layers, wrap_hf

    model = tiny_llama(layers=3)
    assert decoder_layers(model) == list(model.model.layers)
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_llama(layers=3), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    layers = decoder_layers(lora)
    assert len(layers) == 3 and layers[0] is lora.get_base_model().model.layers[0]
    assert decoder_layers(torch.nn.Linear(2, 2)) == []
    wrapped, _ = wrap_hf(model, lr=1e-3)
    assert wrapped._trainstream_session.config.blocks == list(model.model.layers)
    trainstream.unwrap(wrapped)


@pytest.mark.parametrize("attach", [False, True])
def test_callback_logs_trainstream_metrics_with_a_stock_trainer(tmp_path, capsys, attach):
    from trainstream.integrations.huggingface import TrainStreamCallback
    from transformers import Trainer

    model = tiny_llama()
    opt = trainstream.OffloadAdamW(model.parameters(), lr=2e-3, max_grad_norm=1.0 if attach else None)
    if attach:
        opt.attach(model)
    trainer = Trainer(model=model, args=_args(tmp_path, max_grad_norm=0.0 if attach else 1.0),
                      train_dataset=_Rows(), optimizers=(opt, None), callbacks=[TrainStreamCallback(opt)])
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for entry in logged:
        assert entry["trainstream/step_s"] > 0
        assert entry["trainstream/host_state_fraction"] == 1.0
        assert entry["trainstream/d2h_GB"] >= 0 and entry["trainstream/h2d_GB"] >= 0
        if attach:
            assert entry["trainstream/grad_norm"] > 0
        else:
            assert entry["trainstream/host_update_s"] > 0
    out = capsys.readouterr().out
    # Printed once per log, in the Trainer's own line (before: also on a line of the callback's own).
    assert out.count("trainstream/step_s") == out.count("'loss'") + out.count("'train_runtime'") > 0, out
    if attach:
        trainstream.unwrap(model)
    with pytest.raises(ValueError, match="OffloadAdamW"):
        TrainStreamCallback(torch.optim.AdamW(tiny_llama().parameters()))


@pytest.mark.parametrize("disable_tqdm", [True, False])
@pytest.mark.parametrize("given", ["callbacks", "add_callback"])
def test_callback_metrics_are_printed_once_on_their_own_line(tmp_path, capsys, disable_tqdm, given):
    """Given to the Trainer, the metrics are in the Trainer's log line; added afterwards, that line was printed
    before they existed and the callback prints them, on a line of their own (before: glued to the bar)."""
    from trainstream.integrations.huggingface import TrainStreamCallback
    from transformers import Trainer

    model = tiny_llama()
    opt = trainstream.OffloadAdamW(model.parameters(), lr=2e-3)
    callback = TrainStreamCallback(opt)
    trainer = Trainer(model=model, args=_args(tmp_path, disable_tqdm=disable_tqdm), train_dataset=_Rows(),
                      optimizers=(opt, None), callbacks=[callback] if given == "callbacks" else None)
    if given == "add_callback":
        trainer.add_callback(callback)
    trainer.train()
    printed = capsys.readouterr()
    shown = [line.split("\r")[-1] for line in (printed.out + printed.err).split("\n")]
    metric_lines = [line for line in shown if "trainstream/step_s" in line]
    assert len(metric_lines) == 3  # two log steps and the end of training, each once
    own = [line for line in metric_lines if line.startswith("trainstream/step_s=")]
    assert len(own) == (3 if given == "add_callback" else 0), metric_lines


def test_trainer_keys_are_checked_up_front_and_used(tmp_path, monkeypatch):
    from trainstream.integrations import huggingface as hf

    with pytest.raises(ValueError, match=r"unknown wrap\(\) option.*bogus.*chunked_loss"):
        hf.TrainStreamTrainer(model=tiny_llama(), args=_args(tmp_path / "a"), train_dataset=_Rows(),
                              trainstream={"bogus": 1})
    with pytest.raises(ValueError, match="loss_chunk_size=0"):
        hf.TrainStreamTrainer(model=tiny_llama(), args=_args(tmp_path / "b"), train_dataset=_Rows(),
                              trainstream={"loss_chunk_size": 0})
    seen = []
    real = hf.causal_lm_loss
    monkeypatch.setattr(hf, "causal_lm_loss", lambda *a, **k: seen.append(k["chunk_size"]) or real(*a, **k))
    trainer = hf.TrainStreamTrainer(model=tiny_llama(), args=_args(tmp_path / "c"), train_dataset=_Rows(),
                                    trainstream={"loss_chunk_size": 5, "moment_dtype": "bf16"})
    trainer.train()
    assert seen and set(seen) == {5}
    assert trainer.model._trainstream_session.moment_dtype == torch.bfloat16
    trainstream.unwrap(trainer.model)
    seen.clear()
    trainer = hf.TrainStreamTrainer(model=tiny_llama(), args=_args(tmp_path / "d"), train_dataset=_Rows(),
                                    trainstream={"chunked_loss": False})
    trainer.train()
    assert not seen  # the model's own loss
    trainstream.unwrap(trainer.model)


def test_trainer_attaches_an_offload_adamw_given_through_optimizers(tmp_path):
    from trainstream.integrations.huggingface import TrainStreamTrainer

    model = tiny_llama()
    opt = trainstream.OffloadAdamW(model.parameters(), lr=2e-3)
    trainer = TrainStreamTrainer(model=model, args=_args(tmp_path), train_dataset=_Rows(), optimizers=(opt, None))
    trainer.train()
    assert opt.attached and model._trainstream_session.optimizer is opt and model._trainstream_session.steps == 4
    trainstream.unwrap(model)


def test_causal_lm_logprobs_takes_model_kwargs_and_models_with_their_own_logits():
    from trainstream.integrations.huggingface import causal_lm_logprobs

    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    plain = causal_lm_logprobs(model, ids)
    positions = torch.arange(10).expand(2, 10)
    torch.testing.assert_close(causal_lm_logprobs(model, ids, position_ids=positions), plain)
    assert not torch.allclose(causal_lm_logprobs(model, ids, position_ids=positions * 3), plain)  # RoPE: only relative offsets matter
    # A soft-capped head is not a plain projection: the model's own logits are used.
    capped = tiny_llama()
    capped.config.final_logit_softcapping = 30.0  # Llama ignores it: both paths must then agree
    labels = ids.clone()
    labels[:, :4] = -100
    for average in (False, True):
        torch.testing.assert_close(causal_lm_logprobs(capped, ids, labels, average=average),
                                   causal_lm_logprobs(model, ids, labels, average=average), rtol=1e-5, atol=1e-5)


def test_load_model_quant_block_size(tmp_path):
    from trainstream.integrations.huggingface import load_model

    tiny_llama().save_pretrained(tmp_path)
    for size in (32, None):
        model = load_model(str(tmp_path), quantize="int8", quant_block_size=size, progress=False)
        layers = [m for m in model.modules() if hasattr(m, "qweight")]
        assert layers and {m.qweight.block_size for m in layers} == {size or 64}
    with pytest.raises(ValueError, match="block"):
        load_model(str(tmp_path), quantize="int8", quant_block_size=3, progress=False)
