"""Built-in training text for the demo run: a few paragraphs written for this
project, read as bytes, so the default run needs no download and no tokenizer."""

from __future__ import annotations

import torch

__all__ = ["DEMO_TEXT", "byte_batches"]

DEMO_TEXT = """\
A training step has three parts that compete for the same small pool of fast memory: the weights,
the activations saved for the backward pass, and the optimizer state. Adam keeps two running moments
for every trained value and, in mixed precision, a full-precision master copy as well, so the state
is several times larger than the model it trains. Host memory is larger and cheaper. The link between
the two is slower, but it runs in both directions at once and it can work while the GPU computes.

So the plan is simple. As soon as the backward pass has finished with a gradient, it leaves the GPU
on its own copy stream. The host applies the update with every core it has while the backward pass
moves on to earlier layers. The new weight travels back on another stream, and the next forward pass
waits for exactly the weights it is about to read, never for the whole model at once.

Every one of these choices depends on the machine: how much memory the card has left after the first
step, how fast the link is, how many cores the host brings. The library measures them instead of
guessing, writes down what it decided and why, and changes its mind once when the first step shows
that there is room to spare. A plan that cannot fit is refused before training starts, with numbers.

Long sequences, quantized frozen weights, adapters and preference losses all build on the same idea:
keep in fast memory only what the next kernel reads, and keep the link busy with what comes after.
"""


def byte_batches(batch: int, seq: int, steps: int, seed: int = 0):
    """Yields `steps` batches of `batch` x `seq` byte ids (0..255) cut at random offsets."""
    data = torch.frombuffer(bytearray(DEMO_TEXT.encode()), dtype=torch.uint8).long()
    if data.numel() <= seq + 1:
        repeats = (seq + 1) // data.numel() + 2
        data = data.repeat(repeats)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
        yield torch.stack([data[s : s + seq] for s in starts.tolist()])
