"""Failures leave nothing half-done: wrap() and load_state_dict() are all or nothing, a failed host
update leaves its parameter as it was and is raised once, and unwrap() always cleans up."""

from __future__ import annotations

import copy

import pytest
import torch
import trainstream
import ts_quant
from engine_testing import assert_consistent, failing_update, snapshot
from trainstream.engine import UpdateFailed
from ts_testing import batches, loss_of, tiny_llama


def _hooks_of(model) -> int:
    grad_hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    module_hooks = sum(len(m._forward_pre_hooks) + len(m._state_dict_pre_hooks) + len(m._load_state_dict_pre_hooks)
                       for m in model.modules())
    return grad_hooks + module_hooks


def _picture(model):
    return ([type(m) for m in model.modules()], [(p.data_ptr(), p.device, p.dtype) for p in model.parameters()],
            _hooks_of(model), getattr(model, "_trainstream_session", None))


def _frozen_base():
    model = tiny_llama()
    for block in trainstream.find_blocks(model):
        for module in block.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("where", ["session", "migrate", "quantize", "after_quantize"])
def test_a_failed_wrap_leaves_model_and_optimizer_as_they_were(monkeypatch, where):
    import trainstream._session as session_module
    import trainstream._wrap as wrap_module

    model = _frozen_base()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss_of(model, batches(1)[0]).backward()
    opt.step()  # some existing state to migrate
    opt.zero_grad()
    before, opt_before = _picture(model), copy.deepcopy(opt.state_dict())

    boom = RuntimeError(f"injected failure in {where}")
    if where in ("session", "after_quantize"):
        monkeypatch.setattr(session_module.ForwardGuard, "__init__", lambda *a: (_ for _ in ()).throw(boom))
    elif where == "migrate":
        monkeypatch.setattr(wrap_module, "_checked_entry", lambda *a: (_ for _ in ()).throw(boom))
    else:
        real, calls = ts_quant.QuantLinear.from_linear, {"n": 0}

        def fail_third(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise boom
            return real(*args, **kwargs)

        monkeypatch.setattr(ts_quant.QuantLinear, "from_linear", staticmethod(fail_third))
    with pytest.raises(RuntimeError, match="injected"):
        trainstream.wrap(model, opt, quantize="int8" if "quantize" in where else None)
    assert _picture(model) == before
    assert not any(isinstance(m, ts_quant.QuantLinear) for m in model.modules())
    torch.testing.assert_close(opt.state_dict(), opt_before)
    monkeypatch.undo()
    # Nothing is left to steal the gradients of the next wrap().
    model, opt2 = trainstream.wrap(model, opt)
    loss_of(model, batches(1)[0]).backward()
    opt2.step()
    assert_consistent(model)
    assert all(s.step == 2 for s in model._trainstream_session.engine.active)
    trainstream.unwrap(model)


def _bad(state_dict, change):
    bad = copy.deepcopy(state_dict)
    change(bad)
    return bad


@pytest.mark.parametrize("change, match", [
    (lambda sd: sd["state"][3].update(exp_avg=torch.zeros(5)), "exp_avg has 5 values"),
    (lambda sd: sd["state"][3].pop("exp_avg"), "lacks exp_avg"),
    (lambda sd: sd["state"][3].update(step=torch.tensor(-1.0)), "step=-1"),
    (lambda sd: sd["state"][3].update(exp_avg_sq=sd["state"][3]["exp_avg_sq"].long()), "floating-point"),
    (lambda sd: sd["param_groups"][0].update(lr=float("nan")), "lr=nan"),
    (lambda sd: sd["param_groups"][0].update(amsgrad=True), "amsgrad"),
    (lambda sd: sd["param_groups"][0].update(betas=(0.9, 1.5)), "betas"),
    (lambda sd: sd["state"].update({999: sd["state"][0]}), "parameter 999"),
    (lambda sd: sd["param_groups"].append(sd["param_groups"][0]), "param groups"),
])
def test_a_bad_optimizer_state_dict_changes_nothing(change, match):
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-2)
    loss_of(model, batches(1)[0]).backward()
    opt.step()
    good = opt.state_dict()
    loss_of(model, batches(1, seed=3)[0]).backward()
    opt.step()
    before = snapshot(model)
    groups = copy.deepcopy(opt.param_groups[0]["lr"])
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(_bad(good, change))
    after = snapshot(model)
    assert all(a["step"] == b["step"] and torch.equal(a["master"], b["master"]) and torch.equal(a["exp_avg"], b["exp_avg"])
               for a, b in zip(after, before))
    assert opt.param_groups[0]["lr"] == groups
    opt.load_state_dict(good)  # the good one still loads
    assert all(s.step == 1 for s in model._trainstream_session.engine.active)
    trainstream.unwrap(model)


def test_a_failed_host_update_leaves_its_parameter_as_it_was_and_is_raised_once(monkeypatch):
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-2)  # each update's rounding key is its parameter's index
    loss_of(model, batches(1)[0]).backward()
    opt.step()
    before = snapshot(model)
    victim = 4
    calls = failing_update(monkeypatch, victim)
    loss_of(model, batches(1, seed=2)[0]).backward()
    with pytest.raises(UpdateFailed, match=f"parameter {victim} ") as raised:
        opt.step()
    assert calls["failed"] == 1
    assert "model.layers.0" in str(raised.value)  # named, not just numbered
    after = snapshot(model)  # synchronize(): the error is not raised a second time
    for i, (a, b) in enumerate(zip(after, before)):
        if i == victim:
            assert a["step"] == 1 and torch.equal(a["master"], b["master"]) and torch.equal(a["exp_avg"], b["exp_avg"])
            assert torch.equal(a["weight"], b["weight"])
        else:
            assert a["step"] == 2
    assert_consistent(model)
    opt.zero_grad()
    loss_of(model, batches(1, seed=3)[0]).backward()
    opt.step()  # trains again, the victim included
    after = snapshot(model)
    assert after[victim]["step"] == 2 and all(a["step"] == 3 for i, a in enumerate(after) if i != victim)


def test_unwrap_removes_everything_even_after_a_failed_update(monkeypatch):
    model = tiny_llama()
    hooks = _hooks_of(model)
    model, _opt = trainstream.wrap(model, lr=1e-2, guard_params=False)
    failing_update(monkeypatch, 2)
    loss_of(model, batches(1)[0]).backward()  # queues the updates; the failure is not reported yet
    with pytest.raises(UpdateFailed):
        trainstream.unwrap(model)
    assert not hasattr(model, "_trainstream_session")
    assert _hooks_of(model) == hooks
    loss_of(model, batches(1)[0]).backward()
    assert all(p.grad is not None for p in model.parameters())  # plain autograd again
    again, _ = trainstream.wrap(model, lr=1e-3)
    trainstream.unwrap(again)


@pytest.mark.cuda
def test_a_failed_wrap_moves_the_model_back_to_where_it_was(monkeypatch):
    import trainstream._session as session_module

    model = _frozen_base()
    before = _picture(model)
    monkeypatch.setattr(session_module.ForwardGuard, "__init__", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        trainstream.wrap(model, device="cuda", quantize="nf4")
    assert _picture(model) == before  # on the CPU, the very same tensors, no QuantLinear
