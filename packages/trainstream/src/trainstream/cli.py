"""`trainstream`: fine-tune a built-in decoder through wrap(), with the plan first,
a progress bar, and the memory report at the end. Runs on a CPU-only machine too.

`trainstream plan MODEL`: what a training run of MODEL needs and the plan that fits, from its
config alone (see `trainstream plan --help`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

__all__ = ["PLAN_SIZES", "SIZES", "build_model", "main", "plan_main"]

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
    parser = argparse.ArgumentParser(prog="trainstream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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


# ---- `trainstream plan`: the memory plan from a config alone -------------------------------------------

# Qwen2.5's published shapes (tied embeddings up to 3B), and the demo's small decoders.
PLAN_SIZES = {
    "tiny": dict(SIZES["tiny"], tie_word_embeddings=True),
    "small": dict(SIZES["small"], tie_word_embeddings=True),
    "0.5b": dict(SIZES["0.5b"], tie_word_embeddings=True),
    "1.5b": dict(SIZES["1.5b"], tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
}
PLAN_EXIT_REFUSED = 3
_non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")


def _plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainstream plan", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="What one training step of MODEL needs (VRAM, host RAM, page-locked RAM, by category) and "
                    "the plan that fits: quantization, streamed blocks, activations kept / paged / recomputed, "
                    "optimizer placement and moment precision. Reads the config only, never the weights.",
        epilog="Exit code 0 when a plan fits, 3 when none does, 2 for a bad argument.")
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="a Hugging Face Hub id, a folder holding config.json, or a config .json file")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", dest="model_id", metavar="HUB_ID", help="a Hugging Face Hub id (config only)")
    source.add_argument("--config", metavar="PATH", help="a config.json file, or a folder holding one")
    source.add_argument("--size", choices=list(PLAN_SIZES), help="a built-in shape (Qwen2.5's published ones)")
    parser.add_argument("--batch", type=_positive_int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--seq", type=_positive_int, default=2048, help="tokens per sequence (default 2048)")
    train = parser.add_mutually_exclusive_group()
    train.add_argument("--lora-rank", "--lora", dest="lora_rank", type=_positive_int, default=None, metavar="R",
                       help="train LoRA adapters of rank R on the seven projections (base frozen)")
    train.add_argument("--full", action="store_true", help="full fine-tune (the default)")
    parser.add_argument("--quantize", choices=["auto", "none", "int8", "nf4", "fp8", "nvfp4"], default="auto",
                        help="frozen block weights (auto: only when nothing else fits; LoRA only)")
    parser.add_argument("--prefer", choices=["exact", "speed"], default="exact",
                        help="speed: quantize before streaming any block from host RAM")
    parser.add_argument("--optimizer", choices=["auto", "host", "gpu"], default="auto",
                        help="where AdamW's state lives (default: the GPU when it fits)")
    parser.add_argument("--moment-dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--streamed-blocks", type=_non_negative_int, default=None, metavar="N",
                        help="blocks whose weights stream from host RAM (default: the fewest that fit)")
    parser.add_argument("--loss-chunk", type=_positive_int, default=None, metavar="TOKENS",
                        help="tokens per chunk of trainstream's chunked loss (default: full logits, as HF)")
    parser.add_argument("--vram-gb", type=_positive_float, default=None,
                        help="GPU memory to plan for, GB (default: this GPU, its per-process fraction applied)")
    parser.add_argument("--host-gb", "--ram-gb", dest="host_gb", type=_positive_float, default=None,
                        help="host RAM to plan for, GB (default: this machine's available RAM, cgroup-bounded, "
                             "split between LOCAL_WORLD_SIZE processes)")
    parser.add_argument("--measure", action="store_true",
                        help="price the plan with this machine's measured rates (trainstream.profile_hardware, "
                             "cached) instead of the defaults")
    parser.add_argument("--json", dest="as_json", action="store_true", help="print one JSON object")
    return parser


def _plan_shape(args, parser):
    """The ModelShape named by the arguments, from a config only; a parser error when it cannot be had."""
    import ts_planner

    given = [x for x in (args.model, args.model_id, args.config, args.size) if x is not None]
    if len(given) != 1:
        parser.error("name one model: MODEL, --model HUB_ID, --config PATH or --size "
                     f"{{{','.join(PLAN_SIZES)}}}" + (" (not several)" if given else ""))
    if args.size is not None:
        return ts_planner.ModelShape.from_config({**PLAN_SIZES[args.size], "model_type": "qwen2"}), args.size
    path = args.config or args.model or args.model_id
    try:
        if args.config is not None or os.path.exists(path):
            return ts_planner.ModelShape.from_config(path), path
        try:
            from transformers import AutoConfig
        except ImportError:
            parser.error(f"{path} is not a local file or folder, and a Hub id needs transformers: "
                         "pip install 'trainstream[hf]'")
        try:
            config = AutoConfig.from_pretrained(path)  # config.json only: no weights are read
        except (OSError, ValueError) as error:
            parser.error(f"cannot load the config of {path!r}: {str(error).splitlines()[0]}")
        return ts_planner.ModelShape.from_config(config), path
    except ValueError as error:
        parser.error(str(error))


def plan_main(argv: list[str] | None = None) -> int:
    """`trainstream plan`: prints the plan (or with --json one object); 0 when it fits, 3 when nothing does."""
    import ts_planner

    parser = _plan_parser()
    args = parser.parse_args(argv)
    shape, name = _plan_shape(args, parser)
    profile = None
    if args.measure:
        import trainstream

        profile = trainstream.profile_hardware()
    try:
        budget = ts_planner.machine_budget(
            vram_bytes=None if args.vram_gb is None else int(args.vram_gb * 1e9),
            host_bytes=None if args.host_gb is None else int(args.host_gb * 1e9), profile=profile)
    except RuntimeError as error:  # no GPU here and no --vram-gb
        parser.error(f"{error}; pass --vram-gb")
    lora = args.lora_rank is not None
    try:
        plan = ts_planner.plan_memory(
            shape, budget, batch=args.batch, seq=args.seq, train="lora" if lora else "full",
            lora_rank=args.lora_rank or 16, quantize=args.quantize,
            optimizer=args.optimizer, moment_dtype=args.moment_dtype, loss_chunk=args.loss_chunk,
            streamed_blocks="auto" if args.streamed_blocks is None else args.streamed_blocks, prefer=args.prefer)
    except ValueError as error:  # a combination the planner refuses (--quantize nf4 with --full, too many blocks)
        parser.error(str(error))
    rates = "measured rates" if profile is not None else "default rates (--measure for this machine's)"
    if args.as_json:
        print(json.dumps({"model": name, **plan.to_dict(), "rates": rates}, indent=1))
    else:
        print(f"trainstream plan: {name}; budget: {budget.vram_bytes / 1e9:.1f} GB VRAM, {budget.host_bytes / 1e9:.1f} GB "
              f"host RAM ({budget.source}); {rates}")
        print(plan.explain())
    return 0 if plan.fits else PLAN_EXIT_REFUSED


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

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
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
