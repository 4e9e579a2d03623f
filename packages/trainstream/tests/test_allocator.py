"""wrap() on a GPU turns the CUDA allocator's expandable segments on once (fragmentation ran a planned
run out of VRAM at step 3 on the H200), unless the user chose the setting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainstream.memory import allocator

CUDA = torch.device("cuda", 0)


@pytest.fixture
def calls(monkeypatch):
    made = []
    monkeypatch.setattr(allocator, "_setter", lambda: made.append)
    monkeypatch.setattr(allocator, "_switched", [False])
    for name in allocator.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    return made


def test_switched_once_for_a_gpu_model(calls):
    why = allocator.use_expandable_segments(CUDA)
    assert calls == ["expandable_segments:True"]
    assert "expandable segments on" in why
    assert allocator.use_expandable_segments(CUDA) is None and calls == ["expandable_segments:True"]


def test_nothing_changes_on_the_cpu(calls):
    assert allocator.use_expandable_segments(torch.device("cpu")) is None
    assert calls == []


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(allocator.ALLOCATOR_ENV), value=st.sampled_from(
    ["expandable_segments:False", "expandable_segments:True", "max_split_size_mb:128,expandable_segments:False"]))
def test_a_users_setting_is_left_alone(name, value):
    made = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(allocator, "_setter", lambda: made.append)
        mp.setattr(allocator, "_switched", [False])
        for other in allocator.ALLOCATOR_ENV:
            mp.delenv(other, raising=False)
        mp.setenv(name, value)
        why = allocator.use_expandable_segments(CUDA)
    assert made == [] and "left as set" in why and value in why


def test_a_torch_without_the_switch_says_how_to_set_it(calls, monkeypatch):
    monkeypatch.setattr(allocator, "_setter", lambda: None)
    why = allocator.use_expandable_segments(CUDA)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in why


def test_a_platform_that_refuses_the_setting_keeps_the_default_and_says_why(calls, monkeypatch):
    def refuse(value):
        raise RuntimeError("expandable_segments not supported on this platform")

    monkeypatch.setattr(allocator, "_setter", lambda: refuse)
    why = allocator.use_expandable_segments(CUDA)
    assert "not available here (expandable_segments not supported on this platform)" in why
    assert allocator.use_expandable_segments(CUDA) is None  # asked once


def test_the_running_torch_has_the_switch():
    assert callable(allocator._setter())


@pytest.mark.cuda
def test_wrap_on_cuda_switches_and_says_so():
    import trainstream
    from ts_testing import tiny_llama

    allocator._switched[0] = False
    model, _ = trainstream.wrap(tiny_llama().cuda(), lr=1e-3)
    events = trainstream.memory_report(model)["events"]
    trainstream.unwrap(model)
    assert any("expandable segments on" in e or "left as set" in e for e in events), events
