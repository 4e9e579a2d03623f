"""Budget: what one training process may use (VRAM, host RAM, page-locked RAM) and the rates that
price a plan, given or read from this machine."""

from __future__ import annotations

import dataclasses

from ._local import local_process_count

__all__ = ["Budget", "machine_budget"]

MiB, GiB = 1 << 20, 1 << 30


@dataclasses.dataclass(frozen=True)
class Budget:
    """Bytes this process may use: ``vram_bytes`` by the CUDA caching allocator (the per-process memory
    fraction applied), ``host_bytes`` of RAM and ``pinned_bytes`` of it page-locked (both this process's
    share when several share the machine). ``device_bytes``: the GPU's whole memory, which must also hold
    the CUDA context (None: not checked). ``headroom``: fraction of ``vram_bytes`` left for allocator
    fragmentation. Rates: host<->GPU link GB/s, host AdamW parameters/s, bf16 matmul TFLOP/s, and the disk
    that holds optimizer state (``disk_rates`` measures it); the disk defaults are a fast PCIe 4 NVMe
    drive's sequential rates, high on purpose: an unmeasured bound stays a lower bound. ``network_gbps``: what
    one rank sends to the others per second (default a 400 Gb/s NIC per GPU, as on H100 clusters; within one
    machine NVLink is faster, so again a bound from below)."""

    vram_bytes: int
    host_bytes: int
    pinned_bytes: int
    device_bytes: int | None = None
    headroom: float = 0.05
    link_gbps: float = 25.0
    host_adamw_params_per_s: float = 1.0e9
    matmul_tflops: float = 300.0
    source: str = "given"
    disk_read_gbps: float = 7.0
    disk_write_gbps: float = 6.0
    disk_mixed_gbps: float = 13.0
    network_gbps: float = 50.0

    def __post_init__(self) -> None:
        for name in ("vram_bytes", "host_bytes", "pinned_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Budget.{name}={value!r} must be an integer number of bytes >= 0")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"Budget.headroom={self.headroom!r} must be in [0, 1)")
        for name in ("link_gbps", "host_adamw_params_per_s", "matmul_tflops", "disk_read_gbps", "disk_write_gbps", "disk_mixed_gbps",
                     "network_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Budget.{name}={getattr(self, name)!r} must be > 0")

    @property
    def usable_vram(self) -> int:
        """Allocator bytes a plan may use: ``vram_bytes`` less the fragmentation headroom."""
        return int(self.vram_bytes * (1.0 - self.headroom))


def machine_budget(device=None, *, vram_bytes: int | None = None, host_bytes: int | None = None,
                   processes: int | None = None, profile=None, pin_fraction: float = 0.8,
                   headroom: float = 0.05) -> Budget:
    """This process's Budget on this machine. VRAM: the device's memory times the fraction set by
    ``torch.cuda.set_per_process_memory_fraction`` (``vram_bytes`` overrides; no GPU and no override is a
    RuntimeError). Host: available RAM bounded by the cgroup limit (``host_bytes`` overrides), split between
    the ``processes`` on this machine (default ``local_process_count()``: LOCAL_WORLD_SIZE). Page-locked:
    ``pin_fraction`` of the host share, at most its share of a raised memlock limit
    (the rule ts-pinned's ``page_lock_budget`` applies). Rates from ``profile`` (a
    ``HardwareProfile``, trainstream's adds host AdamW and matmul rates) when given, else defaults."""
    from . import _core

    n = local_process_count() if processes is None else processes
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"processes={processes!r} must be an integer >= 1")
    if not 0.0 < pin_fraction <= 1.0:
        raise ValueError(f"pin_fraction={pin_fraction!r} must be in (0, 1]")
    device_total = None
    if vram_bytes is None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("this machine has no CUDA device: pass vram_bytes (the GPU memory to plan for)")
        index = torch.device(device if device is not None else "cuda").index
        index = torch.cuda.current_device() if index is None else index
        device_total = torch.cuda.get_device_properties(index).total_memory
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = get_fraction(index) if get_fraction is not None else 1.0
        vram_bytes = int(device_total * fraction)
    source = "given"
    if host_bytes is None:
        info = _core.host_memory()
        host_bytes, source = int(info["available"]) // n, str(info["source"])
    # The page-lock rule ts-pinned's arena applies too (native/src/page_lock.cpp): fraction of the share,
    # at most the share of a deliberately raised memlock limit. host_bytes is this process's share already.
    pinned = _core.page_lock_budget_bytes(int(host_bytes) * n, pin_fraction, n, _core.memlock_limit())
    rates = {}
    if profile is not None:
        if getattr(profile, "link_h2d_gbps", None):
            rates["link_gbps"] = float(min(profile.link_h2d_gbps, profile.link_d2h_gbps or profile.link_h2d_gbps))
        if getattr(profile, "host_adamw_params_per_s", None):
            rates["host_adamw_params_per_s"] = float(profile.host_adamw_params_per_s)
        if getattr(profile, "matmul_bf16_tflops", None):
            rates["matmul_tflops"] = float(profile.matmul_bf16_tflops)
    return Budget(vram_bytes=int(vram_bytes), host_bytes=int(host_bytes), pinned_bytes=pinned,
                  device_bytes=device_total, headroom=headroom, source=f"{source}, {n} process(es)", **rates)
