"""What a Python worker thread pays to re-take the GIL after each native call while another thread
runs Python (as the training loop does during forward). trainstream's host-update worker makes a few
such calls per parameter.

    python tools/bench/gil_handoff.py [--values 65536] [--seconds 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch
import ts_adamw


def _steps_per_second(busy: bool, values: int, seconds: float) -> float:
    p, g, m, v = (torch.randn(values) for _ in range(4))
    v.abs_()
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, threads=1)
    stop, count = threading.Event(), [0]

    def worker():
        while not stop.is_set():
            ts_adamw.adamw_step(p, g, m, v, **kw)  # releases the GIL inside, re-takes it after
            count[0] += 1

    thread = threading.Thread(target=worker)
    thread.start()
    end = time.perf_counter() + seconds
    spin = 0
    while time.perf_counter() < end:
        if busy:
            spin += 1  # Python bytecode holding the GIL
        else:
            time.sleep(0.01)
    stop.set()
    thread.join()
    return count[0] / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", type=int, default=1 << 16)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, switch interval {sys.getswitchinterval() * 1e3:.1f} ms")
    alone = _steps_per_second(False, args.values, args.seconds)
    busy = _steps_per_second(True, args.values, args.seconds)
    print("| worker thread | calls/s | µs per call |\n|---|---|---|")
    print(f"| alone | {alone:.0f} | {1e6 / alone:.0f} |")
    print(f"| beside a thread running Python | {busy:.0f} | {1e6 / busy:.0f} |")
    print(f"extra per call from the GIL handoff: {1e6 / busy - 1e6 / alone:.0f} µs")


if __name__ == "__main__":
    main()
