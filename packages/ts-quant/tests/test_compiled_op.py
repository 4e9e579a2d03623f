"""quantized_linear under torch.compile: the custom ops (_compiled.py) give the eager bits, forward and
backward, trace without a graph break, and find the weight's cached plan again by its codes tensor."""

import pytest
import torch
import ts_quant
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_quant import _compiled

FORMATS = ["int8", "nf4", "fp8", "nvfp4"]


def _weight(fmt, double_quant, seed):
    torch.manual_seed(seed)
    return ts_quant.quantize(torch.randn(32, 64), fmt, double_quant=double_quant and fmt == "nf4")


def _grads(fn, x, bias):
    x = x.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    y = fn(x, b)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype))
    return y.detach(), x.grad, None if b is None else b.grad


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # a wrapped model made later in this process sees nothing compiled


@settings(max_examples=12, deadline=None)
@given(fmt=st.sampled_from(FORMATS), double_quant=st.booleans(), lead=st.sampled_from([(), (5,), (2, 3)]),
       bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_compiled_calls_give_the_eager_bits(fmt, double_quant, lead, bias, dtype, seed):
    q = _weight(fmt, double_quant, seed)
    x = torch.randn(*lead, 64, dtype=dtype)
    b = torch.randn(32, dtype=dtype) if bias else None

    def linear(x, b):
        return ts_quant.quantized_linear(x, q, b)

    torch._dynamo.reset()  # each example compiles anew (one closure code object: the recompile limit)
    compiled = torch.compile(linear, backend="aot_eager", fullgraph=True)  # fullgraph: a break is an error
    for want, got in zip(_grads(linear, x, b), _grads(compiled, x, b)):
        assert (want is None) == (got is None)
        if want is not None:
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_op_passes_torch_library_checks():
    q = _weight("nf4", True, 0)
    tensors, layout, inner = _compiled.weight_tensors(q)
    x = torch.randn(3, 64, requires_grad=True)
    bias = torch.randn(32, requires_grad=True)
    args = (x, tensors, bias, q.format, list(q.shape), q.block_size, layout, inner, 0.0)
    torch.library.opcheck(torch.ops.ts_quant.quantized_linear.default, args)


def test_the_op_finds_the_weight_and_its_plan_by_the_codes_tensor():
    q = _weight("int8", False, 1)
    x = torch.randn(4, 64)
    want = ts_quant.quantized_linear(x, q)  # eager: builds q's plan
    tensors, layout, inner = _compiled.weight_tensors(q)
    assert _compiled._weight(tensors, q.format, list(q.shape), q.block_size, layout, inner) is q
    # a copy of the codes (what a CUDA graph tree passes): rebuilt around the given tensors, same result
    copies = [t.clone() for t in tensors]
    rebuilt = _compiled._weight(copies, q.format, list(q.shape), q.block_size, layout, inner)
    assert rebuilt is not q and rebuilt.data is copies[0]
    got = torch.ops.ts_quant.quantized_linear(x, copies, None, q.format, list(q.shape), q.block_size, layout, inner, 0.0)
    assert torch.equal(got, want)


def test_a_new_codes_tensor_has_a_new_owner():
    q = _weight("nf4", False, 2)
    old = q.data
    q.data = old.clone()
    assert ts_quant.QuantizedTensor.owner_of(q.data) is q
    other = ts_quant.QuantizedTensor(q.format, q.shape, old, q.scales, q.block_size)
    assert ts_quant.QuantizedTensor.owner_of(old) is other
    del other
    assert ts_quant.QuantizedTensor.owner_of(old) is None  # the registry keeps no weight alive


def test_copies_and_unpickled_weights_own_their_codes():
    import copy
    import io

    q = _weight("nf4", True, 3)
    twin = copy.deepcopy(q)
    assert ts_quant.QuantizedTensor.owner_of(twin.data) is twin and twin.data is not q.data
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert ts_quant.QuantizedTensor.owner_of(loaded.data) is loaded
    tensors, layout, inner = _compiled.weight_tensors(loaded)
    assert _compiled._weight(tensors, loaded.format, list(loaded.shape), loaded.block_size, layout, inner) is loaded
