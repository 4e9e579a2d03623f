"""A plain training loop: wrap() plus the chunked causal-LM loss (no [tokens, vocab] logits).

    python docs/examples/custom_loop.py --steps 20            # tiny built-in model, CPU or GPU
    python docs/examples/custom_loop.py --model Qwen/Qwen2.5-0.5B --seq 512
"""

from __future__ import annotations

import argparse

import torch
import trainstream
from _tiny import batches, load_model


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hub id (default: a tiny random decoder)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model, torch.bfloat16 if device == "cuda" else torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, optimizer = trainstream.wrap(model, optimizer, max_grad_norm=1.0)
    head = model.get_output_embeddings()
    for step, ids in enumerate(batches(args.steps, args.batch, args.seq), start=1):
        ids = ids.to(device)
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        loss = trainstream.causal_lm_loss(hidden, head.weight, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step:3d}  loss {loss.item():.4f}")
    for line in trainstream.memory_report(model)["events"]:
        print(line)
    return loss.item()


if __name__ == "__main__":
    main()
