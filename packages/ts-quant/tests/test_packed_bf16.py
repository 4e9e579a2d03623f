"""Exponent-packed bf16 (ts_quant._packed, csrc/packed_bf16*): every bit restored, the native segment
byte for byte the plain-PyTorch reference's, and the window chosen where most values are."""

import pytest
import torch
import ts_quant
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_quant._packed import PackedBf16, packed_bf16_layout
from ts_quant.reference import pack_bf16_reference, unpack_bf16_reference

settings.register_profile("ts-packed", max_examples=80, deadline=None)


def _bits(x):
    return x.view(torch.int16)


def _plan_for(x, base):
    exponent = (_bits(x).to(torch.int32) >> 7) & 0xFF
    escapes = int(((exponent < base) | (exponent >= base + 15)).sum())
    return PackedBf16(x.numel(), base, escapes, packed_bf16_layout(x.numel(), escapes)[3])


@st.composite
def any_bits(draw):
    """bf16 tensors of arbitrary bit patterns (zeros, subnormals, inf, NaN payloads) and a window."""
    n = draw(st.integers(1, 200))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int32)
    if draw(st.booleans()):  # mostly one binade band, like weights
        bits = (torch.randn(n, generator=gen) * 0.02).bfloat16().view(torch.int16).to(torch.int32)
    return bits.to(torch.int16).view(torch.bfloat16), draw(st.integers(0, 241))


@settings(settings.get_profile("ts-packed"))
@given(any_bits())
def test_native_segment_is_the_reference_and_restores_every_bit(case):
    x, base = case
    plan = _plan_for(x, base)
    segment = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8)
    ts_quant.pack_bf16(x, plan, segment)
    reference = pack_bf16_reference(x, base)
    # The pad bytes between parts are not part of the format: compare the parts.
    nib, idx, _values, total = packed_bf16_layout(x.numel(), plan.escapes)
    for a, b in [(0, x.numel()), (nib, nib + (x.numel() + 1) // 2), (idx, total)]:
        assert torch.equal(segment[a:b], reference[a:b])
    out = torch.empty_like(x)
    ts_quant.unpack_bf16(segment, plan, out)
    assert torch.equal(_bits(out), _bits(x))
    assert torch.equal(_bits(unpack_bf16_reference(reference, x.numel(), plan.escapes, base)), _bits(x))


def test_plan_picks_the_fullest_window_and_saves_a_quarter_on_weights():
    torch.manual_seed(0)
    x = (torch.randn(1 << 16) * 0.02).bfloat16()
    plan = ts_quant.plan_bf16_packing(x)
    assert plan is not None and plan.escapes < x.numel() // 1000
    assert 0.75 <= plan.ratio < 0.76
    for base in (plan.base - 1, plan.base + 1):  # a neighbouring window holds fewer values
        assert _plan_for(x, base).escapes >= plan.escapes


def test_plan_declines_what_would_not_shrink():
    spread = torch.randint(-(2**15), 2**15, (4096,), dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert ts_quant.plan_bf16_packing(spread) is None  # exponents everywhere: mostly escapes
    assert ts_quant.plan_bf16_packing(torch.randn(64)) is None  # not bf16
    assert ts_quant.plan_bf16_packing(torch.zeros(0, dtype=torch.bfloat16)) is None
    ones = torch.ones(1000, dtype=torch.bfloat16)  # one exponent: packs, no escapes
    assert ts_quant.plan_bf16_packing(ones).escapes == 0


def test_bad_arguments_are_refused_with_the_valid_values():
    x = torch.ones(100, dtype=torch.bfloat16)
    plan = ts_quant.plan_bf16_packing(x)
    with pytest.raises(ValueError, match=r"holds .* bytes, needs"):
        ts_quant.pack_bf16(x, plan, torch.empty(plan.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="room for 0 escapes"):
        ts_quant.pack_bf16(torch.full((100,), 1e30, dtype=torch.bfloat16), plan,
                           torch.empty(plan.nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="base must be 0 to 241"):
        ts_quant.pack_bf16(x, PackedBf16(100, 250, 0, plan.nbytes), torch.empty(plan.nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bfloat16"):
        ts_quant.unpack_bf16(torch.empty(plan.nbytes, dtype=torch.uint8), plan, torch.empty(100))
    with pytest.raises(ValueError, match="plan is for 100 values"):
        ts_quant.unpack_bf16(torch.empty(plan.nbytes, dtype=torch.uint8), plan, torch.empty(99, dtype=torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [1, 7, 8, 9, 4096 + 5, 5120 * 1024 + 3])
def test_cuda_unpack_matches_the_cpu_bit_for_bit(n):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen) * 0.02).bfloat16()
    x[:: max(1, n // 7)] = torch.tensor([0.0, float("inf"), float("nan"), 1e-40, 65504.0, -0.0, 3e38],
                                        dtype=torch.bfloat16).repeat(n)[: x[:: max(1, n // 7)].numel()]
    plan = _plan_for(x, 112)  # a window that leaves some of them out: escapes on the GPU too
    assert plan.escapes > 0
    segment = torch.empty(plan.nbytes, dtype=torch.uint8)
    ts_quant.pack_bf16(x, plan, segment)
    out = torch.full((n,), 7.0, dtype=torch.bfloat16, device="cuda")
    ts_quant.unpack_bf16(segment.cuda(), plan, out)
    assert torch.equal(_bits(out.cpu()), _bits(x))
