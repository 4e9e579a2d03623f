"""param_offload with quantized frozen weights: the blocks' codes and scales stream as stored (NF4
moves about a quarter of bf16's bytes), and training is bit for bit the same as keeping them."""

from __future__ import annotations

import pytest
import torch
import trainstream
from ts_testing import batches, tiny_llama, train

peft = pytest.importorskip("peft")


def _lora(seed=0):
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return peft.get_peft_model(tiny_llama(seed=seed), config)


def _train(model, opt, steps=4):
    return train(model, opt, batches(steps))


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_streamed_codes_train_bit_for_bit_like_resident_ones(quantize):
    runs = []
    for options in ({}, {"param_offload": True}, {"param_offload": [0], "recompute": True}):
        model, opt = trainstream.wrap(_lora(), lr=1e-3, quantize=quantize, **options)
        losses = _train(model, opt)
        report = trainstream.memory_report(model)
        trained = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        runs.append((losses, trained, report))
        trainstream.unwrap(model)
    for losses, trained, _ in runs[1:]:
        assert losses == runs[0][0]
        assert all(torch.equal(a, b) for a, b in zip(trained, runs[0][1]))
    streamed = runs[1][2]["params"]
    assert streamed["streaming"]["fetches"] > 0
    # every block streams: its host copy holds all the codes and scales (plus its frozen norms), well
    # under the size of the weights before quantization
    assert streamed["bytes_after"] <= streamed["host_bytes"] < streamed["bytes_before"] * (0.6 if quantize == "int8"
                                                                                           else 0.35)


def test_reads_of_a_streamed_quantized_model_see_the_codes():
    reference, _ = trainstream.wrap(_lora(), lr=1e-3, quantize="nf4")
    expected = {k: v for k, v in reference.state_dict().items()}
    trainstream.unwrap(reference)
    model, opt = trainstream.wrap(_lora(), lr=1e-3, quantize="nf4", param_offload=True)
    state = model.state_dict()  # not resident: the host copies, as the QuantLinear's extra state
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key
    _train(model, opt, steps=1)
    trainstream.unwrap(model)
    for module in model.modules():  # unwrapped: ordinary tensors where the model trains
        q = module.__dict__.get("qweight")
        if q is not None:
            assert q.data.device == torch.device("cpu") and q.data.untyped_storage().nbytes() > 0


def test_wrap_quantizes_and_streams_when_param_offload_auto_implies_nf4(monkeypatch):
    """The decision itself is tested on a 7B shape (test_weights_auto.py); here wrap() acts on it:
    quantize='auto' becomes the implied NF4, and the chosen blocks stream their codes."""
    from trainstream.planning import decide

    monkeypatch.setattr(decide, "_auto_param_offload", lambda o, inputs, moments: ([0, 1], "param_offload='auto': test", "nf4"))
    model, opt = trainstream.wrap(_lora(), lr=1e-3, quantize="auto", param_offload="auto")
    _train(model, opt, steps=2)
    report = trainstream.memory_report(model)
    assert report["params"]["quantize"] == "nf4"
    assert report["params"]["streaming"]["streamed_blocks"] == [0, 1]
    assert report["params"]["streaming"]["fetches"] > 0
    trainstream.unwrap(model)


def test_a_load_into_streamed_codes_writes_them_and_a_new_layout_is_refused():
    x = batches(1)[0]
    other, _ = trainstream.wrap(_lora(seed=5), lr=1e-3, quantize="nf4")  # other values, codes included
    _train(other, _, steps=1)
    state = other.state_dict()
    trainstream.unwrap(other)
    model, opt = trainstream.wrap(_lora(), lr=1e-3, quantize="nf4", param_offload=True)
    _train(model, opt, steps=1)
    model.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(model(x).logits, other(x).logits)  # every streamed block fetched the loaded codes
    _train(model, opt, steps=1)  # trains on from them
    int8, _ = trainstream.wrap(_lora(), lr=1e-3, quantize="int8")
    bad = int8.state_dict()
    trainstream.unwrap(int8)
    before = model(x).logits.detach().clone()
    with pytest.raises(ValueError, match="different layout"):
        model.load_state_dict(bad)
    kept = [m for m in model.modules() if m.__dict__.get("qweight") is not None]
    assert all(m.qweight.format == "nf4" for m in kept)
    torch.testing.assert_close(model(x).logits.detach(), before, rtol=0, atol=0)  # the trained LoRA weights
    trainstream.unwrap(model)
