"""HardwareProfile: measured rates and sizes of this machine, cached on disk."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import resource

import torch

from . import _core

__all__ = ["HardwareProfile", "measure_host_bandwidth", "measure_link", "profile_hardware"]

CACHE_ENV = "TRAINSTREAM_CACHE_DIR"


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """What one machine measured. Rates in GB/s (1e9 bytes per second), sizes in bytes.

    ``link_*`` are None without a GPU. ``host_copy_gbps`` counts bytes read plus written. ``host_cores`` is the
    host pool's size (physical cores this process may use: affinity and cgroup CPU quota); ``host_ram_bytes`` and
    ``host_available_bytes`` are bounded by the cgroup memory limit where one is set, and
    ``host_memory_source`` says what bounds the available bytes ("meminfo", "cgroup v1", "cgroup v2").
    """

    gpu: str | None
    vram_bytes: int
    host_cores: int
    host_ram_bytes: int
    host_available_bytes: int
    memlock_limit: int | None
    host_copy_gbps: float
    link_h2d_gbps: float | None
    link_d2h_gbps: float | None
    link_both_gbps: float | None
    host_memory_source: str = "meminfo"

    def summary(self) -> str:
        link = ("no host-GPU link" if self.link_h2d_gbps is None else
                f"link {self.link_h2d_gbps:.1f} GB/s host->GPU, {self.link_d2h_gbps:.1f} GB/s GPU->host, "
                f"{self.link_both_gbps:.1f} GB/s both at once")
        gpu = f"{self.gpu} ({self.vram_bytes / 2**30:.1f} GiB)" if self.gpu else "no GPU"
        limit = "" if self.host_memory_source == "meminfo" else f", {self.host_memory_source} limit"
        return (f"{gpu}; {self.host_cores} host cores, {self.host_ram_bytes / 2**30:.1f} GiB RAM "
                f"({self.host_available_bytes / 2**30:.1f} available{limit}), host copy {self.host_copy_gbps:.1f} GB/s; {link}")


def _check_threads(threads) -> None:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
                                or threads > _core.max_host_threads()):
        raise ValueError(f"threads={threads!r} is not valid; use None (the whole host pool) or an integer from 1 "
                         f"to {_core.max_host_threads()} (4 x the {_core.usable_cores()} cores this process may use)")


def measure_host_bandwidth(bytes: int = 256 << 20, threads: int | None = None, repeats: int = 3) -> float:
    """Host memory copy rate in GB/s (bytes read + written) with the host pool's threads."""
    _check_threads(threads)
    return _core.host_copy_gbps(int(bytes), threads or 0, int(repeats))


def measure_link(device: torch.device | int | None = None, bytes: int = 256 << 20, repeats: int = 3) -> dict:
    """Pinned host<->GPU copy rates in GB/s: ``h2d_gbps``, ``d2h_gbps``, ``both_gbps``."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_link needs a CUDA device")
    index = torch.device("cuda", device).index if isinstance(device, int) else torch.device(
        device or f"cuda:{torch.cuda.current_device()}").index
    return _core.link_gbps(int(bytes), index if index is not None else torch.cuda.current_device(), int(repeats))


def _cache_root() -> pathlib.Path:
    """TRAINSTREAM_CACHE_DIR, else ``$XDG_CACHE_HOME/trainstream`` (where it is an absolute path, as the XDG
    base directory spec says), else ``~/.cache/trainstream``."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (pathlib.Path(xdg) if os.path.isabs(xdg) else pathlib.Path.home() / ".cache") / "trainstream"


def _cache_path(key: str) -> pathlib.Path:
    return _cache_root() / f"hardware-{key}.json"


def profile_hardware(device: torch.device | int | None = None, quick: bool = True, force: bool = False,
                     threads: int | None = None) -> HardwareProfile:
    """Measures this machine (or loads the cached measurement; ``force`` re-measures).

    ``quick`` uses 64 MiB transfers instead of 512 MiB; ``threads`` caps the host threads of the
    host copy probe (None: the whole host pool). The cache lives in TRAINSTREAM_CACHE_DIR (default
    ``$XDG_CACHE_HOME/trainstream``, else ``~/.cache/trainstream``), keyed by GPU, core count, RAM size, ``quick``
    and ``threads``.
    """
    _check_threads(threads)  # before anything is measured or read
    info = _core.host_memory()
    gpu, vram = None, 0
    if torch.cuda.is_available():
        index = torch.device(device if not isinstance(device, int) else f"cuda:{device}").index \
            if device is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        gpu, vram = props.name, props.total_memory
    cores = _core.host_threads()
    parts = [gpu or "cpu", cores, info["total"] >> 30, "q" if quick else "f"] + ([f"t{threads}"] if threads else [])
    key = "-".join(str(x) for x in parts)
    key = "".join(c if c.isalnum() or c in "-_" else "_" for c in key)
    path = _cache_path(key)
    if path.exists() and not force:
        try:
            return HardwareProfile(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass  # a stale or foreign file: measure again
    size = (64 << 20) if quick else (512 << 20)
    link = measure_link(device, size) if gpu else {"h2d_gbps": None, "d2h_gbps": None, "both_gbps": None}
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    profile = HardwareProfile(
        gpu=gpu, vram_bytes=vram, host_cores=cores, host_ram_bytes=info["total"],
        host_available_bytes=info["available"], host_memory_source=info["source"],
        memlock_limit=None if soft == resource.RLIM_INFINITY else int(soft),
        host_copy_gbps=measure_host_bandwidth(size, threads),
        link_h2d_gbps=link["h2d_gbps"], link_d2h_gbps=link["d2h_gbps"], link_both_gbps=link["both_gbps"],
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(profile), indent=1))
    except OSError:
        pass  # a read-only home: the profile still works, it is just not cached
    return profile
