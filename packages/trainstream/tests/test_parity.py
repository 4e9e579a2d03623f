"""wrap() trains like torch.optim.AdamW with fp32 master weights: same losses, same weights."""

from __future__ import annotations

import copy

import pytest
import torch
import trainstream
from ts_testing import batches, loss_of, max_param_diff, model_pair, tiny_llama

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)


def _loop(model, opt, steps, accumulation, scheduler, clip=None):
    """The same training loop for both runs; `clip` is the reference's clip_grad_norm_ call."""
    sched = scheduler(opt) if scheduler else None
    losses = []
    data = batches(steps * accumulation)
    for step in range(steps):
        for micro in range(accumulation):
            loss = loss_of(model, data[step * accumulation + micro])
            loss.backward()
        if clip:
            clip()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses


def train_reference(model, steps, accumulation=1, max_norm=None, scheduler=None):
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    clip = (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)) if max_norm is not None else None
    return _loop(model, opt, steps, accumulation, scheduler, clip)


def train_wrapped(model, steps, accumulation=1, max_norm=None, scheduler=None, **options):
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    model, opt = trainstream.wrap(model, opt, accumulation_steps=accumulation, max_grad_norm=max_norm, **options)
    losses = _loop(model, opt, steps, accumulation, scheduler)
    model._trainstream_session.synchronize()
    return model, opt, losses


def test_twenty_steps_match_torch_adamw():
    ours, ref = model_pair()
    ref_losses = train_reference(ref, 20)
    ours, _, losses = train_wrapped(ours, 20)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert max_param_diff(ours, ref) <= 1e-5
    assert losses[-1] < losses[0]  # it actually trained


def test_accumulation_matches():
    ours, ref = model_pair()
    ref_losses = train_reference(ref, 6, accumulation=3)
    ours, _, losses = train_wrapped(ours, 6, accumulation=3)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert max_param_diff(ours, ref) <= 1e-5


def test_clipping_matches_clip_grad_norm():
    ours, ref = model_pair()
    ref_losses = train_reference(ref, 8, max_norm=0.5)
    ours, _, losses = train_wrapped(ours, 8, max_norm=0.5)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert max_param_diff(ours, ref) <= 1e-5
    # the norm is computed over gradients that already left the model's memory
    assert ours._trainstream_session.engine.last_grad_norm > 0.5


def test_scheduler_edits_learning_rate():
    ours, ref = model_pair()
    schedule = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.3)  # noqa: E731
    ref_losses = train_reference(ref, 9, scheduler=schedule)
    ours, opt, losses = train_wrapped(ours, 9, scheduler=schedule)
    assert opt.param_groups[0]["lr"] == pytest.approx(HYPER["lr"] * 0.3**3)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert max_param_diff(ours, ref) <= 1e-5


def test_param_groups_with_different_hyper_parameters():
    base = tiny_llama()
    ref = copy.deepcopy(base)

    def groups(model):
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}]

    ref_opt = torch.optim.AdamW(groups(ref), lr=2e-3, foreach=False)
    ours, opt = trainstream.wrap(base, torch.optim.AdamW(groups(base), lr=2e-3))
    for ids in batches(5):
        for model, o in ((ref, ref_opt), (ours, opt)):
            loss_of(model, ids).backward()
            o.step()
            o.zero_grad()
    ours._trainstream_session.synchronize()
    assert max_param_diff(ours, ref) <= 1e-5


def test_bf16_moments_track_fp32_training():
    fp32_model, bf16_model = tiny_llama(), tiny_llama()
    _, _, fp32_losses = train_wrapped(fp32_model, 20, moment_dtype="float32")
    _, opt, bf16_losses = train_wrapped(bf16_model, 20, moment_dtype="bfloat16")
    assert opt.state_dict()["state"][0]["exp_avg"].dtype == torch.bfloat16
    assert bf16_losses[-1] < bf16_losses[0] - 0.3
    assert abs(bf16_losses[-1] - fp32_losses[-1]) < 0.05 * fp32_losses[-1]


def test_existing_adamw_state_is_migrated():
    ours, ref = model_pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **HYPER)
    our_opt = torch.optim.AdamW(ours.parameters(), foreach=False, **HYPER)
    data = batches(6)
    for ids in data[:3]:  # both start with three stock steps
        for model, o in ((ref, ref_opt), (ours, our_opt)):
            loss_of(model, ids).backward()
            o.step()
            o.zero_grad()
    ours, our_opt = trainstream.wrap(ours, our_opt)
    for ids in data[3:]:
        for model, o in ((ref, ref_opt), (ours, our_opt)):
            loss_of(model, ids).backward()
            o.step()
            o.zero_grad()
    ours._trainstream_session.synchronize()
    assert max_param_diff(ours, ref) <= 1e-5
    assert int(our_opt.state_dict()["state"][0]["step"]) == 6
