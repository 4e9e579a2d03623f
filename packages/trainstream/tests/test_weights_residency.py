"""param_offload='auto' at the batch's real size (memory/residency.py): streamed blocks the plan at the real
token count does not need stay in VRAM (WeightStreamer.keep, weights.py invariant 6), bit-exact against
keeping every block; a longer batch streams more again before it runs; evaluation changes nothing."""

from __future__ import annotations

import pytest
import torch
import trainstream
from test_activations import _run
from test_weights import _frozen_stack, _params
from test_weights_auto import _lora, _with_vram
from trainstream.memory.residency import WeightResidency, batch_tokens
from ts_testing import batches, loss_of, tiny_llama


def test_batch_tokens_reads_ids_embeddings_and_float_inputs():
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert batch_tokens((ids,), {}) == (3, 7)
    assert batch_tokens((), {"input_ids": ids, "labels": ids}) == (3, 7)
    assert batch_tokens((), {"inputs_embeds": torch.zeros(2, 5, 16)}) == (2, 5)
    assert batch_tokens((torch.zeros(4, 8, 32),), {}) == (4, 8)  # a plain model's [B, T, H] input
    assert batch_tokens((torch.zeros(9, dtype=torch.long),), {}) == (1, 9)
    assert batch_tokens((), {}) is None
    assert batch_tokens((torch.tensor(3),), {}) is None
    assert batch_tokens((torch.zeros(0, 4, dtype=torch.long),), {}) is None


def test_kept_blocks_train_bit_for_bit_and_are_fetched_once():
    """Blocks 1, 3, 4 of 8 kept: bit-exact against all-resident, and the others fetched as often as when
    only they stream (param_offload=[0, 2, 5, 6, 7])."""
    runs, fetched = [], {}
    for name, options, keep in (("resident", {}, None), ("kept", {"param_offload": True}, [1, 3, 4]),
                                ("listed", {"param_offload": [0, 2, 5, 6, 7]}, None)):
        model, opt = trainstream.wrap(_frozen_stack(depth=8), lr=1e-3, **options)
        weights = model._trainstream_session.weights
        if keep is not None:
            assert weights.keep(keep) == keep
        losses = _run(model, opt, steps=2)
        if weights is not None:
            pointers = {i: weights.streamed[i].device.data_ptr() for i in keep or []}
            fetches = weights.counters["fetches"]
        losses += _run(model, opt, steps=2, seed=2)
        runs.append((losses, _params(model)))
        if weights is not None:
            fetched[name] = weights.counters["fetches"] - fetches
        if keep is not None:
            report = trainstream.memory_report(model)["params"]
            assert report["kept_blocks"] == keep and report["paged_blocks"] == [0, 2, 5, 6, 7]
            for i in keep:  # kept ones hold their storage between steps, and were never fetched again
                assert weights.streamed[i].device.untyped_storage().nbytes() == weights.streamed[i].nbytes
            assert {i: weights.streamed[i].device.data_ptr() for i in keep} == pointers
            assert weights.stats()["peak_resident_blocks"] <= 3
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert fetched["kept"] == fetched["listed"] > 0


def test_the_link_bytes_a_pass_moves_are_what_a_step_fetches_and_count_against_pages():
    """h2d_bytes_per_pass() is half a training step's measured h2d_bytes (forward and backward each fetch
    every streamed block that is not kept but the 3 the other pass left resident), and the activation
    tuner sees it in backward's link bytes."""
    model, opt = trainstream.wrap(_frozen_stack(depth=8), lr=1e-3, param_offload=True)
    session = model._trainstream_session
    weights = session.weights
    for keep in ([], [1, 3, 4]):
        weights.keep(keep)
        _run(model, opt, steps=1)  # kept blocks are fetched the first time they are used
        before = weights.counters["h2d_bytes"]
        _run(model, opt, steps=1, seed=3)
        assert weights.counters["h2d_bytes"] - before == 2 * weights.h2d_bytes_per_pass() > 0
        streaming = [b.nbytes for i, b in weights.streamed.items() if i not in keep]
        assert weights.h2d_bytes_per_pass() == sum(streaming) - weights.capacity * streaming[0]  # equal blocks
        uploads = sum(s.param.numel() * s.param.element_size() for s in session.engine.active
                      if s.placement == "host" and not s.streamed)
        assert session._backward_h2d_bytes() == uploads + weights.h2d_bytes_per_pass()
    trainstream.unwrap(model)


def test_keep_changes_between_steps_and_refuses_what_cannot_stay():
    model, opt = trainstream.wrap(_frozen_stack(depth=4), lr=1e-3, param_offload=True)
    weights = model._trainstream_session.weights
    reference, ref_opt = trainstream.wrap(_frozen_stack(depth=4), lr=1e-3)
    for seed, keep in enumerate(([0, 1, 2, 3], [2], [], [1, 3])):
        weights.keep(keep)
        assert _run(model, opt, steps=1, seed=seed) == _run(reference, ref_opt, steps=1, seed=seed)
        resident = {i for i, b in weights.streamed.items() if b.device.untyped_storage().nbytes()}
        assert set(keep) <= resident
    with pytest.raises(ValueError, match="cannot be kept"):
        weights.keep([7])
    assert weights.kept == {1, 3}  # a refused keep changes nothing
    trainstream.unwrap(model)
    trainstream.unwrap(reference)

    full = _frozen_stack(depth=4)
    for p in full.parameters():
        p.requires_grad_(True)  # a full fine-tune: the trained weights stream with their blocks
    model, _opt = trainstream.wrap(full, lr=1e-3, param_offload=True)
    weights = model._trainstream_session.weights
    assert weights.trained_blocks and weights.keepable() == []
    with pytest.raises(ValueError, match="their trained weights stream"):
        weights.keep([0])
    trainstream.unwrap(model)


def test_residency_follows_the_most_tokens_seen_and_ignores_evaluation():
    """streamed_for stands in for the planner: 1 block streams per 8 tokens."""
    model, opt = trainstream.wrap(_frozen_stack(depth=6), lr=1e-3, param_offload=True)
    session = model._trainstream_session
    asked = []

    def streamed_for(batch, seq):
        asked.append((batch, seq))
        return batch * seq // 8

    session.follow_tokens(WeightResidency(session.weights, streamed_for, lambda text: session.events.add("weights", text)))
    reference, ref_opt = trainstream.wrap(_frozen_stack(depth=6), lr=1e-3)

    def step(tokens, seed):
        x = torch.randn(1, tokens, 32, generator=torch.Generator().manual_seed(seed))
        losses = []
        for m, o in ((model, opt), (reference, ref_opt)):
            loss = m(x)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]

    step(16, 0)  # 2 of 6 stream
    assert asked == [(1, 16)] and len(session.weights.kept) == 4
    step(16, 1)
    step(8, 2)  # fewer tokens: nothing re-planned, nothing more kept
    assert asked == [(1, 16)] and len(session.weights.kept) == 4
    with torch.no_grad():
        model(torch.randn(1, 48, 32))  # evaluation with more tokens: not a training forward
    assert asked == [(1, 16)]
    step(32, 3)  # more tokens: 4 stream, before the forward runs
    assert asked[-1] == (1, 32) and len(session.weights.kept) == 2
    step(64, 4)  # all stream
    assert session.weights.kept == set()
    events = [e for e in trainstream.memory_report(model)["events"] if "param_offload='auto' at" in e]
    assert len(events) == 3 and "6 of the 6" in events[-1] and "(was 2)" in events[-1]
    for m in (model, reference):
        trainstream.unwrap(m)


def test_wrap_auto_keeps_what_the_real_batch_leaves_room_for(monkeypatch):
    """A VRAM budget (15 MiB) where the plan at 2048 tokens streams every block but the one for the 2 x 16
    token batches streams none: they all stay, and training is bit-exact against all-resident."""
    from trainstream.memory import residency

    monkeypatch.setattr(residency, "FOLLOW_TOKENS", True)  # off by default until it measures faster
    data = batches(3)
    runs = []
    for offload in (False, "auto"):
        model = _lora(tiny_llama(layers=4))
        if offload:
            _with_vram(monkeypatch, 15 / 1024)
        model, opt = trainstream.wrap(model, lr=1e-3, param_offload=offload, quantize=None)
        losses = []
        for ids in data:
            loss = loss_of(model, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, _params(model), trainstream.memory_report(model)))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    params = runs[1][2]["params"]
    assert params["streaming"]["streamed_blocks"] == [0, 1, 2, 3]  # planned at 2048 tokens
    assert params["kept_blocks"] == [0, 1, 2, 3] and params["paged_blocks"] == []  # at 2 x 16 tokens none stream
    assert any("param_offload='auto' at 2 x 16 tokens" in e for e in runs[1][2]["events"])
