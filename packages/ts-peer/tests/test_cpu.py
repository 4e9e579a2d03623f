"""Without CUDA: the module imports, says so, and every CUDA-only call raises a clear error;
a pool in one process (host backend) copies its blocks back bit for bit and refuses misuse."""

from __future__ import annotations

import os

import pytest
import torch
import ts_peer
from ts_peer import _backend, _core
from ts_peer._support import summarize

no_cuda_build = pytest.mark.skipif(_core.built_with_cuda, reason="this build has CUDA")


def test_imports_and_reports_what_it_has():
    assert _core.IPC_HANDLE_BYTES == 64
    if not _core.built_with_cuda:
        assert ts_peer.cuda_available() is False
        assert _core.device_count() == 0
        assert "built without CUDA" in ts_peer._native.unavailable_reason()


@no_cuda_build
@pytest.mark.parametrize("name, call", [
    ("can_access_peer", lambda: _core.can_access_peer(0, 1)),
    ("enable_peer_access", lambda: _core.enable_peer_access(0, 1)),
    ("pci_bus_id", lambda: _core.pci_bus_id(0)),
    ("device_from_pci_bus_id", lambda: _core.device_from_pci_bus_id("0000:01:00.0")),
    ("ipc_export", lambda: _core.ipc_export(4096)),
    ("ipc_open", lambda: _core.ipc_open(b"\0" * 64, 0)),
    ("ipc_release", lambda: _core.ipc_release(b"\0" * 64, 0)),
    ("ipc_open_count", lambda: _core.ipc_open_count()),
    ("copy_async", lambda: _core.copy_async(8, 0, 16, 0, 4, 0)),
    ("DeviceBuffer", lambda: ts_peer.DeviceBuffer(0, 1024)),
])
def test_cuda_only_calls_say_cuda_is_missing(name, call):
    with pytest.raises(RuntimeError, match=f"^{name} needs CUDA, but this build has no CUDA support"):
        call()


@pytest.mark.skipif(not _core.built_with_cuda or _core.cuda_device_present(), reason="needs a CUDA build, no GPU")
@pytest.mark.parametrize("name, call", [
    ("can_access_peer", lambda: _core.can_access_peer(0, 1)),
    ("enable_peer_access", lambda: _core.enable_peer_access(0, 1)),
    ("pci_bus_id", lambda: _core.pci_bus_id(0)),
    ("ipc_open", lambda: _core.ipc_open(b"\0" * 64, 0)),
    ("copy_async", lambda: _core.copy_async(8, 0, 16, 0, 4, 0)),
    ("DeviceBuffer", lambda: ts_peer.DeviceBuffer(0, 1024)),
])
def test_a_cuda_build_without_a_gpu_says_so(name, call):
    assert _core.device_count() == 0 and _core.device_from_pci_bus_id("0000:01:00.0") == -1
    with pytest.raises(RuntimeError, match=f"^{name}: no CUDA device or driver is present"):
        call()


@pytest.mark.skipif(ts_peer.cuda_available(), reason="CUDA works here")
def test_cuda_pool_and_support_without_cuda():
    with pytest.raises(RuntimeError, match="PeerPool on cuda"):
        ts_peer.PeerPool(backend="cuda")
    assert ts_peer.PeerPool().kind == "host"  # auto falls back to host memory
    ok, reason = ts_peer.peer_support()
    assert not ok and "1 rank" in reason


@pytest.mark.parametrize("kwargs, match", [
    ({"backend": "nvlink"}, "backend='nvlink' is not a backend"),
    ({"backend": "host", "device": "cuda:0"}, "device must be cpu"),
    ({"backend": "cuda", "device": "cpu"}, "needs a CUDA device"),
])
def test_bad_pool_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ts_peer.PeerPool(**kwargs)


def _my_shm_files():
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"ts_peer_{os.getpid()}_")]


def test_single_process_host_pool_round_trip_and_counters():
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=gen)
    b = torch.randn(5, 3, generator=gen).to(torch.bfloat16)
    pool = ts_peer.PeerPool(backend="host")
    assert pool.place(0, a) == 1001
    assert pool.place("b", b) == 30
    assert pool.place(2, b"xyz") == 3
    pool.exchange()
    assert _my_shm_files() == []  # unlinked once shared: nothing is left behind if the process dies
    assert pool.pool_bytes == 1024 + 256 + 256  # each block starts 256-byte aligned
    got = torch.zeros(1001, dtype=torch.uint8)
    assert pool.copy_block(0, got) == 1001
    assert torch.equal(got, a)
    got_b = torch.zeros(5, 3, dtype=torch.bfloat16)
    pool.copy_block("b", got_b)
    assert torch.equal(got_b.view(torch.int16), b.view(torch.int16))
    got_c = torch.zeros(3, dtype=torch.uint8)
    pool.copy_block(2, got_c)
    assert bytes(got_c.tolist()) == b"xyz"
    assert pool.owner("b") == 0 and pool.nbytes("b") == 30 and sorted(map(str, pool.block_ids)) == ["0", "2", "b"]
    s = pool.stats()
    assert (s["copies"], s["peer_bytes"], s["local_bytes"], s["remote_bytes"]) == (3, 1034, 1034, 0)
    assert pool.peer_bytes == 1034 and s["owned"] == s["blocks"] == 3
    assert pool.pooled_blocks == pool.block_ids and pool.bytes_owned == pool.pool_bytes == 1536  # reference names
    pool.close()
    pool.close()  # idempotent
    assert pool.pool_bytes == 0


def test_host_pool_refuses_misuse_by_name():
    pool = ts_peer.PeerPool(backend="host")
    with pytest.raises(ValueError, match=r"block_id=1\.5 must be an int or a str"):
        pool.place(1.5, b"x")
    with pytest.raises(ValueError, match="must be contiguous"):
        pool.place(1, torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match=r"data must be a torch\.Tensor"):
        pool.place(1, [1, 2])
    pool.place(1, b"abcd")
    with pytest.raises(ValueError, match="already placed"):
        pool.place(1, b"abcd")
    with pytest.raises(RuntimeError, match="call exchange"):
        pool.copy_block(1, torch.empty(4, dtype=torch.uint8))
    with pool:
        pool.exchange()
        with pytest.raises(RuntimeError, match="place every block before exchange"):
            pool.place(2, b"x")
        with pytest.raises(RuntimeError, match="exchange\\(\\) runs once"):
            pool.exchange()
        with pytest.raises(ValueError, match="dst has 8 bytes, block 1 has 4"):
            pool.copy_block(1, torch.empty(2, dtype=torch.float32))
        with pytest.raises(ValueError, match="dst must be contiguous"):
            pool.copy_block(1, torch.empty(2, 4, dtype=torch.uint8)[:, ::2])
        with pytest.raises(KeyError, match="block 9 is in no rank's pool"):
            pool.copy_block(9, torch.empty(4, dtype=torch.uint8))
        with pytest.raises(ValueError, match=r"dst must be a torch\.Tensor"):
            pool.copy_block(1, bytearray(4))
        assert pool.stats()["copies"] == 0
    with pytest.raises(RuntimeError, match="pool is closed"):
        pool.copy_block(1, torch.empty(4, dtype=torch.uint8))
    assert _backend.host_open_count() == 0 and _my_shm_files() == []


def test_empty_pool_exchanges_and_closes():
    pool = ts_peer.PeerPool(backend="host")
    pool.exchange()
    assert pool.pool_bytes == 0 and pool.block_ids == []
    pool.close()


def test_summarize_names_the_first_problem():
    gpu = {"error": None, "bus": "0000:01:00.0", "no_peer": [], "ipc_failed": {}}
    other = {**gpu, "bus": "0000:02:00.0"}
    assert summarize([gpu]) == (False, "the process group has 1 rank; peer pools need two or more")
    ok, reason = summarize([gpu, other])
    assert ok and "every pair of the 2 ranks (2 GPU(s))" in reason
    ok, reason = summarize([gpu, gpu])
    assert ok and "(1 GPU(s))" in reason
    ok, reason = summarize([gpu, {**other, "error": "no driver"}, {**other, "error": "no driver"}])
    assert not ok and reason == "rank(s) 1, 2 cannot use CUDA peer pools: no driver"
    ok, reason = summarize([{**gpu, "no_peer": [1]}, other])
    assert not ok and "rank 0's GPU (0000:01:00.0) has no peer access to rank 1's GPU (0000:02:00.0)" in reason
    ok, reason = summarize([gpu, {**other, "ipc_failed": {0: "RuntimeError: boom"}}])
    assert not ok and reason == "CUDA IPC from rank 0 to rank 1 failed: RuntimeError: boom"
