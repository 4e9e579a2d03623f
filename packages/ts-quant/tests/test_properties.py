"""Property-based checks of the formats: round-trip bounds, idempotence, packing."""

import torch
import ts_quant
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_quant.reference import quantize_reference


@st.composite
def tensors(draw):
    n = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e4]))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * scale
    if draw(st.booleans()):
        x[: draw(st.integers(0, n))] = 0.0
    return x


def _per_value_scale(q, n):
    index = torch.arange(n) // q.block_size
    if q.format == "nvfp4":
        return (q.scales.float() * q.global_scale)[index]
    return q.scales.reshape(-1)[index]


settings.register_profile("ts", max_examples=60, deadline=None)
settings.load_profile("ts")


@given(tensors(), st.sampled_from([2, 16, 64, 100]))
def test_int8_error_within_half_step(x, block):
    q = ts_quant.quantize(x, "int8", block)
    err = (q.dequantize(torch.float32) - x).abs()
    step = _per_value_scale(q, x.numel())
    assert (err <= step * 0.5 * (1 + 1e-5) + 1e-45).all()


@given(tensors(), st.sampled_from([2, 64, 128]))
def test_nf4_error_within_half_the_widest_code_gap(x, block):
    q = ts_quant.quantize(x, "nf4", block)
    err = (q.dequantize(torch.float32) - x).abs()
    # half the widest gap between neighbouring NF4 codes (-1 to -0.696), times the block's absmax
    half_gap = ts_quant.reference.NF4_CODES.diff().max().item() / 2
    assert (err <= _per_value_scale(q, x.numel()) * half_gap * (1 + 1e-5) + 1e-37).all()


@given(tensors())
def test_fp8_error_within_half_step(x):
    q = ts_quant.quantize(x, "fp8")
    err = (q.dequantize(torch.float32) - x).abs()
    # A 1-D tensor is one row of 128-wide tiles: each value's own tile scale.
    s = q.scales.reshape(-1)[torch.arange(x.numel()) // q.block_size]
    # e4m3 relative step 2^-3 (half: 2^-4) and a subnormal step of 2^-9 in units of the scale
    assert (err <= (x.abs() / 16 + s * 2.0**-10) * (1 + 1e-5) + 1e-44).all()


@given(tensors())
def test_nvfp4_error_within_half_the_widest_step(x):
    q = ts_quant.quantize(x, "nvfp4")
    err = (q.dequantize(torch.float32) - x).abs()
    s = _per_value_scale(q, x.numel())
    blocks = torch.arange(x.numel()) // 16
    block_amax = torch.zeros(blocks.max() + 1).scatter_reduce(0, blocks, x.abs(), "amax")[blocks]
    # e2m1's widest step is 2 (4 -> 6): half is one block scale; a block whose scale underflowed decodes to 0
    bound = torch.where(s > 0, s * (1 + 1e-5), block_amax)
    assert (err <= bound + 1e-44).all()


@given(tensors(), st.sampled_from(ts_quant.FORMATS))
def test_quantize_of_dequantize_is_identity(x, fmt):
    q = ts_quant.quantize(x, fmt)
    again = ts_quant.quantize(q.dequantize(torch.float32), fmt)
    assert torch.equal(again.data, q.data)
    torch.testing.assert_close(again.scales.float(), q.scales.float(), rtol=1e-6, atol=0)


@given(tensors(), st.sampled_from(ts_quant.FORMATS))
def test_kernel_equals_reference(x, fmt):
    q = ts_quant.quantize(x, fmt)
    data, scales, _ = quantize_reference(x, fmt)
    assert torch.equal(q.data, data)
    assert torch.equal(q.scales.reshape(-1).view(torch.uint8), scales.reshape(-1).contiguous().view(torch.uint8))


@given(st.lists(st.integers(0, 15), min_size=1, max_size=64))
def test_nf4_packing_order(codes):
    table = ts_quant.reference.NF4_CODES
    x = torch.cat([table[torch.tensor(codes)], torch.ones(1)])  # absmax exactly 1
    q = ts_quant.quantize(x, "nf4", 66 if len(codes) % 2 == 1 else 2 * ((len(codes) + 2) // 2))
    packed = [*codes, 15]
    if len(packed) % 2:
        packed.append(7)
    assert q.data.tolist() == [packed[i] << 4 | packed[i + 1] for i in range(0, len(packed), 2)]
