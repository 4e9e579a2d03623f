"""stream_write_value / stream_wait_value / stream_value_ops_available.

CPU part: arguments are checked in every build, a build or machine without CUDA
raises a clear RuntimeError and reports the operations unavailable. GPU part
(marker `cuda`): a wait blocks its stream until another stream writes the value,
a write is ordered after the copy before it, captured graphs replay both, and no
call synchronizes. The GPU tests that could deadlock if the operations were broken
run in a subprocess with a timeout, so a hang becomes a failure.
"""

from __future__ import annotations

import time

import pytest
import torch
import ts_pinned
from hypothesis import given
from hypothesis import strategies as st
from ts_pinned import _core

OPS = [ts_pinned.stream_write_value, ts_pinned.stream_wait_value]
U64_MAX = 2**64 - 1
out_of_range = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64))


def test_exported():
    for name in ("stream_write_value", "stream_wait_value", "stream_value_ops_available"):
        assert name in ts_pinned.__all__ and callable(getattr(ts_pinned, name))


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_without_cuda_the_ops_raise_a_clear_error(op):
    if _core.cuda_device_present():
        pytest.skip("a CUDA device is present: the cuda tests below cover this build")
    assert ts_pinned.stream_value_ops_available() is False
    assert ts_pinned.stream_value_ops_available(device=5) is False
    why = "ts-pinned was built without CUDA" if not _core.built_with_cuda else "no CUDA device or driver"
    # Valid arguments, the largest values included: only the missing CUDA is wrong.
    for value in (0, 1, U64_MAX):
        with pytest.raises(RuntimeError, match=why):
            op(0, 8, value)
    with pytest.raises(RuntimeError, match="fall back to events"):
        op(U64_MAX, 2**64 - 8, 7)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("position", [0, 1, 2], ids=["stream", "address", "value"])
@given(bad=out_of_range)
def test_out_of_range_ints_are_value_errors(op, position, bad):
    args = [0, 8, 1]
    args[position] = bad
    name = ("stream", "address", "value")[position]
    with pytest.raises(ValueError, match=rf"{op.__name__}: {name} must be in \[0, 2\*\*64\), got {bad}"):
        op(*args)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_bad_addresses_and_types(op):
    for address in (0, 4, 12, 2**64 - 1):
        with pytest.raises(ValueError, match="address must be a non-null, 8-byte aligned device pointer"):
            op(0, address, 1)
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="value must be an int"):
            op(0, 8, bad)
    with pytest.raises(TypeError, match="stream must be an int"):
        op(object(), 8, 1)


def test_available_rejects_a_negative_device():
    with pytest.raises(ValueError, match="device must be >= 0"):
        ts_pinned.stream_value_ops_available(-1)


# ---- GPU ---------------------------------------------------------------------

# Shared by the subprocesses: fail (exit 3) instead of hanging when a wait is
# never released, so a broken write cannot wedge the test run.
PRELUDE = """
import os, sys, time
import torch
import ts_pinned

def finish(event, seconds, what):
    deadline = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > deadline:
            print("TIMEOUT:", what, flush=True)
            os._exit(3)
        time.sleep(0.001)

assert ts_pinned.stream_value_ops_available(torch.cuda.current_device())
"""

# These tests enqueue a wait before the write that releases it (to show that
# the wait blocks): with fewer hardware queues than streams, two streams can
# share one, and the write would queue behind the wait. 32 queues rule that
# out for the three streams used here (see docs/pinned.md).
MANY_QUEUES = {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}


@pytest.mark.cuda
def test_wait_blocks_a_stream_until_another_stream_writes(helpers):
    proc = helpers.run_python(
        PRELUDE
        + """
counter = torch.zeros(1, dtype=torch.int64, device="cuda")
x = torch.zeros(1 << 20, device="cuda")
a, b, c = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
torch.cuda.synchronize()
for round in (1, 2, 3):  # the counter moves on: each round waits for a larger value
    ts_pinned.stream_wait_value(a.cuda_stream, counter.data_ptr(), round)
    with torch.cuda.stream(a):
        x.add_(1)
    after_wait = torch.cuda.Event()
    after_wait.record(a)
    time.sleep(0.3)
    assert not after_wait.query(), f"round {round}: the kernel after the wait ran before any write"
    # x read on a third stream: the add behind the wait has not run.
    with torch.cuda.stream(c):
        seen = x.sum()
    done_c = torch.cuda.Event()
    done_c.record(c)
    finish(done_c, 10, "stream c was blocked by the wait on stream a")
    assert float(seen) == (round - 1) * x.numel(), f"round {round}: x changed before the write"
    assert not after_wait.query()
    if round == 2:
        # A smaller value does not release the wait (GEQ, not "any write").
        ts_pinned.stream_write_value(b.cuda_stream, counter.data_ptr(), round - 1)
        time.sleep(0.2)
        assert not after_wait.query(), "a write of a smaller value released the wait"
    ts_pinned.stream_write_value(b.cuda_stream, counter.data_ptr(), round)
    finish(after_wait, 10, f"round {round}: the write on stream b never released the wait")
    assert float(x.sum()) == round * x.numel()
    assert int(counter.item()) == round
print("OK")
""",
        env=MANY_QUEUES,
        timeout=120,
    )
    assert "OK" in proc.stdout


@pytest.mark.parametrize("connections", [None, "1"], ids=["default-queues", "one-queue"])
@pytest.mark.cuda
def test_write_after_copy_orders_a_read_on_another_stream(helpers, connections):
    # The pattern the engine uses: the copy stream enqueues upload i and then the
    # write of i; the compute stream's wait for i is enqueued after that write,
    # so it cannot deadlock even when all streams share one hardware queue
    # (CUDA_DEVICE_MAX_CONNECTIONS=1). Without the wait, the clone on stream a
    # would start while the 256 MiB copy (several ms) is still running, and see
    # the previous round's values.
    proc = helpers.run_python(
        PRELUDE
        + """
n = 64 << 20  # int32 elements: 256 MiB
counter = torch.zeros(1, dtype=torch.int64, device="cuda")
dst = torch.zeros(n, dtype=torch.int32, device="cuda")
src = torch.empty(n, dtype=torch.int32).pin_memory()  # pinned: the copy is asynchronous
a, b = torch.cuda.Stream(), torch.cuda.Stream()
torch.cuda.synchronize()
for i in range(1, 21):
    src.fill_(i)  # fresh data: stale bytes would read as i - 1 (or 0)
    src[i * 1000] = -i
    with torch.cuda.stream(b):
        dst.copy_(src, non_blocking=True)
    ts_pinned.stream_write_value(b.cuda_stream, counter.data_ptr(), i)
    ts_pinned.stream_wait_value(a.cuda_stream, counter.data_ptr(), i)
    with torch.cuda.stream(a):
        out = dst.clone()
        want = torch.full_like(out, i)
        want[i * 1000] = -i
        wrong = (out != want).sum()  # a tensor: reading it here would block the host
    done = torch.cuda.Event()
    done.record(a)
    finish(done, 30, f"round {i}: the read never ran")
    torch.cuda.synchronize()
    assert int(wrong) == 0, f"round {i}: the read on stream a saw the copy unfinished ({int(wrong)} stale)"
assert int(counter.item()) == 20
print("OK")
""",
        env={"CUDA_DEVICE_MAX_CONNECTIONS": connections} if connections else None,
        timeout=180,
    )
    assert "OK" in proc.stdout


@pytest.mark.cuda
def test_graph_replays_the_wait_and_the_write(helpers):
    # Both operations captured, each in its own graph; the captured values are
    # fixed (1), so the counter is reset between replays.
    proc = helpers.run_python(
        PRELUDE
        + """
counter = torch.zeros(1, dtype=torch.int64, device="cuda")
x = torch.zeros(1 << 20, device="cuda")
out = torch.zeros_like(x)
side = torch.cuda.Stream()
with torch.cuda.stream(side):  # warm the kernels up outside capture
    x.add_(1); out.copy_(x); x.zero_(); out.zero_()
torch.cuda.synchronize()
producer, consumer = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
with torch.cuda.graph(producer):
    x.add_(1)
    ts_pinned.stream_write_value(torch.cuda.current_stream().cuda_stream, counter.data_ptr(), 1)
with torch.cuda.graph(consumer):
    ts_pinned.stream_wait_value(torch.cuda.current_stream().cuda_stream, counter.data_ptr(), 1)
    out.copy_(x)
torch.cuda.synchronize()
assert int(counter.item()) == 0 and float(x.sum()) == 0, "capture ran the operations"
a, b = torch.cuda.Stream(), torch.cuda.Stream()
for replay in (1, 2, 3):
    counter.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        consumer.replay()
    after = torch.cuda.Event()
    after.record(a)
    time.sleep(0.3)
    assert not after.query(), f"replay {replay}: the captured wait did not block"
    with torch.cuda.stream(b):
        producer.replay()
    finish(after, 10, f"replay {replay}: the captured write never released the captured wait")
    torch.cuda.synchronize()
    assert int(counter.item()) == 1
    assert float(out.sum()) == replay * x.numel(), f"replay {replay}: out copied x before the producer ran"
print("OK")
""",
        env=MANY_QUEUES,
        timeout=120,
    )
    assert "OK" in proc.stdout


@pytest.mark.cuda
def test_calls_never_synchronize_and_cost_microseconds():
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time ahead of the calls
    busy = torch.cuda.Event()
    busy.record(stream)
    handle, address = stream.cuda_stream, counter.data_ptr()
    calls = 200  # few enough that the stream's launch queue never fills (that would block)
    start = time.perf_counter()
    for i in range(1, calls + 1):
        ts_pinned.stream_write_value(handle, address, i)
        ts_pinned.stream_wait_value(handle, address, i)
    ts_pinned.stream_value_ops_available(torch.cuda.current_device())
    per_call = (time.perf_counter() - start) / (2 * calls)
    assert not busy.query(), "the calls waited for the stream (the sleep kernel had finished)"
    torch.cuda.synchronize()
    assert int(counter.item()) == calls
    # ~1 µs expected; 20 µs allows a loaded host but not a synchronization.
    assert per_call < 20e-6, f"{per_call * 1e6:.1f} µs per call"
