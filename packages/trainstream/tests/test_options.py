"""Bad options and impossible plans are refused up front with clear messages."""

from __future__ import annotations

import pytest
import torch
import trainstream
import ts_pinned
from ts_testing import tiny_llama


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"optimizer_mode": "tpu"}, "optimizer_mode='tpu' is not valid; use one of 'cpu', 'gpu', 'auto'"),
        ({"offload": False}, "offload=False is not valid"),
        ({"offload": 1}, "offload=1 is not valid"),
        ({"moment_dtype": "fp16"}, "moment_dtype='fp16' is not valid"),
        ({"max_grad_norm": -1.0}, "max_grad_norm=-1.0 is not valid"),
        ({"accumulation_steps": 0}, "accumulation_steps=0 is not valid"),
        ({"accumulation_steps": 2.5}, "accumulation_steps=2.5 is not valid"),
        ({"threads": 0}, "threads=0 is not valid"),
        ({"vram_headroom": 1.5}, "vram_headroom=1.5 is not valid"),
        ({"lr": -1}, "lr=-1 is not valid"),
        ({"check_memory": "yes"}, "check_memory='yes' is not valid"),
        ({"device": "tpu"}, "device='tpu' is not"),
        ({"quantize_weights": True}, "unknown wrap() option(s): 'quantize_weights'"),
        ({"quantise": "nf4"}, "unknown wrap() option(s): 'quantise' (did you mean 'quantize'?)"),
        ({"max_grad_norm": 10**400}, "max_grad_norm=1000"),  # too large for a float: a ValueError too
        ({"lr": 10**400}, "is not valid; use a finite number >= 0"),
        ({"vram_headroom": 10**400}, "is not valid; use a fraction in [0, 1)"),
        ({"quantize": "nf4"}, "freeze the base and train LoRA adapters (peft), or use quantize=None"),
        ({"seed": "x"}, "seed='x' is not valid; use an integer in [0, "),
        ({"seed": -1}, "seed=-1 is not valid"),
        ({"seed": 2**70}, f"seed={2**70} is not valid"),
        ({"lr": True}, "lr=True is not valid"),
        ({"lr": float("nan")}, "lr=nan is not valid"),
        ({"lr": float("inf")}, "lr=inf is not valid"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm=inf is not valid"),
        ({"max_grad_norm": True}, "max_grad_norm=True is not valid"),
        ({"accumulation_steps": True}, "accumulation_steps=True is not valid"),
        ({"accumulation_steps": 2**40}, f"accumulation_steps={2**40} is not valid"),
        ({"threads": 40000}, "threads=40000 is not valid; use None (all usable cores) or an integer in [1, "),
        ({"threads": 2**70}, "is not valid"),
        ({"vram_headroom": float("nan")}, "vram_headroom=nan is not valid"),
        ({"guard_params": 1}, "guard_params=1 is not valid"),
    ],
)
def test_bad_option_values(options, message):
    with pytest.raises(ValueError) as error:
        trainstream.wrap(tiny_llama(), **options)
    assert message in str(error.value)


def test_aliases_are_accepted():
    model, _ = trainstream.wrap(tiny_llama(), moment_dtype=torch.bfloat16)
    assert model._trainstream_session.moment_dtype == torch.bfloat16
    assert model._trainstream_session.config.moment_dtype == "bfloat16"


def test_unsupported_optimizers():
    model = tiny_llama()
    with pytest.raises(ValueError, match="not SGD"):
        trainstream.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="amsgrad"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters(), amsgrad=True))
    with pytest.raises(ValueError, match="L2 penalty"):
        trainstream.wrap(model, torch.optim.Adam(model.parameters(), weight_decay=0.1))


def test_adam_without_weight_decay_is_accepted():
    model = tiny_llama()
    _, opt = trainstream.wrap(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    assert opt.param_groups[0]["weight_decay"] == 0


def test_wrapping_twice_is_refused():
    model, _ = trainstream.wrap(tiny_llama())
    with pytest.raises(ValueError, match="already wrapped"):
        trainstream.wrap(model)


def test_gpu_mode_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        trainstream.wrap(tiny_llama(), optimizer_mode="gpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        trainstream.wrap(tiny_llama(), device="cuda")


def test_run_that_cannot_fit_in_host_ram_is_refused(monkeypatch):
    small = ts_pinned.PageLockBudget(memlock_limit=None, mem_available=10_000, mem_total=20_000, budget=8_000)
    monkeypatch.setattr(ts_pinned, "page_lock_budget", lambda *a, **k: small)
    with pytest.raises(MemoryError) as error:
        trainstream.wrap(tiny_llama())
    text = str(error.value)
    assert "of page-locked host RAM" in text and "bfloat16 moments would need" in text
    # check_memory=False lets it try (this tiny model does fit in real RAM)
    model, _ = trainstream.wrap(tiny_llama(), check_memory=False)
    assert model._trainstream_session.moment_dtype == torch.bfloat16


def test_an_unwrapped_offload_adamw_steps_on_its_own():
    # Issue 19: OffloadAdamW is a complete optimizer without wrap() (test_offload_adamw_standalone.py).
    model = tiny_llama()
    opt = trainstream.OffloadAdamW(model.parameters())
    assert opt.step() is None and not opt.state  # no gradients yet: nothing to do


def test_offload_adamw_settings_are_wraps_defaults():
    model = tiny_llama()
    opt = trainstream.OffloadAdamW(model.parameters(), lr=1e-3, mode="cpu", max_grad_norm=2.0,
                                   accumulation_steps=3, moment_dtype="bf16")
    model, opt = trainstream.wrap(model, opt, accumulation_steps=2)  # wrap()'s own option wins
    config = model._trainstream_session.config
    assert (config.max_grad_norm, config.accumulation_steps, config.moment_dtype) == (2.0, 2, "bfloat16")
    with pytest.raises(ValueError, match="optimizer_mode='tpu'"):
        trainstream.wrap(tiny_llama(), trainstream.OffloadAdamW(tiny_llama().parameters(), mode="tpu"))


def test_threads_are_bounded_by_the_cores_this_process_may_use():
    import threading

    import ts_adamw

    limit = ts_adamw.max_host_threads()
    assert limit == 4 * ts_adamw.usable_cores()
    # Compared as sets, not counts: a collection during the test may stop an earlier test's dropped model's
    # worker (test_unwrap_release.py), which is no thread this wrap() started.
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match=f"integer in \\[1, {limit}\\]"):
        trainstream.wrap(tiny_llama(), threads=limit + 1)
    assert set(threading.enumerate()) - before == set()  # refused before any thread started


@pytest.mark.parametrize(("group", "message"), [
    ({"lr": True}, "lr=True is not valid"),
    ({"lr": float("nan")}, "lr=nan is not valid"),
    ({"eps": float("inf")}, "eps=inf is not valid"),
    ({"weight_decay": float("nan")}, "weight_decay=nan is not valid"),
    ({"betas": (0.9, 1.0)}, "betas=(0.9, 1.0) is not valid"),
    ({"amsgrad": True}, "amsgrad=True"),
])
def test_bad_hyper_parameters_are_refused_at_wrap_and_at_update_time(group, message):
    model = tiny_llama()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:], **group}], lr=1e-3) \
        if "amsgrad" not in group else torch.optim.AdamW(params, lr=1e-3, amsgrad=True)
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        trainstream.wrap(model, opt)
    assert not hasattr(model, "_trainstream_session")
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        trainstream.OffloadAdamW(params, **{k: v for k, v in group.items() if k != "amsgrad"}) \
            if "amsgrad" not in group else trainstream.OffloadAdamW([{"params": params, "amsgrad": True}])
    if "amsgrad" in group:
        return
    # A scheduler (or a user) writing a bad value later: refused when the gradient arrives, nothing changed.
    from ts_testing import batches, loss_of

    model, opt = trainstream.wrap(tiny_llama(), lr=1e-3)
    opt.param_groups[0].update(group)
    with pytest.raises(ValueError, match="param group of parameter"):
        loss_of(model, batches(1)[0]).backward()
    opt.param_groups[0].update({"lr": 1e-3, "eps": 1e-8, "weight_decay": 1e-2, "betas": (0.9, 0.999)})
    opt.zero_grad()
    model._trainstream_session.synchronize()
    assert all(s.step == 0 for s in model._trainstream_session.engine.active)
    loss_of(model, batches(1)[0]).backward()
    opt.step()
    model._trainstream_session.synchronize()
    assert all(s.step == 1 for s in model._trainstream_session.engine.active)


def test_events_go_to_the_trainstream_logger(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="trainstream"):
        model, _ = trainstream.wrap(tiny_llama(), lr=1e-3)
    assert any(r.name == "trainstream" and "plan:" in r.getMessage() for r in caplog.records)
    trainstream.unwrap(model)


def test_verbose_prints_the_events(capsys):
    model, _ = trainstream.wrap(tiny_llama(), lr=1e-3, verbose=True)
    trainstream.unwrap(model)
    assert "trainstream plan: " in capsys.readouterr().err  # on stderr, as logging prints (test_events.py)
