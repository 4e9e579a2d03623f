"""param_offload on a full fine-tune: the trained weights of streamed blocks live in host memory too,
their host AdamW writes each update into the block's host copy, and the next fetch carries it. Bit for
bit against keeping every block resident (CPU: the streamer's copies are memory copies, the same code
paths); reads, edits and loads see the right weights; what cannot work is refused up front."""

from __future__ import annotations

import copy

import pytest
import torch
import trainstream
from test_activations import Stack, _run
from ts_testing import batches, tiny_llama, train


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _trained_streamed(model) -> list[int]:
    return model._trainstream_session.weights.trained_blocks


@pytest.mark.parametrize("options", [
    {"param_offload": True},
    {"param_offload": [1, 2], "prefetch_depth": 2},
    {"param_offload": True, "recompute": True},
    {"param_offload": True, "activation_offload": True, "min_offload_bytes": 0},
    {"param_offload": 0.5, "recompute": [0], "accumulation_steps": 2, "max_grad_norm": 0.1},
    {"param_offload": [0, 3], "max_grad_norm": 0.05, "moment_dtype": "bf16"},
])
def test_streamed_trained_weights_train_bit_for_bit_like_resident_ones(options):
    runs = []
    for extra in ({k: v for k, v in options.items() if k != "param_offload"}, options):
        model, opt = trainstream.wrap(Stack(p=0.1), lr=1e-2, **extra)
        losses = _run(model, opt, steps=5)
        runs.append((losses, _params(model), trainstream.memory_report(model), model))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    streaming = runs[1][2]["params"]["streaming"]
    assert streaming["trained_blocks"] and streaming["trained_bytes"] > 0
    # Fetches wait for their blocks' queued updates, once per block and step, never again mid-backward.
    # (_run calls step() after every backward: each of the 4 later steps' forwards follows updates.)
    assert 0 < streaming["update_waits"] <= 4 * len(streaming["trained_blocks"])
    assert streaming["peak_resident_blocks"] <= options.get("prefetch_depth", 1) + 2


def test_a_fetch_waits_for_its_blocks_updates_when_nothing_else_does():
    """guard_params=False and clipping: the updates queue at step() in slot order and nothing orders the
    prefetch of a later block after them but the fetch's own wait (weights.py, invariant 5)."""
    runs = []
    for options in ({}, {"param_offload": True, "prefetch_depth": 2}):
        model, opt = trainstream.wrap(Stack(width=192, depth=4), lr=1e-2, guard_params=False, max_grad_norm=0.05,
                                      **options)
        runs.append((_run(model, opt, steps=4, width=192), _params(model)))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_a_full_fine_tune_of_a_llama_streams_its_trained_weights_bit_exactly():
    runs = []
    for options in ({}, {"param_offload": True, "prefetch_depth": 1}):
        model, opt = trainstream.wrap(tiny_llama(layers=3), lr=1e-3, **options)
        runs.append((train(model, opt, batches(4)), _params(model)))
        if options:
            assert _trained_streamed(model) == [0, 1, 2]
            session = model._trainstream_session
            streamed = [s for s in session.engine.active if s.streamed]
            assert streamed and all(s.placement == "host" for s in streamed)
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_lora_adapters_of_streamed_blocks_stay_resident():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model, _opt = trainstream.wrap(peft.get_peft_model(tiny_llama(), config), lr=1e-3, param_offload=True)
    assert _trained_streamed(model) == []
    assert not any(s.streamed for s in model._trainstream_session.engine.slots)
    trainstream.unwrap(model)


def test_reads_after_step_see_the_update_and_no_stale_block_stays_resident():
    reference, _ = trainstream.wrap(Stack(), lr=1e-2)
    model, opt = trainstream.wrap(Stack(), lr=1e-2, param_offload=True)
    ref_opt = reference._trainstream_session.optimizer
    for step in range(3):
        x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(step))
        for m, o in ((reference, ref_opt), (model, opt)):
            m(x).backward()
            o.step()
            o.zero_grad()
        # guard_params (default): right after step() every read sees the new weights, wherever they live
        assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
        weights = model._trainstream_session.weights
        assert not (set(weights._lru) & weights._stale)
    trainstream.unwrap(reference)
    trainstream.unwrap(model)


def test_user_edits_between_steps_and_while_resident_are_trained_from():
    runs = []
    for options in ({}, {"param_offload": True}):
        model, opt = trainstream.wrap(Stack(), lr=1e-2, **options)
        first = model.layers[1].up.weight
        losses = _run(model, opt, steps=2)
        with torch.no_grad():
            first.mul_(0.5)  # between steps: on the host copy when streamed
        losses += _run(model, opt, steps=2, seed=10)
        model(torch.ones(2, 8, 32))  # a forward leaves blocks resident ...
        with torch.no_grad():
            model.layers[3].down.weight.add_(0.25)  # ... and an edit there must reach the host copy
        losses += _run(model, opt, steps=2, seed=20)
        runs.append((losses, _params(model)))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_state_dicts_copies_and_loads_of_a_streamed_full_fine_tune():
    model, opt = trainstream.wrap(Stack(), lr=1e-2, param_offload=True)
    _run(model, opt, steps=2)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)  # a plain model with the same weights
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    after = _run(model, opt, steps=2, seed=5)
    # Back to the saved point: model and optimizer loads, then the same two steps again.
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    again = _run(model, opt, steps=2, seed=5)
    assert again == after
    trainstream.unwrap(model)
    assert all(p.device == torch.device("cpu") for p in model.parameters())


def test_streamed_trained_weights_are_refused_where_they_cannot_train(monkeypatch):
    """Under data parallel every rank would write the machine's one host copy: refused before any change
    (the world's size is faked here: the refusal comes before any collective)."""
    from trainstream import distributed as tsd

    model = Stack()
    before = [(p, p.detach().clone(), p.data.data_ptr()) for p in model.parameters()]
    monkeypatch.setattr(tsd, "active_world", lambda: 2)
    with pytest.raises(ValueError, match="needs one process"):
        trainstream.wrap(model, lr=1e-3, param_offload=True)
    assert not hasattr(model, "_trainstream_session")
    assert all(torch.equal(p, value) and p.data.data_ptr() == ptr for p, value, ptr in before)


def test_a_weight_streamed_as_frozen_that_is_unfrozen_is_refused_clearly():
    model = Stack()
    for layer in model.layers:
        layer.up.weight.requires_grad_(False)
        layer.down.weight.requires_grad_(False)
    # The frozen weights are in the optimizer too (as with AdamW(model.parameters())): skipped until unfrozen.
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), param_offload=True)
    _run(model, opt, steps=1)
    model.layers[2].up.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="streams from host memory as a frozen weight"):
        model(torch.randn(2, 8, 32))
    trainstream.unwrap(model)
