"""The disk tier's StateFile: it round-trips aligned transfers, reports every failure at wait naming the file, and
leaves nothing in its directory (closed or killed)."""

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
from disk_testing import BLOCK, MIB, entries, random_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef
from ts_adamw import _core

# ---- StateFile ------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 1023), st.integers(1, 300)), min_size=1, max_size=12),
       threads=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_random_aligned_ranges_round_trip(tmp_path_factory, ranges, threads, seed):
    directory = tmp_path_factory.mktemp("rt")
    with ts_adamw.StateFile(directory, 1024 * BLOCK + 300 * BLOCK, io_threads=threads) as f:
        expect = torch.zeros(f.size, dtype=torch.uint8)
        for i, (block, count) in enumerate(ranges):  # overlapping ranges: the later write wins, so wait each
            data = random_bytes(count * BLOCK, seed + i)
            f.wait(f.write(block * BLOCK, data))
            expect[block * BLOCK:(block + count) * BLOCK] = data
        back = ts_adamw.aligned_empty(f.size)
        f.wait(f.read(0, back))
        assert torch.equal(back, expect)  # untouched blocks read as zeros (reserved, never written)
        assert f.pending == 0
    assert entries(directory) == []


def test_many_concurrent_tickets_across_chunks(tmp_path):
    sizes = [BLOCK * (1 + (i * 37) % 700) for i in range(150)]  # 4 KiB to 2.7 MiB: many span several chunks
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    with ts_adamw.StateFile(tmp_path, sum(sizes), io_threads=8) as f:
        data = [random_bytes(n, i) for i, n in enumerate(sizes)]
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
        data = random_bytes(3 * MIB, 1)
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
        data = random_bytes(2 * MIB, 2)
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
    assert entries(tmp_path) == ["plain.txt"]


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
    assert entries(tmp_path) == []


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
    assert entries(tmp_path) == []


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
        assert entries(tmp_path) == []  # alive, holding 16 MiB: no name in the directory
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        child.kill()
    assert entries(tmp_path) == []
    f = ts_adamw.StateFile(tmp_path, MIB, anonymous=anonymous)
    assert f.anonymous == anonymous and entries(tmp_path) == []
    f.close()
    assert f.closed and entries(tmp_path) == []


def test_direct_io_modes_and_the_buffered_fallback(tmp_path):
    with ts_adamw.StateFile(tmp_path, MIB, direct=False) as f:
        assert not f.direct
        data = random_bytes(MIB, 3)
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
    assert entries(tmp_path) == []


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
    assert entries(tmp_path) == []


def test_a_forked_child_cannot_use_the_file_and_exits_cleanly(tmp_path):
    f = ts_adamw.StateFile(tmp_path, MIB, io_threads=3)
    data = random_bytes(MIB, 5)
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
