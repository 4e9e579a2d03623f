"""The attention backend choice (trainstream.attention): validation, the choice logic under injected
timings, the pin in forward, backward and recomputation, Hugging Face models, the events and the
report. CPU tests run the math and flash backends (the two torch's CPU build has); the GPU tests
(test_attention_cuda.py) time the real kernels on Qwen2.5 shapes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from trainstream.activations.recompute import Recompute
from trainstream.attention import ATTENTION_MODES, AttentionChooser, _measure, check_attention_mode
from trainstream.attention._calls import SdpaCall
from trainstream.attention._measure import candidates, default_timer, deterministic_backends

MATH, FLASH = SDPBackend.MATH, SDPBackend.FLASH_ATTENTION
_PROPERTY = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fake_timer(table: dict[str, float]):
    """A timer that returns the given milliseconds per backend name (the run itself already happened once)."""
    def timer(backend, run, device):
        return table[_measure.name_of(backend)]
    return timer


_ENABLED = {FLASH: torch.backends.cuda.flash_sdp_enabled, MATH: torch.backends.cuda.math_sdp_enabled,
            SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
            SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled}
if torch.cuda.is_available():  # torch sets its CUDA default order at the first CUDA SDPA call: settle it
    from trainstream.attention._pin import initialize_order

    initialize_order("cuda")
_PRIORITY = list(torch._C._get_sdp_priority_order())


def first(device_type: str = "cpu") -> str:
    """The backend torch's dispatcher tries first now: on the CPU flash, then math, when enabled
    (it ignores the priority order); on CUDA the first enabled one in the priority order."""
    if device_type == "cpu":
        return "flash" if torch.backends.cuda.flash_sdp_enabled() else \
            "math" if torch.backends.cuda.math_sdp_enabled() else "none"
    for index in torch._C._get_sdp_priority_order():
        backend = SDPBackend(index)
        if backend in _ENABLED and _ENABLED[backend]():
            return _measure.name_of(backend)
    return "none"


def untouched() -> bool:
    """Every backend enabled and PyTorch's priority order, as before any pin."""
    return all(enabled() for enabled in _ENABLED.values()) and list(torch._C._get_sdp_priority_order()) == _PRIORITY


class Attention(torch.nn.Module):
    """A plain module calling F.scaled_dot_product_attention; records the flags at each call."""

    def __init__(self, dim=32, heads=4, kv_heads=None, causal=True, dropout=0.0, mask=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_dim = dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * self.kv_heads * self.head_dim)
        self.o = torch.nn.Linear(dim, dim)
        self.causal, self.dropout, self.mask = causal, dropout, mask
        self.seen: list[tuple[str, bool]] = []  # (the backend torch tries first, grad mode)
        self.last = None

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        self.seen.append((first(x.device.type), torch.is_grad_enabled()))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=self.dropout,
                                             is_causal=self.causal, enable_gqa=self.kv_heads != self.heads)
        self.last = type(out.grad_fn).__name__  # the kernel autograd recorded
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class Stack(torch.nn.Module):
    def __init__(self, blocks=2, **kwargs):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Attention(seed=i, **kwargs) for i in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _grads(model, x):
    model.zero_grad()
    out = model(x)
    out.pow(2).mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _close(a, b, tol):
    return all(torch.allclose(x, y, atol=tol, rtol=tol) for x, y in zip(a, b))


# ---- options -------------------------------------------------------------------------------


def test_check_attention_mode_accepts_the_documented_values():
    for mode in ATTENTION_MODES:
        assert check_attention_mode(mode) == mode
    assert check_attention_mode(None) == "default"
    assert check_attention_mode(SDPBackend.EFFICIENT_ATTENTION) == "efficient"
    assert check_attention_mode(SDPBackend.CUDNN_ATTENTION) == "cudnn"


@pytest.mark.parametrize("bad", ["Flash", "fast", "", 1, True, SDPBackend.OVERRIDEABLE, SDPBackend.ERROR])
def test_check_attention_mode_names_the_valid_values(bad):
    with pytest.raises(ValueError) as info:
        check_attention_mode(bad)
    message = str(info.value)
    assert f"attention={bad!r}" in message
    for mode in ATTENTION_MODES:
        assert repr(mode) in message


# ---- the choice ---------------------------------------------------------------------------


@pytest.mark.parametrize("table, expected", [({"flash": 1.0, "math": 5.0}, "flash"),
                                             ({"flash": 5.0, "math": 1.0}, "math")])
def test_auto_pins_the_fastest_measured(table, expected):
    model = Attention()
    chooser = AttentionChooser("auto", timer=fake_timer(table))
    handle = chooser.install(model)
    x = torch.randn(2, 8, 32)
    _grads(model, x)
    _grads(model, x)
    report = chooser.report()
    assert report["mode"] == "auto" and report["backend"] == expected
    (label,) = report["timings_ms"]
    assert report["timings_ms"][label] == table and report["chosen"][label] == expected
    assert set(report["skipped"][label]) == {"efficient", "cudnn"}  # not in torch's CPU build
    # The forward ran under the pin, and the output's autograd node is that kernel's.
    assert [s[0] for s in model.seen] == ["flash", expected]  # the first forward's pin is set at the call
    assert ("Flash" in model.last) == (expected == "flash")
    lines = [e for e in chooser.events.lines() if "auto, b2 h4 q8 k8 d8 float32 causal cpu" in e]
    assert len(lines) == 1 and lines[0].endswith(f"-> {expected}; efficient skipped: refused: this torch build "
                                                 "has no such kernel for this device; cudnn skipped: refused: "
                                                 "this torch build has no such kernel for this device")
    handle.remove()
    assert untouched()


class _WrongFlash(AttentionChooser):
    """A chooser whose flash kernel is off by ``error`` (a kernel that disagrees with math)."""

    def __init__(self, *args, error=1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.error = error

    def _runner(self, backend, call, **kwargs):
        out, grads = super()._runner(backend, call, **kwargs)
        if backend == FLASH:
            out = out + self.error
        return out, grads


@_PROPERTY
@given(flash_ms=st.sampled_from([0.5, 1.0, 2.0, 3.0]), math_ms=st.sampled_from([0.5, 1.0, 2.0, 3.0]),
       broken=st.booleans())
def test_choice_is_the_argmin_of_the_valid_candidates(flash_ms, math_ms, broken):
    chooser = _WrongFlash("auto", timer=fake_timer({"flash": flash_ms, "math": math_ms}), error=1.0 if broken else 0.0)
    model = Attention()
    chooser.install(model)
    _grads(model, torch.randn(1, 8, 32))
    report = chooser.report()
    (label,) = report["timings_ms"]
    valid = {"math": math_ms} if broken else {"flash": flash_ms, "math": math_ms}
    assert report["timings_ms"][label] == valid
    order = [_measure.name_of(b) for b in _measure.priority_order()]  # ties go to PyTorch's first
    expected = min(valid, key=lambda n: (valid[n], order.index(n)))
    assert report["chosen"][label] == expected == report["backend"]
    assert list(report["timings_ms"][label]) == [n for n in order if n in valid]  # measured in that order
    if broken:
        assert report["skipped"][label]["flash"].startswith("disagrees with the math backend: relative error")


@_PROPERTY
@given(batch=st.integers(1, 2), heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]), seq=st.integers(1, 24),
       causal=st.booleans(), mask=st.sampled_from([None, "bool", "float"]), dtype=st.sampled_from(["f32", "bf16"]),
       flash_first=st.booleans())
def test_outputs_equal_the_default_path(batch, heads, seq, causal, mask, dtype, flash_first):
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    attn_mask = None
    if mask is not None:
        generator = torch.Generator().manual_seed(seq)
        keep = torch.rand(seq, seq, generator=generator) > 0.3
        keep |= torch.eye(seq, dtype=torch.bool)  # no fully masked row
        attn_mask = keep if mask == "bool" else torch.where(keep, 0.0, -1e4).to(dtype)
    reference = Attention(heads=heads[0], kv_heads=heads[1], causal=causal and mask is None, mask=attn_mask).to(dtype)
    model = copy.deepcopy(reference)
    table = {"flash": 1.0, "math": 2.0} if flash_first else {"flash": 2.0, "math": 1.0}
    chooser = AttentionChooser("auto", timer=fake_timer(table))
    chooser.install(model)
    x = torch.randn(batch, seq, 32).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    out_a, grads_a = _grads(reference, x)
    out_b, grads_b = _grads(model, x)
    assert _close([out_a, *grads_a], [out_b, *grads_b], tol)
    assert chooser.report()["backend"] in ("flash", "math")


def test_each_new_shape_is_measured_once():
    calls = []

    def timer(backend, run, device):
        calls.append(_measure.name_of(backend))
        return 1.0

    model = Attention()
    chooser = AttentionChooser("auto", timer=timer)
    chooser.install(model)
    for seq in (8, 8, 12, 8, 12):
        _grads(model, torch.randn(2, seq, 32))
    assert calls == ["flash", "math", "flash", "math"]
    assert list(chooser.report()["timings_ms"]) == ["b2 h4 q8 k8 d8 float32 causal cpu",
                                                    "b2 h4 q12 k12 d8 float32 causal cpu"]


def test_refused_backend_is_skipped_with_torchs_reason():
    # torch's CPU flash kernel refuses dropout: auto keeps math and says why.
    model = Attention(dropout=0.5)
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 0.1, "math": 9.0}))
    chooser.install(model)
    _grads(model, torch.randn(2, 8, 32))
    report = chooser.report()
    (label,) = report["skipped"]
    assert "dropout" in report["skipped"][label]["flash"] and report["chosen"][label] == "math"
    assert label.endswith("dropout0.5 cpu")


def test_measuring_does_not_move_the_models_random_streams():
    model = Attention(dropout=0.5)
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 1.0, "math": 2.0}))
    chooser.install(model)
    torch.manual_seed(3)
    _grads(model, torch.ones(2, 8, 32))
    after_measured = torch.rand(4)
    torch.manual_seed(3)
    _grads(model, torch.ones(2, 8, 32))  # known now: nothing measured
    assert torch.equal(torch.rand(4), after_measured)


# ---- backward and recomputation -------------------------------------------------------


def test_measuring_bypasses_the_models_saved_tensor_hooks():
    # Checkpointing and activation paging pack the model's saved tensors; the measurement's own
    # forward + backward inside the first forward must not reach them.
    packed = []

    def pack(tensor):
        packed.append(tensor.shape)
        return tensor

    model = Attention()
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 1.0, "math": 2.0}))
    chooser.install(model)
    x = torch.randn(2, 8, 32)
    counts = []
    for _ in range(2):
        packed.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum().backward()
        counts.append(len(packed))
    assert len(chooser.report()["timings_ms"]) == 1 and counts[0] == counts[1] > 0


def test_backward_replays_the_kernel_the_forward_chose():
    # What the pin relies on: the backend enabled at backward time does not matter.
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    with sdpa_kernel([FLASH]):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    with sdpa_kernel([MATH]):  # flash disabled: its backward still runs
        (grad_math_time,) = torch.autograd.grad(out.sum(), q)
    with sdpa_kernel([FLASH]):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(grad, grad_math_time)


@pytest.mark.parametrize("how", ["trainstream", "torch", "reentrant"])
def test_recompute_in_backward_runs_under_the_pin(how):
    # Math is chosen; without the backward pin the recomputed forward would pick flash (PyTorch's first
    # on the CPU), save different tensors and fail torch.utils.checkpoint's check.
    model = Stack()
    reference = copy.deepcopy(model)
    if how == "trainstream":
        for block in model.blocks:
            Recompute(block).install()
    else:
        model.forward = lambda x: _checkpointed(model, x, reentrant=how == "reentrant")
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 9.0, "math": 1.0}))
    chooser.install(model)
    # Reentrant checkpointing runs the first forward under no_grad: measured all the same.
    x = torch.randn(2, 8, 32, requires_grad=how == "reentrant")
    _grads(model, x)
    for block in model.blocks:
        block.seen.clear()
    out, grads = _grads(model, x)
    seen = [s for block in model.blocks for s in block.seen]
    assert len(seen) == 4  # two forwards, two recomputations in backward
    assert all(s[0] == "math" for s in seen)
    assert len(chooser.report()["timings_ms"]) == 1
    out_ref, grads_ref = _grads(reference, x)
    assert _close([out, *grads], [out_ref, *grads_ref], 1e-5)
    assert untouched()  # backward's end left the pin


def _checkpointed(model, x, reentrant):
    for block in model.blocks:
        x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
    return x


def test_one_backward_through_several_forwards_leaves_the_pin_once():
    # DPO-style: two forwards (two signatures), one backward; recomputation of both runs pinned.
    model = Stack()
    for block in model.blocks:
        Recompute(block).install()
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 9.0, "math": 1.0}))
    chooser.install(model)
    for _ in range(2):
        for block in model.blocks:
            block.seen.clear()
        (model(torch.randn(2, 8, 32)).sum() + model(torch.randn(2, 6, 32)).sum()).backward()
        assert untouched()
    assert [s[0] for block in model.blocks for s in block.seen] == ["math"] * 8


def test_a_failed_backward_leaves_no_pin_behind():
    model = Attention()
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 9.0, "math": 1.0}))
    handle = chooser.install(model)
    out = model(torch.randn(2, 8, 32))

    def fail(grad):
        raise RuntimeError("boom")

    out.register_hook(fail)  # runs after the pin's hook (registered in forward)
    with pytest.raises(RuntimeError, match="boom"):
        out.sum().backward()
    model(torch.randn(2, 8, 32))
    assert model.seen[-1][0] == "math"
    with torch.no_grad():
        model(torch.randn(3, 8, 32))  # a new signature without gradients: nothing pinned, nothing stale
    assert model.seen[-1][0] == "flash"
    handle.remove()
    assert untouched()


def test_a_forward_that_raises_leaves_no_pin_and_is_looked_at_again():
    model = Attention()
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 9.0, "math": 1.0}))
    chooser.install(model)
    model.o.register_forward_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("after attention")))
    with pytest.raises(RuntimeError, match="after attention"):
        model(torch.randn(2, 8, 32))
    assert untouched() and not chooser._entries  # measured, but the signature is not cached half-seen
    model.o._forward_hooks.clear()
    _grads(model, torch.randn(2, 8, 32))
    _grads(model, torch.randn(2, 8, 32))
    assert model.seen[-1][0] == "math" and len(chooser.report()["timings_ms"]) == 1


class _Broken(AttentionChooser):
    def _runner(self, backend, call, **kwargs):
        raise MemoryError("no room for the reference")


def test_a_failing_measurement_leaves_the_shape_to_pytorch():
    model = Attention()
    chooser = _Broken("auto")
    chooser.install(model)
    reference = copy.deepcopy(model)
    for _ in range(2):
        out, grads = _grads(model, torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)))
    assert model.seen[-1][0] == "flash" and chooser.report()["backend"] is None
    assert list(chooser.report()["failed"].values()) == ["MemoryError: no room for the reference"]
    assert sum("measuring failed" in e for e in chooser.events.lines()) == 1
    out_ref, grads_ref = _grads(reference, torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)))
    assert _close([out, *grads], [out_ref, *grads_ref], 0)


def test_no_grad_forwards_use_the_training_choice():
    model = Attention()
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 9.0, "math": 1.0}))
    chooser.install(model)
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        model(x)  # before any training forward: nothing measured, PyTorch's order
    assert model.seen[-1] == ("flash", False) and not chooser.report()["timings_ms"]
    _grads(model, x)
    with torch.no_grad():
        model(x)  # the signature's first forward: pinned at the call (after `seen` was recorded)
        model(x)
    assert model.seen[-1] == ("math", False)
    assert len(chooser.report()["timings_ms"]) == 1


# ---- named backends, default, deterministic ---------------------------------------------


def test_named_backend_is_pinned_first_and_falls_back_with_an_event():
    model = Attention()
    chooser = AttentionChooser("math")
    chooser.install(model)
    _grads(model, torch.randn(2, 8, 32))
    _grads(model, torch.randn(2, 8, 32))
    assert model.seen[-1][0] == "math"
    assert "Flash" not in model.last
    assert chooser.report()["backend"] == "math" and not chooser.report()["timings_ms"]["b2 h4 q8 k8 d8 float32 causal cpu"]

    dropout = Attention(dropout=0.5)
    chooser = AttentionChooser("flash")
    chooser.install(dropout)
    _grads(dropout, torch.randn(2, 8, 32))  # flash cannot: math runs it
    assert any("attention='flash' cannot run" in e and "dropout" in e and "PyTorch's next backend" in e
               for e in chooser.events.lines())
    assert chooser.report()["chosen"] == {"b2 h4 q8 k8 d8 float32 causal dropout0.5 cpu": None}


def test_default_changes_nothing():
    model = Attention()
    chooser = AttentionChooser("default")
    handle = chooser.install(model)
    assert not model._forward_hooks and not model._forward_pre_hooks
    _grads(model, torch.randn(2, 8, 32))
    assert chooser.report() == {"mode": "default", "backend": None, "timings_ms": {}, "chosen": {},
                                "skipped": {}, "errors": {}, "failed": {}, "left_alone": None, "reused_shapes": 0}
    handle.remove()


def test_deterministic_candidates():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert deterministic_backends("cuda", warn_only=False) == {MATH, FLASH, SDPBackend.EFFICIENT_ATTENTION}
    assert deterministic_backends("cuda", warn_only=True) == {MATH}
    chosen, left = candidates(cuda, deterministic=True, warn_only=False)
    assert SDPBackend.CUDNN_ATTENTION not in chosen and "not deterministic on cuda" in left["cudnn"]
    chosen, left = candidates(cuda, deterministic=True, warn_only=True)
    assert chosen == [MATH] and set(left) == {"cudnn", "flash", "efficient"}
    assert candidates(cpu, deterministic=False, warn_only=False)[1] == {}
    assert set(candidates(cpu, deterministic=True, warn_only=False)[0]) == {MATH, FLASH}


def test_deterministic_mode_measures_only_deterministic_backends(monkeypatch):
    monkeypatch.setattr(_measure, "deterministic_backends", lambda device_type, warn_only: {MATH})
    model = Attention()
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 0.1, "math": 5.0}))
    chooser.install(model)
    torch.use_deterministic_algorithms(True)
    try:
        _grads(model, torch.randn(2, 8, 32))
    finally:
        torch.use_deterministic_algorithms(False)
    report = chooser.report()
    (label,) = report["timings_ms"]
    assert report["timings_ms"][label] == {"math": 5.0} and report["backend"] == "math"
    assert "not deterministic on cpu under torch.use_deterministic_algorithms(True)" in report["skipped"][label]["flash"]


# ---- Hugging Face models, copies, removal ---------------------------------------------------


def _tiny_qwen(attn_implementation: str, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation=attn_implementation, use_cache=False)
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_hugging_face_sdpa_model(checkpointing):
    model = _tiny_qwen("sdpa")
    reference = copy.deepcopy(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 9.0, "math": 1.0}))
    chooser.install(model)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    for m in (model, reference):
        m.zero_grad()
        m(input_ids=ids, labels=ids).loss.backward()
    report = chooser.report()
    (label,) = report["timings_ms"]
    assert label.startswith("b2 h4/2 q12 k12 d16 float32") and report["backend"] == "math"
    assert max((p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters())) < 1e-5
    model(input_ids=ids[:, :8], labels=ids[:, :8]).loss.backward()  # a new length: measured once more
    assert len(chooser.report()["timings_ms"]) == 2
    assert untouched()


def test_hugging_face_eager_model_is_left_alone():
    model = _tiny_qwen("eager")
    chooser = AttentionChooser("auto")
    handle = chooser.install(model)
    assert not model._forward_hooks and not model._forward_pre_hooks
    report = chooser.report()
    assert report["left_alone"] == ("the model computes attention with attn_implementation='eager', not "
                                    "scaled_dot_product_attention") and report["backend"] is None
    assert any("load the model with attn_implementation='sdpa'" in e for e in chooser.events.lines())
    handle.remove()


def test_a_model_without_attention_says_so():
    chooser = AttentionChooser("auto")
    model = torch.nn.Linear(4, 4)
    chooser.install(model)
    model(torch.randn(2, 4)).sum().backward()
    assert any("made no scaled_dot_product_attention call" in e for e in chooser.events.lines())


def test_copies_are_plain_and_remove_takes_everything_off():
    model = Attention()
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 9.0, "math": 1.0}))
    handle = chooser.install(model)
    with pytest.raises(RuntimeError, match="already installed"):
        chooser.install(Attention())
    _grads(model, torch.randn(2, 8, 32))
    clone = copy.deepcopy(model)  # the hooks copy as no-ops: the copy runs PyTorch's order
    clone(torch.randn(2, 8, 32))
    assert clone.seen[-1][0] == "flash"
    handle.remove()
    handle.remove()
    assert not model._forward_hooks and not model._forward_pre_hooks
    model(torch.randn(2, 8, 32))
    assert model.seen[-1][0] == "flash"
    chooser.install(model).remove()  # installable again once removed


def test_default_timer_on_the_cpu():
    runs = []
    ms = default_timer(reps=3)(MATH, lambda: runs.append(1), torch.device("cpu"))
    assert ms >= 0 and len(runs) == 4  # one warm-up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_numerics_check_compares_like_with_like(dtype):
    # The float32 reference and the candidates get the same output gradient: errors are the
    # dtype's rounding, not noise (which would hide a wrong kernel behind a loose limit).
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 64, 32, generator=generator).to(dtype).requires_grad_()
    k = torch.randn(1, 2, 64, 32, generator=generator).to(dtype).requires_grad_()
    result = _measure.measure(SdpaCall(q, k, k, is_causal=True, enable_gqa=True), [FLASH, MATH],
                              fake_timer({"flash": 1.0, "math": 1.0}))
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert set(result.errors) == {"flash", "math"} and max(result.errors.values()) < bound


def test_reduced_check_keeps_the_head_groups():
    q, k = torch.randn(3, 40, 4, 8), torch.randn(3, 8, 4, 8)
    mask = torch.zeros(3, 40, 4, 4)
    small = _measure._reduced(SdpaCall(q, k, k, attn_mask=mask, enable_gqa=True), max_heads=2)
    assert small.query.shape == (1, 10, 4, 8) and small.key.shape == (1, 2, 4, 8)
    assert small.attn_mask.shape == (1, 10, 4, 4)


def test_attention_bench_smoke(tmp_path):
    import json
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[3] / "tools" / "bench" / "attention_choice.py"
    out = tmp_path / "attention.json"
    done = subprocess.run([sys.executable, str(script), "--smoke", "--shapes", "1x32", "--modes", "default", "auto",
                           "flash", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["scenario"], r["mode"]) for r in results] == [(s, m) for s in ("full", "lora")
                                                             for m in ("default", "auto", "flash")]
    assert all(r["outcome"] == "ok" and r["median_s"] > 0 for r in results)
    auto = [r["attention"] for r in results if r["mode"] == "auto"]
    assert all(a["backend"] in ("flash", "math") and a["timings_ms"] for a in auto)
    assert "| full | 1x32 |" in done.stdout and "default / auto" in done.stdout
