"""params_out through streaming (non-temporal) stores gives the same bits as ordinary stores."""

from __future__ import annotations

import pytest
import torch
import ts_adamw

KW = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


@pytest.fixture
def restore_mode():
    yield
    ts_adamw.set_streaming_stores("auto")


def _run(mode, n, offset, grad_dtype, moment_dtype, out_dtype):
    ts_adamw.set_streaming_stores(mode)
    gen = torch.Generator().manual_seed(n + offset)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    m = (torch.randn(n, generator=gen) * 0.1).to(moment_dtype)
    v = torch.rand(n, generator=gen).to(moment_dtype)
    out = torch.full((n + offset,), 7.0, dtype=out_dtype)[offset:]  # offset: unaligned start of params_out
    for step in (1, 2):
        ts_adamw.adamw_step(p, g, m, v, step=step, param_out=out, seed=3, **KW)
    return p, m, v, out


@pytest.mark.parametrize("n", [1, 63, 2048 + 31, 3 * 2048, 100_003])
@pytest.mark.parametrize("offset", [0, 1, 5])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_streaming_stores_match_ordinary_stores(restore_mode, n, offset, out_dtype, moment_dtype):
    on = _run("on", n, offset, torch.bfloat16, moment_dtype, out_dtype)
    off = _run("off", n, offset, torch.bfloat16, moment_dtype, out_dtype)
    for a, b in zip(on, off):
        assert torch.equal(a, b)
    assert torch.equal(on[3], on[0].to(out_dtype))


def test_mode_round_trip_and_bad_name(restore_mode):
    assert ts_adamw.streaming_stores() == "auto"
    ts_adamw.set_streaming_stores("off")
    assert ts_adamw.streaming_stores() == "off"
    with pytest.raises(ValueError, match="auto, on, off"):
        ts_adamw.set_streaming_stores("sometimes")
    assert ts_adamw.streaming_stores() == "off"


def test_async_steps_stream_too(restore_mode):
    ts_adamw.set_streaming_stores("on")
    n = 50_000
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    ts_adamw.adamw_step_async(p, g, m, v, step=1, param_out=out, **KW).wait()
    assert torch.equal(out, p.bfloat16())
