"""Hopper fused dequantize + matmul (fused_sm90) against dequantize-then-matmul, on fresh random data."""

import pytest
import torch
import torch.nn.functional as F
import ts_quant
from ts_quant import _fused

pytestmark = pytest.mark.cuda


def _needs_sm90():
    """Skips off compute capability 9.0; on it, a build without the fused kernel fails (never skips)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernel is built for sm_90a (H100/H200) only")
    assert ts_quant._core.built_with_cuda and ts_quant._core.built_with_sm90a, (
        "this build is missing sm_90a: the fused kernel is not in it, on a compute capability 9.0 GPU. "
        "Reinstall ts-quant with a CUDA toolkit and TS_ENABLE_CUDA=ON TS_CUDA_ARCHITECTURES including 90")
    assert ts_quant._core.fused_linear_available(torch.cuda.current_device()), (
        "the build has sm_90a but fused_linear_available() says no on this compute capability 9.0 GPU")


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


CASES = [  # (format, m, n, k, block, double_quant)
    ("nf4", 512, 1024, 1024, 64, False),
    ("nf4", 1, 128, 64, 64, False),
    ("nf4", 7, 200, 192, 64, False),     # n not a multiple of the 128-row tile
    ("nf4", 130, 384, 512, 32, False),   # two blocks per 64-column tile
    ("nf4", 300, 256, 640, 128, True),   # double-quantized absmax
    ("int8", 96, 640, 1024, 64, False),
    ("int8", 257, 136, 256, 256, False),
    ("nvfp4", 64, 512, 320, 16, False),
    ("nvfp4", 513, 264, 1024, 16, False),
]


@pytest.mark.parametrize("fmt,m,n,k,block,double_quant", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_matches_dequantize_then_matmul(fmt, m, n, k, block, double_quant, with_bias):
    _needs_sm90()
    gen = torch.Generator(device="cuda").manual_seed(m * 31 + n * 7 + k)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) if with_bias else None
    q = ts_quant.quantize(w, fmt, None if fmt == "nvfp4" else block, double_quant=double_quant)
    assert ts_quant.linear_path(x, q) == "fused_sm90"
    out = ts_quant.quantized_linear(x, q, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    wd = q.dequantize(torch.bfloat16)
    ref = x.double() @ wd.double().t() + (0 if bias is None else bias.double())
    cublas = F.linear(x, wd, bias)
    fused_error, cublas_error = _relative_error(out, ref), _relative_error(cublas, ref)
    # Same bf16 operands, fp32 sums in another order: the error is bf16 output rounding, like cuBLAS's.
    assert fused_error < 4e-3 and fused_error <= 1.5 * cublas_error + 1e-4, (fused_error, cublas_error)


@pytest.mark.parametrize("m,tile_m", [(512, 256), (300, 128), (40, 64), (1000, 64)])
def test_fused_split_tiles_sum_in_a_fixed_order(m, tile_m):
    """Stream-K: tiles split between thread blocks give the same bits on every run, at every tile width."""
    _needs_sm90()
    gen = torch.Generator(device="cuda").manual_seed(m)
    q = ts_quant.quantize(torch.randn(1408, 2048, device="cuda", generator=gen), "nf4")
    x = torch.randn(m, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    first = _fused.fused_linear(x, q, None, tile_m)
    for _ in range(3):
        assert torch.equal(_fused.fused_linear(x, q, None, tile_m), first)
    ref = x.double() @ q.dequantize(torch.bfloat16).double().t()
    assert _relative_error(first, ref) < 4e-3


def test_fused_writes_every_output_and_takes_strided_x():
    _needs_sm90()
    torch.manual_seed(1)
    q = ts_quant.quantize(torch.randn(256, 512, device="cuda"), "nf4")
    x = torch.randn(512, 100, device="cuda").to(torch.bfloat16).t()  # [100, 512], not contiguous
    out = _fused.fused_linear(x, q, None)
    ref = x.double() @ q.dequantize(torch.bfloat16).double().t()
    assert torch.isfinite(out).all()
    assert _relative_error(out, ref) < 4e-3


def test_fused_backward_gives_input_and_bias_grads():
    _needs_sm90()
    torch.manual_seed(2)
    q = ts_quant.quantize(torch.randn(192, 256, device="cuda"), "nf4")
    x = torch.randn(4, 8, 256, device="cuda").to(torch.bfloat16).requires_grad_()
    bias = torch.zeros(192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ts_quant.quantized_linear(x, q, bias).float().square().sum().backward()
    xr = x.detach().clone().requires_grad_()
    br = bias.detach().clone().requires_grad_()
    F.linear(xr, q.dequantize(torch.bfloat16), br).float().square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=3e-2, atol=3e-2 * xr.grad.abs().max().item())
    torch.testing.assert_close(bias.grad, br.grad, rtol=3e-2, atol=3e-2 * br.grad.abs().max().item())


def test_fused_empty_batch_and_fallbacks():
    _needs_sm90()
    q = ts_quant.quantize(torch.randn(128, 128, device="cuda"), "int8")
    assert ts_quant.quantized_linear(torch.empty(0, 128, device="cuda", dtype=torch.bfloat16), q).shape == (0, 128)
    x16 = torch.randn(3, 128, device="cuda", dtype=torch.float16)
    assert ts_quant.linear_path(x16, q) == "dequantize"  # fp16 x: not the fused kernel
    ts_quant.configure_linear(fused=False)
    try:
        assert ts_quant.linear_path(x16.bfloat16(), q) == "dequantize"
    finally:
        ts_quant.configure_linear(fused=True)
    limit = ts_quant.configure_linear()["fused_max_rows"]
    ts_quant.configure_linear(fused_max_rows=2)
    try:  # more rows than the limit: dequantize + cuBLAS, counted over all leading dims
        assert ts_quant.linear_path(torch.zeros(1, 3, 128, device="cuda", dtype=torch.bfloat16), q) == "dequantize"
        assert ts_quant.linear_path(torch.zeros(2, 128, device="cuda", dtype=torch.bfloat16), q) == "fused_sm90"
    finally:
        ts_quant.configure_linear(fused_max_rows=limit)


# ---- CUDA graphs: the stream-K epoch lives on the device, so replays never see stale partial sums ----
# (format, m, n, k). The first three put one 128-row tile over every SM (256 k tiles over 132 blocks):
# its finishing block sums ~131 partials as they land, so flags left by the last replay would hand it
# that replay's partials (the bug of an epoch frozen into the graph as a kernel argument).
GRAPH_CASES = [("int8", 64, 128, 16384), ("nf4", 64, 128, 16384), ("nvfp4", 64, 128, 16384),
               ("nf4", 300, 640, 2048), ("int8", 130, 264, 1024), ("nvfp4", 513, 384, 1024)]


def _capture(fn, static_x, warm_stream):
    """A CUDA graph of fn(static_x) and its static output. warm_stream: first run fn eagerly on the
    capture stream, so its stream-K state (flags holding earlier launches' tokens) predates the capture,
    as after a warm-up; otherwise that state is created (zero-filled) inside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    if warm_stream:
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_out = fn(static_x)
    return graph, static_out


@pytest.mark.parametrize("fmt,m,n,k", GRAPH_CASES)
@pytest.mark.parametrize("warm_stream", [True, False])
def test_graph_replays_of_quantized_linear_match_eager_and_reference(fmt, m, n, k, warm_stream):
    _needs_sm90()
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    q = ts_quant.quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.05, fmt)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    static_x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    assert ts_quant.linear_path(static_x, q) == "fused_sm90"
    graph, static_out = _capture(lambda x: ts_quant.quantized_linear(x, q, bias), static_x, warm_stream)
    wd = q.dequantize(torch.bfloat16).double()
    for replay in range(8):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        static_x.copy_(x)
        graph.replay()
        eager = ts_quant.quantized_linear(x, q, bias)
        ref = x.double() @ wd.t() + bias.double()
        assert torch.equal(static_out, eager), f"replay {replay}: the graph's output differs from the eager call"
        error = _relative_error(static_out, ref)
        assert error < 4e-3, f"replay {replay}: relative error {error} against dequantize + matmul"


def test_graph_of_a_quantlinear_stack_replays_three_fused_launches():
    """int8, nf4 and nvfp4 QuantLinear layers in one graph: three launches per replay share one state."""
    _needs_sm90()
    torch.manual_seed(3)
    dims, formats = (1024, 2048, 1024, 512), ("int8", "nf4", "nvfp4")
    layers = [ts_quant.QuantLinear.from_linear(torch.nn.Linear(a, b, device="cuda", dtype=torch.bfloat16), fmt)
              for a, b, fmt in zip(dims, dims[1:], formats)]
    model = torch.nn.Sequential(*layers)

    def forward(x):
        with torch.no_grad():
            return model(x)

    static_x = torch.randn(48, dims[0], device="cuda", dtype=torch.bfloat16)
    assert all(ts_quant.linear_path(torch.zeros(48, layer.in_features, device="cuda", dtype=torch.bfloat16),
                                    layer.qweight) == "fused_sm90" for layer in layers)
    graph, static_out = _capture(forward, static_x, warm_stream=True)
    for replay in range(6):
        x = torch.randn_like(static_x)
        static_x.copy_(x)
        graph.replay()
        assert torch.equal(static_out, forward(x)), f"replay {replay}: the graph's output differs from eager"
        ref = x
        for layer in layers:  # dequantize + matmul, rounded to bf16 between layers as the kernel does
            w = layer.qweight.dequantize(torch.bfloat16).double()
            ref = (ref.double() @ w.t() + layer.bias.detach().double()).to(torch.bfloat16)
        error = _relative_error(static_out, ref.double())
        assert error < 1e-2, f"replay {replay}: relative error {error} against dequantize + matmul"
