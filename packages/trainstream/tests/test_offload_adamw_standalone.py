"""OffloadAdamW used as a plain torch optimizer, without wrap(): against torch.optim.AdamW."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import trainstream
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_testing import batches, loss_of, max_param_diff, tiny_llama

TOL = 2e-6  # fp32 AdamW, a handful of steps: the host engine and torch differ by rounding only


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _data(count: int, seed: int = 5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 6, generator=generator) for _ in range(count)]


def _run(model, opt, data, scheduler=None):
    for x in data:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


@settings(max_examples=25, deadline=None)
@given(lr=st.floats(1e-4, 5e-2), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999),
       eps=st.sampled_from([1e-8, 1e-6, 1e-3]), weight_decay=st.floats(0.0, 0.3), maximize=st.booleans(),
       steps=st.integers(1, 6))
def test_matches_torch_adamw_over_hyper_parameters(lr, beta1, beta2, eps, weight_decay, maximize, steps):
    ours, theirs = _mlp(), _mlp()
    kwargs = {"lr": lr, "betas": (beta1, beta2), "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
    opt = trainstream.OffloadAdamW(ours.parameters(), **kwargs)
    ref = torch.optim.AdamW(theirs.parameters(), **kwargs)
    data = _data(steps)
    _run(ours, opt, data)
    _run(theirs, ref, data)
    assert max_param_diff(ours, theirs) < TOL
    for p, q in zip(ours.parameters(), theirs.parameters()):
        mine, torch_state = opt.state[p], ref.state[q]
        assert float(mine["step"]) == float(torch_state["step"]) == steps
        torch.testing.assert_close(mine["exp_avg"], torch_state["exp_avg"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(mine["exp_avg_sq"], torch_state["exp_avg_sq"], atol=1e-7, rtol=1e-5)
        assert torch.equal(mine["master_param"], p.detach())  # fp32: the weight is the master


def test_tiny_llama_twenty_steps_match_torch_adamw():
    ours, theirs = tiny_llama(), tiny_llama()
    opt = trainstream.OffloadAdamW(ours.parameters(), lr=2e-3)
    ref = torch.optim.AdamW(theirs.parameters(), lr=2e-3)
    for ids in batches(20):
        for model, o in ((ours, opt), (theirs, ref)):
            loss_of(model, ids).backward()
            o.step()
            o.zero_grad()
    assert max_param_diff(ours, theirs) < 1e-5


def test_lr_scheduler_and_param_groups():
    ours, theirs = _mlp(), _mlp()

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 1e-2}, {"params": m[2].parameters(), "lr": 3e-3,
                                                            "weight_decay": 0.0}]

    opt = trainstream.OffloadAdamW(groups(ours))
    ref = torch.optim.AdamW(groups(theirs))
    lam = lambda step: 1.0 / (1 + step)  # noqa: E731
    _run(ours, opt, _data(5), torch.optim.lr_scheduler.LambdaLR(opt, lam))
    _run(theirs, ref, _data(5), torch.optim.lr_scheduler.LambdaLR(ref, lam))
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] != 1e-2
    assert max_param_diff(ours, theirs) < TOL


def test_add_param_group_midway():
    ours, theirs = _mlp(), _mlp()
    opt = trainstream.OffloadAdamW(ours[0].parameters(), lr=1e-2)
    ref = torch.optim.AdamW(theirs[0].parameters(), lr=1e-2)
    _run(ours, opt, _data(2))
    _run(theirs, ref, _data(2))
    opt.add_param_group({"params": list(ours[2].parameters()), "lr": 5e-3})
    ref.add_param_group({"params": list(theirs[2].parameters()), "lr": 5e-3})
    _run(ours, opt, _data(3, seed=9))
    _run(theirs, ref, _data(3, seed=9))
    assert max_param_diff(ours, theirs) < TOL
    with pytest.raises(ValueError, match="betas"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "betas": (1.5, 0.9)})


def test_state_dict_round_trip_resumes_bit_identically():
    data = _data(6)
    straight = _mlp()
    opt = trainstream.OffloadAdamW(straight.parameters(), lr=1e-2)
    _run(straight, opt, data)

    first = _mlp()
    first_opt = trainstream.OffloadAdamW(first.parameters(), lr=1e-2)
    _run(first, first_opt, data[:3])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _mlp(seed=7)
    resumed.load_state_dict(saved["model"])
    resumed_opt = trainstream.OffloadAdamW(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(saved["opt"])
    _run(resumed, resumed_opt, data[3:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_rewrites_the_weights_from_the_masters():
    trained = _mlp()
    opt = trainstream.OffloadAdamW(trained.parameters(), lr=1e-2)
    _run(trained, opt, _data(2))
    other = _mlp(seed=11)  # the model's own weights are not loaded: the masters are the training state
    other_opt = trainstream.OffloadAdamW(other.parameters(), lr=1e-2)
    other_opt.load_state_dict(opt.state_dict())
    for a, b in zip(trained.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_loads_a_torch_adamw_state_and_torch_loads_ours():
    ours, theirs = _mlp(), _mlp()
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    _run(theirs, ref, _data(3))
    ours.load_state_dict(theirs.state_dict())
    opt = trainstream.OffloadAdamW(ours.parameters(), lr=1e-2)
    opt.load_state_dict(ref.state_dict())  # no master_param: the masters come from the weights
    _run(ours, opt, _data(3, seed=2))
    _run(theirs, ref, _data(3, seed=2))
    assert max_param_diff(ours, theirs) < TOL
    plain = copy.deepcopy(ours)
    back = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    back.load_state_dict(opt.state_dict())
    assert float(back.state[next(plain.parameters())]["step"]) == 6


def test_bad_state_dict_changes_nothing():
    model = _mlp()
    opt = trainstream.OffloadAdamW(model.parameters(), lr=1e-2)
    _run(model, opt, _data(2))
    before = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    bad = copy.deepcopy(before)
    bad["state"][3]["exp_avg_sq"] = -bad["state"][3]["exp_avg_sq"] - 1
    with pytest.raises(ValueError, match="exp_avg_sq has negative values"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(before)
    bad["state"][1]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match="has 5 values"):
        opt.load_state_dict(bad)
    for step in (1e30, 2**31, -1, float("nan"), 2.5):  # before: 1e30 loaded, and every later step() failed
        bad = copy.deepcopy(before)
        bad["state"][2]["step"] = torch.tensor(step)
        with pytest.raises(ValueError, match=r"use a whole number in \[0, 2\*\*31 - 1\)"):
            opt.load_state_dict(bad)
    after = opt.state_dict()
    for key, entry in before["state"].items():
        for name, value in entry.items():
            assert torch.equal(after["state"][key][name], value)
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))


def test_clipping_matches_clip_grad_norm():
    ours, theirs = _mlp(), _mlp()
    opt = trainstream.OffloadAdamW(ours.parameters(), lr=1e-2, max_grad_norm=0.05)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for x in _data(4):
        ours(x).pow(2).mean().mul(10).backward()
        opt.step()
        opt.zero_grad()
        theirs(x).pow(2).mean().mul(10).backward()
        norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
        ref.step()
        ref.zero_grad()
        assert abs(opt.stats()["last_grad_norm"] - float(norm)) < 1e-5 * max(1.0, float(norm))
    assert max_param_diff(ours, theirs) < TOL


def test_a_weight_edited_between_steps_is_where_training_continues():
    ours, theirs = _mlp(), _mlp()
    opt = trainstream.OffloadAdamW(ours.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    _run(ours, opt, _data(2))
    _run(theirs, ref, _data(2))
    with torch.no_grad():
        for model in (ours, theirs):
            model[0].weight.mul_(0.5)
            model[2].bias.fill_(0.25)
    _run(ours, opt, _data(2, seed=3))
    _run(theirs, ref, _data(2, seed=3))
    assert max_param_diff(ours, theirs) < TOL


def test_bf16_weights_keep_fp32_masters():
    model = _mlp().to(torch.bfloat16)
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    opt = trainstream.OffloadAdamW(model.parameters(), lr=1e-3)
    ref = torch.optim.AdamW(fp32, lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        for p, q in zip(model.parameters(), fp32):
            g = torch.randn(p.shape, generator=generator).to(torch.bfloat16)
            p.grad, q.grad = g, g.float()
        opt.step()
        ref.step()
    for p, q in zip(model.parameters(), fp32):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, q.detach(), atol=TOL, rtol=0)
        assert torch.equal(p.detach(), master.to(torch.bfloat16))  # the weight is its rounded master


def test_bf16_moments_when_asked():
    model = _mlp()
    opt = trainstream.OffloadAdamW(model.parameters(), lr=1e-2, moment_dtype="bf16")
    _run(model, opt, _data(3))
    state = opt.state[next(model.parameters())]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


def test_closure_zero_grad_and_frozen_parameters():
    ours, theirs = _mlp(), _mlp()
    ours[0].bias.requires_grad_(False)
    theirs[0].bias.requires_grad_(False)
    opt = trainstream.OffloadAdamW(ours.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for x in _data(3):
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad(set_to_none=False)

            def closure(model=model, x=x):
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss

            assert o.step(closure) is not None
    assert max_param_diff(ours, theirs) < TOL
    assert ours[0].bias not in opt.state or not opt.state[ours[0].bias]
    assert ours[0].weight.grad is not None and ours[0].bias.grad is None


def test_attach_later_continues_and_unwrap_detaches():
    data = batches(8)
    ours, theirs = tiny_llama(), tiny_llama()
    opt = trainstream.OffloadAdamW(ours.parameters(), lr=2e-3)
    ref = torch.optim.AdamW(theirs.parameters(), lr=2e-3)

    def train(model, o, ids_list):
        for ids in ids_list:
            loss_of(model, ids).backward()
            o.step()
            o.zero_grad()

    train(ours, opt, data[:3])  # standalone
    assert not opt.attached
    assert opt.attach(ours) is ours
    assert opt.attached and ours._trainstream_session.optimizer is opt
    train(ours, opt, data[3:6])  # streamed by the engine, from the standalone state
    opt.synchronize()
    trainstream.unwrap(ours)
    assert not opt.attached
    train(ours, opt, data[6:])  # standalone again, from the engine's state
    train(theirs, ref, data)
    assert max_param_diff(ours, theirs) < 1e-5
    assert float(opt.state[next(ours.parameters())]["step"]) == 8
    opt.attach(ours)
    with pytest.raises(ValueError, match="already attached"):
        opt.attach(ours)
    trainstream.unwrap(ours)


def test_a_deep_copy_trains_like_the_original():
    model = _mlp()
    opt = trainstream.OffloadAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.05)
    _run(model, opt, _data(2))
    model_copy, opt_copy = copy.deepcopy((model, opt))
    assert opt_copy.wrap_options == {"max_grad_norm": 0.05} and not opt_copy.attached
    _run(model, opt, _data(3, seed=4))
    _run(model_copy, opt_copy, _data(3, seed=4))
    for a, b in zip(model.parameters(), model_copy.parameters()):
        assert torch.equal(a, b)


def test_engine_settings_are_checked_at_construction():
    params = _mlp().parameters()
    with pytest.raises(ValueError, match="mode='fast'"):
        trainstream.OffloadAdamW(params, mode="fast")
    with pytest.raises(ValueError, match="max_grad_norm"):
        trainstream.OffloadAdamW(_mlp().parameters(), max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="amsgrad"):
        trainstream.OffloadAdamW([{"params": _mlp().parameters(), "amsgrad": True}])


def test_stock_trainer_with_optimizers_matches_torch_adamw(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import Dataset

    class Ids(Dataset):
        def __init__(self):
            self.rows = [row for ids in batches(4, batch=2) for row in ids]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    def train(optimizer_class):
        model = tiny_llama()
        opt = optimizer_class(model.parameters(), lr=2e-3)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / optimizer_class.__name__),
                                              per_device_train_batch_size=2, max_steps=4, logging_steps=1,
                                              max_grad_norm=1.0, report_to=[], save_strategy="no",
                                              use_cpu=True, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Ids(), optimizers=(opt, None))
        trainer.train()
        return model, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    ours, our_losses = train(trainstream.OffloadAdamW)
    theirs, their_losses = train(torch.optim.AdamW)
    assert len(our_losses) == 4
    assert our_losses == pytest.approx(their_losses, abs=1e-5)
    assert max_param_diff(ours, theirs) < 1e-5


@pytest.mark.cuda
def test_cuda_parameters_match_torch_adamw_and_stay_ordered():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ours, theirs = tiny_llama().cuda(), tiny_llama().cuda()
    opt = trainstream.OffloadAdamW(ours.parameters(), lr=2e-3)
    ref = torch.optim.AdamW(theirs.parameters(), lr=2e-3)
    for ids in batches(10):
        for model, o in ((ours, opt), (theirs, ref)):
            loss_of(model, ids.cuda()).backward()
            o.step()
            o.zero_grad()
    # no synchronize(): later kernels on the current stream read the uploaded weights
    assert max_param_diff(ours, theirs) < 1e-5
    assert opt.stats()["d2h_bytes"] > 0 and opt.stats()["h2d_bytes"] > 0
    for p in ours.parameters():
        assert opt.state[p]["master_param"].is_pinned()
