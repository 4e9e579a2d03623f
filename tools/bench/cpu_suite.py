"""The CPU benchmarks that run on a CI-class machine, each writing records (tools/bench/_record.py).

Cases (each engine measured in this one process, alternated A B C A B C ... over ``--rounds`` rounds, every run
kept; a run's figure is the median over its own steady-state window):

- ``adamw``: ts_adamw's host AdamW (fp32 moments; trainstream's configuration: bf16 grad in, bf16 param_out;
  and with fp32 grad, torch's traffic) against torch's fused and foreach CPU AdamW at the same thread count,
  one record per size. Bound: the bytes an ideal pass moves / the host bandwidth (adamw.py's probe, run before
  and after the rounds). A run below its bound, or probes more than 25 % apart, marks ``loaded_machine``.
- ``step``: a CPU training step of a small Qwen2-shaped model, ``trainstream.wrap(model, torch.optim.AdamW)``
  against the plain step with torch.optim.AdamW; fresh model each run, the first 2 steps skipped.
- ``chunked-loss``: trainstream.chunked_cross_entropy against dense F.cross_entropy over the logits, forward +
  backward: two records per (vocab, tokens), time and peak memory (torch.profiler's allocation events).

Every record carries ``machine_use``: the share of the machine's CPU time other processes in the VM and the
hypervisor (steal) took during its rounds; more than 25 % also marks ``loaded_machine``, with the reason.
- ``pinned``: ts_pinned's arena allocation against page-locking each buffer (pageable torch.empty without CUDA,
  where page-locking through torch is impossible), one record per block-size class.

    python tools/bench/cpu_suite.py                        # every case, docs/results/cpu-*-<date>.json
    python tools/bench/cpu_suite.py adamw --rounds 5 --out /tmp/r
    python tools/bench/cpu_suite.py --quick --rounds 2     # tiny sizes: a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import gc
import glob
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _record  # noqa: E402
import adamw as adamw_bench  # noqa: E402
import pinned as pinned_bench  # noqa: E402

MACHINE_NOTE = "shared 2-core VM (CI class); figures are noisy"
PROBE_TOLERANCE = 0.25  # bandwidth probes before and after the rounds further apart than this: a loaded machine
OTHERS_LIMIT = 0.25  # others took more of the machine's CPU time than this during the rounds: a loaded machine
WARMUP_STEPS = 2
MIB = 1 << 20
CASES = ("adamw", "step", "chunked-loss", "pinned")


# ---- shared: alternation, the bound check, the cache size ------------------------------------------------------

def alternate(engines: dict[str, Callable[[int], dict]], rounds: int) -> dict[str, list[dict]]:
    """Each engine's runs, the engines taking turns: round 0 runs every engine in the dict's order, then round 1,
    ... Each run's dict gets "round" and "order" (its place among all the runs, from 0)."""
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    order = 0
    for round_ in range(rounds):
        for name, run in engines.items():
            runs[name].append({**run(round_), "round": round_, "order": order})
            order += 1
            gc.collect()
    return runs


def bound_check(engines: dict[str, list[dict]], figure: str, bounds: dict[str, dict],
                probes: list[float] | None = None, tolerance: float = PROBE_TOLERANCE) -> list[str]:
    """Why this record's figures cannot be trusted against their bounds ([] when they can): every run whose figure
    is below its engine's bound (the bound's rate was not the machine's best: another tenant took some during
    the probe), and bandwidth probes further apart than `tolerance` (the machine's share changed mid-run)."""
    reasons = []
    for engine, runs in engines.items():
        bound = bounds.get(engine)
        if bound is None:
            continue
        for run in runs:
            value = run.get(figure)
            if value is not None and value < bound["value"]:
                reasons.append(f"{engine}, round {run.get('round')}: {figure} {value:.4g} is below its bound "
                               f"{bound['value']:.4g} ({value / bound['value']:.0%} of it)")
    good = [p for p in probes or [] if p]
    if len(good) >= 2 and max(good) > min(good) * (1 + tolerance):
        reasons.append(f"bandwidth probes {', '.join(f'{p:.1f}' for p in good)} GB/s differ by "
                       f"{max(good) / min(good) - 1:.0%} (more than {tolerance:.0%})")
    return reasons


def cpu_snapshot() -> dict:
    """The machine's busy and steal CPU seconds (/proc/stat), this process's CPU seconds and the wall clock."""
    snap = {"wall": time.perf_counter(), "own": sum(resource.getrusage(resource.RUSAGE_SELF)[:2])}
    try:
        with open("/proc/stat") as f:
            fields = [int(x) / os.sysconf("SC_CLK_TCK") for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return snap
    # user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait; steal apart
    return {**snap, "busy": sum(fields[:8]) - fields[3] - fields[4] - fields[7], "steal": fields[7]}


def others_since(before: dict) -> dict:
    """How much of the machine's CPU time others took since `before`: other processes in this VM (busy time not
    ours) and the hypervisor (steal), each as a share of cpus x wall time."""
    now, cpus = cpu_snapshot(), os.cpu_count() or 1
    capacity = (now["wall"] - before["wall"]) * cpus
    use = {"window_s": now["wall"] - before["wall"], "cpus": cpus, "own_share": (now["own"] - before["own"]) / capacity}
    if "busy" in now and "busy" in before:
        use["others_share"] = max(0.0, (now["busy"] - before["busy"]) - (now["own"] - before["own"])) / capacity
        use["steal_share"] = (now["steal"] - before["steal"]) / capacity
    return use


def busy_reasons(use: dict, limit: float = OTHERS_LIMIT) -> list[str]:
    """A reason to distrust the figures when others took more than `limit` of the machine during the rounds."""
    taken = use.get("others_share", 0.0) + use.get("steal_share", 0.0)
    if taken <= limit:
        return []
    return [f"other processes and the hypervisor took {taken:.0%} of the machine's {use['cpus']} CPUs over the "
            f"{use['window_s']:.0f} s of rounds (more than {limit:.0%})"]


def measured(engines: dict[str, Callable[[int], dict]], rounds: int) -> tuple[dict[str, list[dict]], dict]:
    """alternate(), with what others took of the machine meanwhile."""
    before = cpu_snapshot()
    runs = alternate(engines, rounds)
    return runs, others_since(before)


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache (bytes) sysfs reports for cpu0; None where unknown."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def _common(args) -> dict:
    return {"machine_note": args.machine_note, "quick": args.quick, "threads": args.threads,
            "torch_threads": torch.get_num_threads()}


def _label(n: int) -> str:
    for unit, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


# ---- adamw --------------------------------------------------------------------------------------------------------

# engine: (grad dtype, param_out dtype, what it is)
ADAMW_ENGINES = {
    "ts_adamw (bf16 grad, bf16 out)": (torch.bfloat16, torch.bfloat16,
                                       "ts_adamw.adamw_step, fp32 moments, bf16 grad in, bf16 param_out: the "
                                       "configuration trainstream runs (streaming stores as 'auto' picks)"),
    "ts_adamw (fp32 grad)": (torch.float32, None, "ts_adamw.adamw_step, fp32 moments, fp32 grad, no param_out: "
                                                   "torch's traffic"),
    "torch fused": (torch.float32, None, "torch.optim.AdamW(fused=True), CPU"),
    "torch foreach": (torch.float32, None, "torch.optim.AdamW(foreach=True), CPU"),
}


def _adamw_runner(engine: str, n: int, threads: int, repeats: int) -> Callable[[int], dict]:
    grad, out, _ = ADAMW_ENGINES[engine]
    if engine.startswith("ts_adamw"):
        return lambda _round: adamw_bench.bench_ts_host(n, torch.float32, threads, repeats, grad=grad, out=out)
    mode = engine.split()[-1]
    return lambda _round: adamw_bench.bench_torch(n, "cpu", mode, threads, repeats)


def case_adamw(args) -> list[tuple[str, dict]]:
    sizes = [64_000, 1_000_000] if args.quick else [1_000_000, 16_000_000, 64_000_000]
    repeats = 2 if args.quick else 5
    llc = last_level_cache_bytes()
    out = []
    probe_repeats = 1 if args.quick else 3
    before = adamw_bench.host_bandwidth(sizes[0], probe_repeats, args.threads)
    for n in sizes:
        engines = {e: _adamw_runner(e, n, args.threads, repeats) for e in ADAMW_ENGINES}
        runs, use = measured(engines, args.rounds)
        after = adamw_bench.host_bandwidth(n, probe_repeats, args.threads)  # also the next size's "before"
        probes = [before["best"], after["best"]]
        bandwidth = max(probes)  # the larger rate: the smaller, safer bound
        bounds, cached = {}, []
        for engine, (grad, param_out, _) in ADAMW_ENGINES.items():
            streamed = "streaming stores" in runs[engine][0].get("variant", "")
            per_value = adamw_bench.host_bytes_per_param(torch.float32, grad, param_out, streamed)
            resident = n * (12 + grad.itemsize + (param_out.itemsize if param_out is not None else 0))
            if llc is not None and resident <= llc:  # DRAM bandwidth does not limit it
                cached.append(f"{engine} ({resident / MIB:.0f} MiB)")
                continue
            bounds[engine] = {"value": per_value * n / (bandwidth * 1e9), "terms": {
                "bytes_per_value": per_value, "values": n, "bytes": per_value * n, "bandwidth_gbs": bandwidth,
                "bandwidth_probes_gbs": probes, "streaming_stores": streamed}}
        reasons = bound_check(runs, "seconds", bounds, probes) + busy_reasons(use)
        out.append((_label(n), _record.record(
            "cpu-adamw", f"adamw-{_label(n)}", runs, "seconds", args.rounds, "s", bounds, gpu=False,
            values=n, repeats_per_run=repeats, host_isa=adamw_bench.ts_adamw.host_isa(),
            last_level_cache_bytes=llc, bandwidth_probes={"before": before, "after": after}, machine_use=use,
            loaded_machine=bool(reasons), loaded_reasons=reasons,
            bounds_note="bytes an ideal single pass moves (write-allocate included, adamw.py's count) / the "
                        "larger of the two bandwidth probes" + (f"; no bound for {', '.join(cached)}: its buffers "
                                                                  f"fit in the {llc / MIB:.0f} MiB last-level cache, "
                                                                  f"DRAM bandwidth does not limit it" if cached else ""),
            engine_notes={e: d for e, (_, _, d) in ADAMW_ENGINES.items()},
            figure_note=f"a run's figure: the median of {repeats} timed steps after one warm-up step, fresh "
                        f"buffers each run", **_common(args))))
        before = after
    return out


# ---- step ---------------------------------------------------------------------------------------------------------

def _qwen2(quick: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512) if quick else
             dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, vocab_size=16384))
    torch.manual_seed(0)
    config = Qwen2Config(**shape, max_position_embeddings=1024, tie_word_embeddings=False, use_cache=False,
                         attn_implementation="sdpa")
    return Qwen2ForCausalLM(config), shape


def _step_run(wrapped: bool, quick: bool, steps: int, ids: torch.Tensor) -> dict:
    import trainstream

    model, _ = _qwen2(quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    setup = time.perf_counter()
    if wrapped:
        model, opt = trainstream.wrap(model, opt, device="cpu")
    setup = time.perf_counter() - setup
    session = getattr(model, "_trainstream_session", None)
    times = []
    for _ in range(WARMUP_STEPS + steps):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if session is not None:
            session.synchronize()  # the host updates are part of the step
        times.append(time.perf_counter() - start)
    run = {"seconds": statistics.median(times[WARMUP_STEPS:]), "steps_s": times[WARMUP_STEPS:],
           "warmup_steps_s": times[:WARMUP_STEPS], "final_loss": loss.item(), "setup_s": setup}
    if wrapped:
        run["optimizer"] = trainstream.memory_report(model)["optimizer"]
        trainstream.unwrap(model)
    return run


def case_step(args) -> list[tuple[str, dict]]:
    steps = 3 if args.quick else 8
    batch, seq = (2, 32) if args.quick else (2, 128)
    _, shape = _qwen2(args.quick)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    engines = {"trainstream.wrap": lambda _r: _step_run(True, args.quick, steps, ids),
               "plain torch.optim.AdamW": lambda _r: _step_run(False, args.quick, steps, ids)}
    runs, use = measured(engines, args.rounds)
    reasons = busy_reasons(use)
    values = sum(p.numel() for p in _qwen2(args.quick)[0].parameters())
    return [("", _record.record(
        "cpu-step", "qwen2-tiny-step" if args.quick else "qwen2-19m-step", runs, "seconds", args.rounds, "s", {},
        gpu=False, model={"config": "Qwen2Config", **shape, "parameters": values}, batch=batch, seq=seq,
        steps_per_run=steps, warmup_steps=WARMUP_STEPS, machine_use=use, loaded_machine=bool(reasons),
        loaded_reasons=reasons,
        bounds_note="no bound: no measured rate on this host bounds a whole forward + backward + update",
        figure_note=f"a run's figure: the median of its {steps} steps after {WARMUP_STEPS} warm-up steps, a fresh "
                    f"model (same seed) each run; a step is forward, backward, optimizer.step(), zero_grad() and, "
                    f"wrapped, waiting for the host updates", **_common(args)))]


# ---- chunked-loss -------------------------------------------------------------------------------------------------

def peak_new_bytes(prof) -> int:
    """The most bytes live at once among those allocated inside the profiled region (allocation events of
    torch.profiler(profile_memory=True), in time order; tensors made before it are not counted)."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            events.append((event.start_time_ns, event.typed[1].alloc_size))
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


def _loss_pass(chunked: bool, hidden, weight, targets, chunk: int) -> dict:
    import torch.nn.functional as F
    import trainstream
    from torch.profiler import ProfilerActivity, profile

    hidden.grad = weight.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        if chunked:
            loss = trainstream.chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk)
        else:
            loss = F.cross_entropy(F.linear(hidden, weight), targets)
        loss.backward()
        seconds = time.perf_counter() - start
    peak = peak_new_bytes(prof)
    return {"seconds": seconds, "peak_mib": peak / MIB, "peak_bytes": peak, "loss": loss.item(),
            "tokens_per_s": targets.numel() / seconds}


def case_chunked_loss(args) -> list[tuple[str, dict]]:
    width, chunk = (64, 64) if args.quick else (256, 1024)
    configs = [(v, t) for v in ((1000, 4000) if args.quick else (32000, 152064))
               for t in ((256,) if args.quick else (1024, 2048))]
    engines_of = {"chunked (trainstream)": True, "dense (F.cross_entropy)": False}
    small = torch.randn(8, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True), torch.zeros(8).long()
    for chunked in engines_of.values():  # first-call costs (profiler start-up, kernels) outside the runs
        _loss_pass(chunked, *small, 4)
    out = []
    for vocab, tokens in configs:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(tokens, width, generator=gen).requires_grad_()
        weight = (torch.randn(vocab, width, generator=gen) * width**-0.5).requires_grad_()
        targets = torch.randint(0, vocab, (tokens,), generator=gen)
        runs, use = measured({e: (lambda _r, c=c, h=hidden, w=weight, t=targets: _loss_pass(c, h, w, t, chunk))
                              for e, c in engines_of.items()}, args.rounds)
        grads = (hidden.numel() + weight.numel()) * 4
        memory_bounds = {e: {"value": grads / MIB, "terms": {
            "hidden_bytes": hidden.numel() * 4, "weight_bytes": weight.numel() * 4,
            "why": "backward returns fp32 gradients of hidden and weight, both live at its end"}} for e in engines_of}
        label = f"v{_label(vocab) if vocab % 1000 == 0 else vocab}-t{tokens}"
        shared = dict(vocab=vocab, tokens=tokens, hidden_size=width, dtype="float32", chunk_size=chunk,
                      logits_mib=tokens * vocab * 4 / MIB, machine_use=use, **_common(args))
        busy = busy_reasons(use)
        reasons = bound_check(runs, "peak_mib", memory_bounds)
        out.append((f"{label}-time", _record.record(
            "cpu-loss", f"loss-{label}-time", runs, "seconds", args.rounds, "s", {}, gpu=False,
            loaded_machine=bool(busy), loaded_reasons=busy, paired_with=f"loss-{label}-memory",
            bounds_note="no time bound: no matmul rate is measured here (both are compute-bound)",
            figure_note="one forward + backward (grads of hidden and weight), timed with perf_counter inside "
                        "torch.profiler(profile_memory=True) (its per-op cost: microseconds against passes of "
                        "tenths of seconds)", **shared)))
        out.append((f"{label}-memory", _record.record(
            "cpu-loss", f"loss-{label}-memory", runs, "peak_mib", args.rounds, "MiB", memory_bounds, gpu=False,
            loaded_machine=bool(reasons), loaded_reasons=reasons, paired_with=f"loss-{label}-time",
            bounds_note="the bytes of hidden + weight: the gradients backward must return",
            figure_note="the most bytes live at once among those allocated during forward + backward "
                        "(torch.profiler allocation events; the inputs, made before, not counted)", **shared)))
    return out


# ---- pinned -------------------------------------------------------------------------------------------------------

def _arena_run(rounds_: list[list[int]], high: int) -> dict:
    slab = min(1 << 30, max(64 * MIB, high * 8))
    arena = pinned_bench.ts_pinned.PinnedArena(slab)
    start = time.perf_counter()
    arena.reserve(max(sum(r) for r in rounds_) + slab)
    reserve_s = time.perf_counter() - start
    before = arena.stats()
    times = pinned_bench.time_allocations(lambda n: arena.empty(n, torch.uint8), rounds_)
    after = arena.stats()
    return {**_alloc_figures(times), "reserve_s": reserve_s, "pinned": bool(after["pinned"]),
            "host_alloc_calls_while_timed": after["host_alloc_calls"] - before["host_alloc_calls"],
            "fallbacks_while_timed": after["arena_fallbacks"] - before["arena_fallbacks"]}


def _torch_run(rounds_: list[list[int]]) -> dict:
    if pinned_bench.has_gpu():
        pinned_bench.empty_torch_host_cache()
        times = pinned_bench.time_allocations(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True),
                                              rounds_, between=pinned_bench.empty_torch_host_cache)
        return {**_alloc_figures(times), "pinned": True}
    return {**_alloc_figures(pinned_bench.time_allocations(lambda n: torch.empty(n, dtype=torch.uint8), rounds_)),
            "pinned": False}


def _alloc_figures(times: list[float]) -> dict:
    return {"us_per_alloc": statistics.fmean(times) * 1e6, "median_us": statistics.median(times) * 1e6,
            "max_us": max(times) * 1e6, "total_s": sum(times), "allocations": len(times)}


def case_pinned(args) -> list[tuple[str, dict]]:
    import random

    blocks, max_live = (40, 256 * MIB) if args.quick else (400, 2 << 30)
    gpu = pinned_bench.has_gpu()
    baseline = ("torch.empty(pin_memory=True), cache emptied" if gpu
                else "torch.empty (pageable: no CUDA, no page-locking)")
    out = []
    for name, low, high, seed in (("large", MIB, 64 * MIB, 0), ("small", 4 << 10, MIB, 1)):
        rng = random.Random(seed)
        sizes = [rng.randint(low, high) for _ in range(blocks)]
        rounds_ = pinned_bench.rounds_of(sizes, max_live)
        runs, use = measured({"ts_pinned arena (reserved)": lambda _r, g=rounds_, h=high: _arena_run(g, h),
                              baseline: lambda _r, g=rounds_: _torch_run(g)}, args.rounds)
        busy = busy_reasons(use)
        out.append((name, _record.record(
            "cpu-pinned", f"pinned-{name}", runs, "us_per_alloc", args.rounds, "us", {}, gpu=gpu,
            blocks=blocks, size_range_bytes=[low, high], total_bytes=sum(sizes), max_live_bytes=max_live,
            baseline_page_locks=gpu, machine_use=use, loaded_machine=bool(busy), loaded_reasons=busy,
            bounds_note="no bound: no measured rate bounds handing out a block of reserved memory",
            figure_note="mean microseconds per allocation over every block of the run (blocks freed, untimed, "
                        "between groups of at most max_live_bytes); the arena reserves its slabs first, untimed"
                        + ("" if gpu else "; without CUDA the arena is not page-locked either, and torch.empty "
                           "does not touch its pages: this compares allocators, not page-locking"),
            **_common(args))))
    return out


RUNNERS = {"adamw": case_adamw, "step": case_step, "chunked-loss": case_chunked_loss, "pinned": case_pinned}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", metavar="CASE", help=f"of {', '.join(CASES)} (default: all)")
    parser.add_argument("--out", default=os.path.normpath(os.path.join(HERE, "..", "..", "docs", "results")),
                        help="records go here")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each engine, alternated (at least 2)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CI smoke test)")
    parser.add_argument("--threads", type=int, default=adamw_bench.ts_adamw.host_threads(),
                        help="threads for torch and ts_adamw (default: ts_adamw's host threads)")
    parser.add_argument("--machine-note", default=MACHINE_NOTE, help="what every record says of the machine")
    args = parser.parse_args(argv)
    if any(case not in CASES for case in args.cases):
        parser.error(f"cases are {', '.join(CASES)}; got {' '.join(args.cases)}")
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: engines alternate")
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    for case in args.cases or CASES:
        started, load = time.perf_counter(), os.getloadavg()
        for suffix, data in RUNNERS[case](args):
            # Other tenants' work shows here (ours adds up to --threads while a case runs).
            data["load_average_1_5_15"] = {"case_start": load, "record_written": os.getloadavg()}
            path = os.path.join(args.out, f"cpu-{case}{'-' + suffix if suffix else ''}-{date}.json")
            _record.write(path, data)
            lines = [f"  {e}: median {s['summary'].get('median', float('nan')):.4g} {data['unit']} "
                     f"[{s['summary'].get('min', float('nan')):.4g}, {s['summary'].get('max', float('nan')):.4g}]"
                     + (f", bound {data['bounds'][e]['value']:.4g}" if e in data["bounds"] else "")
                     for e, s in data["engines"].items()]
            flag = f"  LOADED MACHINE: {'; '.join(data['loaded_reasons'])}" if data.get("loaded_machine") else ""
            print("\n".join([f"{path} ({data['figure']})", *lines] + ([flag] if flag else [])), flush=True)
        print(f"# {case}: {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
