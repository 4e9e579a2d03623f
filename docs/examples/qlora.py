"""LoRA on a quantized base: the checkpoint streamed through load_model (block weights quantized as they
are read), PEFT adapters on top, then wrap().

    python docs/examples/qlora.py --steps 10                 # tiny built-in model, saved and re-read
    python docs/examples/qlora.py --model Qwen/Qwen2.5-0.5B --quantize nf4
"""

from __future__ import annotations

import argparse
import tempfile

import peft
import torch
import trainstream
from _tiny import batches
from trainstream.integrations.huggingface import load_model, wrap_hf
from ts_quant import QuantLinear


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hub id or local folder (default: the tiny built-in model)")
    parser.add_argument("--quantize", default="nf4", choices=["auto", "none", "int8", "nf4", "fp8", "nvfp4"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as folder:
        path = args.model
        if path is None:  # a checkpoint on disk to stream from
            from trainstream.cli import build_model

            build_model("tiny", torch.float32).save_pretrained(folder)
            path = folder
        model = load_model(path, quantize=args.quantize, dtype=dtype)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    print(f"base: {model.trainstream_quantize or 'not quantized'}, {len(layers)} quantized layers, "
          f"{sum(m.qweight.nbytes for m in layers) / 2**20:.1f} MiB of codes and scales")
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, task_type="CAUSAL_LM",
                                                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = wrap_hf(model, torch.optim.AdamW(trainable, lr=1e-2), device=device)
    model.train()
    losses = []
    for ids in batches(args.steps, args.batch, args.seq):
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"loss {losses[-1]:.4f}")
    trainstream.unwrap(model)
    return losses


if __name__ == "__main__":
    main()
