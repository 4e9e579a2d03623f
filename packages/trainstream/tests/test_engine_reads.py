"""Reads of a weight after step() see the update (guard_params=True), and the opt-out is what it says."""

from __future__ import annotations

import pytest
import torch
import trainstream
from engine_testing import slow_updates
from ts_testing import batches, loss_of, tiny_llama


def _one_step(model, opt):
    loss_of(model, batches(1)[0]).backward()
    opt.step()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_reads_right_after_step_see_the_updated_weights(monkeypatch, clip):
    slow_updates(monkeypatch)
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-2, max_grad_norm=clip)
    before = [p.detach().clone() for p in model.parameters()]
    _one_step(model, opt)
    read = [p.detach().clone() for p in model.parameters()]  # logging, an EMA, evaluation...
    masters = opt.state_dict()["state"]
    for i, (r, b) in enumerate(zip(read, before)):
        assert torch.equal(r, masters[i]["master_param"]), f"parameter {i} read before its update landed"
        assert not torch.equal(r, b)
    trainstream.unwrap(model)


def test_guard_params_false_reads_are_delayed_until_synchronize(monkeypatch):
    slow_updates(monkeypatch)
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-2, guard_params=False)
    embedding = model.model.embed_tokens.weight
    before = embedding.detach().clone()
    _one_step(model, opt)
    # The embedding's gradient arrives last: its update is behind a dozen slow ones in the queue.
    assert torch.equal(embedding.detach(), before)
    model._trainstream_session.synchronize()
    assert not torch.equal(embedding.detach(), before)
    trainstream.unwrap(model)


def test_model_state_dict_waits_for_updates(monkeypatch):
    slow_updates(monkeypatch)
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-2, guard_params=False)  # only the state_dict hook waits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _one_step(model, opt)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    masters = opt.state_dict()["state"]
    for i, (name, _) in enumerate(model.named_parameters()):
        assert torch.equal(after[name], masters[i]["master_param"])
        assert not torch.equal(after[name], before[name])
    trainstream.unwrap(model)


def test_a_parent_reading_a_childs_weight_in_forward_sees_the_update(monkeypatch):
    slow_updates(monkeypatch)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(11, 8)  # never called: the parent reads its weight
            self.mix = torch.nn.Linear(8, 11)

        def forward(self, ids):
            # Read first, so its gradient arrives last and its update is the last queued:
            # waiting for mix's own update does not cover it.
            h = torch.nn.functional.embedding(ids, self.table.weight)
            return self.mix(h)

    torch.manual_seed(0)
    model, opt = trainstream.wrap(Tied(), lr=1e-2, guard_params=False)  # the root guard must catch it
    ids = torch.arange(11).reshape(1, 11)
    for _ in range(3):
        out = model(ids)
        seen = out.detach().clone()
        out.logsumexp(-1).mean().backward()
        opt.step()
    model._trainstream_session.synchronize()
    assert opt.state_dict()["state"][0]["step"].item() == 3
    torch.manual_seed(0)
    reference = Tied()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=1e-2)
    for _ in range(3):
        out = reference(ids)
        ref_seen = out.detach().clone()
        out.logsumexp(-1).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.testing.assert_close(seen, ref_seen, rtol=1e-5, atol=1e-6)
    trainstream.unwrap(model)


def test_host_update_time_is_counted_while_attached():
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-3)
    for ids in batches(2):
        loss_of(model, ids).backward()
        opt.step()
        opt.zero_grad()
    model._trainstream_session.synchronize()
    assert opt.stats()["host_update_seconds"] > 0
    trainstream.unwrap(model)


def test_local_processes_split_the_page_lock_budget(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model, _ = trainstream.wrap(tiny_llama(), lr=1e-3)
    assert any("1/4 of the machine's" in e for e in trainstream.memory_report(model)["events"])
    trainstream.unwrap(model)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10**9))  # a share too small for even this model
    with pytest.raises(MemoryError, match="page-locked host RAM"):
        trainstream.wrap(tiny_llama(), lr=1e-3)
