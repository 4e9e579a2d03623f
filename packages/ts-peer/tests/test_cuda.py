"""GPU tests (marker `cuda`, skipped without a GPU; `multigpu` needs two): the native calls on
one device, a pool in one process, and two processes sharing one GPU, where CUDA IPC works: a
block placed by one rank is copied by the other bit for bit, and peer_support says ok."""

from __future__ import annotations

import os

import pytest
import torch
import ts_peer
from ts_peer import _core

pytestmark = pytest.mark.cuda


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_build_and_device_facts():
    assert _core.built_with_cuda and ts_peer.cuda_available()
    assert _core.device_count() == torch.cuda.device_count()
    bus = _core.pci_bus_id(0)
    assert _core.device_from_pci_bus_id(bus) == 0
    assert _core.device_from_pci_bus_id("0000:ff:1f.7") == -1
    assert _core.can_access_peer(0, 0) is True
    assert _core.enable_peer_access(0, 0) == "same_device"
    with pytest.raises(ValueError, match="is not one of the"):
        _core.can_access_peer(0, _core.device_count())


def test_device_buffer_export_and_copy_on_a_stream():
    buf = ts_peer.DeviceBuffer(0, 3 << 20)
    view = buf.tensor()
    assert view.device == torch.device("cuda", 0) and view.numel() == 3 << 20 and view.data_ptr() == buf.ptr
    handle, offset, size, device = _core.ipc_export(buf.ptr + 1000)
    assert len(handle) == 64 and offset == 1000 and size >= 3 << 20 and device == 0
    want = _random_bytes(5000, 1).cuda()
    view[:5000].copy_(want)
    dst = torch.zeros(5000, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    _core.copy_async(dst.data_ptr(), 0, buf.ptr, 0, 5000, stream.cuda_stream)
    stream.synchronize()
    assert torch.equal(dst, want)
    del view
    buf.release()
    assert buf.released
    with pytest.raises(RuntimeError, match="was released"):
        buf.tensor()


def test_torch_memory_exports_with_its_offset():
    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    try:
        handle, offset, size, _dev = _core.ipc_export(t[4096:].data_ptr())
    except RuntimeError as e:  # expandable segments cannot be exported: the message says so
        assert "expandable_segments" in str(e)
        return
    assert len(handle) == 64 and offset >= 4096 and size >= offset + (1 << 20) - 4096


def test_single_process_cuda_pool():
    a, b = _random_bytes(10_001, 2), torch.randn(64, 3).to(torch.bfloat16)
    with ts_peer.PeerPool(device="cuda:0") as pool:
        assert pool.kind == "cuda"
        pool.place(0, a)
        pool.place(1, b.cuda())
        pool.exchange()
        got = torch.empty(10_001, dtype=torch.uint8, device="cuda")
        got_b = torch.empty(64, 3, dtype=torch.bfloat16, device="cuda")
        pool.copy_block(0, got)
        pool.copy_block(1, got_b, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), a) and torch.equal(got_b.cpu().view(torch.int16), b.view(torch.int16))
        # The blocks take 10,240 + 384 bytes; the device allocation rounds the pool up (10,752 on the H200).
        assert 10_240 + 384 <= pool.pool_bytes <= 10_240 + 384 + 512
        assert pool.stats()["local_bytes"] == 10_001 + 384
        with pytest.raises(ValueError, match="copy into a tensor there"):
            pool.copy_block(0, torch.empty(10_001, dtype=torch.uint8))
        own = ts_peer.IpcHandle("cuda", b"\0" * 64, 0, 1, 0, _core.pci_bus_id(0), os.getpid())
        with pytest.raises(ValueError, match="exported by this process"):
            pool._backend.open(own)
    assert ts_peer.peer_support(device="cuda:0") == (False, "the process group has 1 rank; peer pools need two or more")


@pytest.fixture(scope="module")
def two_processes_one_gpu(run_ranks, tmp_path_factory):
    return run_ranks("cuda", 2, tmp_path_factory.mktemp("peer_cuda"))


def test_two_processes_one_gpu_copy_bit_for_bit(two_processes_one_gpu):
    for r in two_processes_one_gpu:
        assert r["equal"] == {"0": True, "1": True, "2": True, "3": True, "5": True, "typed": True}
        assert r["stats"]["remote_bytes"] > 0 and r["stats"]["local_bytes"] > 0
        assert r["open_during"] == 1 and r["open_after"] == 0  # the other rank's pool, closed at close()


def test_two_processes_one_gpu_handle_cache(two_processes_one_gpu):
    for r in two_processes_one_gpu:
        assert r["cache"] == [True, 1, 1, 0, 0]  # same base, one mapping, closed with the last release
        assert r["release_again"].startswith("ValueError: ipc_release: this handle is not open")
        assert r["duplicate"].startswith("ValueError: PeerPool.exchange: block 'same' was placed by ranks 0 and 1")


def test_two_processes_one_gpu_peer_support_ok(two_processes_one_gpu):
    for r in two_processes_one_gpu:
        ok, reason = r["support"]
        assert ok, reason
        assert reason == "peer access and CUDA IPC work for every pair of the 2 ranks (1 GPU(s))"


def test_two_processes_one_gpu_share_its_budget(two_processes_one_gpu):
    a, b = two_processes_one_gpu
    assert a["budgets"] == b["budgets"] and a["budgets"][0] == a["budgets"][1] > 0
    assert sum(a["budgets"]) <= max(a["free"], b["free"]) * 0.5 + 1  # the GPU's memory counted once


def test_two_processes_one_gpu_pool_blocks(two_processes_one_gpu):
    for r in two_processes_one_gpu:
        assert r["auto_reason"].startswith("5 of 5 blocks (15000 bytes) pooled across 2 ranks")
        assert r["auto_equal"] == {f"w{i}": True for i in range(5)}
        assert r["auto_mismatch"].startswith("ValueError: pool_blocks: rank 1's blocks differ")


@pytest.mark.multigpu
def test_two_gpus_peer_access_and_copy():
    if not _core.can_access_peer(0, 1):
        pytest.skip("GPUs 0 and 1 have no peer path")
    first = _core.enable_peer_access(0, 1)
    assert first in ("enabled", "already_enabled")
    assert _core.enable_peer_access(0, 1) == "already_enabled"
    src = _random_bytes(1 << 20, 3).to("cuda:1")
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize(1)
    _core.copy_async(dst.data_ptr(), 0, src.data_ptr(), 1, 1 << 20, torch.cuda.current_stream(0).cuda_stream)
    torch.cuda.synchronize(0)
    assert torch.equal(dst.cpu(), src.cpu())
