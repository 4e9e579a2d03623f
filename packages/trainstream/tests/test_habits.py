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
    model(x).square().sum().backward()


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
