"""CPU kernels against the plain-PyTorch reference, bit for bit, and the documented edge cases."""

import math

import pytest
import torch
import ts_quant
from ts_quant.reference import dequantize_reference, quantize_reference

FORMATS = ts_quant.FORMATS
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1,), (3,), (17,), (64,), (1000,), (7, 9), (37, 50), (128, 256), (130, 300), (2, 3, 40), ()]


def _scales_bytes(scales):
    return scales.reshape(-1).contiguous().view(torch.uint8)


def assert_matches_reference(x, fmt, block=None):
    q = ts_quant.quantize(x, fmt, block)
    data, scales, g = quantize_reference(x, fmt, block)
    assert torch.equal(q.data, data)
    assert torch.equal(_scales_bytes(q.scales), _scales_bytes(scales))
    if g is not None:
        assert torch.equal(q.global_scale, g)
    for dtype in DTYPES:
        got = q.dequantize(dtype)
        want = dequantize_reference(fmt, x.shape, data, scales, g, block, dtype)
        assert got.shape == x.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    return q


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_random_tensors_match_reference(fmt, dtype, shape):
    gen = torch.Generator().manual_seed(hash((fmt, str(dtype), shape)) % 2**31)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    assert_matches_reference(x.to(dtype), fmt)


@pytest.mark.parametrize("fmt,block", [("int8", 2), ("int8", 30), ("int8", 256), ("nf4", 2), ("nf4", 62),
                                       ("nf4", 4096), ("fp8", 1), ("fp8", 16), ("fp8", 100)])
def test_other_block_sizes_match_reference(fmt, block):
    x = torch.randn(61, 77)
    q = assert_matches_reference(x, fmt, block)
    assert q.block_size == block


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_blocks_decode_to_zero(fmt):
    x = torch.zeros(3, 256)
    x[1, 5] = 1.5  # one live block among zero ones
    q = assert_matches_reference(x, fmt)
    assert torch.equal(q.dequantize(torch.float32) == 0, x == 0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_denormals(fmt, dtype):
    tiny = torch.finfo(dtype).tiny
    x = torch.linspace(-4, 4, 512) * tiny * torch.tensor([1e-3, 0.5, 1.0, 3.0]).repeat(128)
    assert_matches_reference(x.to(dtype), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_values_poison_only_their_block(fmt):
    """Documented: a block (fp8: tile) holding inf or NaN decodes to all-NaN; other blocks are unaffected."""
    x = torch.randn(256, 256)
    x[0, 3] = float("inf")
    x[200, 7] = float("nan")
    x[130, 250] = float("-inf")
    q = assert_matches_reference(x, fmt)
    out = q.dequantize(torch.float32)
    bad = torch.zeros_like(x, dtype=torch.bool)
    if fmt == "fp8":
        for r, c in [(0, 3), (200, 7), (130, 250)]:
            bad[r // 128 * 128: r // 128 * 128 + 128, c // 128 * 128: c // 128 * 128 + 128] = True
    else:
        block = q.block_size
        flat = bad.view(-1)
        for r, c in [(0, 3), (200, 7), (130, 250)]:
            i = (r * 256 + c) // block * block
            flat[i: i + block] = True
    assert torch.equal(torch.isnan(out), bad)
    assert torch.isfinite(out[~bad]).all()
    if fmt == "nvfp4":  # the per-tensor scale ignores the non-finite values
        finite_amax = x[torch.isfinite(x)].abs().max()
        assert q.global_scale.item() == pytest.approx(finite_amax.item() / 2688.0, rel=1e-6)


def test_nf4_packing_first_value_in_high_nibble():
    codes = ts_quant.reference.NF4_CODES
    x = torch.stack([codes[15], codes[0], codes[7], codes[9], codes[3]])  # absmax 1.0
    q = ts_quant.quantize(x, "nf4")
    assert q.data.tolist() == [0xF0, 0x79, 0x37]  # odd length: padded with code 7 (0.0) like bitsandbytes


def test_nvfp4_packing_first_value_in_low_nibble():
    x = torch.tensor([6.0, -0.5, 1.0, 3.0, -6.0])
    q = ts_quant.quantize(x, "nvfp4")
    # amax 6 -> global 6/2688; block scale byte e4m3(1/g * 1) = 448 -> exact codes
    assert q.data.tolist() == [0x97, 0x52, 0x0F]
    assert q.scales.view(torch.uint8).tolist() == [0x7E]
    assert q.dequantize(torch.float32).tolist() == x.tolist()


def test_int8_round_half_to_even_and_symmetric_range():
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -127.0] + [0.0] * 58)
    q = ts_quant.quantize(x, "int8")
    assert q.scales.tolist() == [1.0]
    assert q.data.view(torch.int8)[:6].tolist() == [127, 0, 2, 2, 0, -127]


def test_nf4_exact_midpoint_goes_to_lower_code():
    codes = ts_quant.reference.NF4_CODES
    mid = (codes[8] + codes[9]) / 2
    x = torch.zeros(64)
    x[0], x[1] = 1.0, mid
    q = ts_quant.quantize(x, "nf4")
    assert q.data[0].item() & 0x0F == 8


def test_e2m1_ties_round_to_even_and_saturate():
    # values given in units of the block scale: global g = 6/2688, block byte 448 -> scale exactly 1
    v = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.9, 0.24, -2.5, -0.0, 4.9, 1.0, 0.5, 3.0])
    q = ts_quant.quantize(v, "nvfp4")
    assert q.dequantize(torch.float32).tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, -2.0, -0.0,
                                                     4.0, 1.0, 0.5, 3.0]


def test_fp8_tiles_are_128x128_and_scales_amax_over_448():
    x = torch.randn(300, 260)
    q = ts_quant.quantize(x, "fp8")
    assert q.scales.shape == (3, 3)
    assert q.scales[1, 2].item() == pytest.approx(x[128:256, 256:].abs().max().item() / 448.0, rel=1e-6)


@pytest.mark.parametrize("fmt,bytes_per_weight", [("int8", 1.0625), ("nf4", 0.5625), ("fp8", 1.0003),
                                                  ("nvfp4", 0.5625)])
def test_bytes_per_weight(fmt, bytes_per_weight):
    q = ts_quant.quantize(torch.randn(1024, 1024), fmt)
    assert q.nbytes / q.numel == pytest.approx(bytes_per_weight, abs=1e-3)


def test_nf4_double_quant_shrinks_scales_and_stays_close():
    x = torch.randn(512, 512)
    plain = ts_quant.quantize(x, "nf4")
    dq = ts_quant.quantize(x, "nf4", double_quant=True)
    assert torch.equal(dq.data, plain.data)
    assert dq.nbytes < plain.nbytes and dq.nbytes / dq.numel < 0.52
    torch.testing.assert_close(dq.block_scales(), plain.scales, rtol=0, atol=plain.scales.max().item() / 200)


def test_empty_tensor():
    for fmt in FORMATS:
        q = ts_quant.quantize(torch.empty(0, 16), fmt)
        assert q.dequantize().shape == (0, 16)


@pytest.mark.parametrize("bad", ["fp4", "NF4", "", None])
def test_unknown_format_message(bad):
    with pytest.raises(ValueError, match=f'quantize="{bad}" is not a format; use one of int8, nf4, fp8, nvfp4'):
        ts_quant.quantize(torch.randn(4), bad)


@pytest.mark.parametrize("fmt,block", [("int8", 3), ("nf4", 63), ("nvfp4", 32), ("int8", 0), ("fp8", -1),
                                       ("nf4", 2.0), ("int8", True)])
def test_bad_block_sizes(fmt, block):
    with pytest.raises(ValueError, match="block_size"):
        ts_quant.quantize(torch.randn(64), fmt, block)


def test_bad_inputs():
    with pytest.raises(ValueError, match="dtype"):
        ts_quant.quantize(torch.arange(8), "int8")
    with pytest.raises(TypeError):
        ts_quant.quantize([1.0, 2.0], "int8")
    with pytest.raises(ValueError, match="double_quant"):
        ts_quant.quantize(torch.randn(64), "int8", double_quant=True)
    with pytest.raises(ValueError, match="dequantize"):
        ts_quant.quantize(torch.randn(64), "int8").dequantize(torch.int32)


def test_float64_and_noncontiguous_inputs():
    x = torch.randn(64, 48, dtype=torch.float64)
    q = ts_quant.quantize(x.t(), "nf4")
    assert torch.equal(q.data, quantize_reference(x.t().float().contiguous(), "nf4")[0])
    assert q.shape == (48, 64) and math.prod(q.shape) == q.numel


def test_native_rejects_wrong_buffers():
    core = ts_quant._tensor.native_quantize.__globals__["_core"]
    x = torch.randn(64)
    with pytest.raises(ValueError, match="data holds"):
        core.quantize(0, x, torch.empty(10, dtype=torch.uint8), torch.empty(1), None, 64, 64, 0, 0, 0)
    with pytest.raises(ValueError, match="float32"):
        core.quantize(0, x, torch.empty(64, dtype=torch.uint8), torch.empty(1, dtype=torch.float16), None,
                      64, 64, 0, 0, 0)
    with pytest.raises(ValueError, match="per-tensor"):
        core.quantize(3, x, torch.empty(32, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8), None,
                      64, 16, 0, 0, 0)
