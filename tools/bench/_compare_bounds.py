"""compare.py's lower bounds: the least a trainstream step can take on this host, from rates measured in the
same call as the engines.

bound = max(compute, dequantize, link, host):
  compute     forward + backward of a stock engine of the same call (bf16 weights resident, HF's default
              attention): the matmul and attention work every engine does at least once. Not measured
              (None) when no stock engine of STOCK_TIMED ran.
  dequantize  a quantized base's values / the measured dequantize rate of ts_quant on this GPU: the engine
              expands every frozen weight at least once per step (forward). A term of the max, never a sum
              with compute, since a fused kernel overlaps the two.
  link        bytes per step / the pinned link rate, forward and backward in turn, each bound by its busier
              direction (see link_seconds).
  host        host-placed trained values / the ts-adamw rate (fp32 moments).
A run whose median step falls below its bound shows the bound is wrong: the harness flags it, it is never
reported as a result.
"""

from __future__ import annotations

import time

import torch

LINK_GBPS = 55.0  # pinned host<->H200 each way (DESIGN.md); used only where no GPU measures it


def host_adamw_rate() -> float:
    """ts-adamw fp32-moment updates per second on this host (64 M values)."""
    import ts_adamw

    n = 64 << 20
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    out = torch.empty(n, dtype=torch.bfloat16)
    g16 = g.to(torch.bfloat16)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    ts_adamw.adamw_step(p, g16, m, v, step=1, param_out=out, **kw)
    start = time.perf_counter()
    for step in range(2, 7):
        ts_adamw.adamw_step(p, g16, m, v, step=step, param_out=out, **kw)
    return 5 * n / (time.perf_counter() - start)


def link_rate() -> float:
    """Pinned host->device bytes per second (1 GiB copies), LINK_GBPS without a GPU."""
    if not torch.cuda.is_available():
        return LINK_GBPS * 1e9
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * host.numel() / (time.perf_counter() - start)


def dequantize_rate(fmt: str = "nf4") -> float | None:
    """Values per second ts_quant expands from `fmt` to bf16 on this GPU (64 M values); None without one."""
    if not torch.cuda.is_available():
        return None
    import ts_quant

    weight = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    q = ts_quant.quantize(weight, fmt)
    weight_values = weight.numel()
    del weight
    q.dequantize()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        q.dequantize()
    torch.cuda.synchronize()
    return 10 * weight_values / (time.perf_counter() - start)


def activation_link_bytes(activations: dict | None, iterations: int) -> tuple[float, float]:
    """Saved-activation bytes paged per training iteration (device->host, host->device), from
    memory_report()["activations"]: its cumulative "paging" counters (d2h_bytes, h2d_bytes) over the
    `iterations` run, else (and for a tuned policy) block_bytes summed over offloaded_blocks, both ways.
    (0, 0) without either."""
    if not activations:
        return 0.0, 0.0
    paging = activations.get("paging") or {}
    # A tuned policy paged differently while it probed and tried: count the settled one.
    if iterations and isinstance(paging.get("d2h_bytes"), (int, float)) and "tuning" not in activations:
        return paging["d2h_bytes"] / iterations, (paging.get("h2d_bytes") or 0) / iterations
    blocks = activations.get("offloaded_blocks") or []
    per_block = activations.get("block_bytes")
    if isinstance(per_block, (int, float)):
        total = per_block * len(blocks)
    elif isinstance(per_block, (list, tuple)):
        total = sum(per_block[i] for i in blocks if isinstance(i, int) and 0 <= i < len(per_block))
    else:
        total = 0
    return float(total), float(total)


def lower_bound(r: dict, compute: tuple[str, float] | None, link: float, adamw_rate: float,
                dequant_rate: float | None = None) -> None:
    """Adds lower_bound_s and lower_bound_terms to a trainstream run's result (see the module docstring)."""
    placements = r.get("placements") or {}
    host_values = placements.get("host", {}).get("values", 0)
    mapped_values = placements.get("mapped", {}).get("values", 0)
    per_value = r.get("trainable_bytes_per_value") or 2
    paged_down, paged_up = activation_link_bytes(r.get("activations"), len(r.get("steps_s") or []))
    weights = r.get("weights") or {}
    streamed = weights.get("load_bytes") or 0
    # A full fine-tune's streamed trained weights come back in their blocks' fetches (load_bytes), not as uploads.
    fetched = (weights.get("streaming") or {}).get("trained_bytes") or 0
    down = host_values * per_value + mapped_values * 12  # gradients leave the GPU in backward
    up = host_values * per_value - fetched + mapped_values * 12 + streamed  # weights come back
    # Forward, then backward, each bound by its busier direction: in forward the pages leave (device to
    # host) while the streamed blocks come in (about half of them: a block is fetched for forward and again
    # for backward); in backward the gradients leave while the page-ins and the other half come in.
    link_s = (max(paged_down, streamed / 2) + max(down, up - streamed / 2 + paged_up)) / link
    down, up = down + paged_down, up + paged_up
    # The quantized base's values: bf16 bytes before quantizing / 2 (wrap()'s quantize report).
    quantized_values = (weights.get("bytes_before") or 0) / 2 if weights.get("quantize") else 0
    dequant_s = quantized_values / dequant_rate if quantized_values and dequant_rate else None
    terms = {"compute_fwd_bwd": compute[1] if compute else None, "compute_from": compute[0] if compute else None,
             "dequantize": dequant_s, "link": link_s, "host_adamw": host_values / adamw_rate,
             "link_bytes_down": down, "link_bytes_up": up}
    r["lower_bound_s"] = max(terms["compute_fwd_bwd"] or 0.0, dequant_s or 0.0, terms["link"], terms["host_adamw"])
    r["lower_bound_terms"] = terms
