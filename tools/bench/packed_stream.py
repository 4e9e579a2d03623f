"""One streamed block's fetch, plain against exponent-packed (ts_quant.pack_bf16; trainstream's
stream_packing): the host-to-device copy of a Qwen2.5-shaped block's bf16 projections from
page-locked memory, and for the packed form the copy of its packed bytes plus the decoding on the
GPU, timed with CUDA events on one stream (medians of --repeats). Also the CPU's packing rate.

    python tools/bench/packed_stream.py                 # Qwen2.5-14B block (5120 / 13824, 8 KV heads)
    python tools/bench/packed_stream.py --hidden 1536 --intermediate 8960 --kv 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import ts_quant


def _block(hidden: int, intermediate: int, kv: int, std: float) -> list[torch.Tensor]:
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
              (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=gen) * std).bfloat16() for s in shapes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--intermediate", type=int, default=13824)
    ap.add_argument("--kv", type=int, default=1024, help="rows of k_proj / v_proj (KV heads x head dim)")
    ap.add_argument("--std", type=float, default=0.02, help="the weights' standard deviation (HF's init: 0.02)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    weights = _block(args.hidden, args.intermediate, args.kv, args.std)
    plain_bytes = sum(w.numel() * 2 for w in weights)
    started = time.perf_counter()
    plans = [ts_quant.plan_bf16_packing(w) for w in weights]
    segments = [torch.empty(p.nbytes, dtype=torch.uint8) for p in plans]
    for w, p, s in zip(weights, plans, segments):
        ts_quant.pack_bf16(w, p, s)
    pack_s = time.perf_counter() - started
    packed_bytes = sum(p.nbytes for p in plans)
    print(f"block: {plain_bytes / 2**20:.1f} MiB bf16, packed {packed_bytes / 2**20:.1f} MiB "
          f"({packed_bytes / plain_bytes:.4f}), escapes {sum(p.escapes for p in plans)}; "
          f"packing on {torch.get_num_threads()} threads: {pack_s:.3f} s ({plain_bytes / pack_s / 1e9:.2f} GB/s)")
    if not torch.cuda.is_available():
        print("no CUDA device: the copies are not timed")
        return
    host_plain = torch.empty(plain_bytes, dtype=torch.uint8).pin_memory()
    offsets, at = [], 0
    for w in weights:
        host_plain[at:at + w.numel() * 2].copy_(w.view(-1).view(torch.uint8))
        offsets.append(at)
        at += w.numel() * 2
    host_packed = [s.pin_memory() for s in segments]
    device_plain = torch.empty(plain_bytes, dtype=torch.uint8, device="cuda")
    staging = [torch.empty(s.numel(), dtype=torch.uint8, device="cuda") for s in segments]

    def plain_fetch():
        device_plain.copy_(host_plain, non_blocking=True)

    def packed_fetch(decode=True):
        for h, d in zip(host_packed, staging):
            d.copy_(h, non_blocking=True)
        if decode:
            for d, p, w, o in zip(staging, plans, weights, offsets):
                ts_quant.unpack_bf16(d, p, device_plain[o:o + w.numel() * 2].view(torch.bfloat16))

    def timed(fn) -> float:
        times = []
        for _ in range(args.repeats + 2):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        return statistics.median(times[2:])

    t_plain = timed(plain_fetch)
    t_copy = timed(lambda: packed_fetch(decode=False))
    t_packed = timed(packed_fetch)
    exact = all(torch.equal(device_plain[o:o + w.numel() * 2].view(torch.bfloat16).view(w.shape).cpu(), w)
                for w, o in zip(weights, offsets))
    print(f"{torch.cuda.get_device_name()}: plain fetch {t_plain * 1e3:.2f} ms ({plain_bytes / t_plain / 1e9:.1f} GB/s); "
          f"packed copy {t_copy * 1e3:.2f} ms, copy + decode {t_packed * 1e3:.2f} ms "
          f"({plain_bytes / t_packed / 1e9:.1f} GB/s of bf16 delivered, {t_plain / t_packed:.2f}x); bit-exact: {exact}")


if __name__ == "__main__":
    main()
