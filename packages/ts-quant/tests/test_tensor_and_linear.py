"""QuantizedTensor persistence and placement; quantized_linear / QuantLinear on the CPU, and emulated tensor-core paths."""

import io

import pytest
import torch
import ts_quant
from torch import nn
from ts_quant._tiled import tiled_linear


def _equal_q(a, b):
    assert a.format == b.format and a.shape == b.shape and a.block_size == b.block_size
    assert torch.equal(a.data, b.data)
    assert torch.equal(a.dequantize(torch.float32).nan_to_num(), b.dequantize(torch.float32).nan_to_num())


@pytest.mark.parametrize("fmt", ts_quant.FORMATS)
def test_torch_save_roundtrip(fmt):
    q = ts_quant.quantize(torch.randn(33, 64), fmt)
    buf = io.BytesIO()
    torch.save({"w": q}, buf)
    buf.seek(0)
    _equal_q(torch.load(buf, weights_only=False)["w"], q)


@pytest.mark.parametrize("double_quant", [False, True])
def test_state_dict_roundtrip(double_quant):
    q = ts_quant.quantize(torch.randn(40, 64), "nf4", double_quant=double_quant)
    state = q.to_state_dict("w.")
    assert all(k.startswith("w.") for k in state)
    buf = io.BytesIO()
    torch.save(state, buf)  # plain tensors and strings/ints: loads with weights_only=True
    buf.seek(0)
    _equal_q(ts_quant.QuantizedTensor.from_state_dict(torch.load(buf, weights_only=True), "w."), q)


def test_to_same_device_is_identity_and_keeps_dtypes():
    q = ts_quant.quantize(torch.randn(16, 16), "nvfp4")
    assert q.to("cpu") is q
    assert q.scales.dtype == torch.float8_e4m3fn and q.data.dtype == torch.uint8


@pytest.mark.parametrize("fmt", ts_quant.FORMATS)
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 96)])
def test_quantized_linear_forward_backward_matches_reference(fmt, shape):
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    q = ts_quant.quantize(w, fmt)
    bias = torch.randn(40, requires_grad=True)
    x = torch.randn(shape, requires_grad=True)
    y = ts_quant.quantized_linear(x, q, bias)
    x_ref = x.detach().clone().requires_grad_()
    bias_ref = bias.detach().clone().requires_grad_()
    w_ref = q.dequantize(torch.float32).requires_grad_(False)
    y_ref = nn.functional.linear(x_ref, w_ref, bias_ref)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bias.grad, bias_ref.grad)


def test_quantized_linear_bf16_and_frozen_weight():
    q = ts_quant.quantize(torch.randn(24, 32), "nf4")
    x = torch.randn(3, 32, dtype=torch.bfloat16, requires_grad=True)
    y = ts_quant.quantized_linear(x, q)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, x.detach() @ q.dequantize(torch.bfloat16).t(), rtol=0, atol=0)
    y.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16


def test_quantized_linear_errors():
    q = ts_quant.quantize(torch.randn(8, 16), "int8")
    with pytest.raises(ValueError, match="features"):
        ts_quant.quantized_linear(torch.randn(2, 8), q)
    with pytest.raises(ValueError, match="outliers applies to nvfp4"):
        ts_quant.quantized_linear(torch.randn(2, 16), q, outliers=0.1)
    with pytest.raises(ValueError, match="outliers"):
        ts_quant.quantized_linear(torch.randn(2, 16), ts_quant.quantize(torch.randn(8, 16), "nvfp4"), outliers=1.5)
    with pytest.raises(ValueError, match="2-D"):
        ts_quant.quantized_linear(torch.randn(2, 16), ts_quant.quantize(torch.randn(16), "int8"))
    with pytest.raises(ValueError, match="bias"):
        ts_quant.quantized_linear(torch.randn(2, 16), q, torch.randn(3))
    with pytest.raises(TypeError):
        ts_quant.quantized_linear(torch.randn(2, 16), torch.randn(8, 16))
    assert ts_quant.linear_path(torch.randn(2, 16), q) == "dequantize"


@pytest.mark.parametrize("fmt", ts_quant.FORMATS)
@pytest.mark.parametrize("tiles", [2, 3, 7])
def test_tiled_dequantize_matches_whole(fmt, tiles):
    q = ts_quant.quantize(torch.randn(300, 160), fmt)
    x = torch.randn(6, 160, dtype=torch.bfloat16)
    bias = torch.randn(300, dtype=torch.bfloat16)
    want = nn.functional.linear(x, q.dequantize(torch.bfloat16), bias)
    torch.testing.assert_close(tiled_linear(x, q, bias, tiles, overlap=False), want, rtol=0, atol=0)


def test_quant_linear_module_roundtrip_and_dtype_cast():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    mod = ts_quant.QuantLinear.from_linear(lin, "nf4", double_quant=True)
    x = torch.randn(4, 64)
    torch.testing.assert_close(mod(x), lin(x), rtol=0.2, atol=0.2)
    state = mod.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    other = ts_quant.QuantLinear(ts_quant.quantize(torch.zeros(32, 64), "nf4"), torch.zeros(32))
    other.load_state_dict(torch.load(buf, weights_only=False))
    torch.testing.assert_close(other(x), mod(x), rtol=0, atol=0)
    mod.half()  # codes and scales keep their dtypes
    assert mod.qweight.data.dtype == torch.uint8 and mod.qweight.block_scales().dtype == torch.float32
    assert "format=nf4" in repr(mod)


def test_fp8_emulation_is_close_to_the_float_result():
    torch.manual_seed(0)
    w = torch.randn(256, 256)
    q = ts_quant.quantize(w, "fp8")
    x = torch.randn(8, 256)
    got = ts_quant.fp8_linear_emulated(x, q, None)
    want = x @ w.t()
    assert ((got - want).norm() / want.norm()).item() < 0.05


def test_nvfp4_columns_equal_full_dequantize():
    q = ts_quant.quantize(torch.randn(48, 64), "nvfp4")
    index = torch.tensor([0, 1, 17, 63, 30])
    torch.testing.assert_close(ts_quant.nvfp4_columns(q, index, torch.float32), q.dequantize(torch.float32)[:, index],
                               rtol=0, atol=0)


def test_nvfp4_outliers_by_emulation():
    """The largest-|x| channels bypass the 4-bit input: with a huge outlier channel, outliers= wins big."""
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    q = ts_quant.quantize(w, "nvfp4")
    x = torch.randn(16, 128)
    x[:, 5] *= 500.0
    exact = x @ q.dequantize(torch.float32).t()
    plain = ts_quant.nvfp4_linear_emulated(x, q, None, 0.0)
    kept = ts_quant.nvfp4_linear_emulated(x, q, None, 1 / 128)
    err_plain = (plain - exact).norm() / exact.norm()
    err_kept = (kept - exact).norm() / exact.norm()
    assert err_kept < err_plain / 3
    # the selection: channel 5 is the one kept, and it is zeroed in the quantized operand
    index = ts_quant._scaled.outlier_channels(x, 1 / 128)
    assert index.tolist() == [5]
    main = x.index_fill(1, index, 0)
    split = ts_quant.quantize(main, "nvfp4").dequantize(torch.float32) @ q.dequantize(torch.float32).t()
    split += x[:, index] @ q.dequantize(torch.float32)[:, index].t()
    torch.testing.assert_close(kept, split, rtol=1e-5, atol=1e-4)


def _independent_swizzle(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS 1D block-scaling layout, element by element (no reshapes)."""
    rows, cols = scales.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    out = torch.zeros(row_tiles * col_tiles * 512, dtype=torch.uint8)
    raw = scales.view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * col_tiles + c // 4
            out[tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] = raw[r, c]
    return out


@pytest.mark.parametrize("shape", [(128, 64), (200, 48), (1, 16), (300, 160)])
def test_nvfp4_swizzle_matches_independent_layout(shape):
    q = ts_quant.quantize(torch.randn(shape), "nvfp4")
    got = q.swizzled_scales()
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), _independent_swizzle(q.scales.view(shape[0], shape[1] // 16)))


def test_swizzle_needs_2d_nvfp4():
    with pytest.raises(ValueError, match="nvfp4"):
        ts_quant.quantize(torch.randn(16, 16), "int8").swizzled_scales()
    with pytest.raises(ValueError, match="2-D"):
        ts_quant.quantize(torch.randn(64), "nvfp4").swizzled_scales()


def test_configure_linear():
    assert ts_quant.configure_linear()["tiles"] >= 1
    with pytest.raises(ValueError):
        ts_quant.configure_linear(tiles=0)


def test_fused_linear_reasons_name_the_blocking_condition():
    from ts_quant import _fused

    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    assert "fp8" in _fused.fused_linear_reason(x, ts_quant.quantize(torch.randn(64, 128), "fp8"))
    q = ts_quant.quantize(torch.randn(64, 128), "nf4")
    assert "float16" in _fused.fused_linear_reason(x.half(), q)
    assert "multiple of 64" in _fused.fused_linear_reason(torch.zeros(2, 96, dtype=torch.bfloat16),
                                                         ts_quant.quantize(torch.randn(64, 96), "nf4"))
    assert "power of two" in _fused.fused_linear_reason(x, ts_quant.quantize(torch.randn(64, 128), "int8", 48))
    with pytest.raises(ValueError, match="fused"):
        ts_quant.configure_linear(fused=1)
    with pytest.raises(ValueError, match="fused_max_rows"):
        ts_quant.configure_linear(fused_max_rows=-1)
    settings = ts_quant.configure_linear()
    assert settings["fused"] is True and settings["fused_max_rows"] >= 512


def test_quant_linear_is_a_linear_without_a_weight_parameter():
    linear = nn.Linear(64, 32)
    layer = ts_quant.QuantLinear.from_linear(linear, "int8")
    assert isinstance(layer, nn.Linear) and (layer.in_features, layer.out_features) == (64, 32)
    assert [name for name, _ in layer.named_parameters()] == ["bias"]
    assert "weight" not in layer.state_dict()
    torch.testing.assert_close(layer.weight, layer.qweight.dequantize(torch.float32), rtol=0, atol=0)
    assert layer.weight.dtype == torch.float32 and not layer.weight.requires_grad
