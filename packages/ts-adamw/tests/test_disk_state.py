"""The disk tier: StateFile round-trips aligned transfers, reports every failure at wait naming the file, leaves
nothing in its directory (closed or killed); DiskState steps bit-for-bit as adamw_steps in RAM, and a failed
step never applies data that was not fully read."""

from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import ts_adamw
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef
from ts_adamw import _core

KW = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
BLOCK = 4096
MIB = 1 << 20


def _random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    out = ts_adamw.aligned_empty(nbytes)
    out.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return out


def _entries(directory) -> list[str]:
    return sorted(os.listdir(directory))


# ---- StateFile ------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 1023), st.integers(1, 300)), min_size=1, max_size=12),
       threads=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_random_aligned_ranges_round_trip(tmp_path_factory, ranges, threads, seed):
    directory = tmp_path_factory.mktemp("rt")
    with ts_adamw.StateFile(directory, 1024 * BLOCK + 300 * BLOCK, io_threads=threads) as f:
        expect = torch.zeros(f.size, dtype=torch.uint8)
        for i, (block, count) in enumerate(ranges):  # overlapping ranges: the later write wins, so wait each
            data = _random_bytes(count * BLOCK, seed + i)
            f.wait(f.write(block * BLOCK, data))
            expect[block * BLOCK:(block + count) * BLOCK] = data
        back = ts_adamw.aligned_empty(f.size)
        f.wait(f.read(0, back))
        assert torch.equal(back, expect)  # untouched blocks read as zeros (reserved, never written)
        assert f.pending == 0
    assert _entries(directory) == []


def test_many_concurrent_tickets_across_chunks(tmp_path):
    sizes = [BLOCK * (1 + (i * 37) % 700) for i in range(150)]  # 4 KiB to 2.7 MiB: many span several chunks
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    with ts_adamw.StateFile(tmp_path, sum(sizes), io_threads=8) as f:
        data = [_random_bytes(n, i) for i, n in enumerate(sizes)]
        tickets = [f.write(o, d) for o, d in zip(offsets, data)]
        assert f.pending == len(sizes)
        for t in reversed(tickets):  # any order
            f.wait(t)
        backs = [ts_adamw.aligned_empty(n) for n in sizes]
        tickets = [f.read(o, b) for o, b in zip(offsets, backs)]
        for t in tickets[::2] + tickets[1::2]:
            f.wait(t)
            assert f.pending < len(sizes)
        assert all(torch.equal(a, b) for a, b in zip(data, backs))


def test_partial_transfers_are_retried_until_done(tmp_path):
    with ts_adamw.StateFile(tmp_path, 8 * MIB) as f:
        data = _random_bytes(3 * MIB, 1)
        f._fail_next("partial", "write")
        f.wait(f.write(MIB, data))
        back = ts_adamw.aligned_empty(3 * MIB)
        f._fail_next("partial", "read", after=1)
        f.wait(f.read(MIB, back))
        assert torch.equal(back, data)


@pytest.mark.parametrize("kind", ["eio", "short"])
@pytest.mark.parametrize("op", ["read", "write"])
def test_injected_faults_raise_at_wait_naming_the_request(tmp_path, kind, op):
    with ts_adamw.StateFile(tmp_path, 4 * MIB) as f:
        data = _random_bytes(2 * MIB, 2)
        f.wait(f.write(0, data))
        buffer = ts_adamw.aligned_empty(2 * MIB) if op == "read" else data
        f._fail_next(kind, op)
        ticket = getattr(f, op)(0, buffer)  # queued: nothing raises at submit
        with pytest.raises(ts_adamw.DiskIOError) as info:
            f.wait(ticket)
        error = info.value
        assert isinstance(error, OSError) and error.errno == errno.EIO
        text = str(error)
        assert f"{op} of {2 * MIB} bytes at offset 0" in text and f.path in text and str(tmp_path) in text
        assert ("end of file" in text or "no progress" in text) if kind == "short" else "Input/output error" in text
        with pytest.raises(ValueError, match="already waited"):
            f.wait(ticket)
        back = ts_adamw.aligned_empty(2 * MIB)  # the file still works
        f.wait(f.read(0, back))
        assert torch.equal(back, data)


def test_unaligned_or_out_of_range_requests_are_refused(tmp_path):
    with ts_adamw.StateFile(tmp_path, MIB) as f:
        buffer = ts_adamw.aligned_empty(2 * BLOCK)
        with pytest.raises(ValueError, match=r"offset=100 is not aligned.*4096"):
            f.read(100, buffer)
        with pytest.raises(ValueError, match="nbytes=1000 is not aligned"):
            f.write(0, buffer, 1000)
        with pytest.raises(ValueError, match=r"address .* is not aligned"):
            f.read(0, buffer[1:BLOCK + 1])
        with pytest.raises(ValueError, match="not inside the file"):
            f.read(MIB - BLOCK, buffer)
        with pytest.raises(ValueError, match="more than the buffer"):
            f.read(0, buffer, 4 * BLOCK)
        with pytest.raises(ValueError, match="unknown"):
            f.wait(12345)
        assert f.pending == 0
    with pytest.raises(ValueError, match="closed"):
        f.read(0, buffer)


def test_missing_directory_and_file_path_name_the_directory(tmp_path):
    missing = tmp_path / "nope" / "deeper"
    with pytest.raises(ts_adamw.DiskIOError, match=f"'{missing}'.*does not exist") as info:
        ts_adamw.StateFile(missing, MIB)
    assert info.value.errno == errno.ENOENT
    a_file = tmp_path / "plain.txt"
    a_file.write_text("x")
    for anonymous in (True, False):
        with pytest.raises(ts_adamw.DiskIOError, match=f"'{a_file}'.*not a directory") as info:
            ts_adamw.StateFile(a_file, MIB, anonymous=anonymous)
        assert info.value.errno == errno.ENOTDIR
    assert _entries(tmp_path) == ["plain.txt"]


def _filesystem(path) -> str:
    path, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            mount, fs = line.split()[1:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fs
    return kind


def test_a_reservation_larger_than_the_disk_names_directory_and_bytes(tmp_path):
    if _filesystem(tmp_path) != "ext4":
        # ext4 refuses 2**60 bytes at once (beyond its largest file); XFS or btrfs might first allocate every
        # free block of a shared disk before failing. The RLIMIT_FSIZE test below covers every filesystem.
        pytest.skip(f"{tmp_path} is not on ext4")
    with pytest.raises(ts_adamw.DiskIOError, match=f"reserve {1 << 60} bytes .* in '{tmp_path}'") as info:
        ts_adamw.StateFile(tmp_path, 1 << 60)
    assert info.value.errno in (errno.ENOSPC, errno.EFBIG)
    assert _entries(tmp_path) == []


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_a_full_disk_raises_at_creation_naming_directory_and_bytes(tmp_path):
    # RLIMIT_FSIZE stands in for a full disk: with SIGXFSZ ignored, growing a file past it fails with EFBIG.
    done = run_python(f"""
        import errno, resource, signal
        import ts_adamw
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))
        ts_adamw.StateFile({str(tmp_path)!r}, 4 << 20).close()  # fits
        try:
            ts_adamw.StateFile({str(tmp_path)!r}, 64 << 20)
        except ts_adamw.DiskIOError as e:
            assert e.errno == errno.EFBIG, e.errno
            print(e)
    """)
    assert done.returncode == 0, done.stderr
    assert f"reserve {64 * MIB} bytes (64.00 MiB) in '{tmp_path}'" in done.stdout
    assert "RLIMIT_FSIZE" in done.stdout
    assert _entries(tmp_path) == []


@pytest.mark.parametrize("anonymous", [True, False])
def test_the_file_never_stays_in_its_directory_even_after_sigkill(tmp_path, anonymous):
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        import ts_adamw
        f = ts_adamw.StateFile({str(tmp_path)!r}, 16 << 20, anonymous={anonymous})
        f.wait(f.write(0, ts_adamw.aligned_empty(16 << 20)))
        print(f.anonymous, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == str(anonymous)
        assert _entries(tmp_path) == []  # alive, holding 16 MiB: no name in the directory
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        child.kill()
    assert _entries(tmp_path) == []
    f = ts_adamw.StateFile(tmp_path, MIB, anonymous=anonymous)
    assert f.anonymous == anonymous and _entries(tmp_path) == []
    f.close()
    assert f.closed and _entries(tmp_path) == []


def test_direct_io_modes_and_the_buffered_fallback(tmp_path):
    with ts_adamw.StateFile(tmp_path, MIB, direct=False) as f:
        assert not f.direct
        data = _random_bytes(MIB, 3)
        f.wait(f.write(0, data))
        back = ts_adamw.aligned_empty(MIB)
        f.wait(f.read(0, back))
        assert torch.equal(back, data)
        with pytest.raises(ValueError, match="not aligned"):  # the same rule as direct I/O
            f.read(BLOCK // 2, back)
    _core._simulate_direct_refused(True)
    try:
        with ts_adamw.StateFile(tmp_path, MIB) as f:
            assert not f.direct  # fell back
        with pytest.raises(ts_adamw.DiskIOError, match=f"'{tmp_path}' refuses direct I/O.*direct=None"):
            ts_adamw.StateFile(tmp_path, MIB, direct=True)
    finally:
        _core._simulate_direct_refused(False)
    assert _entries(tmp_path) == []


def test_buffers_stay_referenced_until_waited_and_close_waits(tmp_path):
    f = ts_adamw.StateFile(tmp_path, 64 * MIB, io_threads=2)
    buffer = ts_adamw.aligned_empty(64 * MIB)
    memory = StorageWeakRef(buffer.untyped_storage())
    ticket = f.read(0, buffer)
    del buffer
    gc.collect()
    assert not memory.expired()  # an I/O thread may still be writing into it
    f.wait(ticket)
    gc.collect()
    assert memory.expired()
    tickets = [f.write(i * 8 * MIB, ts_adamw.aligned_empty(8 * MIB)) for i in range(8)]
    f.close()  # waits for all of them
    assert all(f.done(t) for t in tickets)
    for t in tickets:
        f.wait(t)
    g = ts_adamw.StateFile(tmp_path, 64 * MIB)
    g.write(0, ts_adamw.aligned_empty(64 * MIB))
    del g  # never waited, never closed: the destructor waits
    gc.collect()
    assert _entries(tmp_path) == []


def test_a_forked_child_cannot_use_the_file_and_exits_cleanly(tmp_path):
    f = ts_adamw.StateFile(tmp_path, MIB, io_threads=3)
    data = _random_bytes(MIB, 5)
    f.wait(f.write(0, data))
    pid = os.fork()
    if pid == 0:  # the child: refused, then closed and collected without joining the parent's threads
        code = 1
        try:
            try:
                f.read(0, data)
            except ValueError as e:
                code = 0 if "fork" in str(e) else 2
            assert f.closed
            f.close()
            del f
            gc.collect()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung closing or collecting the file")
    assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0
    back = ts_adamw.aligned_empty(MIB)  # the parent's file is untouched by the child
    f.wait(f.read(0, back))
    assert torch.equal(back, data)
    f.close()


def test_bad_arguments_are_value_errors(tmp_path):
    for kwargs in ({"io_threads": 0}, {"io_threads": 65}, {"direct": "yes"}):
        with pytest.raises(ValueError):
            ts_adamw.StateFile(tmp_path, MIB, **kwargs)
    for nbytes in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            ts_adamw.StateFile(tmp_path, nbytes)
    f = ts_adamw.StateFile(tmp_path, 5000)
    assert f.size == 2 * BLOCK
    with pytest.raises(ValueError, match="fault"):
        f._fail_next("boom")
    f.close()
    f.close()


# ---- DiskState --------------------------------------------------------------------------------------------------


def _model(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}


def _reference(params, moments):
    ps = [p.clone().reshape(-1) for p in params.values()]
    return ps, [torch.zeros_like(p, dtype=moments) for p in ps], [torch.zeros_like(p, dtype=moments) for p in ps]


def _state_equals(state, ref) -> bool:
    for i, name in enumerate(state.names):
        got = state.read_state(name)
        if not all(torch.equal(got[k].reshape(-1), r[i]) for k, r in zip(("param", "exp_avg", "exp_avg_sq"), ref)):
            return False
    return True


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(0, 9000), min_size=1, max_size=6), quanta=st.integers(1, 5),
       depth=st.integers(1, 4), moments=st.sampled_from([torch.float32, torch.bfloat16]),
       grad=st.sampled_from([torch.float32, torch.bfloat16]), out=st.sampled_from([None, torch.bfloat16]),
       seed=st.integers(0, 2**32))
def test_disk_steps_are_bit_exact_with_steps_in_ram(tmp_path_factory, sizes, quanta, depth, moments, grad, out,
                                                     seed):
    params = _model(sizes, seed % 1000)
    ref = _reference(params, moments)
    directory = tmp_path_factory.mktemp("exact")
    with ts_adamw.DiskState(params, directory, moment_dtype=moments, depth=depth,
                            segment_values=quanta * 2048) as state:
        assert state.depth == depth
        for step in range(1, 4):
            gen = torch.Generator().manual_seed(seed % 997 + step)
            grads = {n: torch.randn(p.shape, generator=gen).to(grad) for n, p in params.items()}
            outs = None if out is None else {n: torch.empty(p.shape, dtype=out) for n, p in params.items()}
            ref_outs = None if out is None else [torch.empty(p.numel(), dtype=out) for p in params.values()]
            state.step(grads, step=step, params_out=outs, seed=seed, **KW)
            ts_adamw.adamw_steps(ref[0], [g.reshape(-1) for g in grads.values()], ref[1], ref[2], step=step,
                                 params_out=ref_outs, seed=seed, **KW)
            if out is not None:
                assert all(torch.equal(o.reshape(-1), r) for o, r in zip(outs.values(), ref_outs))
        assert _state_equals(state, ref)
    assert _entries(directory) == []


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 7000), min_size=2, max_size=6), depth=st.integers(1, 3),
       moments=st.sampled_from([torch.float32, torch.bfloat16]), picks=st.lists(st.integers(0, 63), min_size=3,
                                                                                max_size=5),
       ahead=st.sampled_from(["none", "next", "wrong"]), read_between=st.booleans(), wait=st.booleans(),
       seed=st.integers(0, 2**32))
def test_steps_of_some_parameters_match_ram_and_leave_the_others(tmp_path_factory, sizes, depth, moments, picks,
                                                                  ahead, read_between, wait, seed):
    """Buckets arrive one at a time: stepping a subset (whose segments it may share with neighbours) updates
    exactly that subset, as adamw_steps over it would, and leaves every other value bit for bit; reading the
    next subset ahead (right, wrong, or dropped by a read between), or leaving writes in flight, changes no bit."""
    params = _model(sizes, seed % 1000)
    names = list(params)
    ref = _reference(params, moments)
    chosen_of = [[n for i, n in enumerate(names) if pick >> i & 1] or names[-1:] for pick in picks]
    with ts_adamw.DiskState(params, tmp_path_factory.mktemp("subset"), moment_dtype=moments, depth=depth,
                            segment_values=2048) as state:
        for step, chosen in enumerate(chosen_of, start=1):
            at = [names.index(n) for n in chosen]
            gen = torch.Generator().manual_seed(seed % 991 + step)
            grads = [torch.randn(params[n].shape, generator=gen) for n in chosen]
            outs = [torch.empty(params[n].shape, dtype=torch.bfloat16) for n in chosen]
            ref_outs = [torch.empty(params[n].numel(), dtype=torch.bfloat16) for n in chosen]
            following = chosen_of[step % len(chosen_of)]
            prefetch = {"none": None, "next": following, "wrong": [n for n in names if n not in following] or None}
            state.step(grads, step=step, params_out=outs, seed=seed, names=chosen, prefetch=prefetch[ahead],
                       wait_writes=wait, **KW)
            if read_between:
                state.read_state(names[0])
            ts_adamw.adamw_steps([ref[0][i] for i in at], [g.reshape(-1) for g in grads], [ref[1][i] for i in at],
                                 [ref[2][i] for i in at], step=step, params_out=ref_outs, seed=seed, keys=at, **KW)
            assert all(torch.equal(o.reshape(-1), r) for o, r in zip(outs, ref_outs))
        assert _state_equals(state, ref)


def test_a_step_reads_the_next_parameters_ahead_and_the_next_step_uses_them(tmp_path):
    params = _model([4096, 4096, 4096, 4096], 5)  # one segment each
    with ts_adamw.DiskState(params, tmp_path, segment_values=4096) as state:
        grads = {n: torch.randn(4096) for n in params}
        state.step([grads["p3"]], names=["p3"], prefetch=["p2", "p1"], step=1, **KW)
        assert sorted(state._ready) == [2]  # depth 3: one set reads ahead, two stay the step's
        state.step([grads["p2"]], names=["p2"], prefetch=["p1"], step=1, **KW)
        assert sorted(state._ready) == [1]
        state.step([grads["p0"]], names=["p0"], step=1, **KW)  # not what was read ahead: dropped
        assert state._ready == {}
        with pytest.raises(ValueError, match="unknown parameters"):
            state.step([grads["p0"]], names=["p0"], prefetch=["zz"], step=2, **KW)


def test_a_segment_a_step_writes_is_never_read_ahead(tmp_path):
    """Two parameters in one segment: reading the second ahead while the first's update is written back
    would hand the next step the segment as it was, and its write would undo the first update."""
    params = _model([1000, 1000], 6)
    ref = _reference(params, torch.float32)
    with ts_adamw.DiskState(params, tmp_path, segment_values=2048) as state:
        for step in range(1, 4):
            for i, name in enumerate(params):
                g = torch.full((1000,), 0.1 * step + i)
                state.step([g], names=[name], prefetch=[n for n in params if n != name], step=step, **KW)
                ts_adamw.adamw_steps([ref[0][i]], [g], [ref[1][i]], [ref[2][i]], step=step, keys=[i], **KW)
        assert _state_equals(state, ref)


@pytest.mark.parametrize("depth", [3, 5, 8])
def test_no_segment_is_read_while_its_write_is_in_flight(tmp_path, depth):
    """Writes left in flight (wait_writes=False) land before their segment is read again, by a step or by a
    read ahead: checked at every read submitted (the disk might serve an overlapping read first)."""
    params = _model([3000, 3000, 3000, 3000], 8)  # two parameters per 4096-value segment
    with ts_adamw.DiskState(params, tmp_path, segment_values=2048, depth=depth) as state:
        submit, seen = state._submit, []

        def checked(op, segment, staging, fields=(0, 1, 2)):
            if op == "read":
                seen.append(segment)
                assert not any(st.writes and st.written == segment for st in state._sets), segment
            return submit(op, segment, staging, fields)

        state._submit = checked
        names = list(params)
        for step in range(1, 4):
            for i, name in enumerate(reversed(names)):  # backward order, the next one read ahead
                ahead = [names[-2 - i]] if i + 1 < len(names) else [names[-1]]
                state.step([torch.randn(3000)], names=[name], prefetch=ahead, step=step, wait_writes=False, **KW)
        assert len(seen) > 8


def test_a_write_left_in_flight_that_fails_makes_the_state_unusable_at_the_next_call(tmp_path):
    params = _model([4096, 4096], 7)
    with ts_adamw.DiskState(params, tmp_path, segment_values=4096) as state:
        grads = [torch.randn(4096)]
        state.step(grads, names=["p0"], step=1, wait_writes=False, **KW)
        state.flush()  # nothing pending fails
        state._file._fail_next("eio", "write")
        state.step(grads, names=["p1"], step=1, wait_writes=False, **KW)  # returns: its write is in flight
        with pytest.raises(ts_adamw.DiskIOError, match="write"):
            state.flush()
        assert state.failed is not None
        with pytest.raises(ts_adamw.DiskIOError, match="unusable"):
            state.step(grads, names=["p0"], step=2, **KW)


def test_bad_names_are_refused_before_any_io(tmp_path):
    params = _model([3000, 20], 4)
    with ts_adamw.DiskState(params, tmp_path, segment_values=2048) as state:
        g = torch.randn(20)
        for names, message in ((["zz"], "unknown parameters"), (["p1", "p1"], "twice"), ([], "non-empty"),
                               ("p1", "non-empty")):
            with pytest.raises(ValueError, match=message):
                state.step([g], step=1, names=names, **KW)
        with pytest.raises(ValueError, match="not stepped"):
            state.step({"p0": torch.randn(3000), "p1": g}, step=1, names=["p1"], **KW)
        assert state.failed is None


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_one_large_parameter_matches_adamw_step(tmp_path, moments):
    n = 300_001  # many segments of one tensor: bf16 rounding continues across segment borders
    p = torch.randn(n)
    ref_p, ref_m, ref_v = p.clone(), torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    with ts_adamw.DiskState({"w": p}, tmp_path, moment_dtype=moments, segment_values=16384) as state:
        for step in range(1, 5):
            g = torch.randn(n)
            out, ref_out = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
            ts_adamw.adamw_step_on_disk(state, [g], step=step, seed=9, params_out=[out], **KW)
            ts_adamw.adamw_step(ref_p, g, ref_m, ref_v, step=step, seed=9, param_out=ref_out, **KW)
            assert torch.equal(out, ref_out)
        got = state.read_state("w")
        assert torch.equal(got["param"], ref_p) and torch.equal(got["exp_avg"], ref_m)
        assert torch.equal(got["exp_avg_sq"], ref_v)


def test_caller_staging_is_used_as_given(tmp_path):
    params = _model([5000, 70, 12000], 1)
    set_bytes = ts_adamw.DiskState.staging_bytes(4096)
    staging = [ts_adamw.aligned_empty(set_bytes + BLOCK) for _ in range(2)]
    ptrs = [t.data_ptr() for t in staging]
    ref = _reference(params, torch.float32)
    with ts_adamw.DiskState(params, tmp_path, segment_values=4096, staging=staging) as state:
        assert state.depth == 2 and state.nbytes % BLOCK == 0
        grads = [torch.randn(p.shape) for p in params.values()]
        state.step(grads, step=1, **KW)
        ts_adamw.adamw_steps(ref[0], [g.reshape(-1) for g in grads], ref[1], ref[2], step=1, **KW)
        assert _state_equals(state, ref) and [t.data_ptr() for t in staging] == ptrs
    with pytest.raises(ValueError, match="4096-byte boundary"):
        ts_adamw.DiskState(params, tmp_path, segment_values=4096, staging=[staging[0][1:]])
    with pytest.raises(ValueError, match="staging\\[0\\] and staging\\[1\\] share memory"):
        ts_adamw.DiskState(params, tmp_path, segment_values=4096, staging=[staging[0], staging[0]])


def test_write_state_and_read_state_round_trip_without_touching_neighbours(tmp_path):
    params = _model([3, 1500, 4097, 10], 2)  # starts not on block boundaries
    with ts_adamw.DiskState(params, tmp_path, moment_dtype=torch.bfloat16, segment_values=2048) as state:
        before = {n: state.read_state(n) for n in state.names}
        assert torch.equal(before["p1"]["param"], params["p1"]) and not before["p2"]["exp_avg"].any()
        new = {"param": torch.randn(4097), "exp_avg": torch.randn(4097), "exp_avg_sq": torch.rand(4097)}
        state.write_state("p2", **new)
        got = state.read_state("p2")
        assert torch.equal(got["param"], new["param"])
        assert torch.equal(got["exp_avg"], new["exp_avg"].bfloat16())
        for n in ("p0", "p1", "p3"):
            assert all(torch.equal(state.read_state(n)[k], before[n][k]) for k in before[n])
        with pytest.raises(ValueError, match="4097 values"):
            state.write_state("p2", param=torch.zeros(4096))
        with pytest.raises(KeyError):
            state.read_state("nope")


def _bad_step_cases(params):
    grads = {n: torch.randn(p.shape) for n, p in params.items()}
    return {
        "grad dtype": ({**grads, "p0": grads["p0"].double()}, {}, "float64"),
        "grad numel": ({**grads, "p1": torch.randn(3)}, {}, "has 3 values"),
        "missing grad": ({"p0": grads["p0"]}, {}, "missing"),
        "unknown grad": ({**grads, "zz": grads["p0"]}, {}, "unknown"),
        "strided grad": ({**grads, "p0": torch.randn(2 * params["p0"].numel())[::2]}, {}, "contiguous"),
        "out dtype": (grads, {"params_out": {n: torch.empty(p.shape, dtype=torch.int32) for n, p in params.items()}},
                      "int32"),
        "out aliases grad": (grads, {"params_out": grads}, "share memory"),
        "lr": (grads, {"lr": -1.0}, "lr"),
        "step": (grads, {"step": 0}, "step"),
        "threads": (grads, {"threads": 0}, "threads"),
    }


@pytest.mark.parametrize("case", sorted(_bad_step_cases(_model([10, 20], 0))))
def test_bad_step_input_raises_before_any_io(tmp_path, case):
    params = _model([3000, 20], 3)
    with ts_adamw.DiskState(params, tmp_path, segment_values=2048) as state:
        before = {n: state.read_state(n) for n in state.names}
        grads, extra, message = _bad_step_cases(params)[case]
        with pytest.raises(ValueError, match=message):
            state.step(grads, step=extra.pop("step", 1), **{**KW, **extra})
        assert state.failed is None
        assert all(torch.equal(state.read_state(n)[k], before[n][k]) for n in before for k in before[n])


def test_bad_construction_raises(tmp_path):
    params = _model([10], 0)
    for kwargs, message in (({"segment_values": 3000}, "multiple of 2048"), ({"moment_dtype": torch.float16},
                            "moment_dtype"), ({"keys": [1, 2]}, "keys"), ({"depth": 0}, "depth")):
        with pytest.raises(ValueError, match=message):
            ts_adamw.DiskState(params, tmp_path, **kwargs)
    with pytest.raises(ValueError, match="empty"):
        ts_adamw.DiskState({}, tmp_path)
    with pytest.raises(ValueError, match="floating"):
        ts_adamw.DiskState({"i": torch.arange(4)}, tmp_path)
    with pytest.raises(ts_adamw.DiskIOError, match="does not exist"):
        ts_adamw.DiskState(params, tmp_path / "missing")
    assert _entries(tmp_path) == []


def _failing_step(tmp_path, kind, op, after):
    """A 4-segment state whose step meets `kind` on the `after`-th later chunk of `op`: (state, outs before, outs
    after the failed step, outs of a good step, the error)."""
    params = _model([4 * 2048], 4)
    state = ts_adamw.DiskState(params, tmp_path, segment_values=2048, depth=3)
    grads = {"p0": torch.randn(4 * 2048)}
    outs = {"p0": torch.full((4 * 2048,), 7.0, dtype=torch.bfloat16)}
    expect = {"p0": torch.empty(4 * 2048, dtype=torch.bfloat16)}
    ref = _reference(params, torch.float32)
    ts_adamw.adamw_steps(ref[0], [grads["p0"]], ref[1], ref[2], step=1, params_out=[expect["p0"]], **KW)
    state._file._fail_next(kind, op, after)
    with pytest.raises(ts_adamw.DiskIOError) as info:
        state.step(grads, step=1, params_out=outs, **KW)
    assert state.path in str(info.value)
    return state, params, grads, outs["p0"], expect["p0"], info.value


@pytest.mark.parametrize("kind", ["eio", "short"])
def test_a_failed_first_read_changes_nothing_and_the_state_stays_usable(tmp_path, kind):
    state, params, grads, out, expect, _ = _failing_step(tmp_path, kind, "read", 0)
    assert state.failed is None
    assert bool((out == 7.0).all())  # params_out untouched
    assert torch.equal(state.read_state("p0")["param"], params["p0"])  # the file untouched
    state.step(grads, step=1, params_out={"p0": out}, **KW)  # the step, retried, is the step
    assert torch.equal(out, expect)
    state.close()
    assert _entries(tmp_path) == []


@pytest.mark.parametrize("kind", ["eio", "short"])
def test_a_later_failed_read_never_applies_unread_data_and_marks_the_state_unusable(tmp_path, kind):
    state, _, grads, out, expect, error = _failing_step(tmp_path, kind, "read", 3 * 2)  # segment 2's master
    segments = [slice(i * 2048, (i + 1) * 2048) for i in range(4)]
    assert torch.equal(out[segments[0]], expect[segments[0]]) and torch.equal(out[segments[1]], expect[segments[1]])
    assert bool((out[segments[2]] == 7.0).all()) and bool((out[segments[3]] == 7.0).all())
    assert state.failed is error
    with pytest.raises(ts_adamw.DiskIOError, match="unusable"):
        state.step(grads, step=2, **KW)
    with pytest.raises(ts_adamw.DiskIOError, match="unusable"):
        state.read_state("p0")
    state.close()
    assert _entries(tmp_path) == []


def test_a_failed_write_keeps_the_in_memory_result_and_marks_the_state_unusable(tmp_path):
    state, _, _, out, expect, error = _failing_step(tmp_path, "eio", "write", 0)
    assert "write of" in str(error) and error.errno == errno.EIO
    assert torch.equal(out[:2048], expect[:2048])  # segment 0 was updated, its write failed
    assert state.failed is error
    with pytest.raises(ts_adamw.DiskIOError, match="unusable"):
        state.read_state("p0")
    state.close()
    with pytest.raises(ValueError, match="closed"):
        state.read_state("p0")


def test_steps_after_close_raise_and_the_directory_is_empty(tmp_path):
    state = ts_adamw.DiskState(_model([100], 5), tmp_path)
    assert state.direct in (True, False) and state.nbytes > 0
    state.close()
    state.close()
    assert state.closed and _entries(tmp_path) == []
    with pytest.raises(ValueError, match="closed"):
        state.step([torch.zeros(100)], step=1, **KW)


def test_a_step_lets_other_python_threads_run(tmp_path):
    # The step releases the GIL while it waits for I/O and while it updates.
    import threading

    params = _model([400_000], 6)
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    with ts_adamw.DiskState(params, tmp_path, segment_values=8192) as state:
        worker = threading.Thread(target=tick)
        worker.start()
        try:
            start = time.perf_counter()
            for step in range(1, 4):
                state.step([torch.randn(400_000)], step=step, **KW)
            end = time.perf_counter()
        finally:
            stop.set()
            worker.join()
    assert sum(start <= t <= end for t in ticks) >= 3
    stats = state.stats  # the last step's clock: every wait attributed
    assert set(stats) == {"read_wait_s", "write_wait_s", "update_s", "step_s"}
    assert stats["update_s"] > 0 and stats["read_wait_s"] + stats["write_wait_s"] + stats["update_s"] > 0
    assert stats["read_wait_s"] + stats["write_wait_s"] + stats["update_s"] <= stats["step_s"]
