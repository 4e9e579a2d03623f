"""unwrap() frees the session at once: no reference cycle is left for a garbage collection to find,
so the page-locked optimizer state (and the streamed weights' host copies) are released when unwrap()
returns, even with the collector off or not due to run (trainstream/_weak.py), also after a forward that
raised midway."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import trainstream
import ts_pinned
from test_activations import Stack
from test_weights import _frozen_stack
from ts_testing import batches, tiny_llama, train


def _linear_stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


def _steps(model, opt, rows=64):
    g = torch.Generator().manual_seed(0)
    device = model._trainstream_session.device  # a streamed weight's parameter is in host memory
    for _ in range(3):
        model(torch.randn(4, rows, generator=g).to(device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


class _Boom(Exception):
    pass


def _steps_one_failing_mid_forward(model, opt):
    """A step, one whose forward raises inside block 2 (after blocks 0-1 ran and paged), a step."""
    calls = []

    def boom(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise _Boom

    handle = model.layers[2].register_forward_pre_hook(boom)
    try:
        for _ in range(3):
            with contextlib.suppress(_Boom):
                _steps(model, opt, rows=32)
    finally:
        handle.remove()
    assert len(calls) > 2


CASES = {
    "plain": (_linear_stack, {}, _steps),
    "clipped-accumulated": (_linear_stack, {"max_grad_norm": 0.5, "accumulation_steps": 2}, _steps),
    "streamed": (_frozen_stack, {"param_offload": True}, lambda m, o: _steps(m, o, rows=32)),
    "streamed-recompute": (_frozen_stack, {"param_offload": True, "recompute": True}, lambda m, o: _steps(m, o, 32)),
    "paged-activations": (Stack, {"activation_offload": True, "min_offload_bytes": 0}, lambda m, o: _steps(m, o, 32)),
    "streamed-paged-failed-forward": (_frozen_stack, {"param_offload": True, "activation_offload": True,
                                                      "min_offload_bytes": 0}, _steps_one_failing_mid_forward),
    "hugging-face": (tiny_llama, {}, lambda m, o: train(m, o, batches(2), device=m._trainstream_session.device)),
}
# The optimizer state stays in host memory (the arena) on a GPU too, where offload="auto" may move it to VRAM.
HOST_STATE = {"offload": True}
ON_GPU = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
@pytest.mark.parametrize("case", sorted(CASES))
def test_unwrap_frees_the_session_and_its_host_state_without_a_garbage_collection(case, device):
    build, options, run = CASES[case]
    arena = ts_pinned.default_arena()
    gc.collect()
    before = arena.stats()["arena_used"]
    gc.disable()
    try:
        model, opt = trainstream.wrap(build(), lr=1e-3, device=device, **HOST_STATE, **options)
        run(model, opt)
        session = weakref.ref(model._trainstream_session)
        engine = weakref.ref(model._trainstream_session.engine)
        assert arena.stats()["arena_used"] > before  # the host state lives in the arena while wrapped
        trainstream.unwrap(model)
        # The optimizer (kept: it holds the exported state) and the model no longer reach the session.
        assert session() is None and engine() is None
        assert arena.stats()["arena_used"] == before
        assert opt.state  # what unwrap() exported is still there
    finally:
        gc.enable()


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wrapped_model_dropped_without_unwrap_is_freed_whole_by_a_collection(case, device):
    """No unwrap(): the model and its session are a cycle, which one collection frees entirely: weights,
    engine, host state, and the host worker's thread (before, the parameters' grad hooks, which C++ holds
    and the collector cannot see through, kept the engine and everything it holds alive for good)."""
    build, options, run = CASES[case]
    arena = ts_pinned.default_arena()
    gc.collect()
    before = arena.stats()["arena_used"]
    model, opt = trainstream.wrap(build(), lr=1e-3, device=device, **HOST_STATE, **options)
    run(model, opt)
    engine = weakref.ref(model._trainstream_session.engine)
    weight = weakref.ref(next(model.parameters()))
    worker = model._trainstream_session.engine.host._thread
    del model, opt
    gc.collect()
    assert engine() is None
    worker.join(timeout=30)  # collecting the engine told its worker to stop
    assert not worker.is_alive()
    assert weight() is None
    assert arena.stats()["arena_used"] == before


def test_wrap_frees_an_earlier_wrapped_model_dropped_without_unwrap_before_it_plans(monkeypatch):
    """A wrapped model and its session form a cycle: `del model` leaves both to the collector, with their
    memory (VRAM, host state) unseen by the next plan. wrap() collects first when they may hold enough."""
    from trainstream import _dropped

    arena = ts_pinned.default_arena()
    gc.collect()
    before = arena.stats()["arena_used"]
    gc.disable()
    try:
        model, opt = trainstream.wrap(_linear_stack(), lr=1e-3)
        _steps(model, opt)
        held = arena.stats()["arena_used"] - before
        dropped = weakref.ref(model._trainstream_session)
        del model, opt
        assert dropped() is not None  # the cycle: nothing freed it yet

        small, _ = trainstream.wrap(_linear_stack(), lr=1e-3)  # below MIN_HELD_BYTES: no collection
        assert dropped() is not None
        assert not any("earlier wrapped model" in e for e in trainstream.memory_report(small)["events"])
        trainstream.unwrap(small)

        monkeypatch.setattr(_dropped, "MIN_HELD_BYTES", 0)
        model, _opt = trainstream.wrap(_linear_stack(), lr=1e-3)
        assert dropped() is None
        assert arena.stats()["arena_used"] - before == held  # this model's state only
        events = [e for e in trainstream.memory_report(model)["events"] if "earlier wrapped model" in e]
        assert len(events) == 1 and "1 earlier wrapped model(s)" in events[0], events
        trainstream.unwrap(model)
    finally:
        gc.enable()


def test_a_stop_queued_from_the_workers_own_thread_is_found_by_its_next_timed_wait(monkeypatch):
    """A collection can run the engine's finalizer on the host worker's own thread, even while that thread
    holds its wake event's lock: there stop_soon() only queues the stop (setting the event could deadlock),
    and the worker's timed wait finds it."""
    import threading

    from trainstream.engine import updates

    monkeypatch.setattr(updates, "IDLE_CHECK_S", 0.05)
    model, opt = trainstream.wrap(_linear_stack(), lr=1e-3)
    _steps(model, opt)  # the worker now waits with the new, short period
    host = model._trainstream_session.engine.host
    worker = host._thread
    monkeypatch.setattr(threading, "current_thread", lambda: worker)  # as if called on the worker
    host.stop_soon()
    monkeypatch.undo()
    assert not host._wake.is_set()  # not woken: only the timed wait can find the stop
    worker.join(timeout=10)
    assert not worker.is_alive()
    trainstream.unwrap(model)


@pytest.mark.parametrize("options", [{"param_offload": True}, {"param_offload": True, "recompute": True}])
def test_tensors_taken_from_streamed_weights_stay_readable_after_steps_and_unwrap(options):
    """A state dict and a detached weight taken while wrapped hold their values through later steps (which
    evict and refetch the blocks) and after unwrap() (which let go of every buffer), with the freed memory
    reused in between: before, reading them read freed memory (a segmentation fault, or a file torch.load
    refused)."""
    import io

    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model, opt = trainstream.wrap(model, lr=1e-3, **options)
    assert trainstream.memory_report(model)["params"]["streaming"]
    train(model, opt, batches(2))
    state = model.state_dict()
    up = model.get_submodule("base_model.model.model.layers.0.mlp.up_proj").weight.detach()
    expected = {k: v.clone() for k, v in state.items()}
    expected_up = up.clone()
    train(model, opt, batches(2, seed=3))  # blocks evicted and fetched again
    trainstream.unwrap(model)
    del model, opt
    gc.collect()
    reuse = [torch.randn(1 << 18) for _ in range(40)]  # the freed memory handed out again
    assert all(torch.equal(state[k], v) or "lora" in k for k, v in expected.items())
    assert torch.equal(up, expected_up)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    del reuse
