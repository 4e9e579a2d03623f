"""PyTorch habits on a wrapped model: torch.nn.utils' clipping, which would find no gradients and clip nothing,
is refused with the fix (wrap's max_grad_norm); the same calls on other parameters, and after unwrap(), are
torch's own."""

from __future__ import annotations

import pytest
import torch
import trainstream
from test_engine_state_machine import _net


def _backward(model, seed=0):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    model(x.to(next(model.parameters()).device)).square().sum().backward()


@pytest.mark.parametrize("name", ["clip_grad_norm_", "clip_grad_value_"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_clipping_a_wrapped_model_s_gradients_is_refused_with_the_fix(name, clip):
    model, opt = trainstream.wrap(_net(0), lr=0.05, max_grad_norm=clip)
    _backward(model)
    function = getattr(torch.nn.utils, name)
    with pytest.raises(RuntimeError, match=f"Pass max_grad_norm= to trainstream.wrap\\(\\) \\(now {clip}\\)"):
        function(model.parameters(), 1.0)  # before: returned 0 and clipped nothing
    opt.step()
    opt.zero_grad()
    trainstream.unwrap(model)
    _backward(model)  # unwrapped: torch's own, gradients in .grad
    reference = _net(0)
    reference.load_state_dict(model.state_dict())
    _backward(reference)
    assert torch.equal(torch.as_tensor(function(model.parameters(), 0.1) or 0.0),
                       torch.as_tensor(function(reference.parameters(), 0.1) or 0.0))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))


def test_other_models_clip_as_torch_does_while_one_is_wrapped():
    wrapped, _ = trainstream.wrap(_net(0), lr=0.05)
    plain, reference = _net(1), _net(1)
    for m in (plain, reference):
        _backward(m, seed=3)
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    assert norm > 0.1  # it clipped
    expected = trainstream._habits._ORIGINALS["clip_grad_norm_"](reference.parameters(), 0.1)
    assert torch.equal(norm, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), reference.parameters()))
    trainstream.unwrap(wrapped)


def test_the_engine_clips_like_torch_when_given_max_grad_norm():
    model, opt = trainstream.wrap(_net(0), lr=0.05, max_grad_norm=0.5)
    reference = _net(0)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for seed in range(3):
        _backward(model, seed)
        opt.step()
        opt.zero_grad()
        _backward(reference, seed)
        expected = trainstream._habits._ORIGINALS["clip_grad_norm_"](reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        assert opt.stats()["last_grad_norm"] == pytest.approx(float(expected), rel=1e-5)
    model._trainstream_session.synchronize()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    trainstream.unwrap(model)


def _stock_steps(lrs: list[float], clip=None) -> torch.nn.Module:
    """torch.optim.AdamW with lrs[i] for step i (set between backward and step, where torch applies it)."""
    reference = _net(0)
    opt = torch.optim.AdamW(reference.parameters(), lr=lrs[0])
    for seed, lr in enumerate(lrs):
        _backward(reference, seed)
        opt.param_groups[0]["lr"] = lr
        if clip is not None:
            trainstream._habits._ORIGINALS["clip_grad_norm_"](reference.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return reference


def _same(model, reference) -> bool:
    """Equal to host AdamW's rounding against torch's (an lr of another step moves weights by ~1e-2)."""
    pairs = zip(model.state_dict().values(), reference.state_dict().values(), strict=True)
    return max(float((a - b).abs().max()) for a, b in pairs) < 1e-5


@pytest.mark.parametrize("key, value", [("lr", 0.02), ("weight_decay", 0.5), ("betas", (0.8, 0.99))])
def test_a_hyper_parameter_edited_between_backward_and_step_is_refused_after_a_whole_step(key, value):
    """Updates start during backward (no clipping): the step runs entirely with the values its first gradient
    saw and the edit is refused at step(), naming it; the step counts, and the next one uses the new value."""
    model, opt = trainstream.wrap(_net(0), lr=0.05, offload=True, threads=1)
    _backward(model, 0)
    opt.param_groups[0][key] = value  # before: silently ignored for this step
    with pytest.raises(RuntimeError, match=f"changed between backward\\(\\) and step\\(\\): {key.rstrip('s')}"):
        opt.step()
    opt.zero_grad()
    assert all(s["step"] == 1 for s in opt.state_dict()["state"].values())
    reference = _net(0)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    _backward(reference, 0)
    ref_opt.step()  # the whole step with the old value
    ref_opt.zero_grad()
    assert _same(model, reference)
    _backward(model, 1)
    opt.step()  # the edit is the value now: no refusal
    ref_opt.param_groups[0][key] = value
    _backward(reference, 1)
    ref_opt.step()
    assert _same(model, reference)
    trainstream.unwrap(model)


def test_edits_between_backward_and_step_apply_when_updates_wait_for_step():
    """With max_grad_norm every update waits for the norm at step(): the edit applies, as in torch."""
    model, opt = trainstream.wrap(_net(0), lr=0.05, max_grad_norm=1e6, offload=True, threads=1)
    for seed, lr in enumerate([0.05, 0.02, 0.01]):
        _backward(model, seed)
        opt.param_groups[0]["lr"] = lr
        opt.step()
        opt.zero_grad()
    assert _same(model, _stock_steps([0.05, 0.02, 0.01], clip=1e6))
    trainstream.unwrap(model)


def test_edits_before_backward_apply_as_a_scheduler_s_do():
    model, opt = trainstream.wrap(_net(0), lr=0.05, offload=True, threads=1)
    for seed, lr in enumerate([0.05, 0.02, 0.01]):
        opt.param_groups[0]["lr"] = lr
        _backward(model, seed)
        opt.step()
        opt.zero_grad()
    assert _same(model, _stock_steps([0.05, 0.02, 0.01]))
    trainstream.unwrap(model)


def test_zero_grad_set_to_none_false_zeroes_the_gradients_still_held_as_torch_does():
    """Mid-window (accumulating) the gradients are in .grad: zeroed in place, the same tensors, as torch's
    zero_grad(set_to_none=False); training after it matches torch's."""
    model, opt = trainstream.wrap(_net(0), lr=0.05, accumulation_steps=2, offload=True, threads=1)
    reference = _net(0)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for m in (model, reference):
        _backward(m, 0)
    held = [p.grad for p in model.parameters()]
    assert all(g is not None for g in held)
    opt.zero_grad(set_to_none=False)  # before: None
    ref_opt.zero_grad(set_to_none=False)
    for p, g, r in zip(model.parameters(), held, reference.parameters(), strict=True):
        assert p.grad is g and torch.equal(p.grad, r.grad) and not p.grad.any()
    for seed in (1, 2):  # the window starts again from the zeros
        for m in (model, reference):
            _backward(m, seed)
    opt.step()
    ref_opt.step()
    assert _same(model, reference)
    opt.zero_grad(set_to_none=False)  # gradients the engine took are gone: None stays None, as torch leaves it
    assert all(p.grad is None for p in model.parameters())
    trainstream.unwrap(model)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options, placement, applies", [
    ({"offload": True}, "host", False),  # host AdamW, started as the gradients arrive
    ({"offload": True, "optimizer_mode": "gpu"}, "mapped", False),  # the CUDA kernel, per gradient as it arrives
    ({"offload": "auto"}, "device", True),  # in VRAM after step 1: one fused launch at step()
])
def test_on_a_gpu_an_edit_after_backward_applies_or_is_refused_by_where_updates_start(options, placement, applies):
    model, opt = trainstream.wrap(_net(0).cuda(), lr=0.05, threads=1, **options)
    reference = _net(0).cuda()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for seed in range(4):  # offload="auto" moves the state once the activation policy settled
        for m, o in ((model, opt), (reference, ref_opt)):
            _backward(m, seed)
            o.step()
            o.zero_grad()
        if set(opt.stats()["placement"]) == {placement}:
            break
    assert set(opt.stats()["placement"]) == {placement}
    _backward(model, 10)
    opt.param_groups[0]["lr"] = 0.01
    if applies:
        opt.step()
    else:
        with pytest.raises(RuntimeError, match=r"lr 0\.05 -> 0\.01"):
            opt.step()
    opt.zero_grad()
    _backward(reference, 10)
    ref_opt.param_groups[0]["lr"] = 0.01 if applies else 0.05
    ref_opt.step()
    model._trainstream_session.synchronize()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    trainstream.unwrap(model)
