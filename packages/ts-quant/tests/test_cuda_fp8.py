"""Fused FP8 activation quantization (CUDA) against its PyTorch reference, bit for bit, and the split FP8 path."""

import pytest
import torch
import ts_quant
from ts_quant import _scaled

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,pad", [(1, 128, 3), (3, 640, 1), (70, 512, 2), (512, 5120, 0), (4, 256, 0)])
def test_fp8_act_quant_matches_reference(dtype, m, k, pad):
    gen = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen) * 2)).to(dtype)
    x[0, :128] = 0.0  # an all-zero block
    xc = x.cuda()
    codes, scales = _scaled.fp8_act_quant(xc, m + pad)
    assert codes.shape == (m + pad, k) and codes.dtype == torch.float8_e4m3fn
    assert scales.shape == (m + pad, k // 128) and scales.stride() == (1, m + pad)  # outer-dim-major
    want_codes, want_scales = _scaled.quantize_activation_1x128(xc)
    assert torch.equal(codes[:m].view(torch.uint8).cpu(), want_codes.view(torch.uint8).cpu())
    assert torch.equal(scales[:m].cpu().view(torch.int32), want_scales.cpu().view(torch.int32))
    cpu_codes, cpu_scales = _scaled.quantize_activation_1x128(x)  # the CPU gives the same IEEE quotients
    assert torch.equal(codes[:m].view(torch.uint8).cpu(), cpu_codes.view(torch.uint8))
    assert torch.equal(scales[:m].cpu(), cpu_scales)
    if pad:
        assert not codes[m:].view(torch.uint8).any()


def test_fp8_split_path_equals_linear():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("blockwise FP8 scaled_mm is the sm_90 path")
    torch.manual_seed(0)
    q = ts_quant.quantize(torch.randn(1024, 512, device="cuda"), "fp8")
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    codes, scales = _scaled.fp8_act_quant(x)
    parts = _scaled.fp8_scaled_mm(codes, scales, q, x.dtype)
    whole = ts_quant.quantized_linear(x, q)
    assert ts_quant.linear_path(x, q) == "fp8_scaled_mm"
    torch.testing.assert_close(parts, whole, rtol=0, atol=0)
    emulated = ts_quant.fp8_linear_emulated(x, q, None)
    torch.testing.assert_close(parts.float(), emulated.float(), rtol=2e-2, atol=2e-2 * emulated.abs().max().item())
