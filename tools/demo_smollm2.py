"""Fine-tune a SmolLM2-135M-shaped model with TrainStreamTrainer (LoRA, optimizer state in host RAM).

    python tools/demo_smollm2.py --smoke                  # seconds on a CPU: 2 of the 30 layers, 3 steps
    python tools/demo_smollm2.py --steps 50               # the full shape, random weights (no download)
    python tools/demo_smollm2.py --model ./SmolLM2-135M --quantize nf4   # a local checkpoint, NF4 base

Without ``--model`` the weights are random (SmolLM2-135M's published shape), so the loss only shows
that training runs; with a local folder (config.json + .safetensors, and a tokenizer if it has one)
the model is loaded by ``from_pretrained``, with ``--quantize`` through ``TrainStreamQuantConfig``
(block linears quantized as each tensor loads). The training text is the project's built-in text,
as bytes unless the folder has a tokenizer. Prints the loss of every step and the held-out loss
before and after.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json): a Llama with tied embeddings.
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, hidden_act="silu")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FORMATS = ("none", "int8", "nf4", "fp8", "nvfp4")


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local folder with config.json and .safetensors "
                                                       "(default: SmolLM2-135M's shape, random weights)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--batch", type=int, default=4, help="sequences a step (default 4)")
    parser.add_argument("--seq", type=int, default=256, help="tokens a sequence (default 256)")
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate (default 2e-3)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank; 0 trains every weight (default 16)")
    parser.add_argument("--quantize", choices=FORMATS, default="none",
                        help="store the frozen block linears in this format (LoRA only; default none)")
    parser.add_argument("--layers", type=int, default=None, help="keep only this many decoder layers")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a few seconds on a CPU: 2 layers, 3 steps of 2 x 32")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.steps, args.batch, args.seq = args.layers or 2, 3, 2, 32
        args.device = args.device or "cpu"
    for name in ("steps", "batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.rank < 0 or (args.layers is not None and args.layers < 1):
        parser.error("--rank must be >= 0 and --layers >= 1")
    if args.quantize != "none" and args.rank == 0:
        parser.error("--quantize stores frozen weights: train LoRA adapters (--rank > 0) with it")
    if args.model is not None and not os.path.isdir(args.model):
        parser.error(f"--model {args.model!r} is not a folder (give a local folder; this demo downloads nothing)")
    return args


def _load(args, dtype):
    """(model, tokenizer or None)."""
    from trainstream.integrations.huggingface import TrainStreamQuantConfig
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    quantization = {} if args.quantize == "none" else {"quantization_config": TrainStreamQuantConfig(args.quantize)}
    if args.model is None:
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, **overrides})).to(dtype)
        if not quantization:
            return model, None
        with tempfile.TemporaryDirectory() as folder:  # the from_pretrained path, as for a real checkpoint
            model.save_pretrained(folder)
            del model
            return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **quantization), None
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **quantization, **overrides)
    tokenizer = None
    if any(os.path.isfile(os.path.join(args.model, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    return model, tokenizer


def _token_ids(tokenizer, vocab: int) -> torch.Tensor:
    from trainstream._demo_text import DEMO_TEXT

    if tokenizer is None:  # bytes: ids 0..255, inside every vocabulary here
        ids = torch.frombuffer(bytearray(DEMO_TEXT.encode()), dtype=torch.uint8).long()
    else:
        ids = torch.tensor(tokenizer(DEMO_TEXT)["input_ids"], dtype=torch.long)
    if int(ids.max()) >= vocab:
        raise SystemExit(f"the text's ids reach {int(ids.max())} but the model has {vocab} tokens")
    return ids


class _Windows(torch.utils.data.Dataset):
    """Random windows of the training ids, the same every run for a seed."""

    def __init__(self, ids: torch.Tensor, count: int, seq: int, seed: int):
        if ids.numel() <= seq + 1:
            ids = ids.repeat((seq + 1) // ids.numel() + 2)
        starts = torch.randint(0, ids.numel() - seq, (count,), generator=torch.Generator().manual_seed(seed))
        self.rows = torch.stack([ids[s:s + seq] for s in starts.tolist()])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _held_out_loss(model, ids: torch.Tensor, seq: int, device) -> float:
    was = model.training
    model.eval()
    with torch.no_grad():
        window = ids[: seq * max(1, min(4, ids.numel() // seq))].view(-1, seq) if ids.numel() >= seq else ids[None]
        window = window.to(device)
        loss = model(input_ids=window, labels=window).loss.item()
    model.train(was)
    return loss


def main(argv=None) -> list[float]:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from trainstream.integrations.huggingface import TrainStreamTrainer
    from transformers import TrainerCallback, TrainingArguments

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bf16 = device.type == "cuda"
    started = time.perf_counter()
    model, tokenizer = _load(args, torch.float32)  # fp32 master weights; bf16 autocast on the GPU
    ids = _token_ids(tokenizer, model.config.vocab_size)
    split = ids.numel() * 9 // 10  # the last tenth is held out
    train_ids, held_out = ids[:split], ids[split:]
    if args.rank:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                           task_type="CAUSAL_LM", target_modules=LORA_TARGETS))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    source = args.model or "random SmolLM2-135M shape"
    print(f"demo_smollm2: {source}, {model.config.num_hidden_layers} layers, {trained / 1e6:.2f} M trained values"
          f"{f', LoRA r={args.rank}' if args.rank else ', full fine-tune'}, base {args.quantize}, {device}, "
          f"loaded in {time.perf_counter() - started:.1f} s", flush=True)
    model.to(device)
    before = _held_out_loss(model, held_out, min(args.seq, held_out.numel()), device)

    class _PrintLoss(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                print(f"step {state.global_step}/{args.steps} loss {logs['loss']:.4f}", flush=True)

    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                                     learning_rate=args.lr, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                                     report_to=[], bf16=bf16, use_cpu=device.type == "cpu", disable_tqdm=True,
                                     seed=args.seed, dataloader_num_workers=0)
        trainer = TrainStreamTrainer(model=model, args=training, callbacks=[_PrintLoss()],
                                     train_dataset=_Windows(train_ids, args.steps * args.batch, args.seq, args.seed))
        trainer.train()
    model._trainstream_session.synchronize()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    after = _held_out_loss(model, held_out, min(args.seq, held_out.numel()), device)
    print(f"held-out loss {before:.4f} -> {after:.4f} (perplexity {math.exp(before):.1f} -> {math.exp(after):.1f}); "
          f"{time.perf_counter() - started:.1f} s in all")
    return losses


if __name__ == "__main__":
    main()
