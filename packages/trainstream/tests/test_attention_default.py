"""wrap()'s attention default: "auto" for a model on one GPU, PyTorch's choice on the CPU and with
data parallel, each with an event saying why; an explicit value is always kept."""

from __future__ import annotations

import pytest
import torch
import trainstream
from trainstream._events import EventLog
from trainstream.attention import WRAP_DEFAULT, resolve_wrap_default


@pytest.mark.parametrize(("device", "world", "expected", "reason"), [
    ("cuda", 1, "auto", None),
    ("cpu", 1, "default", "not on a GPU"),
    ("cuda", 2, "default", "data parallel over 2 ranks"),
])
def test_the_wrap_default_resolves_by_device_and_world(device, world, expected, reason):
    events = EventLog()
    assert resolve_wrap_default(WRAP_DEFAULT, torch.device(device), world, events) == expected
    lines = events.lines()
    if reason is None:
        assert lines == []
    else:
        assert len(lines) == 1 and reason in lines[0] and "attention not given" in lines[0]


@pytest.mark.parametrize("mode", ["auto", "default", "flash", "math"])
def test_an_explicit_mode_is_kept_everywhere(mode):
    events = EventLog()
    for device, world in (("cpu", 1), ("cuda", 4)):
        assert resolve_wrap_default(mode, torch.device(device), world, events) == mode
    assert events.lines() == []


def test_a_cpu_model_wrapped_without_attention_keeps_pytorchs_choice():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model, _ = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    try:
        report = trainstream.memory_report(model)
        assert report["attention"]["mode"] == "default"
        assert any("attention not given: 'default'" in line for line in report["events"])
    finally:
        trainstream.unwrap(model)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    model, _ = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), attention="auto")
    try:
        assert trainstream.memory_report(model)["attention"]["mode"] == "auto"
    finally:
        trainstream.unwrap(model)
