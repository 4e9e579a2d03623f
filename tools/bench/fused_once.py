"""Runs the Hopper fused NF4 linear a few times at the issue's shape, for a profiler to attach to.

    ncu --clock-control none -k regex:fused_linear --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python tools/bench/fused_once.py [--m 512]
"""

import argparse

import torch
import ts_quant

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--m", type=int, default=512)
parser.add_argument("--format", default="nf4")
args = parser.parse_args()
q = ts_quant.quantize(torch.randn(13824, 5120, device="cuda"), args.format)
x = torch.randn(args.m, 5120, device="cuda", dtype=torch.bfloat16)
assert ts_quant.linear_path(x, q) == "fused_sm90", ts_quant.linear_path(x, q)
for _ in range(6):
    ts_quant.quantized_linear(x, q)
torch.cuda.synchronize()
print("ok")
