"""State dicts, resume, unwrap and reports of a wrapped model."""

from __future__ import annotations

import contextlib
import copy
import io

import torch
import trainstream
from ts_testing import batches, loss_of, tiny_llama


def _train(model, opt, data):
    for ids in data:
        loss_of(model, ids).backward()
        opt.step()
        opt.zero_grad()
    model._trainstream_session.synchronize()


def test_resume_continues_bit_identically():
    data = batches(10)
    straight, opt = trainstream.wrap(tiny_llama(), lr=2e-3, moment_dtype="bfloat16")
    _train(straight, opt, data)

    first, first_opt = trainstream.wrap(tiny_llama(), lr=2e-3, moment_dtype="bfloat16")
    _train(first, first_opt, data[:5])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed = tiny_llama(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    resumed, resumed_opt = trainstream.wrap(resumed, lr=2e-3, moment_dtype="bfloat16")
    resumed_opt.load_state_dict(saved["optimizer"])
    _train(resumed, resumed_opt, data[5:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_state_dict_is_torch_adamw_format_and_loads_into_torch():
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-3)
    _train(model, opt, batches(2))
    sd = opt.state_dict()
    params = list(model.parameters())
    assert sorted(sd["state"]) == list(range(len(params)))
    for i, p in enumerate(params):
        entry = sd["state"][i]
        assert entry["exp_avg"].shape == p.shape and entry["exp_avg_sq"].shape == p.shape
        assert float(entry["step"]) == 2.0
        assert torch.equal(entry["master_param"], p.detach())  # fp32 model: the weight is the master
    plain = copy.deepcopy(trainstream.unwrap(model))
    torch_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    torch_opt.load_state_dict(sd)
    assert torch.equal(torch_opt.state[next(iter(plain.parameters()))]["exp_avg"], sd["state"][0]["exp_avg"])


def test_unwrap_restores_a_plain_model():
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-3)
    _train(model, opt, batches(2))
    plain = trainstream.unwrap(model)
    assert not hasattr(plain, "_trainstream_session")
    assert all(not p._post_accumulate_grad_hooks for p in plain.parameters() if p._post_accumulate_grad_hooks is not None)
    loss_of(plain, batches(1)[0]).backward()  # ordinary autograd again: gradients stay
    assert all(p.grad is not None for p in plain.parameters())
    again, _ = trainstream.wrap(plain, lr=1e-3)  # and it can be wrapped again
    assert again is plain


def test_memory_report_and_transfer_counters():
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-3)
    start = trainstream.transfer_stats("cpu")
    _train(model, opt, batches(3))
    report = trainstream.memory_report(model)
    for key in ("events", "gpu", "pinned", "pinned_by_tag", "transfers", "optimizer", "resident"):
        assert key in report
    n_params = len(list(model.parameters()))
    assert report["optimizer"]["host_updates"] == 3 * n_params
    assert report["optimizer"]["placements"]["host"]["params"] == n_params
    values = sum(p.numel() for p in model.parameters())
    assert report["pinned_by_tag"]["master"] >= values * 4
    assert report["pinned_by_tag"]["moments"] >= values * 8
    moved = report["transfers"]["d2h_bytes"] - start["d2h_bytes"]
    assert moved == 3 * values * 4  # every fp32 gradient crossed once per step
    assert any("optimizer_mode='cpu'" in line for line in report["events"])
    assert report["resident"] is False
    bare = trainstream.memory_report()
    assert set(bare) == {"gpu", "pinned", "pinned_by_tag"}


def test_adamw_without_optimizer_uses_lr_and_trainable_params():
    model = tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    model, opt = trainstream.wrap(model, lr=5e-4)
    trained = [p for group in opt.param_groups for p in group["params"]]
    assert len(trained) == len(list(model.parameters())) - 1
    assert opt.param_groups[0]["lr"] == 5e-4
    before = model.model.embed_tokens.weight.clone()
    _train(model, opt, batches(2))
    assert torch.equal(model.model.embed_tokens.weight, before)


def test_exception_mid_backward_then_a_good_step():
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    data = batches(2)
    calls = {"n": 0}

    def explode(module, grad_input, grad_output):
        calls["n"] += 1
        raise KeyboardInterrupt("interrupted in backward")

    handle = model.model.layers[0].mlp.register_full_backward_hook(explode)
    with contextlib.suppress(KeyboardInterrupt):
        loss_of(model, data[0]).backward()
    handle.remove()
    assert calls["n"] == 1
    opt.zero_grad()
    model._trainstream_session.synchronize()
    # Every parameter's weight, master and step agree with each other.
    sd = opt.state_dict()["state"]
    for i, p in enumerate(model.parameters()):
        assert torch.equal(sd[i]["master_param"], p.detach())
        assert float(sd[i]["step"]) in (0.0, 1.0)
    # The next step works and updates everything.
    loss_of(model, data[1]).backward()
    opt.step()
    model._trainstream_session.synchronize()
    steps = [float(s["step"]) for s in opt.state_dict()["state"].values()]
    # Parameters whose gradients were complete before the interrupt were updated then
    # (the output layers); the good step updated every parameter once more.
    assert set(steps) == {1.0, 2.0}
    assert steps[-1] == 2.0 and steps[0] == 1.0  # lm_head finished first, the embedding never did
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_second_session_grows_the_arena_by_what_it_lacks(monkeypatch):
    import ts_pinned

    # Its own arena: the process-wide one may hold free slabs left by earlier tests.
    arena = ts_pinned.PinnedArena(slab_bytes=1 << 20)
    monkeypatch.setattr(trainstream._session.ts_pinned, "default_arena", lambda: arena)
    first, _ = trainstream.wrap(tiny_llama(), lr=1e-3)
    before = arena.stats()
    second, _ = trainstream.wrap(tiny_llama(seed=1), lr=1e-3)
    after = arena.stats()
    # The second session's state came from new slabs, not from blocks page-locked one by one.
    assert after["arena_fallbacks"] == before["arena_fallbacks"]
    assert after["arena_bytes"] > before["arena_bytes"]
    trainstream.unwrap(first)
    trainstream.unwrap(second)
