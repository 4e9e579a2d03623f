r"""Generation throughput with TrainStreamCache against DynamicCache and DynamicCache(offloading=True).

One process per setting (``--engine E --batch B``), printing one ``RESULT {json}`` line: tokens/s
(batch x new tokens / generate() wall time, after a short warm-up), peak VRAM from the end of the
model build on, and the paged cache's plan and counters. ``--sweep`` finds the largest batch at
which DynamicCache fits (doubling from ``--start-batch``), then runs every engine at that batch and
at 4x it, each in a fresh process, and appends the results to ``--out`` (JSON lines).

Model: a random-init Qwen2.5-7B shape (28 layers, 28/4 heads of 128, vocab 152064), bf16, SDPA
attention, greedy decoding with exactly ``--new`` new tokens. ``--vram-cap-gb`` caps the process
with ``set_per_process_memory_fraction`` (what is left after the weights plays the training state's
part). Needs a GPU, transformers and trainstream.

    python packages/ts-kvcache/bench/generate.py --sweep --vram-cap-gb 40 --out docs/results/kvcache_h200.jsonl
    python packages/ts-kvcache/bench/generate.py --sweep --layers 8 --new 128 --vram-cap-gb 12   # minutes, not tens
    python packages/ts-kvcache/bench/generate.py --sweep --vram-cap-gb 24 --prefill-chunk 64   # the 4x batch's prefill fits

The sweep's probes each print a progress line on stderr (on 2026-12-01 a full-size sweep printed nothing
within 230 s on the H200: every probe is a whole generate() of the 7B shape in its own process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
import warnings

import torch

SHAPE = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
         "num_key_value_heads": 4, "vocab_size": 152064}
ENGINES = ("dynamic", "offloaded", "paged")


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 97}


def _model(layers: int | None, device: str, tiny: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(TINY if tiny else SHAPE)
    shape["num_hidden_layers"] = layers or shape["num_hidden_layers"]
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=False,
                         attn_implementation="sdpa", eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def _cache(engine: str, model, max_tokens: int, args):
    from transformers import DynamicCache

    if engine == "dynamic":
        return DynamicCache(config=model.config)
    if engine == "offloaded":
        return DynamicCache(config=model.config, offloading=True)
    from trainstream.integrations.kvcache import TrainStreamCache

    options = {"page_tokens": args.page_tokens, "vram_fraction": args.vram_fraction, "slots": args.slots,
               "copy": args.copy}
    if args.resident is not None:
        options["resident_layers"] = args.resident
    return TrainStreamCache(model, max_tokens, **options)


SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
_sdpa: list[str] = []  # --sdpa: the backends generation may use (empty: PyTorch's own choice)


def _attention_backends():
    """A context that limits scaled_dot_product_attention to the --sdpa backends (none: no limit)."""
    if not _sdpa:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
             "math": "MATH"}
    return sdpa_kernel([getattr(SDPBackend, names[b]) for b in _sdpa])


def _generate(model, ids, cache, new: int, prefill_chunk: int | None = None, **extra):
    if prefill_chunk:
        extra["prefill_chunk_size"] = prefill_chunk
    with warnings.catch_warnings(), _attention_backends():
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, past_key_values=cache, pad_token_id=0, **extra)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _profile_tools():
    """tools/bench/profile_step.py (the trace and cProfile readers), imported from the repository."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools" / "bench"))
    import profile_step

    return profile_step


def _profile(model, ids, args) -> dict:
    """One more generate() of ``--profile`` new tokens under torch.profiler, with a fresh cache: per
    decoding step (the window between two logits calls), GPU time by class (tools/bench/profile_step.py),
    the medians over the steps after the first two, the link's rate while it copies host-to-device, and
    the top kernels. Says whether decoding waits on the link, on kernels, or on the host."""
    import statistics

    from transformers import LogitsProcessor, LogitsProcessorList

    profile_step = _profile_tools()

    class StepMarker(LogitsProcessor):
        def __call__(self, input_ids, scores):
            with torch.profiler.record_function("decode_step"):
                return scores

    cache = _cache(args.engine, model, args.prompt + args.profile, args)
    kv = getattr(cache, "kv", None)
    if kv is not None:  # the paged cache's own host time, as an annotated range per update
        update = kv.update

        def annotated(layer, k, v):
            with torch.profiler.record_function("PagedKVCache.update"):
                return update(layer, k, v)

        kv.update = annotated
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    try:
        with torch.profiler.profile(activities=activities) as prof:
            _generate(model, ids, cache, args.profile, args.prefill_chunk,
                      logits_processor=LogitsProcessorList([StepMarker()]))
            _sync(args.device)
    finally:
        if kv is not None:  # the wrapper refers to kv: without this the cache lives on until gc runs
            del kv.update
    plan = kv.plan.get("message") if kv is not None else None
    steps = [w for w in profile_step.gpu_busy_per_window(prof, "decode_step", top=8) if "wall" in w][2:]
    if not steps:
        return {"steps": 0, "plan": plan}
    median = {key: round(statistics.median(w[key] for w in steps) * 1e3, 2)
              for key in ("wall", "busy", "kernel", "h2d", "d2h", "h2d_alone")}
    h2d_seconds = sum(w["h2d"] for w in steps)

    def per_step(key: str, top: int) -> list[tuple[str, float]]:  # a per-window top list, over all steps
        totals = profile_step.sum_by_name((pair for w in steps for pair in w[key]), top)
        return [(name[:90], round(seconds / len(steps) * 1e3, 2)) for name, seconds in totals]

    return {"steps": len(steps), "plan": plan, "median_ms": median,
            "h2d_gb_per_s_while_copying": round(sum(w["h2d_bytes"] for w in steps) / h2d_seconds / 1e9, 1)
            if h2d_seconds else None,
            "top_kernels_ms_per_step": per_step("top", 8),
            "cuda_runtime_ms_per_step": per_step("runtime_top", 6),
            "host_ops_ms_per_step": per_step("host_top", 10)}


def _py_profile(model, ids, args) -> list[str]:
    """One more generate() of ``--py-profile`` new tokens under cProfile: the host's top functions by
    own time (where decoding spends host time when the GPU waits for it)."""
    import cProfile

    cache = _cache(args.engine, model, args.prompt + args.py_profile, args)
    profiler = cProfile.Profile()
    profiler.enable()
    _generate(model, ids, cache, args.py_profile, args.prefill_chunk)
    _sync(args.device)
    profiler.disable()
    return _profile_tools().cprofile_top(profiler, 25)


def run_one(args) -> dict:
    cuda = args.device == "cuda"
    _sdpa[:] = args.sdpa or []
    result = {"engine": args.engine, "batch": args.batch, "prompt": args.prompt, "new": args.new,
              "prefill_chunk": args.prefill_chunk, "sdpa": args.sdpa or "default",
              "vram_cap_gb": args.vram_cap_gb, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if args.vram_cap_gb and cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_cap_gb * 2**30 / total))
    model = _model(args.layers, args.device, args.tiny)
    _sync(args.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (args.batch, args.prompt), generator=gen).to(args.device)
    cache = None
    try:
        with torch.no_grad():
            cache = _cache(args.engine, model, args.prompt + 8, args)
            _generate(model, ids, cache, 8, args.prefill_chunk)  # warm-up
            cache = None
            cache = _cache(args.engine, model, args.prompt + args.new, args)
            _sync(args.device)
            start = time.perf_counter()
            out = _generate(model, ids, cache, args.new, args.prefill_chunk)
            _sync(args.device)
            elapsed = time.perf_counter() - start
    except torch.OutOfMemoryError as error:
        result.update(outcome="out of memory", error=str(error).splitlines()[0],
                      peak_vram_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None)
        kv = getattr(cache, "kv", None)
        if kv is not None:  # what the paged cache had planned when the model ran out
            result.update(plan=kv.plan.get("message"), memory=kv.memory())
        return result
    generated = (out.shape[1] - args.prompt) * args.batch
    result.update(outcome="ok", seconds=round(elapsed, 3), tokens_per_s=round(generated / elapsed, 1),
                  peak_vram_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                  weights_gb=round(base / 2**30, 2))
    kv = getattr(cache, "kv", None)
    if kv is not None:
        result.update(resident=len(kv.resident), offloaded=len(kv.offloaded), stats=kv.stats, memory=kv.memory(),
                      pinned=kv._pool.pinned if kv._pool is not None else None, plan=kv.plan.get("message"))
    if args.profile:
        cache = kv = None
        with torch.no_grad():
            result["profile"] = _profile(model, ids, args)
    if args.py_profile:
        cache = kv = None
        with torch.no_grad():
            result["py_profile"] = _py_profile(model, ids, args)
    return result


def _child(args, engine: str, batch: int) -> dict:
    cmd = [sys.executable, __file__, "--engine", engine, "--batch", str(batch), "--prompt", str(args.prompt),
           "--new", str(args.new), "--vram-cap-gb", str(args.vram_cap_gb), "--page-tokens", str(args.page_tokens),
           "--vram-fraction", str(args.vram_fraction), "--slots", str(args.slots), "--copy", args.copy]
    if args.sdpa:
        cmd += ["--sdpa", *args.sdpa]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    if args.prefill_chunk:
        cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    if args.tiny:
        cmd += ["--tiny", "--device", args.device]
    if args.resident is not None:
        cmd += ["--resident", str(args.resident)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "batch": batch, "outcome": f"timed out after {args.timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"engine": engine, "batch": batch, "outcome": f"failed ({proc.returncode})", "error": " | ".join(tail)}


def sweep(args) -> None:
    results = []

    def record(result):
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")

    batch, fits, too_large = args.start_batch, None, None
    while batch <= args.max_batch:
        result = _child(args, "dynamic", batch)
        # Progress: each probe is a whole generate() in a fresh process (a minute or more at 7B).
        print(f"probe: DynamicCache at batch {batch}: {result.get('outcome')} "
              f"({result.get('tokens_per_s', '-')} tokens/s)", file=sys.stderr, flush=True)
        if result.get("outcome") != "ok":
            too_large = result
            break
        fits = (batch, result)
        batch *= 2
    if fits is None:
        raise SystemExit(f"DynamicCache does not fit even at batch {args.start_batch}; lower --start-batch")
    batch, dynamic = fits
    record(dynamic)
    if too_large is not None:
        record(too_large)
    # The engine under test first at each batch: a run cut short by the caller's time limit keeps it.
    for engine in ("paged", "offloaded"):
        record(_child(args, engine, batch))
    for engine in ("paged", "offloaded", "dynamic"):
        if engine == "dynamic" and too_large is not None:
            continue  # it did not fit at half this batch (recorded above)
        record(_child(args, engine, 4 * batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=ENGINES)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test; with --device cpu)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--vram-cap-gb", type=float, default=0.0)
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="prompt tokens per prefill forward (transformers' prefill_chunk_size), the same for "
                             "every engine: at 4x the batch the prefill's MLP, not the cache, ran out of memory")
    parser.add_argument("--page-tokens", type=int, default=256)
    parser.add_argument("--vram-fraction", type=float, default=0.5)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--copy", choices=("auto", "engine", "kernel"), default="auto")
    parser.add_argument("--resident", type=int, default=None, help="resident layers (default: auto)")
    parser.add_argument("--sdpa", nargs="+", choices=SDPA_BACKENDS, default=None,
                        help="limit attention to these SDPA backends (default: PyTorch's choice; on torch 2.11 "
                             "and the H200 that is cuDNN, which spends host time on each new sequence length)")
    parser.add_argument("--profile", type=int, default=0, metavar="NEW",
                        help="after the timed run, profile one more generate() of NEW tokens: GPU time per step by "
                             "class (kernels, host-to-device, device-to-host), the link's rate, the top kernels")
    parser.add_argument("--py-profile", type=int, default=0, metavar="NEW",
                        help="after the timed run, cProfile one more generate() of NEW tokens (host functions)")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--start-batch", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.sweep:
        sweep(args)
    elif args.engine:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
    else:
        parser.error("give --engine or --sweep")


if __name__ == "__main__":
    main()
