"""stream_packing=True: streamed frozen bf16 weights cross the link exponent-packed (weights/packed_source.py).
Training is bit-exact against streaming them as stored; fewer bytes cross; a frozen weight written in place
or loaded is packed again before its next fetch; the option is refused when it is not a bool."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import trainstream
from trainstream.weights import packed_source
from ts_testing import batches, tiny_llama, train

peft = pytest.importorskip("peft")


@pytest.fixture(autouse=True)
def _small_tensors_pack(monkeypatch):
    monkeypatch.setattr(packed_source, "MIN_PACKED_VALUES", 256)  # the tiny model's weights are 8 K values


def _lora(seed=0):
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return peft.get_peft_model(tiny_llama(seed, layers=3, dtype=torch.bfloat16), config)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _wrap(packing, **extra):
    return trainstream.wrap(_lora(), lr=1e-3, param_offload=True, stream_packing=packing, **extra)


@pytest.mark.parametrize("extra", [{}, {"recompute": True}, {"activation_offload": True, "min_offload_bytes": 0}])
def test_packed_streaming_trains_bit_for_bit_like_streaming_as_stored(extra):
    runs = []
    for packing in (False, True):
        model, opt = _wrap(packing, **extra)
        runs.append((train(model, opt, batches(4)), _params(model), trainstream.memory_report(model)))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    plain, packed = runs[0][2]["params"]["streaming"], runs[1][2]["params"]["streaming"]
    assert packed["packed_blocks"] == [0, 1, 2] and plain.get("packed_blocks") is None
    assert 0.70 < packed["packed_ratio"] < 0.9
    assert packed["h2d_bytes"] == plain["h2d_bytes"]  # the same fetches of the same blocks
    assert packed["link_bytes"] < 0.9 * plain["link_bytes"] and plain["link_bytes"] == plain["h2d_bytes"]
    assert runs[1][2]["params"]["load_bytes"] < 0.9 * runs[0][2]["params"]["load_bytes"]  # what crossed, per step


def _edit_and_train(packing, edit):
    model, opt = _wrap(packing)
    train(model, opt, batches(2))
    session = model._trainstream_session
    session.weights.evict_all()  # every streamed weight now reads its host copy
    edit(model)
    losses = train(model, opt, batches(2, seed=3))
    out = (losses, _params(model), session.weights.source.stats() if packing else None)
    trainstream.unwrap(model)
    return out


def _scale_a_frozen_weight(model):
    weight = model.base_model.model.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        weight.mul_(-2.0)  # in place through the parameter: its version moves


def _load_other_weights(model):
    other = _lora(seed=5).state_dict()
    model.load_state_dict(other)


@pytest.mark.parametrize("edit", [_scale_a_frozen_weight, _load_other_weights])
def test_a_frozen_weight_written_on_the_host_is_packed_again(edit):
    plain = _edit_and_train(False, edit)
    packed = _edit_and_train(True, edit)
    assert plain[0] == packed[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], packed[1]))
    assert packed[2]["repacks"] >= 1


def test_the_event_says_what_packed_and_bad_values_are_refused():
    model, _opt = _wrap(True)
    events = "\n".join(trainstream.memory_report(model)["events"])
    assert "stream_packing: 3 of 3 streamed blocks cross the link exponent-packed" in events
    trainstream.unwrap(model)
    with pytest.raises(ValueError, match="stream_packing='yes' is not valid; use one of 'auto', True, False"):
        trainstream.wrap(_lora(), lr=1e-3, param_offload=True, stream_packing="yes")


def test_off_by_default_and_auto_packs_unless_only_the_unpacked_plan_fits(monkeypatch):
    model, _opt = trainstream.wrap(_lora(), lr=1e-3, param_offload=True)  # a prototype: off unless asked
    assert "packed_blocks" not in trainstream.memory_report(model)["params"]["streaming"]
    trainstream.unwrap(model)
    import trainstream.planning.decide as decide_module

    model, _opt = trainstream.wrap(_lora(), lr=1e-3, param_offload=True, stream_packing="auto")  # room for both
    assert trainstream.memory_report(model)["params"]["streaming"]["packed_blocks"] == [0, 1, 2]
    trainstream.unwrap(model)
    real = decide_module.plan_wrap

    def host_too_small_for_packed_copies(*args, stream_packing=False, **kwargs):
        plan = real(*args, stream_packing=stream_packing, **kwargs)
        if stream_packing and kwargs.get("streamed_blocks"):
            plan = dataclasses.replace(plan, fits=False)
        return plan

    monkeypatch.setattr(decide_module, "plan_wrap", host_too_small_for_packed_copies)
    model, _opt = trainstream.wrap(_lora(), lr=1e-3, param_offload=True, stream_packing="auto")
    streaming = trainstream.memory_report(model)["params"]["streaming"]
    assert "packed_blocks" not in streaming and streaming["source"] == "host"
    assert not any("stream_packing" in e for e in trainstream.memory_report(model)["events"])
    trainstream.unwrap(model)


def test_blocks_that_would_not_shrink_stream_as_stored(monkeypatch):
    monkeypatch.setattr(packed_source, "MIN_PACKED_VALUES", 1 << 30)  # nothing packs
    model, opt = _wrap(True)
    train(model, opt, batches(1))
    streaming = trainstream.memory_report(model)["params"]["streaming"]
    assert streaming["packed_blocks"] == [] and streaming["link_bytes"] == streaming["h2d_bytes"]
    assert any("they stream as stored" in e for e in trainstream.memory_report(model)["events"])
    trainstream.unwrap(model)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("extra", [{}, {"recompute": True, "weights_prefetch_depth": 2}])
def test_cuda_packed_streaming_is_bit_exact_and_moves_fewer_bytes(monkeypatch, extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(packed_source, "MIN_PACKED_VALUES", 1 << 16)  # the default: real-sized weights

    def model():
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=1024, intermediate_size=3072, num_hidden_layers=6, num_attention_heads=8,
                             num_key_value_heads=8, vocab_size=4096, tie_word_embeddings=False,
                             attn_implementation="eager")
        base = LlamaForCausalLM(config).to(torch.bfloat16)
        return peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"]))

    runs = []
    for packing in (False, True):
        wrapped, opt = trainstream.wrap(model(), lr=1e-3, device="cuda", param_offload=True,
                                        stream_packing=packing, **extra)
        data = batches(4, batch=2, seq=64, vocab=4096)
        runs.append((train(wrapped, opt, data, device="cuda"), _params(wrapped),
                     trainstream.memory_report(wrapped)["params"]["streaming"]))
        trainstream.unwrap(wrapped)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(runs[0][1], runs[1][1]))
    assert runs[1][2]["packed_blocks"] == list(range(6))
    assert runs[1][2]["link_bytes"] < 0.8 * runs[0][2]["link_bytes"]


def test_a_block_mixing_packed_and_unpacked_matrices_packs_what_packs(monkeypatch):
    """The MLP matrices (8 K values) pack, the attention ones (2-4 K) travel as they are, in the same block:
    before, copying an unpacked 2-D weight into its flat segment failed wrap() with a size mismatch."""
    monkeypatch.setattr(packed_source, "MIN_PACKED_VALUES", 8192)
    runs = []
    for packing in (False, True):
        model, opt = _wrap(packing)
        runs.append((train(model, opt, batches(3)), _params(model), trainstream.memory_report(model)))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    streaming = runs[1][2]["params"]["streaming"]
    assert streaming["packed_blocks"] == [0, 1, 2] and 0.8 < streaming["packed_ratio"] < 0.95
