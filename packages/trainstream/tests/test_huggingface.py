"""TrainStreamTrainer against the stock Trainer, resume from its checkpoints, and causal-LM log-probs."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import trainstream
from trainstream.integrations.huggingface import TrainStreamTrainer, causal_lm_logprobs, decoder_and_head
from transformers import Trainer, TrainingArguments
from ts_testing import tiny_llama


class _Rows(torch.utils.data.Dataset):
    def __init__(self, count=16, seq=12, vocab=97, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[:3] = -100  # a prompt that does not count
        return {"input_ids": self.ids[i], "labels": labels}


def _args(tmp_path, **overrides):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=2e-3, max_grad_norm=0.5, max_steps=6, logging_steps=1, save_strategy="no",
                report_to=[], use_cpu=True, seed=0, data_seed=0, lr_scheduler_type="linear", warmup_steps=1,
                disable_tqdm=True, dataloader_num_workers=0)
    base.update(overrides)
    return TrainingArguments(**base)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _model(lora):
    """The full model (lora None), or PEFT LoRA on `lora`'s target modules ("all-linear" included)."""
    model = tiny_llama()
    if lora is None:
        return model
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=lora))


@pytest.mark.parametrize(("lora", "bf16"), [(None, False), (None, True), ("all-linear", False),
                                            ("all-linear", True), (["q_proj", "v_proj"], True)])
def test_matches_the_stock_trainer(tmp_path, lora, bf16):
    """A full fine-tune and LoRA on every linear layer, fp32 and bf16 autocast (the Trainer's bf16=True), with
    accumulation 2 and clipping on: the same losses and weights as the stock Trainer. Under bf16 the chunked
    loss rounds the output layer's gradient per chunk (the stock loss rounds it once), so there the exact
    comparison runs with chunked_loss=False and the chunked run is held to bf16's rounding."""
    if lora is not None:
        pytest.importorskip("peft")
    stock = Trainer(model=_model(lora), args=_args(tmp_path / "stock", bf16=bf16), train_dataset=_Rows())
    stock.train()
    if bf16:
        chunked = TrainStreamTrainer(model=_model(lora), args=_args(tmp_path / "chunked", bf16=True),
                                     train_dataset=_Rows())
        chunked.train()
        assert _losses(chunked) == pytest.approx(_losses(stock), rel=2e-3)
        chunked.model._trainstream_session.synchronize()
        for a, b in zip(chunked.model.parameters(), stock.model.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-2)  # a few Adam steps of lr 2e-3 at most
        trainstream.unwrap(chunked.model)
    ours = TrainStreamTrainer(model=_model(lora), args=_args(tmp_path / "ours", bf16=bf16), train_dataset=_Rows(),
                              trainstream={"chunked_loss": not bf16})
    ours.train()
    assert isinstance(ours.optimizer.optimizer if hasattr(ours.optimizer, "optimizer") else ours.optimizer,
                      trainstream.OffloadAdamW)
    assert _losses(ours) == pytest.approx(_losses(stock), rel=1e-4)
    session = ours.model._trainstream_session
    session.synchronize()
    assert session.config.accumulation_steps == 2 and session.config.max_grad_norm == 0.5
    for a, b in zip(ours.model.parameters(), stock.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


@pytest.mark.parametrize("options", [{}, {"param_offload": True}])
def test_torch_compile_compiles_the_decoder_blocks_and_trains_alike(tmp_path, options):
    # The chunked loss runs the decoder itself, past the model Accelerate compiled: the blocks are
    # compiled in place at optimizer creation (without that, torch_compile=True compiled nothing here);
    # blocks whose weights stream compile their forward, their fetch hooks eager around it.
    from trainstream.activations.compiled_forward import CompiledForward

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = TrainStreamTrainer(model=tiny_llama(layers=4), args=_args(tmp_path / "eager"), train_dataset=_Rows(),
                               trainstream=options)
    eager.train()
    assert not torch._dynamo.utils.counters["frames"]["ok"]
    args = _args(tmp_path / "compiled", torch_compile=True, torch_compile_backend="aot_eager")
    compiled = TrainStreamTrainer(model=tiny_llama(layers=4), args=args, train_dataset=_Rows(), trainstream=options)
    compiled.train()
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0
    layers = compiled.model.model.layers
    whole = [layer._compiled_call_impl is not None for layer in layers]
    forward_only = [isinstance(layer.__dict__.get("forward"), CompiledForward) for layer in layers]
    assert (forward_only if options else whole) == [True] * 4
    assert _losses(compiled) == _losses(eager)
    assert any("blocks compiled in place" in e.message for e in compiled.model._trainstream_session.events)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _fields(args):
    return {f.name: copy.deepcopy(getattr(args, f.name)) for f in dataclasses.fields(args)}


@pytest.mark.parametrize("positional", [False, True])
def test_the_users_training_arguments_are_left_untouched(tmp_path, positional):
    args = _args(tmp_path / "shared")
    before = _fields(args)
    if positional:
        ours = TrainStreamTrainer(tiny_llama(), args, train_dataset=_Rows())
    else:
        ours = TrainStreamTrainer(model=tiny_llama(), args=args, train_dataset=_Rows())
    ours.train()
    assert ours.args is not args and ours.args.max_grad_norm == 0.0  # the Trainer's copy: the optimizer clips
    assert args.max_grad_norm == 0.5
    assert _fields(args) == before
    # A stock Trainer reusing the same arguments still clips: it trains exactly as one given fresh ones.
    reused = Trainer(model=tiny_llama(), args=args, train_dataset=_Rows())
    reused.train()
    fresh = Trainer(model=tiny_llama(), args=_args(tmp_path / "fresh"), train_dataset=_Rows())
    fresh.train()
    unclipped = Trainer(model=tiny_llama(), args=_args(tmp_path / "unclipped", max_grad_norm=0.0),
                        train_dataset=_Rows())
    unclipped.train()
    assert all(h["grad_norm"] > 0.5 for h in reused.state.log_history if "grad_norm" in h)
    for a, b in zip(reused.model.parameters(), fresh.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.allclose(a, b) for a, b in zip(reused.model.parameters(), unclipped.model.parameters()))


def test_resume_from_checkpoint_continues(tmp_path):
    straight = TrainStreamTrainer(model=tiny_llama(), args=_args(tmp_path / "a"), train_dataset=_Rows())
    straight.train()
    first = TrainStreamTrainer(model=tiny_llama(), args=_args(tmp_path / "b", save_strategy="steps", save_steps=3),
                               train_dataset=_Rows())
    first.train()
    resumed = TrainStreamTrainer(model=tiny_llama(seed=9), args=_args(tmp_path / "b"), train_dataset=_Rows())
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-3"))
    resumed.model._trainstream_session.synchronize()
    straight.model._trainstream_session.synchronize()
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_unsupported_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="Adam/AdamW"):
        TrainStreamTrainer(model=tiny_llama(), args=_args(tmp_path, optim="sgd"), train_dataset=_Rows())
    with pytest.raises(ValueError, match="loss_chunk_size"):
        TrainStreamTrainer(model=tiny_llama(), args=_args(tmp_path), train_dataset=_Rows(),
                           trainstream={"loss_chunk_size": 0})
    with pytest.raises(ValueError, match="TrainingArguments"):
        TrainStreamTrainer(model=tiny_llama(), args=_args(tmp_path), train_dataset=_Rows(),
                           trainstream={"max_grad_norm": 1.0})


def test_causal_lm_logprobs_match_the_model_logits():
    model = tiny_llama()
    ids = torch.randint(0, 97, (3, 10), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[:, :4] = -100
    ours = causal_lm_logprobs(model, ids, labels, chunk_size=7)
    logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[:, :-1]
    target = labels[:, 1:]
    ref = (logp.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1) * (target != -100)).sum(1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert decoder_and_head(torch.nn.Linear(3, 3)) is None


def test_bf16_runs_the_layers_in_bf16_as_the_stock_trainer_does(tmp_path):
    """bf16=True: the chunked loss runs the decoder inside the Trainer's autocast, as the stock forward does
    (it ran in float32 before), and the losses follow the stock trainer's."""
    runs = {}
    for name, cls in (("stock", Trainer), ("ours", TrainStreamTrainer)):
        model = tiny_llama()
        seen = []
        model.model.layers[0].self_attn.q_proj.register_forward_hook(
            lambda module, args, output, seen=seen: seen.append(output.dtype) if module.training else None)
        trainer = cls(model=model, args=_args(tmp_path / name, bf16=True, max_steps=3), train_dataset=_Rows())
        trainer.train()
        runs[name] = (set(seen), _losses(trainer))
    assert runs["stock"][0] == runs["ours"][0] == {torch.bfloat16}
    assert runs["ours"][1] == pytest.approx(runs["stock"][1], rel=2e-2)  # bf16 rounding, chunked against whole


def test_wrap_warns_nothing_deprecated_and_still_sees_hf_checkpointing():
    import warnings

    from trainstream.activations.recompute import uses_hf_checkpointing

    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        wrapped, _ = trainstream.wrap(model, lr=1e-3)
        trainstream.unwrap(wrapped)
    blocks = list(model.model.layers)
    assert not uses_hf_checkpointing(model, blocks)
    model.gradient_checkpointing_enable()
    assert uses_hf_checkpointing(model, blocks)
