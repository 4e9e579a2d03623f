"""`trainstream plan MODEL`: what a training run of MODEL needs and the plan that fits, from its config alone
(`trainstream plan --help`). `trainstream.cli` runs it and re-exports its names."""

from __future__ import annotations

import argparse
import json
import os

from ._cli_common import SIZE_HELP, SIZES, non_negative_int, number, positive_int, size_in_gib
from ._units import fmt_bytes

__all__ = ["PLAN_EXIT_REFUSED", "PLAN_SIZES", "plan_main", "plan_parser"]

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


def _param_offload(text: str):
    """--param-offload: "auto", a fraction in [0, 1] (with a decimal point), or a count of blocks."""
    if text == "auto":
        return "auto"
    if "." in text:
        value = number(float, lambda v: 0.0 <= v <= 1.0, "a fraction in [0, 1]")(text)
        return ("fraction", value)
    return non_negative_int(text)


def plan_parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--seq", type=positive_int, default=2048, help="tokens per sequence (default 2048)")
    train = parser.add_mutually_exclusive_group()
    train.add_argument("--lora-rank", "--lora", dest="lora_rank", type=positive_int, default=None, metavar="R",
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
    parser.add_argument("--streamed-blocks", dest="param_offload", type=non_negative_int, help=argparse.SUPPRESS)
    parser.add_argument("--loss-chunk-size", "--loss-chunk", dest="loss_chunk", type=positive_int, default=None,
                        metavar="TOKENS", help="as TrainStreamTrainer's loss_chunk_size: tokens per chunk of the "
                                               "chunked loss (default: full logits, as Hugging Face computes them)")
    parser.add_argument("--vram-gb", dest="vram_bytes", type=size_in_gib, default=None, metavar="SIZE",
                        help=f"GPU memory to plan for, in {SIZE_HELP}; default: this GPU, its per-process "
                             "fraction applied")
    parser.add_argument("--host-gb", "--ram-gb", dest="host_bytes", type=size_in_gib, default=None, metavar="SIZE",
                        help=f"host RAM to plan for, in {SIZE_HELP}; default: this machine's available RAM, "
                             "cgroup-bounded, split between LOCAL_WORLD_SIZE processes")
    parser.add_argument("--world-size", type=positive_int, default=1, metavar="N",
                        help="data-parallel ranks in all: each holds the host optimizer state of the tensors it owns")
    parser.add_argument("--local-ranks", type=positive_int, default=None, metavar="N",
                        help="plan one of N data-parallel processes on this machine: each gets 1/N of its RAM "
                             "(unless --host-gb) and 1/N of the streamed frozen weights' one shared copy "
                             "(default: LOCAL_WORLD_SIZE, else 1)")
    parser.add_argument("--fsdp", action="store_true",
                        help="the model is sharded by FSDP2 (fully_shard) over the --world-size ranks: each holds 1/N "
                             "of every weight, gradient and optimizer state by element, gathers a block to run it, "
                             "and the network carries the all-gathers and the reduce-scatter")
    parser.add_argument("--nvme-path", default=None, metavar="DIR",
                        help="as wrap()'s nvme_path: when the optimizer state does not fit in host RAM, plan the least "
                             "share of it on the disk holding DIR (its rates measured once, cached)")
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


def _host_state_overflows(plan) -> bool:
    """Whether host RAM (or its page-locked part) is short because of the optimizer state."""
    return any(budget != "VRAM" and category == "optimizer_state" for budget, category, _ in plan.overflow)


def _plan_with_disk(args, parser, shape, budget, plan):
    """(the plan with the least share of the optimizer state on disk that fits, or with all of it when none
    does; what the disk tier holds, as wrap(nvme_path=) would place it: whole tensors, so at least this)."""
    import dataclasses

    import ts_planner

    try:
        rates = ts_planner.disk_rates(args.nvme_path)
    except OSError as error:
        parser.error(f"--nvme-path {args.nvme_path}: {error}")
    budget = dataclasses.replace(budget, disk_read_gbps=rates.read_gbps, disk_write_gbps=rates.write_gbps,
                                 disk_mixed_gbps=rates.mixed_gbps)
    o = plan.options

    def with_share(share: float):
        return ts_planner.plan_memory(
            shape, budget, batch=o.batch, seq=o.seq, train=o.train, lora_rank=o.lora_rank, quantize=args.quantize,
            optimizer="host", moment_dtype=args.moment_dtype, loss_chunk=args.loss_chunk,
            streamed_blocks=plan.options.streamed_blocks if args.param_offload not in (None, "auto") else "auto",
            prefer=args.prefer, streamed_shared_by=o.streamed_shared_by, state_shared_by=o.state_shared_by,
            fsdp_shards=o.fsdp_shards, disk_state_share=share)

    best = with_share(1.0)
    if best.fits:  # more state on disk never takes more RAM: the least share that fits, by bisection
        low, high = 0.0, 1.0
        for _ in range(12):
            middle = (low + high) / 2
            candidate = with_share(middle)
            low, high, best = (low, middle, candidate) if candidate.fits else (middle, high, best)
    share = best.options.disk_state_share
    text = (f"nvme_path={args.nvme_path!r}: {share:.1%} of the trained values' master weights and moments "
            f"({fmt_bytes(best.estimate.disk_bytes, 'GiB', 2)}) on disk, read and written each step; "
            f"{rates.summary()}" + ("" if best.fits else "; even all of it on disk does not fit"))
    return best, {"share": share, "bytes": best.estimate.disk_bytes, "rates": dataclasses.asdict(rates),
                  "text": text}


def plan_main(argv: list[str] | None = None) -> int:
    """`trainstream plan`: prints the plan (or with --json one object); 0 when it fits, 3 when nothing does."""
    import ts_planner

    parser = plan_parser()
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
            vram_bytes=args.vram_bytes, host_bytes=args.host_bytes, processes=ranks, profile=profile)
    except RuntimeError:  # no GPU here and no --vram-gb
        parser.error("this machine has no CUDA device: pass --vram-gb (the GPU memory to plan for, in GiB)")
    if args.fsdp and (args.world_size < 2 or args.param_offload not in (None, "auto")):
        parser.error("--fsdp shards over --world-size N ranks (N >= 2), and FSDP2 owns the sharded weights: "
                     "--param-offload does not apply")
    lora = args.lora_rank is not None
    layers = shape.num_hidden_layers
    streamed = "auto" if args.param_offload in (None, "auto") else (
        round(args.param_offload[1] * layers) if isinstance(args.param_offload, tuple) else args.param_offload)
    if args.world_size > 1 and not args.fsdp and not lora:  # a full fine-tune's blocks are trained weights
        if streamed not in ("auto", 0):
            parser.error("--param-offload streams a full fine-tune's trained weights, which trainstream's data "
                         "parallel does not take (every rank would write its machine's one host copy): use --fsdp, "
                         "or LoRA (--lora-rank)")
        streamed = 0
    optimizer = args.optimizer or {None: "auto", "auto": "auto", "true": "host"}[args.offload]
    try:
        plan = ts_planner.plan_memory(
            shape, budget, batch=args.batch, seq=args.seq, train="lora" if lora else "full",
            lora_rank=args.lora_rank or 16, quantize=args.quantize,
            optimizer=optimizer, moment_dtype=args.moment_dtype, loss_chunk=args.loss_chunk,
            streamed_blocks=streamed, prefer=args.prefer,
            streamed_shared_by=ranks, state_shared_by=1 if args.fsdp else args.world_size,
            fsdp_shards=args.world_size if args.fsdp else 1)
    except ValueError as error:  # a combination the planner refuses (--quantize nf4 with --full, too many blocks)
        parser.error(str(error))
    disk = None
    if args.nvme_path is not None and not plan.fits and _host_state_overflows(plan):
        plan, disk = _plan_with_disk(args, parser, shape, budget, plan)
    rates = "measured rates" if profile is not None else "default rates (--measure for this machine's)"
    if args.as_json:
        print(json.dumps({"model": name, **plan.to_dict(), "decisions": _decisions(plan), "rates": rates,
                          "disk": disk}, indent=1))
    else:
        print(f"trainstream plan: {name}; budget: {fmt_bytes(budget.vram_bytes, 'GiB', 2)} VRAM, "
              f"{fmt_bytes(budget.host_bytes, 'GiB', 2)} host RAM ({budget.source}); {rates}")
        if disk is not None:
            print(disk["text"])
        print(plan.explain())
    return 0 if plan.fits else PLAN_EXIT_REFUSED
