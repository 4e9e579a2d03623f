"""`trainstream`: fine-tune a built-in decoder through wrap(), with the plan first,
a progress bar, and the memory report at the end. Runs on a CPU-only machine too."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

__all__ = ["SIZES", "build_model", "main"]

# Random-init Qwen2-style decoders; the 0.5b and 1.5b rows use Qwen2.5's published shapes.
SIZES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=384, vocab_size=256),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1536, vocab_size=256),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
}


def build_model(size: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A random-init Qwen2 causal LM of one of SIZES (needs `transformers`)."""
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError:
        raise SystemExit("the demo model needs transformers: pip install 'trainstream[hf]'") from None
    torch.manual_seed(seed)
    config = Qwen2Config(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=size != "1.5b",
                         attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).to(dtype)


# argparse `type=` validators: a bad value becomes "argument --X: <message>", exit code 2, before any work.
def _number(convert, accept, valid: str):
    """An argparse type: `convert` the text, then `accept` the value, else the message names `valid`."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes {valid}, not {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {valid}, not {text}")
        return value

    return parse


_positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
_positive_float = _number(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
_seed = _number(int, lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)")


def _device(text: str) -> torch.device:
    kind, colon, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"takes cpu, cuda or cuda:N, not {text!r}")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text}: torch {torch.__version__} sees no GPU; use cpu")
        if colon and int(index) >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has cuda:0..cuda:{count - 1}")
    return torch.device(text)


def _json_path(text: str) -> str:
    """A file the run can write at the end, checked now without creating or truncating anything."""
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file path")
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):  # append: an existing file keeps its contents
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{text} cannot be written ({error.strerror})") from None
    if not existed:
        os.unlink(path)  # leave no stray file if the run fails before the end
    return path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="trainstream", description=__doc__)
    parser.add_argument("--size", choices=["auto", *SIZES], default="auto",
                        help="model size (auto: tiny on the CPU, small on a GPU)")
    parser.add_argument("--steps", type=_positive_int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--batch", type=_positive_int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=_positive_int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--lr", type=_positive_float, default=1e-3,
                        help="AdamW learning rate, > 0 (default 1e-3)")
    parser.add_argument("--device", type=_device, default=None,
                        help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--vram-gb", type=_positive_float, default=None,
                        help="cap this process's VRAM, in GB (> 0)")
    parser.add_argument("--optimizer-mode", choices=["cpu", "gpu", "auto"], default="cpu")
    parser.add_argument("--offload", choices=["auto", "on"], default="on",
                        help="on: keep the optimizer in host memory; auto: move it to VRAM if it fits")
    parser.add_argument("--moment-dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--max-grad-norm", type=_positive_float, default=None,
                        help="clip the gradient norm to this (> 0; default: no clipping)")
    parser.add_argument("--seed", type=_seed, default=0, help="integer in [0, 2**32) (default 0)")
    parser.add_argument("--json", type=_json_path, default=None,
                        help="write the step times, losses and report here (checked before training)")
    return parser.parse_args(argv)


def _progress(step: int, total: int, loss: float, seconds: float) -> None:
    width = 28
    done = int(width * step / total)
    bar = "=" * done + (">" if done < width else "") + " " * (width - done - 1)
    sys.stderr.write(f"\rstep {step:4d}/{total} [{bar}] loss {loss:7.4f}  {seconds * 1000:8.1f} ms/step")
    if step == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    import trainstream
    from trainstream._demo_text import byte_batches

    args = _parse(argv)
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size if args.size != "auto" else ("small" if device.type == "cuda" else "tiny")
    if SIZES[size]["vocab_size"] != 256:
        print(f"note: {size} has a {SIZES[size]['vocab_size']}-token vocabulary; the built-in text uses ids 0..255")
    if args.vram_gb is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_gb * 1e9 / total), device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(size, dtype, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    print(f"trainstream demo: {size} decoder, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters "
          f"({str(dtype).removeprefix('torch.')}), {args.steps} steps of {args.batch} x {args.seq} tokens on {device}")
    model, optimizer = trainstream.wrap(
        model, optimizer, device=device, optimizer_mode=args.optimizer_mode,
        offload="auto" if args.offload == "auto" else True, moment_dtype=args.moment_dtype,
        max_grad_norm=args.max_grad_norm, seed=args.seed, verbose=True)
    session = model._trainstream_session
    seen = len(session.events)
    losses, times = [], []
    for step, batch in enumerate(byte_batches(args.batch, args.seq, args.steps, args.seed), start=1):
        started = time.perf_counter()
        ids = batch.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.item()  # also waits for this step's GPU work
        times.append(time.perf_counter() - started)
        losses.append(value)
        _progress(step, args.steps, value, times[-1])
        if len(session.events) > seen:  # a decision was printed mid-run: start a fresh progress line
            sys.stderr.write("\n")
            seen = len(session.events)
    session.synchronize()
    report = trainstream.memory_report(model)
    steady = sorted(times[2:] or times)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; median step {steady[len(steady) // 2] * 1000:.1f} ms")
    print("memory report:")
    print(json.dumps({k: v for k, v in report.items() if k != "events"}, indent=2, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"losses": losses, "step_seconds": times, "report": report}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
