"""The process-wide SDPA settings around the attention chooser's pins: the caller's switches and
priority order come back exactly after every forward and backward (recomputation included), however
the pins end; backends the caller turned off stay off. The CUDA side (torch's lazy default order)
is in test_attention_cuda.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import Attention, Stack, _grads, fake_timer
from torch.nn.attention import SDPBackend
from trainstream.activations.recompute import Recompute
from trainstream.attention import AttentionChooser

MATH, FLASH = SDPBackend.MATH, SDPBackend.FLASH_ATTENTION
_SWITCHES = ("cudnn", "flash", "mem_efficient", "math", "overrideable")


def sdpa_settings() -> tuple:
    """Every SDPA switch torch has and its priority order, read straight from torch."""
    return (tuple(getattr(torch._C, f"_get_{n}_sdp_enabled")() for n in _SWITCHES),
            tuple(torch._C._get_sdp_priority_order()))


def _set(enabled: dict[str, bool], priority: list[int] | None = None) -> None:
    for name, on in enabled.items():
        getattr(torch._C, f"_set_sdp_use_{name}")(on)
    if priority is not None:
        torch._C._set_sdp_priority_order(priority)


@pytest.fixture
def callers_settings():
    """Restores torch's defaults after a test that changes the caller's settings."""
    before = sdpa_settings()
    yield
    _set(dict(zip(_SWITCHES, before[0])), list(before[1]))
    assert sdpa_settings() == before


@pytest.mark.parametrize("mode, table", [("auto", {"flash": 9.0, "math": 1.0}), ("auto", {"flash": 1.0, "math": 9.0}),
                                         ("math", None), ("flash", None)])
@pytest.mark.parametrize("off, priority", [("cudnn", None), ("overrideable", [4, 1, 2, 0, 3])])
def test_settings_come_back_exactly_after_forward_and_recompute(mode, table, off, priority, callers_settings):
    # A backend the caller disabled before the pin: torch's sdpa_kernel(set_priority=True) puts it
    # back in the order of the pin it leaves, not where it was.
    _set({off: False}, priority)
    model = Stack()
    for block in model.blocks:
        Recompute(block).install()
    chooser = AttentionChooser(mode, timer=fake_timer(table) if table else None)
    chooser.install(model)
    before = sdpa_settings()
    for step in range(3):  # the measuring forward, then known signatures
        for block in model.blocks:
            block.seen.clear()
        out = model(torch.randn(2, 8, 32))
        assert sdpa_settings() == before  # after forward
        out.pow(2).mean().backward()
        assert sdpa_settings() == before  # after backward and its recomputation
        if step:  # (the measuring forward records the flags before its pin is set, at the call)
            assert len({s[0] for block in model.blocks for s in block.seen}) == 1  # forward and recompute
    assert chooser.report()["backend"] in ("flash", "math")


def test_two_models_in_one_backward_leave_the_settings_as_they_were():
    # Two wrapped models (policy and value, say) with different pins, one backward: each pin was
    # entered by a hook and left by its own final callback, first-entered first-left, so the second
    # restored what it saw at entry: the first pin.
    before = sdpa_settings()
    a, b = Attention(seed=0), Attention(seed=1)
    choosers = [AttentionChooser("auto", timer=fake_timer({"flash": 9.0, "math": 1.0})),
                AttentionChooser("auto", timer=fake_timer({"flash": 1.0, "math": 9.0}))]
    for chooser, model in zip(choosers, (a, b)):
        chooser.install(model)
    x = torch.randn(2, 8, 32)
    for _ in range(2):
        (a(x).sum() + b(x).sum()).backward()
        assert sdpa_settings() == before
    assert [c.report()["backend"] for c in choosers] == ["math", "flash"]
    conflicts = [e for c in choosers for e in c.events.lines() if "one backward runs through forwards pinned" in e]
    assert len(conflicts) == 1


def test_a_failed_backward_is_released_by_any_later_forward():
    before = sdpa_settings()
    a, b = Attention(seed=0), Attention(seed=1)
    AttentionChooser("auto", timer=fake_timer({"flash": 9.0, "math": 1.0})).install(a)
    AttentionChooser("auto", timer=fake_timer({"flash": 1.0, "math": 9.0})).install(b)
    out = a(torch.randn(2, 8, 32))
    out.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        out.sum().backward()
    assert sdpa_settings() != before  # autograd ran no final callback: a's pin is still on
    _grads(b, torch.randn(2, 8, 32))  # another model's forward: outside any backward, so stale
    assert b.seen[-1][0] == "flash" and sdpa_settings() == before


def test_backends_the_caller_disabled_are_not_measured_or_pinned(callers_settings):
    _set({"flash": False})
    before = sdpa_settings()
    model = Attention()
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 0.1, "math": 5.0}))
    chooser.install(model)
    for _ in range(2):
        _grads(model, torch.randn(2, 8, 32))
        assert sdpa_settings() == before and model.seen[-1][0] == "math"
    report = chooser.report()
    (label,) = report["timings_ms"]
    assert report["timings_ms"][label] == {"math": 5.0} and report["backend"] == "math"
    assert report["skipped"][label]["flash"].startswith("disabled by the caller (torch.backends.cuda.enable_flash_sdp")


def test_a_named_backend_is_used_even_when_the_caller_disabled_it(callers_settings):
    _set({"flash": False})
    before = sdpa_settings()
    model = Attention()
    AttentionChooser("flash").install(model)
    for _ in range(2):
        _grads(model, torch.randn(2, 8, 32))
    assert "Flash" in model.last and sdpa_settings() == before


# ---- the pin stack itself -------------------------------------------------------------------

_BACKENDS = [SDPBackend.CUDNN_ATTENTION, FLASH, SDPBackend.EFFICIENT_ATTENTION, MATH]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(switches=st.lists(st.booleans(), min_size=5, max_size=5), priority=st.permutations([0, 1, 2, 3, 4]),
       pins=st.lists(st.lists(st.sampled_from(_BACKENDS), min_size=1, max_size=4, unique=True), min_size=1, max_size=5),
       data=st.data())
def test_pins_left_in_any_order_restore_the_settings_exactly(switches, priority, pins, data):
    from trainstream.attention._pin import Pin, SdpaState, held

    initial = sdpa_settings()
    entered = []
    try:
        _set(dict(zip(_SWITCHES, switches)), priority)
        caller = sdpa_settings()
        saved = SdpaState.current()
        entered += [Pin(backends).enter() for backends in pins]
        order = data.draw(st.permutations(range(len(entered))))
        for done, index in enumerate(order):
            # While pins are held, the newest one still held is in force: its backends, first, in its order.
            newest = max(i for i in range(len(entered)) if entered[i].is_held)
            assert SdpaState.current() == saved.pinned(pins[newest])
            state = SdpaState.current()
            assert state.priority[:len(pins[newest])] == tuple(int(b) for b in pins[newest])
            entered[index].exit()
            entered[index].exit()  # idempotent
            assert held() == len(entered) - done - 1
        assert sdpa_settings() == caller
    finally:
        for pin in entered:
            pin.exit()
        _set(dict(zip(_SWITCHES, initial[0])), list(initial[1]))


# ---- torch.compile ---------------------------------------------------------------------------


def _compiled_steps(whole: bool | None, mode: str, steps: int = 2):
    from test_attention import _tiny_qwen

    torch._dynamo.reset()
    model = _tiny_qwen("sdpa")
    chooser = AttentionChooser(mode, timer=fake_timer({"flash": 9.0, "math": 1.0}))
    chooser.install(model)
    run = model
    if whole:
        run = torch.compile(model, backend="aot_eager")
    elif whole is False:  # the first block only: the other runs eagerly, as a reference inside the same model
        model.model.layers[0].compile(backend="aot_eager", dynamic=False)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    torch._dynamo.reset()
    return chooser, losses


def test_compiled_blocks_are_measured_and_pinned():
    # Dynamo used to trace the measurement inside a compiled block (it failed: PyTorch's order) and
    # left a pin on; the chooser's hooks and measurement now run eagerly, with a graph break.
    before = sdpa_settings()
    chooser, losses = _compiled_steps(whole=False, mode="auto")
    _, reference = _compiled_steps(whole=None, mode="auto")  # not compiled
    assert sdpa_settings() == before
    report = chooser.report()
    assert report["backend"] == "math" and not report["failed"], report
    assert losses == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow
def test_a_compiled_model_is_measured_and_pinned(mode="auto"):
    # torch.compile(model) traced the discovery TorchFunctionMode and broke the model's forward
    # (a Tensor.device read returned a torch.Size).
    before = sdpa_settings()
    chooser, losses = _compiled_steps(whole=True, mode=mode)
    assert sdpa_settings() == before and chooser.report()["backend"] == "math"
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)  # no optimizer step: the same loss twice


# ---- many shapes (dynamic padding) ---------------------------------------------------------------


def test_shapes_past_the_budget_use_the_nearest_measured_choice():
    measured = []

    def timer(backend, run, device):  # flash wins the first measured shape, math the second
        name = backend.name
        measured.append(name)
        return {"FLASH_ATTENTION": 1.0, "MATH": 2.0}[name] * (1 if len(measured) <= 2 else -1)

    model = Attention()
    chooser = AttentionChooser("auto", timer=timer, max_shapes=2)
    chooser.install(model)
    picked = []
    for seq in (8, 16, 9, 15, 10, 8):
        _grads(model, torch.randn(2, seq, 32))
        picked.append(chooser.report()["backend"])
    assert measured == ["FLASH_ATTENTION", "MATH"] * 2  # two shapes measured, the rest reused
    assert picked == ["flash", "math", "flash", "math", "flash", "flash"]
    report = chooser.report()
    assert report["reused_shapes"] == 3 and len(report["timings_ms"]) == 2
    assert sum("2 attention shapes measured" in e for e in chooser.events.lines()) == 1
    # Another kind of call (here: another head count) is measured whatever the budget.
    other = Attention(heads=2)
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 1.0, "math": 2.0}), max_shapes=0)
    chooser.install(other)
    _grads(other, torch.randn(2, 8, 32))
    assert len(chooser.report()["timings_ms"]) == 1 and chooser.report()["reused_shapes"] == 0
