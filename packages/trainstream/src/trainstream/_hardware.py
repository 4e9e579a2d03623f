"""profile_hardware(): ts-planner's machine probes plus the two rates training needs from trainstream's
own parts: host AdamW throughput (ts-adamw) and the GPU's bf16 matmul rate, cached beside the planner's."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

import torch
import ts_adamw
import ts_planner

__all__ = ["HardwareProfile", "profile_hardware"]


@dataclasses.dataclass(frozen=True)
class HardwareProfile(ts_planner.HardwareProfile):
    """ts-planner's ``HardwareProfile`` (link GB/s each way, host copy GB/s, cores, RAM, VRAM) plus
    ``host_adamw_params_per_s`` (fp32 master and moments, bf16 gradient and weight, on
    ``host_adamw_threads`` threads) and ``matmul_bf16_tflops`` (None without a GPU)."""

    host_adamw_params_per_s: float = 0.0
    host_adamw_threads: int = 0
    matmul_bf16_tflops: float | None = None

    def summary(self) -> str:
        matmul = "" if self.matmul_bf16_tflops is None else f"; bf16 matmul {self.matmul_bf16_tflops:.0f} TFLOP/s"
        return (f"{super().summary()}; host AdamW {self.host_adamw_params_per_s / 1e9:.2f} G params/s on "
                f"{self.host_adamw_threads} threads{matmul}")


def _adamw_rate(values: int, threads: int | None, repeats: int = 3) -> float:
    """Parameters per second of one host AdamW step, the best of `repeats` after a warm-up."""
    master = torch.randn(values)
    grad = torch.randn(values).to(torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros(values), torch.zeros(values)
    out = torch.empty(values, dtype=torch.bfloat16)
    best = float("inf")
    for step in range(1, repeats + 2):
        started = time.perf_counter()
        ts_adamw.adamw_step(master, grad, exp_avg, exp_avg_sq, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.0, step=step, param_out=out, threads=threads)
        if step > 1:
            best = min(best, time.perf_counter() - started)
    return values / best


def _matmul_tflops(device: torch.device, n: int, repeats: int = 5) -> float:
    with torch.cuda.device(device):
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        a @ b  # warm-up: kernel selection
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            a @ b
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / repeats
    return 2 * n**3 / seconds / 1e12


def _cache_file(base: ts_planner.HardwareProfile, quick: bool, threads: int | None) -> pathlib.Path:
    # ts-planner's cache folder: TRAINSTREAM_CACHE_DIR, else $XDG_CACHE_HOME/trainstream, else ~/.cache/trainstream
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = pathlib.Path(os.environ.get("TRAINSTREAM_CACHE_DIR") or (
        (pathlib.Path(xdg) if os.path.isabs(xdg) else pathlib.Path.home() / ".cache") / "trainstream"))
    parts = [base.gpu or "cpu", base.host_cores, base.host_ram_bytes >> 30, "q" if quick else "f", f"t{threads or 0}"]
    key = "".join(c if c.isalnum() or c in "-_" else "_" for c in "-".join(map(str, parts)))
    return root / f"trainstream-rates-{key}.json"


def profile_hardware(device: torch.device | int | str | None = None, quick: bool = True, force: bool = False,
                     threads: int | None = None) -> HardwareProfile:
    """Measures this machine, or loads the cached measurement (``force``: measure again).

    ``device``: the GPU to measure (default the current one). ``quick``: 64 MiB transfers, 4 M-value
    AdamW and 4096-square matmuls instead of 512 MiB, 32 M and 8192. ``threads``: host threads for
    the host copy and AdamW probes (None: the whole host pool). Cached in ``TRAINSTREAM_CACHE_DIR``
    (default ``$XDG_CACHE_HOME/trainstream``, else ``~/.cache/trainstream``) per GPU, cores, RAM, ``quick`` and
    ``threads``.
    """
    if device is not None and not isinstance(device, (int, str, torch.device)):
        raise ValueError(f"device={device!r} is not valid; use None, a GPU index, 'cuda:N' or a torch.device")
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type != "cuda":
        raise ValueError(f"device={str(device)!r} is not a GPU; profile_hardware measures a CUDA device "
                         f"(None: the current one, or none without CUDA)")
    base = ts_planner.profile_hardware(device, quick=quick, force=force, threads=threads)
    path = _cache_file(base, quick, threads)
    rates = None
    if path.exists() and not force:
        try:
            rates = json.loads(path.read_text())
            HardwareProfile(**dataclasses.asdict(base), **rates)  # a foreign or stale file fails here
        except (ValueError, TypeError):
            rates = None
    if rates is None:
        gpu = None
        if base.gpu is not None:
            gpu = torch.device("cuda", device) if isinstance(device, int) else (
                device if device is not None and device.index is not None
                else torch.device("cuda", torch.cuda.current_device()))
        rates = {
            "host_adamw_params_per_s": _adamw_rate((4 << 20) if quick else (32 << 20), threads),
            "host_adamw_threads": threads or ts_adamw.host_threads(),
            "matmul_bf16_tflops": None if gpu is None else _matmul_tflops(gpu, 4096 if quick else 8192),
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(rates, indent=1))
        except OSError:
            pass  # a read-only home: the profile still works, it is just not cached
    return HardwareProfile(**dataclasses.asdict(base), **rates)
