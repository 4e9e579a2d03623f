"""CUDA kernels against the CPU kernels (bit for bit) and the tensor-core paths (run on a GPU machine)."""

import pytest
import torch
import ts_quant
from torch import nn
from ts_quant._tiled import tiled_linear

pytestmark = pytest.mark.cuda
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bytes(t):
    return t.reshape(-1).contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("fmt", ts_quant.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (17,), (1000,), (37, 50), (130, 300), (256, 4096), (3, 5, 64)])
def test_cuda_quantize_dequantize_bit_identical_to_cpu(fmt, dtype, shape):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2)).to(dtype)
    x.view(-1)[:3] = 0.0
    cpu = ts_quant.quantize(x, fmt)
    gpu = ts_quant.quantize(x.cuda(), fmt)
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.data.cpu(), cpu.data)
    assert torch.equal(_bytes(gpu.scales), _bytes(cpu.scales))
    for out in DTYPES:
        torch.testing.assert_close(gpu.dequantize(out).cpu(), cpu.dequantize(out), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", ts_quant.FORMATS)
def test_cuda_nonfinite_and_misaligned(fmt):
    x = torch.randn(4096)
    x[100] = float("nan")
    x[3000] = float("inf")
    cpu = ts_quant.quantize(x, fmt)
    gpu = cpu.to("cuda")
    torch.testing.assert_close(gpu.dequantize(torch.float32).cpu(), cpu.dequantize(torch.float32), rtol=0, atol=0,
                               equal_nan=True)
    # a view that starts off the 16-byte grid takes the scalar path, same values
    out = torch.empty(4097, device="cuda")[1:]
    ts_quant._native.native_dequantize(fmt, x.shape, gpu.data, gpu.block_scales().view(torch.uint8) if fmt == "nvfp4"
                                       else gpu.block_scales(), gpu.global_scale, gpu.block_size, out)
    torch.testing.assert_close(out.cpu(), cpu.dequantize(torch.float32), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", ts_quant.FORMATS)
def test_cuda_to_and_pin_memory_roundtrip(fmt):
    q = ts_quant.quantize(torch.randn(64, 64), fmt)
    pinned = q.pin_memory()
    assert pinned.is_pinned()
    gpu = pinned.to("cuda", non_blocking=True)
    back = gpu.to("cpu")
    assert torch.equal(back.data, q.data)
    torch.testing.assert_close(back.dequantize(), q.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_cuda_tiled_overlap_matches_plain(fmt):
    torch.manual_seed(0)
    q = ts_quant.quantize(torch.randn(1000, 512, device="cuda"), fmt)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    want = nn.functional.linear(x, q.dequantize(torch.bfloat16), bias)
    for tiles in (2, 4, 8):  # cuBLAS may pick another kernel per tile width: bf16 tolerance, not bits
        torch.testing.assert_close(tiled_linear(x, q, bias, tiles), want)
    torch.cuda.synchronize()


@pytest.mark.parametrize("fmt", ts_quant.FORMATS)
def test_cuda_quantized_linear_forward_backward(fmt):
    torch.manual_seed(0)
    q = ts_quant.quantize(torch.randn(512, 256, device="cuda"), fmt)
    x = torch.randn(4, 32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = ts_quant.quantized_linear(x, q)
    ref = x.detach().float() @ q.dequantize(torch.float32).t()
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.05  # fp8 path quantizes x too
    y.sum().backward()
    want = torch.ones_like(y) @ q.dequantize(torch.bfloat16)
    torch.testing.assert_close(x.grad, want)


def test_fp8_scaled_mm_path_on_hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("blockwise FP8 scaled_mm is the sm_90 path")
    torch.manual_seed(0)
    w = torch.randn(1024, 512, device="cuda")
    q = ts_quant.quantize(w, "fp8")
    x = torch.randn(70, 512, device="cuda", dtype=torch.bfloat16)  # M not a multiple of 4: padded
    assert ts_quant.linear_path(x, q) == "fp8_scaled_mm"
    y = ts_quant.quantized_linear(x, q)
    assert ts_quant.linear_path(x, q) == "fp8_scaled_mm", "scaled_mm failed and the path fell back"
    emulated = ts_quant.fp8_linear_emulated(x, q, None)
    torch.testing.assert_close(y.float(), emulated.float(), rtol=2e-2, atol=2e-2 * emulated.abs().max().item())


def test_nvfp4_scaled_mm_path_on_blackwell():
    if torch.cuda.get_device_capability()[0] < 10:
        pytest.skip("FP4 tensor cores need sm_100+; the H200 covers this path by emulation only")
    torch.manual_seed(0)
    q = ts_quant.quantize(torch.randn(512, 256, device="cuda"), "nvfp4")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    for outliers in (0.0, 0.02):
        y = ts_quant.quantized_linear(x, q, outliers=outliers)
        assert ts_quant.linear_path(x, q) == "nvfp4_scaled_mm"
        emulated = ts_quant.nvfp4_linear_emulated(x, q, None, outliers)
        torch.testing.assert_close(y.float(), emulated.float(), rtol=2e-2, atol=2e-2 * emulated.abs().max().item())


def test_operands_on_different_devices_are_refused_naming_both():
    q = ts_quant.quantize(torch.randn(64, 64, device="cuda"), "nf4")
    with pytest.raises(ValueError, match=r"^x is on cpu but qweight on cuda:0; move one with \.to\(\)$"):
        ts_quant.quantized_linear(torch.randn(2, 64), q)
    with pytest.raises(ValueError, match=r"^x is on cuda:0 but qweight on cpu; move one with \.to\(\)$"):
        ts_quant.quantized_linear(torch.randn(2, 64, device="cuda"), ts_quant.quantize(torch.randn(64, 64), "nf4"))
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match=r"^x is on cuda:1 but qweight on cuda:0"):
            ts_quant.quantized_linear(torch.randn(2, 64, device="cuda:1"), q)
