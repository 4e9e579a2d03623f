"""CUDA dequantize (group kernel + scalar tails) and NVFP4 per-tensor scale against the CPU, bit for bit."""

import pytest
import torch
import ts_quant
from ts_quant._native import native_dequantize
from ts_quant._tensor import QuantizedTensor, nvfp4_global_scale

pytestmark = pytest.mark.cuda
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _same(a, b):
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_global_scale_is_the_ieee_quotient_on_cuda(dtype):
    # torch's CUDA `tensor / python_float` multiplies by the reciprocal; the scale must not.
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        x = (torch.randn(64, generator=gen) * torch.exp(torch.randn(1, generator=gen) * 8)).to(dtype)
        cpu = nvfp4_global_scale(x)
        gpu = nvfp4_global_scale(x.cuda())
        assert torch.equal(gpu.cpu().view(torch.int32), cpu.view(torch.int32)), (x.abs().max().item(), cpu, gpu)
        # Non-finite values do not set the scale (fp16 overflows to inf at these magnitudes).
        finite_amax = x.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).max().double().item()
        want = torch.tensor([finite_amax / 2688.0], dtype=torch.float32)
        assert torch.equal(cpu.view(torch.int32), want.view(torch.int32))


def _all_codes(fmt: str, n: int, block: int, shape):
    """A QuantizedTensor whose codes run through every byte value, with random positive scales."""
    gen = torch.Generator().manual_seed(5)
    nbytes = (n + 1) // 2 if fmt in ("nf4", "nvfp4") else n
    data = (torch.arange(nbytes) * 7 % 256).to(torch.uint8)
    if fmt == "fp8":
        rows, cols = shape
        scales = torch.rand(-(-rows // block), -(-cols // block), generator=gen) + 0.01
        return QuantizedTensor(fmt, shape, data, scales, block)
    count = -(-n // block)
    if fmt == "nvfp4":
        scales = (torch.rand(count, generator=gen) * 400).to(torch.float8_e4m3fn)
        return QuantizedTensor(fmt, shape, data, scales, block, global_scale=torch.tensor([0.37]))
    return QuantizedTensor(fmt, shape, data, torch.rand(count, generator=gen) * 3, block)


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
@pytest.mark.parametrize("shape,block", [((4096,), None), ((8200,), 8), ((999,), 24), ((48, 40), 40),
                                         ((256, 768), None), ((136, 264), 8), ((130, 520), 24)])
def test_cuda_dequantize_every_code_bit_identical(fmt, shape, block):
    if fmt == "fp8" and len(shape) == 1:
        shape = (1, shape[0])
    if fmt == "nvfp4":
        block = 16  # its only block size
    block = block or (128 if fmt == "fp8" else 64)
    n = 1
    for s in shape:
        n *= s
    q = _all_codes(fmt, n, block, shape)
    g = q.to("cuda")
    for dtype in DTYPES:
        _same(g.dequantize(dtype), q.dequantize(dtype))


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
@pytest.mark.parametrize("offset", [1, 2, 4, 8])
def test_cuda_dequantize_offset_outputs(fmt, offset):
    x = torch.randn(64, 1000)
    q = ts_quant.quantize(x, fmt)
    g = q.to("cuda")
    want = q.dequantize(torch.bfloat16)
    out = torch.empty(x.numel() + offset, device="cuda", dtype=torch.bfloat16)[offset:]
    scales = g.block_scales().view(torch.uint8) if fmt == "nvfp4" else g.block_scales()
    native_dequantize(fmt, x.shape, g.data, scales, g.global_scale, g.block_size, out)
    _same(out.view(x.shape), want)


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_cuda_dequantize_large_bit_identical(fmt):
    x = torch.randn(1536, 5120, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    q = ts_quant.quantize(x, fmt)
    g = ts_quant.quantize(x.cuda(), fmt)
    assert torch.equal(g.data.cpu(), q.data)
    _same(g.dequantize(torch.bfloat16), q.dequantize(torch.bfloat16))
