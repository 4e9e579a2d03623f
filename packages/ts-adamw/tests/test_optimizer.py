"""ts_adamw.AdamW vs torch.optim.AdamW: steps, param groups, schedulers, state_dict in torch's format."""

from __future__ import annotations

import copy

import pytest
import torch
import ts_adamw


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _groups(model, **extra):
    first, second = model[0], model[2]
    return [{"params": list(first.parameters())},
            {"params": list(second.parameters()), "lr": 5e-3, "weight_decay": 0.0, **extra}]


def _loss(model, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=gen)
    return model(x).square().mean()


def _train(model, opt, steps, start=0, scheduler=None):
    for i in range(start, start + steps):
        opt.zero_grad()
        _loss(model, i).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _assert_close(a, b, tol=1e-6):
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert (pa.detach() - pb.detach()).abs().max().item() <= tol


@pytest.mark.parametrize("maximize", [False, True])
def test_groups_match_torch_over_20_steps(maximize):
    ref, ours = _model(), _model()
    kw = {"lr": 1e-2, "betas": (0.85, 0.99), "eps": 1e-7, "weight_decay": 0.05, "maximize": maximize}
    t_opt = torch.optim.AdamW(_groups(ref), **kw)
    o_opt = ts_adamw.AdamW(_groups(ours), **kw)
    _train(ref, t_opt, 20)
    _train(ours, o_opt, 20)
    _assert_close(ref, ours)
    for pr, po in zip(ref.parameters(), ours.parameters()):
        sr, so = t_opt.state[pr], o_opt.state[po]
        assert so["step"].item() == sr["step"].item() == 20.0
        assert (so["exp_avg_sq"] - sr["exp_avg_sq"]).abs().max().item() <= 1e-6


def test_schedulers_edit_lr():
    ref, ours = _model(), _model()
    t_opt, o_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), ts_adamw.AdamW(ours.parameters(), lr=1e-2)
    lam = lambda s: 1.0 / (1 + s)  # noqa: E731
    _train(ref, t_opt, 10, scheduler=torch.optim.lr_scheduler.LambdaLR(t_opt, lam))
    _train(ours, o_opt, 10, scheduler=torch.optim.lr_scheduler.LambdaLR(o_opt, lam))
    assert o_opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 11)
    _assert_close(ref, ours)


def test_state_dict_round_trip_continues_identically():
    a = _model()
    opt_a = ts_adamw.AdamW(a.parameters(), lr=1e-2, moment_dtype=torch.bfloat16, seed=3)
    _train(a, opt_a, 5)
    sd = copy.deepcopy(opt_a.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["state"][0]["exp_avg"].dtype == torch.bfloat16
    b = copy.deepcopy(a)
    opt_b = ts_adamw.AdamW(b.parameters(), lr=1.0, moment_dtype=torch.bfloat16, seed=3)
    opt_b.load_state_dict(sd)
    assert opt_b.param_groups[0]["lr"] == 1e-2
    _train(a, opt_a, 5, start=5)
    _train(b, opt_b, 5, start=5)
    _assert_close(a, b, tol=0.0)


def test_loads_a_torch_adamw_state_dict():
    ref, ours = _model(), _model()
    t_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    _train(ref, t_opt, 7)
    ours.load_state_dict(ref.state_dict())
    o_opt = ts_adamw.AdamW(ours.parameters())
    o_opt.load_state_dict(t_opt.state_dict())  # copies: the live torch state is not aliased
    assert o_opt.state[next(ours.parameters())]["exp_avg"].data_ptr() != t_opt.state[next(ref.parameters())][
        "exp_avg"].data_ptr()
    _train(ref, t_opt, 13, start=7)
    _train(ours, o_opt, 13, start=7)
    _assert_close(ref, ours)
    # and the other way: torch loads ours
    t2 = torch.optim.AdamW(ref.parameters())
    t2.load_state_dict(o_opt.state_dict())
    assert t2.state[next(ref.parameters())]["step"].item() == 20.0


def test_bf16_moments_load_from_fp32_state():
    ref, ours = _model(), _model()
    t_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(ref, t_opt, 3)
    o_opt = ts_adamw.AdamW(ours.parameters(), moment_dtype=torch.bfloat16)
    o_opt.load_state_dict(t_opt.state_dict())
    state = o_opt.state[next(ours.parameters())]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg"].is_contiguous()
    _train(ours, o_opt, 2, start=3)
    assert state["step"].item() == 5.0


def test_closure_params_without_grads_and_threads():
    model = _model()
    frozen = torch.nn.Parameter(torch.ones(4))
    opt = ts_adamw.AdamW([*model.parameters(), frozen], lr=1e-2, threads=1)

    def closure():
        opt.zero_grad()
        loss = _loss(model, 0)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert frozen not in opt.state and torch.equal(frozen.detach(), torch.ones(4))
    assert opt.state[next(model.parameters())]["step"].item() == 1.0


def test_params_added_later_keep_their_own_step_count():
    ref, ours = _model(), _model()
    t_opt = torch.optim.AdamW(list(ref[0].parameters()), lr=1e-2)
    o_opt = ts_adamw.AdamW(list(ours[0].parameters()), lr=1e-2)
    _train(ref, t_opt, 3)
    _train(ours, o_opt, 3)
    t_opt.add_param_group({"params": list(ref[2].parameters())})
    o_opt.add_param_group({"params": list(ours[2].parameters())})
    _train(ref, t_opt, 4, start=3)
    _train(ours, o_opt, 4, start=3)
    _assert_close(ref, ours)
