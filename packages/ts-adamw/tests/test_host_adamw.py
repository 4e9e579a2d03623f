"""HostAdamW: the engine object with stored hyper-parameters, against torch.optim.AdamW."""

import pytest
import torch
import ts_adamw


def test_steps_match_torch_adamw_and_async_equals_sync():
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(5000, generator=g)
    grads = [torch.randn(5000, generator=g) for _ in range(5)]
    ref = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, foreach=False)
    engine = ts_adamw.HostAdamW(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    sync_p, async_p = p0.clone(), p0.clone()
    state = {k: (torch.zeros(5000), torch.zeros(5000)) for k in ("sync", "async")}
    for step, grad in enumerate(grads, start=1):
        ref.grad = grad.clone()
        opt.step()
        engine.step(sync_p, grad, *state["sync"], step=step)
        engine.step_async(async_p, grad, *state["async"], step=step).wait()
    assert (sync_p - ref.detach()).abs().max().item() <= 1e-6
    assert torch.equal(sync_p, async_p)


def test_overrides_and_norm():
    engine = ts_adamw.HostAdamW(lr=0.0)
    p = torch.ones(10)
    engine.step(p, torch.ones(10), torch.zeros(10), torch.zeros(10), step=1)
    assert torch.equal(p, torch.ones(10))  # lr 0: nothing moves
    engine.step(p, torch.ones(10), torch.zeros(10), torch.zeros(10), step=1, lr=0.1, weight_decay=0.0)
    assert torch.all(p < 1)
    assert engine.grad_norm([torch.full((4,), 3.0), torch.full((4,), 4.0)]) == pytest.approx(10.0)


def test_bad_arguments():
    with pytest.raises(ValueError):
        ts_adamw.HostAdamW(lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        ts_adamw.HostAdamW(betas=(0.9,))
    with pytest.raises(ValueError, match="unknown HostAdamW"):
        ts_adamw.HostAdamW().step(torch.ones(2), torch.ones(2), torch.zeros(2), torch.zeros(2), step=1, amsgrad=True)
