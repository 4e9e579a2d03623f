"""quantized_linear's cached plans on CUDA: the address-passing fused and dequantize calls give the bits of
the checked ones (the fused kernel sums in a fixed order), and plans follow in-place re-quantization,
moves, dtype changes, streams and misaligned or strided inputs."""

import pytest
import torch
import ts_quant
from ts_quant import _fused

pytestmark = pytest.mark.cuda


def _uncached(fn):
    ts_quant.configure_linear(cache=False)
    try:
        return fn()
    finally:
        ts_quant.configure_linear(cache=True)


def _weight(fmt, n=256, k=512, seed=0, double_quant=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return ts_quant.quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.05, fmt,
                             double_quant=double_quant)


@pytest.mark.parametrize("fmt,double_quant", [("nf4", False), ("nf4", True), ("int8", False), ("nvfp4", False),
                                              ("fp8", False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("lead", [(7,), (2, 33), (1300,)])  # 1300 rows: past fused_max_rows
def test_cached_equals_uncached_forward_and_backward(fmt, double_quant, dtype, lead):
    q = _weight(fmt, double_quant=double_quant)
    x = torch.randn(*lead, 512, device="cuda", dtype=dtype)
    bias = torch.randn(256, device="cuda", dtype=dtype)
    g = torch.randn(*lead, 256, device="cuda", dtype=dtype)

    def run():
        xi = x.clone().requires_grad_(True)
        bi = bias.clone().requires_grad_(True)
        y = ts_quant.quantized_linear(xi, q, bi)
        y.backward(g)
        return y.detach(), xi.grad, bi.grad

    reference = _uncached(run)
    for _ in range(2):  # the plan's first call, then a call on it
        for a, b in zip(run(), reference):
            assert torch.equal(a, b)


def test_fused_plan_equals_the_checked_kernel_call():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernel is built for sm_90a (H100/H200) only")
    q = _weight("nf4", n=384, k=1024)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    assert ts_quant.linear_path(x, q) == "fused_sm90"
    out = ts_quant.quantized_linear(x, q, bias)
    assert q._cache[(x.device, x.dtype)].small == "fused_sm90"
    assert torch.equal(ts_quant.quantized_linear(x, q, bias), out)
    assert torch.equal(_fused.fused_linear(x, q, bias), out)


def test_plans_follow_in_place_requantization_streams_and_odd_inputs():
    q = _weight("nf4", n=256, k=512, double_quant=True)
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    first = ts_quant.quantized_linear(x, q)
    fresh = _weight("nf4", n=256, k=512, seed=9, double_quant=True)
    q.data.copy_(fresh.data)
    q.scales.data.copy_(fresh.scales.data)
    q.scales.scales.copy_(fresh.scales.scales)
    q.scale_offset.copy_(fresh.scale_offset)
    after = ts_quant.quantized_linear(x, q)
    assert not torch.equal(after, first)
    assert torch.equal(after, _uncached(lambda: ts_quant.quantized_linear(x, q)))
    assert torch.equal(after, ts_quant.quantized_linear(x, fresh))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # another stream: its own stream-K state
        on_side = ts_quant.quantized_linear(x, q)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, after)
    buf = torch.empty(16 * 512 + 1, device="cuda", dtype=torch.bfloat16)
    misaligned = buf[1:].view(16, 512)
    misaligned.copy_(x)
    # a misaligned x takes dequantize + cuBLAS (linear_path), whose bits need not be the fused kernel's
    got = ts_quant.quantized_linear(misaligned, q)
    assert torch.equal(got, _uncached(lambda: ts_quant.quantized_linear(misaligned, q)))
    torch.testing.assert_close(got, after, rtol=1e-2, atol=1e-2)
    wide = torch.zeros(16, 1024, device="cuda", dtype=torch.bfloat16)
    wide[:, ::2] = x
    assert torch.equal(ts_quant.quantized_linear(wide[:, ::2], q), after)


def test_moved_weight_gets_its_own_plan():
    q = _weight("nf4")
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    on_cpu = ts_quant.quantized_linear(x, q.cpu())
    on_gpu = ts_quant.quantized_linear(x.cuda(), q)
    back = ts_quant.quantized_linear(x, q.cpu())
    assert torch.equal(on_cpu, back)
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=2e-2, atol=2e-2)
    if torch.cuda.device_count() > 1:
        q1 = q.to("cuda:1")
        with torch.cuda.device(0):  # a weight and x on a device other than the current one
            out = ts_quant.quantized_linear(x.to("cuda:1"), q1)
        assert torch.equal(out.cpu(), on_gpu.cpu())


@pytest.mark.parametrize("fmt,double_quant", [("nf4", True), ("nf4", False), ("int8", False)])
def test_a_first_call_inside_a_graph_capture_leaves_no_plan_behind(fmt, double_quant):
    """Built inside a capture, a plan would keep decoded scales only a replay writes: that call runs
    unplanned, and eager calls after it build their own plan, with the uncached bits."""
    q = _weight(fmt, double_quant=double_quant)
    static_x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_out = ts_quant.quantized_linear(static_x, q)
    assert not q._cache
    graph.replay()
    torch.cuda.synchronize()
    eager = ts_quant.quantized_linear(static_x, q)
    assert q._cache
    assert torch.equal(eager, _uncached(lambda: ts_quant.quantized_linear(static_x, q)))
    assert torch.equal(static_out, eager)
