"""peer_support: may the ranks of a group pool blocks on each other's GPUs? (for ``peer="auto"``)

A collective that every rank runs: it gathers each rank's GPU, checks peer access for every
pair of distinct GPUs, and round-trips a small pattern through CUDA IPC between every pair of
ranks (two processes on one GPU included). Every rank returns the same answer, and a failure
on one rank becomes the reason, never an exception on some ranks only."""

from __future__ import annotations

import torch

from . import _core
from ._handles import IpcHandle
from ._native import cuda_available, gather, rank_and_world, stream_handle, unavailable_reason
from ._plan import split_free_vram

__all__ = ["peer_support", "pool_budgets", "summarize"]

_PROBE_BYTES = 4096


def _pattern(rank: int, device) -> torch.Tensor:
    return ((torch.arange(_PROBE_BYTES, dtype=torch.int32) * 7 + rank * 31) % 251).to(torch.uint8).to(device)


def _probe_local(device) -> dict:
    report = {"error": None, "device": -1, "bus": ""}
    if not cuda_available():
        report["error"] = unavailable_reason()
        return report
    try:
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        index = torch.cuda.current_device() if dev.index is None else dev.index
        report["device"], report["bus"] = index, _core.pci_bus_id(index)
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    return report


def summarize(reports: list[dict]) -> tuple[bool, str]:
    """The answer from every rank's report: ``error`` (str or None: this rank cannot take part),
    ``bus`` (its GPU), ``no_peer`` (ranks whose GPU it cannot access) and ``ipc_failed``
    ({rank: message} for handles of other ranks that did not round-trip). Pure."""
    world = len(reports)
    if world < 2:
        return False, f"the process group has {world} rank; peer pools need two or more"
    broken = [r for r, rep in enumerate(reports) if rep.get("error")]
    if broken:
        first = reports[broken[0]]["error"]
        return False, f"rank(s) {', '.join(map(str, broken))} cannot use CUDA peer pools: {first}"
    for r, rep in enumerate(reports):
        for other in rep.get("no_peer", []):
            return False, (f"rank {r}'s GPU ({rep['bus']}) has no peer access to rank {other}'s GPU "
                           f"({reports[other]['bus']}): no NVLink or PCIe peer path between them")
    for r, rep in enumerate(reports):
        for other, message in sorted(rep.get("ipc_failed", {}).items()):
            return False, f"CUDA IPC from rank {other} to rank {r} failed: {message}"
    gpus = len({rep["bus"] for rep in reports})
    return True, f"peer access and CUDA IPC work for every pair of the {world} ranks ({gpus} GPU(s))"


def peer_support(group=None, device: torch.device | str | None = None) -> tuple[bool, str]:
    """Collective: (ok, reason). ok when every rank has CUDA, every pair of distinct GPUs has
    peer access and a buffer exported by each rank reads back bit for bit in every other rank.
    ``device``: this rank's GPU (default: the current one). Synchronizes the device."""
    rank, world = rank_and_world(group)
    report = _probe_local(device)
    if world < 2:
        return summarize([report])
    reports = gather(report, group, world)
    if any(rep["error"] for rep in reports):
        return summarize(reports)
    # Every rank has a GPU: peer access, then an IPC round trip.
    index = report["device"]
    report["no_peer"], report["ipc_failed"] = [], {}
    buffer, handle = None, None
    try:
        for r, rep in enumerate(reports):
            local = _core.device_from_pci_bus_id(rep["bus"])
            if local < 0:
                report["ipc_failed"][r] = f"its GPU {rep['bus']} is not visible to rank {rank}"
            elif local != index and not _core.can_access_peer(index, local):
                report["no_peer"].append(r)
        buffer = _core.DeviceBuffer(index, _PROBE_BYTES)
        view = buffer.tensor()
        view.copy_(_pattern(rank, view.device))
        del view
        torch.cuda.synchronize(index)
        h, offset, _size, dev = buffer.ipc_export()
        handle = IpcHandle("cuda", h, offset, _PROBE_BYTES, dev, report["bus"]).to_bytes()
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    handles = gather(handle, group, world)
    if report["error"] is None:
        _round_trips(rank, index, handles, report)
    reports = gather(report, group, world)  # also: every rank is done with the others' buffers
    if buffer is not None:
        buffer.release()
    return summarize(reports)


def _round_trips(rank: int, index: int, handles: list, report: dict) -> None:
    device = torch.device("cuda", index)
    for r, data in enumerate(handles):
        if r == rank or data is None or r in report["ipc_failed"]:
            continue
        try:
            h = IpcHandle.from_bytes(data)
            src = _core.device_from_pci_bus_id(h.pci_bus_id)
            base = _core.ipc_open(h.handle, src)
            try:
                got = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=device)
                _core.copy_async(got.data_ptr(), index, base + h.offset, src, _PROBE_BYTES,
                                 stream_handle(None, device))
                torch.cuda.synchronize(index)
            finally:
                _core.ipc_release(h.handle, src)
            if not torch.equal(got.cpu(), _pattern(r, "cpu")):
                report["ipc_failed"][r] = "the bytes read through the handle differ from those written"
        except Exception as e:
            report["ipc_failed"][r] = f"{type(e).__name__}: {e}"


def pool_budgets(group=None, device: torch.device | str | None = None, fraction: float = 0.5) -> list[int]:
    """Collective: every rank's pool budget in bytes, the same list on every rank, for
    ``assign_blocks``: ``fraction`` of each GPU's free memory now (``torch.cuda.mem_get_info``),
    split among the ranks that share that GPU. A rank without CUDA gets 0."""
    rank, world = rank_and_world(group)
    report = _probe_local(device)
    free = 0
    if report["error"] is None:
        free = torch.cuda.mem_get_info(report["device"])[0]
    reports = gather((report["bus"] or f"no-gpu-rank-{rank}", free), group, world)
    return split_free_vram([g for g, _ in reports], [f for _, f in reports], fraction)
