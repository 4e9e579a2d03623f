"""Host cost per call of ts_quant.quantized_linear against F.linear (issue 13: at most 15 us a call).

A chain of `--layers` linears of one small square weight (so the GPU keeps up and wall time is host
time), forward and then backward through the whole chain; per layer: host microseconds of the forward
and of the backward, for F.linear with a frozen bf16 weight, quantized_linear with its per-weight
plans (cache=True, the default) and without them (cache=False: every check and choice per call, the
code before the plans). The input requires grad, as in LoRA training.

    python tools/bench/quant_overhead.py                 # CUDA when there is a GPU, else the CPU
    python tools/bench/quant_overhead.py --device cpu --format nf4 --size 512 --rows 8
    python tools/bench/quant_overhead.py --device cpu --python-only --size 64 --rows 2

--python-only (CPU): the native decode calls return at once, so what is left is the Python-side
cost of a call (checks, plan lookup, autograd.Function, allocation) beside F.linear's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
import ts_quant


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chain(fn, x: torch.Tensor, layers: int, device: torch.device) -> tuple[float, float]:
    """(forward us a layer, backward us a layer): wall time with the GPU idle at both ends."""
    _sync(device)
    t0 = time.perf_counter()
    y = x
    for _ in range(layers):
        y = fn(y)
    t1 = time.perf_counter()
    loss = y.float().sum()
    _sync(device)
    t2 = time.perf_counter()
    loss.backward()
    _sync(device)
    t3 = time.perf_counter()
    return (t1 - t0) / layers * 1e6, (t3 - t2) / layers * 1e6


def measure(fn, x: torch.Tensor, layers: int, repeats: int, device: torch.device) -> tuple[float, float]:
    for _ in range(3):  # warm-up: plans, allocator, kernels' first launch
        _chain(fn, x.detach().requires_grad_(True), layers, device)
    runs = [_chain(fn, x.detach().requires_grad_(True), layers, device) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--format", default="nf4", choices=ts_quant.FORMATS)
    parser.add_argument("--size", type=int, default=512, help="in = out features (a multiple of 128)")
    parser.add_argument("--rows", type=int, default=8, help="rows of x")
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    parser.add_argument("--python-only", action="store_true", help="CPU: stub the native decode (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    w = (torch.randn(args.size, args.size, device=device) / args.size**0.5).to(dtype)
    q = ts_quant.quantize(w, args.format)
    wd = q.dequantize(dtype)  # F.linear multiplies the same decoded weight
    x = torch.randn(args.rows, args.size, device=device, dtype=dtype)
    path = ts_quant.linear_path(x, q)
    if args.python_only:
        if device.type != "cpu":
            parser.error("--python-only is for CPU runs")
        core = ts_quant._core

        class Stubbed:  # the real module for everything but the two decode entry points
            def __getattr__(self, name):
                return getattr(core, name)

            @staticmethod
            def dequantize(*args):
                return None

            @staticmethod
            def dequantize_at(*args):
                return None

        ts_quant._native._core = ts_quant._plan._core = Stubbed()
        path += " (native decode stubbed)"
    print(f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"format={args.format}, W {args.size}x{args.size}, x {args.rows}x{args.size} bf16, path={path}, "
          f"{args.layers} layers, median of {args.repeats}")
    rows = [("F.linear (bf16 weight)", lambda y: F.linear(y, wd))]
    rows.append(("quantized_linear cache=True", lambda y: ts_quant.quantized_linear(y, q)))
    rows.append(("quantized_linear cache=False", None))
    results = {}
    for name, fn in rows:
        cache = name.endswith("cache=False")
        if name.startswith("quantized"):
            ts_quant.configure_linear(cache=not cache)
            fn = fn or (lambda y: ts_quant.quantized_linear(y, q))
        results[name] = measure(fn, x, args.layers, args.repeats, device)
    ts_quant.configure_linear(cache=True)
    ref_f, ref_b = results["F.linear (bf16 weight)"]
    print(f"{'host us per call':32s} {'forward':>9s} {'backward':>9s} {'fwd / F.linear':>15s} {'bwd / F.linear':>15s}")
    for name, (f, b) in results.items():
        print(f"{name:32s} {f:9.1f} {b:9.1f} {f / ref_f:15.2f} {b / ref_b:15.2f}")
    f, b = results["quantized_linear cache=True"]
    print(f"target (issue 13): at most 15 us a call: forward {'met' if f <= 15 else 'NOT met'} ({f:.1f} us), "
          f"backward {'met' if b <= 15 else 'NOT met'} ({b:.1f} us)")


if __name__ == "__main__":
    main()
