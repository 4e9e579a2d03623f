"""TRL's SFT, DPO and GRPO trainers with TrainStream against their stock runs (CPU, tiny Llama + LoRA),
clipping honoured or refused, the logged grad_norm, and DPO's precomputed reference columns."""

from __future__ import annotations

import pytest
import torch
import trainstream
from trainstream.integrations.huggingface import TrainStreamCallback, TrainStreamTrainer, wrap_hf
from ts_testing import tiny_llama

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from trainstream.integrations import trl as ts_trl  # noqa: E402  (needs trl)

CLIP = 0.05  # well below the gradient norms here (about 0.3): clipping changes every step
PAIRS = [{"prompt": "the cat", "chosen": " sat on the mat.", "rejected": " ran off!"},
         {"prompt": "a dog", "chosen": " barks.", "rejected": " is quiet, yes"},
         {"prompt": "hello", "chosen": " world!", "rejected": " there?"},
         {"prompt": "sky is", "chosen": " blue.", "rejected": " green and red"}] * 2
TEXTS = [{"text": t} for t in ["the cat sat on the mat.", "a dog barks at night!", "hello world, again?",
                               "sky is blue and wide."]] * 2


def _tokenizer():
    """A character-level tokenizer built in memory (no network): ids fit tiny_llama's 97-word vocabulary."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz .,!?"
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def _lora(targets=("q_proj", "v_proj")):
    return peft.LoraConfig(r=4, target_modules=targets if isinstance(targets, str) else list(targets))


# What users run beside the docs' example: LoRA on every linear layer, and bf16 autocast (TRL's default on a GPU).
MATRIX = [pytest.param(("q_proj", "v_proj"), False, id="qv-fp32"), pytest.param("all-linear", False, id="all-fp32"),
          pytest.param(("q_proj", "v_proj"), True, id="qv-bf16"), pytest.param("all-linear", True, id="all-bf16")]


def _common(tmp_path, **overrides):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                learning_rate=5e-3, max_grad_norm=CLIP, logging_steps=1, report_to=[], use_cpu=True,
                save_strategy="no", disable_tqdm=True, seed=0, data_seed=0)
    base.update(overrides)
    return base


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if "loss" in h and key in h]


def _dpo(cls, tmp_path, model=None, trainer_kwargs=None, targets=("q_proj", "v_proj"), **overrides):
    config = trl.DPOConfig(**_common(tmp_path, **overrides))
    kwargs = dict(trainer_kwargs or {})
    if model is None:
        kwargs["peft_config"] = _lora(targets)  # TRL wraps the model in PEFT inside __init__
    trainer = cls(model=model if model is not None else tiny_llama(), args=config,
                  train_dataset=datasets.Dataset.from_list(PAIRS), processing_class=_tokenizer(), **kwargs)
    return trainer, config


def _assert_same_run(ours, stock):
    assert len(_logged(ours, "loss")) == len(_logged(stock, "loss")) == 2  # the second after a clipped update
    assert _logged(ours, "loss") == pytest.approx(_logged(stock, "loss"), abs=1e-5)
    assert all(norm > CLIP for norm in _logged(stock, "grad_norm"))  # clipping was active
    assert _logged(ours, "grad_norm") == pytest.approx(_logged(stock, "grad_norm"), rel=1e-5)
    theirs = dict(stock.model.named_parameters())
    # The trained adapter ("default"; TRL adds a frozen "ref" copy to a model that comes with one).
    lora = [name for name, p in ours.model.named_parameters() if "lora" in name and p.requires_grad]
    assert lora and set(lora) <= set(theirs)
    mine = dict(ours.model.named_parameters())
    for name in lora:
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize(("targets", "bf16"), MATRIX)
def test_sft_matches_stock_with_clipping_and_accumulation(tmp_path, targets, bf16):
    runs = {}
    for cls in (trl.SFTTrainer, ts_trl.TrainStreamSFTTrainer):
        config = trl.SFTConfig(**_common(tmp_path / cls.__name__, bf16=bf16))
        trainer = cls(model=tiny_llama(), args=config, train_dataset=datasets.Dataset.from_list(TEXTS),
                      processing_class=_tokenizer(), peft_config=_lora(targets))
        trainer.train()
        runs[cls] = trainer
        assert config.max_grad_norm == CLIP  # the caller's config is not changed
    ours = runs[ts_trl.TrainStreamSFTTrainer]
    ours.model._trainstream_session.synchronize()
    assert ours.model._trainstream_session.config.max_grad_norm == CLIP
    assert ours.model._trainstream_session.config.accumulation_steps == 2
    _assert_same_run(ours, runs[trl.SFTTrainer])
    trainstream.unwrap(ours.model)


@pytest.mark.parametrize(("targets", "bf16"), MATRIX)
def test_dpo_matches_stock_with_clipping(tmp_path, targets, bf16):
    stock, _ = _dpo(trl.DPOTrainer, tmp_path / "stock", targets=targets, bf16=bf16)
    stock.train()
    ours, config = _dpo(ts_trl.TrainStreamDPOTrainer, tmp_path / "ours", targets=targets, bf16=bf16)
    ours.train()
    ours.model._trainstream_session.synchronize()
    assert isinstance(ours.optimizer.optimizer, trainstream.OffloadAdamW)  # inside Accelerate's wrapper
    assert config.max_grad_norm == CLIP and ours.args.max_grad_norm == 0.0
    _assert_same_run(ours, stock)
    trainstream.unwrap(ours.model)
    if targets != ("q_proj", "v_proj") or bf16:
        return  # the attached-optimizer variant once, on the docs' example
    # An optimizer attached beforehand with the config's clipping and accumulation trains the same way.
    model, opt = _wrapped_lora(accumulation_steps=2, max_grad_norm=CLIP)
    attached, _ = _dpo(ts_trl.TrainStreamDPOTrainer, tmp_path / "attached", model=model, bf16=bf16,
                       trainer_kwargs={"optimizers": (opt, None)})
    attached.train()
    attached.model._trainstream_session.synchronize()
    _assert_same_run(attached, stock)
    trainstream.unwrap(model)


def test_dpo_precomputed_reference_columns_come_from_reference_logprobs(tmp_path, monkeypatch):
    stock, _ = _dpo(trl.DPOTrainer, tmp_path / "stock", precompute_ref_log_probs=True)
    calls = []
    real = ts_trl.reference_logprobs
    monkeypatch.setattr(ts_trl, "reference_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    # A different seed for the data order would change nothing here: the columns are per example.
    ours, _ = _dpo(ts_trl.TrainStreamDPOTrainer, tmp_path / "ours", precompute_ref_log_probs=True)
    assert len(calls) == 4  # 8 pairs, 2 per batch: TRL's own reference pass did not run
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        torch.testing.assert_close(torch.tensor(ours.train_dataset[column]), torch.tensor(stock.train_dataset[column]),
                                   rtol=0, atol=1e-5)
    stock.train()
    ours.train()
    _assert_same_run(ours, stock)
    trainstream.unwrap(ours.model)


def _grpo(cls, tmp_path, reward, targets=("q_proj", "v_proj"), bf16=False, **kwargs):
    config = trl.GRPOConfig(**_common(tmp_path, max_steps=2, gradient_accumulation_steps=1, num_generations=2,
                                      max_completion_length=6, bf16=bf16))
    prompts = datasets.Dataset.from_list([{"prompt": p} for p in ["the cat", "a dog", "hello", "sky is"]])
    return cls(model=tiny_llama(), reward_funcs=reward, args=config, train_dataset=prompts,
               processing_class=_tokenizer(), peft_config=_lora(targets), **kwargs)


def _reward(completions, **kwargs):
    return [float(len(c)) + c.count("a") for c in completions]


@pytest.mark.parametrize(("targets", "bf16"), [m for m in MATRIX if m.id != "qv-fp32"])  # qv-fp32: the test below
def test_grpo_matches_stock_on_every_linear_and_under_bf16(tmp_path, targets, bf16):
    """The same sampled completions, rewards, losses, norms and adapters as TRL's GRPOTrainer."""
    stock = _grpo(trl.GRPOTrainer, tmp_path / "stock", _reward, targets=targets, bf16=bf16)
    stock.train()
    ours = _grpo(ts_trl.TrainStreamGRPOTrainer, tmp_path / "ours", _reward, targets=targets, bf16=bf16)
    ours.train()
    ours.model._trainstream_session.synchronize()
    for key in ("loss", "reward", "grad_norm"):
        assert len(_logged(ours, key)) == 2
        assert _logged(ours, key) == pytest.approx(_logged(stock, key), rel=1e-5, abs=1e-7), key
    theirs = dict(stock.model.named_parameters())
    lora = [(n, p) for n, p in ours.model.named_parameters() if "lora" in n and p.requires_grad]
    assert len(lora) > (8 if targets == "all-linear" else 0)
    for name, p in lora:
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=1e-5, msg=name)
    trainstream.unwrap(ours.model)


def test_grpo_trains_two_steps_with_a_python_reward_as_stock_does(tmp_path, monkeypatch):
    seen = []

    def reward(completions, **kwargs):
        seen.append(len(completions))
        return [float(len(c)) + c.count("a") for c in completions]

    stock = _grpo(trl.GRPOTrainer, tmp_path / "stock", reward)
    stock.train()
    caches = []
    from trainstream.integrations import kvcache

    real = kvcache.TrainStreamCache.__init__
    monkeypatch.setattr(kvcache.TrainStreamCache, "__init__", lambda self, *a, **k: caches.append(k) or real(self, *a, **k))
    for kv in (False, True):
        caches.clear()
        seen.clear()
        ours = _grpo(ts_trl.TrainStreamGRPOTrainer, tmp_path / f"ours{kv}", reward, trainstream={"kv_cache": kv})
        before = {n: p.detach().clone() for n, p in ours.model.named_parameters() if p.requires_grad}
        ours.train()
        session = ours.model._trainstream_session
        session.synchronize()
        assert session.steps == 2 and session.config.max_grad_norm == CLIP
        assert sum(seen) >= 4  # completions scored by the Python function
        assert len(caches) == (2 if kv else 0)  # one paged cache per generation, sized prompt + completion
        assert all(k["max_tokens"] > 6 for k in caches)
        # Same sampled completions, rewards, losses and norms as the stock trainer (the paged cache included).
        for key in ("loss", "reward", "grad_norm"):
            assert _logged(ours, key) == pytest.approx(_logged(stock, key), rel=1e-5, abs=1e-7)
        assert any(not torch.equal(p, before[n]) for n, p in ours.model.named_parameters() if p.requires_grad)
        trainstream.unwrap(ours.model)
    with pytest.raises(ValueError, match="kv_cache"):
        _grpo(ts_trl.TrainStreamGRPOTrainer, tmp_path / "bad", reward, trainstream={"kv_cache": "yes"})


def _wrapped_lora(**options):
    model = tiny_llama()
    transformers.set_seed(0)  # as TRL does before it adds the adapters: the same LoRA initialization
    model = peft.get_peft_model(model, _lora())
    # The Trainer's own AdamW would have these hyper-parameters (TrainingArguments' weight_decay is 0).
    opt = trainstream.OffloadAdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3, weight_decay=0.0)
    return wrap_hf(model, opt, **options)


def test_a_stock_trainer_with_an_attached_optimizer_refuses_clipping_it_cannot_do(tmp_path):
    model, opt = _wrapped_lora(accumulation_steps=2)
    trainer, _ = _dpo(trl.DPOTrainer, tmp_path / "a", model=model,
                      trainer_kwargs={"optimizers": (opt, None), "callbacks": [TrainStreamCallback(opt, verbose=False)]})
    with pytest.raises(ValueError, match=r"max_grad_norm=0.05.*clips at nothing.*silently"):
        trainer.train()
    assert model._trainstream_session.steps == 0  # refused before the first step
    trainstream.unwrap(model)

    model, opt = _wrapped_lora(max_grad_norm=CLIP)  # accumulation left at 1, the config says 2
    trainer, _ = _dpo(trl.DPOTrainer, tmp_path / "b", model=model,
                      trainer_kwargs={"optimizers": (opt, None), "callbacks": [TrainStreamCallback(opt, verbose=False)]})
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2.*accumulation_steps=2"):
        trainer.train()
    trainstream.unwrap(model)


def test_a_trainstream_trainer_given_an_attached_optimizer_checks_it(tmp_path):
    model, opt = _wrapped_lora(accumulation_steps=2)
    trainer = ts_trl.TrainStreamDPOTrainer(
        model=model, args=trl.DPOConfig(**_common(tmp_path / "a")), train_dataset=datasets.Dataset.from_list(PAIRS),
        processing_class=_tokenizer(), optimizers=(opt, None))
    with pytest.raises(ValueError, match=r"TrainStreamDPOTrainer has max_grad_norm=0\.05"):
        trainer.train()
    assert model._trainstream_session.steps == 0
    trainstream.unwrap(model)


def test_options_are_checked_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"trainstream=\{\.\.\.\}: .*bogus"):
        _dpo(lambda **k: ts_trl.TrainStreamDPOTrainer(trainstream={"bogus": 1}, **k), tmp_path / "a")
    with pytest.raises(ValueError, match="comes from the trainer's config"):
        _dpo(lambda **k: ts_trl.TrainStreamDPOTrainer(trainstream={"max_grad_norm": 1.0}, **k), tmp_path / "b")
    with pytest.raises(ValueError, match="Adam/AdamW"):
        _dpo(ts_trl.TrainStreamDPOTrainer, tmp_path / "c", optim="sgd")


def test_trainstream_trainer_logs_the_real_grad_norm(tmp_path):
    from transformers import Trainer, TrainingArguments

    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 97, (8, 10),
                                                                       generator=torch.Generator().manual_seed(1))]
    runs = {}
    for cls in (Trainer, TrainStreamTrainer):
        args = TrainingArguments(**_common(tmp_path / cls.__name__))
        runs[cls] = cls(model=tiny_llama(), args=args, train_dataset=rows)
        runs[cls].train()
    assert _logged(runs[TrainStreamTrainer], "grad_norm") == pytest.approx(_logged(runs[Trainer], "grad_norm"),
                                                                            rel=1e-5)
    trainstream.unwrap(runs[TrainStreamTrainer].model)
    # Without clipping TrainStream measures no norm: grad_norm is left out rather than logged as 0.
    unclipped = TrainStreamTrainer(model=tiny_llama(), args=TrainingArguments(**_common(tmp_path / "u",
                                                                                         max_grad_norm=0.0)),
                                   train_dataset=rows)
    unclipped.train()
    assert _logged(unclipped, "grad_norm") == [] and len(_logged(unclipped, "loss")) == 2
    trainstream.unwrap(unclipped.model)


@pytest.mark.xfail(not hasattr(trainstream.OffloadAdamW, "train"), strict=True,
                   reason="needs OffloadAdamW.train() calling integrations.huggingface._refuse_unhonoured_trainer")
def test_a_stock_trainer_without_the_callback_is_refused_at_its_first_step(tmp_path):
    model, opt = _wrapped_lora(accumulation_steps=2)  # no clipping; the config asks max_grad_norm=0.05
    trainer, _ = _dpo(trl.DPOTrainer, tmp_path, model=model, trainer_kwargs={"optimizers": (opt, None)}, max_steps=1)
    try:
        with pytest.raises(ValueError, match=r"DPOTrainer has max_grad_norm=0\.05.*silently"):
            trainer.train()
        assert model._trainstream_session.steps == 0
    finally:
        trainstream.unwrap(model)


def test_sft_from_a_path_quantized_on_load_through_model_init_kwargs(tmp_path):
    from trainstream.integrations.huggingface import TrainStreamQuantConfig
    from ts_quant import QuantLinear

    folder = tmp_path / "model"
    tiny_llama().save_pretrained(folder)
    runs = {}
    for cls in (trl.SFTTrainer, ts_trl.TrainStreamSFTTrainer):
        init = {"quantization_config": TrainStreamQuantConfig("nf4"), "dtype": torch.float32}
        config = trl.SFTConfig(**_common(tmp_path / cls.__name__), model_init_kwargs=init)
        trainer = cls(model=str(folder), args=config, train_dataset=datasets.Dataset.from_list(TEXTS),
                      processing_class=_tokenizer(), peft_config=_lora())
        assert isinstance(trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer, QuantLinear)
        trainer.train()
        runs[cls] = trainer
    ours = runs[ts_trl.TrainStreamSFTTrainer]
    ours.model._trainstream_session.synchronize()
    _assert_same_run(ours, runs[trl.SFTTrainer])
    trainstream.unwrap(ours.model)
