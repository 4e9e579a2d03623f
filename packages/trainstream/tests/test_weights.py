"""param_offload: frozen block weights stream from host memory, bit-exact against keeping them,
with recompute, activation paging and LoRA; reads of the model see the right values; bad input
is refused before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
import trainstream
from test_activations import Stack, _run
from ts_testing import batches, tiny_llama, train


def _frozen_stack(seed=0, depth=4):
    model = Stack(width=32, depth=depth, seed=seed)
    for layer in model.layers:
        layer.up.weight.requires_grad_(False)
        layer.down.weight.requires_grad_(False)
    return model


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("options", [
    {"param_offload": True},
    {"param_offload": [1, 2], "weights_prefetch_depth": 2},
    {"param_offload": True, "recompute": True},
    {"param_offload": True, "activation_offload": True, "min_offload_bytes": 0},
    {"param_offload": 0.5, "recompute": [0], "accumulation_steps": 2, "max_grad_norm": 0.1},
])
def test_streamed_weights_train_bit_for_bit_like_resident_ones(options):
    runs = []
    for extra in ({k: v for k, v in options.items() if k != "param_offload"}, options):
        model, opt = trainstream.wrap(_frozen_stack(), lr=1e-3, **extra)
        losses = _run(model, opt, steps=4)
        runs.append((losses, _params(model), trainstream.memory_report(model)))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    params = runs[1][2]["params"]
    streaming = params["streaming"]
    assert streaming["fetches"] > 0 and streaming["h2d_bytes"] > 0
    assert streaming["peak_resident_blocks"] <= options.get("weights_prefetch_depth", 1) + 2
    assert sorted(params["paged_blocks"] + params["resident_blocks"]) == list(range(4))
    assert params["link_bytes_per_s"] > 0  # the fetches' memory copies, timed


def test_lora_on_a_streamed_base_is_bit_exact():
    peft = pytest.importorskip("peft")

    def lora():
        torch.manual_seed(0)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
        return peft.get_peft_model(tiny_llama(), config)

    runs = []
    for options in ({}, {"param_offload": True, "prefetch_depth": 1}):
        model, opt = trainstream.wrap(lora(), lr=1e-3, **options)
        runs.append((train(model, opt, batches(4)), _params(model)))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_only_the_resident_blocks_hold_device_storage():
    model, opt = trainstream.wrap(_frozen_stack(depth=6), lr=1e-3, param_offload=True, prefetch_depth=1)
    _run(model, opt, steps=2)
    weights = model._trainstream_session.weights
    resident = set(weights._lru)
    assert 0 < len(resident) <= 3
    for index, block in weights.streamed.items():
        held = block.device.untyped_storage().nbytes()
        assert held == (block.nbytes if index in resident else 0)
    trainstream.unwrap(model)


def test_reads_state_dict_copies_and_loads_see_the_right_weights():
    reference = _frozen_stack()
    model, opt = trainstream.wrap(_frozen_stack(), lr=1e-3, param_offload=True)
    _run(model, opt, steps=1)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    state = model.state_dict()
    for name in frozen:
        torch.testing.assert_close(state[name], reference.state_dict()[name], rtol=0, atol=0)
    twin = copy.deepcopy(model)  # a plain model: its forward needs no streaming
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    # A load writes the host copies; a block resident on the device must not keep the old values.
    other = _frozen_stack(seed=7)
    model.load_state_dict(other.state_dict())
    twin.load_state_dict(other.state_dict())
    torch.testing.assert_close(model(x), twin(x), rtol=0, atol=0)
    trainstream.unwrap(model)
    assert all(p.device == torch.device("cpu") for p in model.parameters())
    torch.testing.assert_close(model(x), twin(x), rtol=0, atol=0)  # unwrapped: ordinary tensors


@pytest.mark.parametrize(("options", "message"), [
    ({"param_offload": "yes"}, "param_offload='yes' is not valid; use 'auto'"),
    ({"param_offload": 2.0}, "param_offload=2.0 is not valid"),
    ({"param_offload": [9]}, "the model has 4 blocks, indices [9] do not exist"),
])
def test_bad_param_offload_is_refused_and_changes_nothing(options, message):
    model = _frozen_stack()
    before = [(p, p.detach().clone(), p.data.data_ptr()) for p in model.parameters()]
    with pytest.raises(ValueError) as error:
        trainstream.wrap(model, lr=1e-3, **options)
    assert message in str(error.value)
    assert not hasattr(model, "_trainstream_session")
    assert all(torch.equal(p, value) and p.data.data_ptr() == ptr for p, value, ptr in before)


def test_the_copy_timer_reads_completed_pairs_and_never_waits():
    from trainstream.weights.copy_timer import CopyTimer

    class Event:
        def __init__(self, done, at):
            self.done, self.at = done, at

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    timer = CopyTimer(pending=2)
    assert timer.rate() is None
    timer.host(0.5, 100)
    assert timer.rate() == 200
    timer._pending.extend([(Event(True, 0.0), Event(True, 1.0), 300), (Event(True, 0.0), Event(False, 2.0), 400)])
    assert timer.rate() == 400 / 1.5  # the unfinished pair is not read
    assert len(timer._pending) == 1


def test_a_block_is_fetched_from_its_own_hooks_once_a_pass(monkeypatch):
    """The fetch hooks are the block's, not its modules': use() runs once per streamed block in forward
    and once in backward, however many of its modules hold streamed weights (the host work per block;
    a compiled forward, one backward node, needs it so too)."""
    peft = pytest.importorskip("peft")
    from trainstream.weights import streamer as weights_module

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(tiny_llama(layers=3), config)
    uses = []
    real_use = weights_module.WeightStreamer.use
    monkeypatch.setattr(weights_module.WeightStreamer, "use",
                        lambda self, index, ahead=1: uses.append((index, ahead)) or real_use(self, index, ahead))
    model, opt = trainstream.wrap(model, lr=1e-3, param_offload=True, prefetch_depth=1)
    train(model, opt, batches(2))
    per_step = [(i, 1) for i in range(3)] + [(i, -1) for i in reversed(range(3))]
    assert uses == per_step * 2
    assert trainstream.memory_report(model)["params"]["streaming"]["prefetched"] > 0


def test_an_eviction_renews_the_prefetch_of_the_block_in_use():
    """The skip in use() holds only while nothing was evicted since the block's first module: after an
    eviction (evict_all, keep, a stale block dropped) the same block's next use prefetches again."""
    model, opt = trainstream.wrap(_frozen_stack(depth=6), lr=1e-3, param_offload=True, prefetch_depth=1)
    _run(model, opt, steps=1)
    weights = model._trainstream_session.weights
    first, second = sorted(weights.streamed)[:2]
    with torch.no_grad():
        weights.use(first, 1)
        assert second in weights._lru
        weights.evict_all()
        weights.use(first, 1)
    assert first in weights._lru and second in weights._lru
    trainstream.unwrap(model)
