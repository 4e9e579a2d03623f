"""One engine's run in compare.py's child process: its steps, its steady-state window, what it decided.

The steady-state window starts after the last step that was not yet steady: the first WARM_STEPS (the first
allocations, the first kernels' autotuning), any step that compiled a graph (torch._dynamo's count of unique
graphs grew), and, for trainstream, every step before its plan reports settled (no placement trial, no
activation policy still tuning: memory_report()["plan"]["settled"]). Inside the window a step in which the
CUDA allocator freed its cache and retried (a device synchronisation each) is excluded and counted. The
figure is the median of the window; the window, the excluded steps and the reason the window starts where it
does are in the result.
"""

from __future__ import annotations

import statistics
import time
import traceback

import _compare_engines as engines
import torch

WARM_STEPS = 2


def failure(e: BaseException, where: str) -> str:
    """The outcome of an engine that raised: CUDA OOMs as "out of memory in <phase> (...)", the rest by type."""
    text = " ".join(str(e).split())
    if isinstance(e, torch.OutOfMemoryError) or (type(e) is RuntimeError and "out of memory" in text.lower()):
        return f"out of memory in {where} ({text[:160]})"
    return f"{where} raised {type(e).__name__}: {text[:400]}"


def _graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def _numel(p: torch.Tensor) -> int:
    """A parameter's values, also under DeepSpeed ZeRO-3 (which empties a partitioned one: ds_numel)."""
    return getattr(p, "ds_numel", None) or p.numel()


def steady_window(steps: int, unsettled: list[int], compiled: list[int], retried: list[int]) -> dict:
    """The window over `steps` steps (0-based indices): it starts after the warm-up, the last compiling
    step and the last unsettled one; retried steps inside it are excluded. Returns start, the kept
    indices, the excluded ones with why, and what set the start."""
    reasons = {"warm-up": WARM_STEPS - 1}
    if compiled:
        reasons["compilation"] = max(compiled)
    if unsettled:
        reasons["plan not settled"] = max(unsettled)
    why = max(reasons, key=lambda k: reasons[k])
    start = min(reasons[why] + 1, steps)
    excluded = [{"step": i, "why": "allocator retry"} for i in retried if i >= start]
    kept = [i for i in range(start, steps) if i not in set(retried)]
    return {"start": start, "started_after": why, "kept": kept, "excluded": excluded}


def run_engine(engine: str, scenario: dict, wrap_options: dict, compile_mode: str | None = None,
               skip_streamed: bool = False) -> dict:
    """One engine in this process: step times and their steady window, peak VRAM and what it decided."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cap = None if engine.endswith("-uncapped") else scenario["vram_gb"]
    if device.type == "cuda" and cap:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cap * 1e9 / total, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mixed = engine == "stock-mixed"
    result: dict = {"engine": engine, "outcome": "ok", "median_s": None, "peak_gb": None,
                    "vram_cap_gb": cap if device.type == "cuda" else None}
    info: dict = {}

    def peak() -> float | None:
        return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None

    try:
        model, opt = engines.setup(engine, scenario, device, dtype, wrap_options, info)
        if compile_mode:
            info["compiled_blocks"] = engines.compile_blocks(model, compile_mode, skip_streamed)
    except engines.EngineUnavailable as e:
        return {**result, "outcome": str(e)}
    except Exception as e:  # an engine's failure is its outcome
        return {**result, **info, "outcome": failure(e, info.get("failed_in", "setup")), "peak_gb": peak()}
    is_trainstream = engine.startswith("trainstream")
    backward = getattr(opt, "backward", None)  # engines that own backward (DeepSpeed) give it on their optimizer
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    times, fwd_bwd, losses, retries = [], [], [], []
    unsettled, compiled, retried = [], [], []
    timed = device.type == "cuda" and engine in engines.STOCK_TIMED
    try:
        for step in range(scenario["steps"]):
            info["failed_in"] = f"step {step + 1}"
            ids = torch.randint(0, vocab, (scenario["batch"], scenario["seq"]), generator=generator).to(device)
            graphs = _graphs()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
                loss = model(input_ids=ids, labels=ids).loss
            backward(loss) if backward else loss.backward()
            if timed:
                torch.cuda.synchronize()
                fwd_bwd.append(time.perf_counter() - start)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            # Outside the timed span: what made this step not steady.
            if device.type == "cuda":  # the allocator freed its cache and retried (a device sync each)
                retries.append(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
                if retries[-1] > (retries[-2] if len(retries) > 1 else 0):
                    retried.append(step)
            if _graphs() > graphs:
                compiled.append(step)
            if is_trainstream and not engines.trainstream_settled(model):
                unsettled.append(step)
        info.pop("failed_in", None)
    except Exception as e:
        result["outcome"] = failure(e, info["failed_in"])
        result["traceback"] = traceback.format_exc()[-4000:]
    if is_trainstream:
        try:
            result.update(engines.trainstream_report(model))
        except Exception as e:  # a report after a failed step is a bonus
            result["report_error"] = f"{type(e).__name__}: {e}"
    window = steady_window(len(times), unsettled, compiled, retried)
    kept = [times[i] for i in window["kept"]]
    if result["outcome"] == "ok" and not kept:
        result["outcome"] = f"no steady state in {len(times)} steps (window starts after {window['started_after']})"
    trainable = engines.trainable(model)
    values = sum(_numel(p) for p in trainable)
    result.update({
        "median_s": statistics.median(kept) if kept else None,
        "window": window,
        "steps_s": times,
        "alloc_retries": retries,
        "losses": losses,
        "fwd_bwd_s": statistics.median([fwd_bwd[i] for i in window["kept"]]) if fwd_bwd and kept else None,
        "peak_gb": peak(),
        "params": sum(_numel(p) for p in model.parameters()),
        "trainable_bytes_per_value": sum(_numel(p) * p.element_size() for p in trainable) / values if values else None,
        **info,
    })
    return result
