"""CPU benchmark of per-tensor host overhead (issue 13), for CI to watch: a model with 672 small
trainable tensors (the LoRA count of a 48-block Qwen2.5-14B: 7 projections x A and B x 48 blocks),
trained by stock torch.optim.AdamW and by trainstream.wrap() in one run; median step times.

The arithmetic is tiny on purpose: what is measured is the cost per tensor and per step of hooks,
copies and optimizer calls, which is what made the 14B LoRA step host-bound on the H200.

    python tools/bench/host_overhead.py                 # 48 blocks, 672 trainable tensors
    python tools/bench/host_overhead.py --blocks 4 --steps 5     # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

PROJECTIONS = 7  # q, k, v, o, gate, up, down
RANK = 4


class AdaptedLinear(nn.Module):
    """A frozen linear plus a trainable low-rank pair (B A), as PEFT's LoRA adds it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(RANK, width) / width**0.5)
        self.lora_b = nn.Parameter(torch.zeros(width, RANK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.projections = nn.ModuleList(AdaptedLinear(width) for _ in range(PROJECTIONS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for p in self.projections:
            x = x + torch.tanh(p(x))
        return x


class Model(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def build(blocks: int, width: int, seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model(blocks, width)


def run(model: nn.Module, opt, steps: int, batch: torch.Tensor, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        session = getattr(model, "_trainstream_session", None)
        if session is not None:
            session.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import trainstream

    batch = torch.randn(args.rows, args.width, generator=torch.Generator().manual_seed(1))
    stock = build(args.blocks, args.width)
    tensors = sum(p.requires_grad for p in stock.parameters())
    print(f"{args.blocks} blocks x {PROJECTIONS} projections: {tensors} trainable tensors "
          f"({sum(p.numel() for p in stock.parameters() if p.requires_grad)} values), x {args.rows}x{args.width}, "
          f"{torch.get_num_threads()} torch threads, median of {args.steps} steps after {args.warmup}")
    stock_opt = torch.optim.AdamW([p for p in stock.parameters() if p.requires_grad], lr=1e-3)
    stock_times = run(stock, stock_opt, args.steps, batch, args.warmup)

    wrapped = build(args.blocks, args.width)
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3)
    wrapped, opt = trainstream.wrap(wrapped, opt, device="cpu")
    ours = run(wrapped, opt, args.steps, batch, args.warmup)
    steps = args.warmup + args.steps
    launches = wrapped._trainstream_session.engine.d2h_launches
    calls = trainstream.memory_report(wrapped)["optimizer"]["host_calls"]

    s, o = statistics.median(stock_times), statistics.median(ours)
    print(f"{'stock torch.optim.AdamW':28s} {s * 1e3:9.2f} ms/step")
    print(f"{'trainstream.wrap':28s} {o * 1e3:9.2f} ms/step   ({o / s:.2f}x stock, "
          f"{(o - s) / tensors * 1e6:+.1f} us per trainable tensor)")
    # Issue 13: host work per step grows with the buckets (blocks), not with the tensors.
    print(f"host work per step: {launches / steps:g} gradient D2H launches, {calls / steps:g} host AdamW calls "
          f"for {tensors} trained tensors")


if __name__ == "__main__":
    main()
