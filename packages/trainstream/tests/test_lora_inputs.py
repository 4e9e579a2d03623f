"""compact_lora_inputs (activations/lora_inputs.py): PEFT LoRA layers save their 16-bit input instead of the
float32 copy; the gradients are the same bits, fewer bytes are saved, and anything unusual runs PEFT's
own path."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import trainstream  # noqa: E402
from trainstream.activations.lora_inputs import CompactInputLinear, CompactLoraInputs, eligible_layers  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_qwen(dtype=torch.bfloat16, dropout=0.0, seed=0, layers=2, hidden=64, attention="sdpa"):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(hidden_size=hidden, intermediate_size=160, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                      attn_implementation=attention)
    model = transformers.Qwen2ForCausalLM(config).to(dtype)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout,
                                                       target_modules=TARGETS))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: A's gradient would be zero too
            torch.nn.init.normal_(p)
    return model


def _blocks(model):
    return list(model.base_model.model.model.layers)


def _grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_bits(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    unequal = [n for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]
    assert not unequal, unequal


def _saved_bytes(model, ids) -> tuple[int, int]:
    """(bytes, float32 bytes) of the distinct storages the forward saves for backward."""
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), (t.dtype, t.untyped_storage().nbytes(), t.requires_grad))
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    activations = [(dt, nb) for ptr, (dt, nb, _) in seen.items() if ptr not in params]
    return sum(nb for _, nb in activations), sum(nb for dt, nb in activations if dt == torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradients_are_the_same_bits_as_peft(dtype):
    model = _lora_qwen(dtype)
    reference = copy.deepcopy(model)
    installed = CompactLoraInputs(eligible_layers(_blocks(model)))
    assert len(installed.layers) == 2 * len(TARGETS)
    ids = torch.randint(0, 101, (2, 17))
    _assert_same_bits(_grads(model, ids), _grads(reference, ids))


def test_fewer_bytes_are_saved_and_no_float32_input_copy():
    model = _lora_qwen(layers=1, hidden=128)
    ids = torch.randint(0, 101, (1, 64))
    before, before_fp32 = _saved_bytes(model, ids)
    CompactLoraInputs(eligible_layers(_blocks(model)))
    after, after_fp32 = _saved_bytes(model, ids)
    # Seven float32 input copies (q, k, v, o, gate, up: 128 values a token; down: 160) become three
    # new 16-bit tensors (q/k/v share one, gate/up one, down one; o's input, the attention output, is
    # saved by attention already).
    tokens = ids.numel()
    assert before_fp32 - after_fp32 == 4 * tokens * (6 * 128 + 160)
    assert before - after == 4 * tokens * (6 * 128 + 160) - 2 * tokens * (2 * 128 + 160)


def test_remove_restores_peft_and_deepcopy_keeps_working():
    model = _lora_qwen()
    reference = copy.deepcopy(model)
    installed = CompactLoraInputs(eligible_layers(_blocks(model)))
    clone = copy.deepcopy(model)
    layer = installed.layers[0]
    assert type(layer.lora_A["default"]) is CompactInputLinear and "_cast_input_dtype" in vars(layer)
    assert vars(clone.base_model.model.model.layers[0].self_attn.q_proj)["_cast_input_dtype"].__self__ is not layer
    ids = torch.randint(0, 101, (2, 9))
    _assert_same_bits(_grads(clone, ids), _grads(reference, ids))
    installed.remove()
    assert type(layer.lora_A["default"]) is torch.nn.Linear and "_cast_input_dtype" not in vars(layer)
    assert model.state_dict().keys() == reference.state_dict().keys()


def test_dropout_layers_are_left_to_peft():
    assert eligible_layers(_blocks(_lora_qwen(dropout=0.1))) == []


def test_lora_a_called_on_its_own_runs_nn_linear():
    model = _lora_qwen()
    layer = CompactLoraInputs(eligible_layers(_blocks(model))).layers[0]
    lora_a = layer.lora_A["default"]
    x = torch.randn(3, 64, requires_grad=True)
    out = lora_a(x)
    assert out.grad_fn is not None and "LinearSavingSource" not in type(out.grad_fn).__name__
    # a cast made, then lora_A called on another tensor: the slot is not used and is emptied
    layer._cast_input_dtype(torch.randn(3, 64, dtype=torch.bfloat16), torch.float32)
    out = lora_a(x)
    assert "LinearSavingSource" not in type(out.grad_fn).__name__
    with torch.no_grad():
        assert lora_a(layer._cast_input_dtype(x.bfloat16(), torch.float32)).grad_fn is None


def test_wrap_option_pages_and_recomputes_with_the_same_bits():
    ids = torch.randint(0, 101, (2, 17))
    results = []
    for compact in (True, False):
        model = _lora_qwen(seed=3)
        model, optimizer = trainstream.wrap(model, lr=1e-2, activation_offload=[0], recompute=[1],
                                            compact_lora_inputs=compact, min_offload_bytes=0)
        report = trainstream.memory_report(model)["activations"]
        assert report["compact_lora_layers"] == (2 * len(TARGETS) if compact else 0)
        losses = []
        for _ in range(3):  # the gradients leave p.grad for the engine: the updated weights show them
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
        trainstream.unwrap(model)
        results.append((losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}))
        assert not any(isinstance(m, CompactInputLinear) for m in model.modules())
    (losses_a, weights_a), (losses_b, weights_b) = results
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b)) and len(losses_a) == 3
    assert not torch.equal(losses_a[0], losses_a[2])  # it trained
    assert weights_a and all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a)


def test_option_is_validated_and_off_by_default():
    for bad in ("yes", "on", 1):
        with pytest.raises(ValueError, match="compact_lora_inputs"):
            trainstream.wrap(_lora_qwen(), lr=1e-3, compact_lora_inputs=bad)
    model, _ = trainstream.wrap(_lora_qwen(), lr=1e-3)  # a prototype (trainstream.prototype): off by default
    assert trainstream.memory_report(model)["activations"]["compact_lora_layers"] == 0
    assert trainstream.memory_report(model)["plan"]["compact_lora_inputs"] is False
    assert not any(isinstance(m, CompactInputLinear) for m in model.modules())
    trainstream.unwrap(model)
    model, _ = trainstream.wrap(_lora_qwen(), lr=1e-3, compact_lora_inputs="auto")  # the plain PEFT layers qualify
    assert trainstream.memory_report(model)["activations"]["compact_lora_layers"] == 2 * len(TARGETS)
    assert trainstream.memory_report(model)["plan"]["compact_lora_inputs"] is True  # the plan priced it so
    trainstream.unwrap(model)
    model, _ = trainstream.wrap(_lora_qwen(dropout=0.1), lr=1e-3, compact_lora_inputs="auto")  # left to PEFT
    assert trainstream.memory_report(model)["activations"]["compact_lora_layers"] == 0
    assert not any("compact_lora_inputs" in e for e in trainstream.memory_report(model)["events"])
    assert trainstream.memory_report(model)["plan"]["compact_lora_inputs"] is False
    assert not any(isinstance(m, CompactInputLinear) for m in model.modules())
    trainstream.unwrap(model)


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(2, 12), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_property_same_bits_for_any_batch_and_length(batch, seq, dtype, seed):
    model = _lora_qwen(dtype, seed=seed, layers=1)
    reference = copy.deepcopy(model)
    CompactLoraInputs(eligible_layers(_blocks(model)))
    ids = torch.randint(0, 101, (batch, seq), generator=torch.Generator().manual_seed(seed))
    _assert_same_bits(_grads(model, ids), _grads(reference, ids))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_gradients_are_the_same_bits_as_peft(dtype):
    model = _lora_qwen(dtype, layers=2, hidden=512).cuda()
    reference = copy.deepcopy(model)
    CompactLoraInputs(eligible_layers(_blocks(model)))
    ids = torch.randint(0, 101, (2, 256), device="cuda")
    _assert_same_bits(_grads(model, ids), _grads(reference, ids))


@pytest.mark.cuda
def test_cuda_wrap_pages_the_compact_inputs_with_the_same_bits():
    ids = torch.randint(0, 101, (2, 256), device="cuda")
    results = []
    for compact in (True, False):
        # Eager attention: wrap()'s attention chooser times SDPA's backends at each wrap, and two wraps may pick
        # different ones (the H200 run of 2026-12-03, call 4, did): not comparable bit for bit.
        model = _lora_qwen(seed=5, layers=2, hidden=512, attention="eager")
        model, optimizer = trainstream.wrap(model, lr=1e-2, device="cuda", activation_offload=[0], recompute=[1],
                                            compact_lora_inputs=compact, min_offload_bytes=0)
        losses = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
        paged = trainstream.memory_report(model)["activations"]["block_bytes"][0]
        trainstream.unwrap(model)
        results.append((losses, paged, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}))
    (losses_a, paged_a, weights_a), (losses_b, paged_b, weights_b) = results
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b))
    assert all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a)
    assert 0 < paged_a < paged_b, (paged_a, paged_b)


def test_a_saved_wrapped_model_loads_as_a_plain_one():
    import io

    model, _ = trainstream.wrap(_lora_qwen(), lr=1e-3)  # compact by default
    ids = torch.randint(0, 101, (2, 9))
    expected = model(input_ids=ids).logits
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(input_ids=ids).logits, expected)
    trainstream.unwrap(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_under_autocast_every_linear_trains_as_peft_does(dtype):
    """bf16 autocast (TRL's default bf16=True) with LoRA on every projection, o_proj included: the compact
    layers cast as autocast does for F.linear, so loss and gradients are PEFT's bits (this crashed in
    backward with a dtype mismatch before)."""
    model = _lora_qwen(dtype)
    reference = copy.deepcopy(model)
    installed = CompactLoraInputs(eligible_layers(_blocks(model)))
    assert len(installed.layers) == 2 * len(TARGETS)
    ids = torch.randint(0, 101, (2, 17))
    runs = []
    for m in (model, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    _assert_same_bits(*runs)
