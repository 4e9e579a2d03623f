"""quantized_linear's fallbacks, on the CPU: which errors of a fast path fall back, and for how long.

The fast paths are stand-ins (monkeypatched) whose result is offset by 1000, so each test can tell
which path produced an output.
"""

import re

import pytest
import torch
import torch.nn.functional as F
import ts_quant
from ts_quant import _fused, _linear, _scaled

MARK = 1000.0


def _reference(x, q, bias=None):
    return F.linear(x, q.dequantize(x.dtype), bias)


@pytest.fixture
def fake_path(monkeypatch):
    """fake_path(path, attr, module) routes quantized_linear to `path`, served by a stand-in for
    module.attr; returns a controller whose .error the stand-in raises (None: it returns a result)."""

    class Fake:
        error = None
        calls = 0

    def install(path, module, attr):
        def stand_in(x2d, q, bias, *args, **kwargs):
            Fake.calls += 1
            if Fake.error is not None:
                raise Fake.error
            return _reference(x2d, q, bias) + MARK

        monkeypatch.setattr(_linear, "linear_path", lambda x, q: path)
        monkeypatch.setattr(module, attr, stand_in)
        monkeypatch.setattr(_linear, "_broken", set())
        # The per-weight plans choose paths once, from the real linear_path (test_plan_cache.py covers
        # their fallback): these tests drive the path choice per call.
        monkeypatch.setitem(_linear._settings, "cache", False)
        return Fake

    return install


def _operands(fmt="nf4"):
    torch.manual_seed(0)
    q = ts_quant.quantize(torch.randn(48, 64), fmt)
    return torch.randn(5, 64), q


TRANSIENT = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error in cudaGetLastError() (fused_linear.cu:470): cudaErrorIllegalAddress"),
    RuntimeError("fused linear: cuTensorMapEncodeTiled failed with error 999"),
    ValueError("fused_linear: shapes disagree"),
]


@pytest.mark.parametrize("error", TRANSIENT, ids=lambda e: type(e).__name__)
def test_fused_errors_other_than_unavailable_propagate_and_keep_the_path(fake_path, error, recwarn):
    fake = fake_path("fused_sm90", _fused, "fused_linear")
    x, q = _operands()
    fake.error = error
    with pytest.raises(type(error), match=re.escape(str(error))):
        ts_quant.quantized_linear(x, q)
    assert not [w for w in recwarn if "ts_quant" in str(w.message)]
    fake.error = None  # the next call takes the fused path again: nothing was switched off
    torch.testing.assert_close(ts_quant.quantized_linear(x, q), _reference(x, q) + MARK)
    assert fake.calls == 2


def test_fused_unavailable_falls_back_for_that_call_only(fake_path):
    fake = fake_path("fused_sm90", _fused, "fused_linear")
    x, q = _operands()
    bias = torch.randn(48)
    fake.error = ts_quant.FusedLinearUnavailable("fused_linear: this build is missing sm_90a")
    with pytest.warns(RuntimeWarning, match="missing sm_90a.*this call uses dequantize"):
        y = ts_quant.quantized_linear(x, q, bias)
    torch.testing.assert_close(y, _reference(x, q, bias), rtol=0, atol=0)
    fake.error = None
    torch.testing.assert_close(ts_quant.quantized_linear(x, q, bias), _reference(x, q, bias) + MARK)
    assert fake.calls == 2 and not _linear._broken


def test_fused_unavailable_is_a_runtime_error_raised_for_operands_it_cannot_take():
    assert issubclass(ts_quant.FusedLinearUnavailable, RuntimeError)
    assert ts_quant.FusedLinearUnavailable is ts_quant._core.FusedLinearUnavailable
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    with pytest.raises(ts_quant.FusedLinearUnavailable, match="x is on cpu"):
        _fused.fused_linear(x, ts_quant.quantize(torch.randn(64, 128), "nf4"), None)
    with pytest.raises(ts_quant.FusedLinearUnavailable, match="fp8 weights"):
        _fused.fused_linear(x, ts_quant.quantize(torch.randn(64, 128), "fp8"), None)


@pytest.mark.parametrize("error", TRANSIENT[:3], ids=lambda e: type(e).__name__)
def test_scaled_mm_memory_and_cuda_errors_propagate(fake_path, error):
    fake = fake_path("fp8_scaled_mm", _scaled, "fp8_scaled_mm_linear")
    x, q = _operands("fp8")
    fake.error = error
    with pytest.raises(type(error)):
        ts_quant.quantized_linear(x, q)
    assert not _linear._broken
    fake.error = None
    torch.testing.assert_close(ts_quant.quantized_linear(x, q), _reference(x, q) + MARK)


def test_scaled_mm_refused_by_torch_falls_back_from_then_on(fake_path):
    fake = fake_path("fp8_scaled_mm", _scaled, "fp8_scaled_mm_linear")
    x, q = _operands("fp8")
    fake.error = RuntimeError("scaled_mm: BlockWise1x128 scaling is not supported by this build")
    with pytest.warns(RuntimeWarning, match="from now on"):
        y = ts_quant.quantized_linear(x, q)
    torch.testing.assert_close(y, _reference(x, q), rtol=0, atol=0)
    assert _linear._broken == {"fp8_scaled_mm"}
