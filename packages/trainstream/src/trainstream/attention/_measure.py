"""Measuring the attention backends on one call's shapes: which can run it, whether they agree with
the math backend, and how long forward + backward take.

Backward is not under the backend context on purpose: autograd records the kernel the forward
chose and replays that kernel's backward, whatever is enabled when backward runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from ._calls import SdpaCall
from ._pin import Pin, caller_state

__all__ = ["BACKENDS", "Measurement", "candidates", "default_timer", "measure", "name_of", "run_backend"]

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
_NAMES = {backend: name for name, backend in BACKENDS.items()}
# Backends within this fraction of the fastest count as tied, and a tie goes to PyTorch's earlier one.
# Timing noise on a warm GPU is a few percent: two backends close in speed can swap places between
# two measurements of one shape, and a choice that flips between runs changes a run's numerics
# (docs/attention.md).
NEAR_TIE = 0.05
# Relative error (max |x - ref| / max |ref|, output and gradients) a backend may show against the
# math backend in float32 before it is refused; or 4x what the math backend itself shows in the dtype.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
_HEADERS = {SDPBackend.FLASH_ATTENTION: "Flash attention kernel not used because",
            SDPBackend.EFFICIENT_ATTENTION: "Memory efficient kernel not used because",
            SDPBackend.CUDNN_ATTENTION: "cuDNN attention kernel not used because"}

Timer = Callable[[SDPBackend, Callable[[], object], torch.device], float]


def name_of(backend: SDPBackend) -> str:
    name = _NAMES.get(backend)
    return name if name is not None else str(backend).removeprefix("SDPBackend.").lower()


def priority_order() -> list[SDPBackend]:
    """The order PyTorch tries the backends in outside every pin (ties in a measurement go to the
    earlier one)."""
    try:
        order = [SDPBackend(i) for i in caller_state().priority]
    except (AttributeError, ValueError, TypeError):  # a torch without the private getter
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
    return [b for b in order if b in _NAMES]


def deterministic_backends(device_type: str, warn_only: bool) -> set[SDPBackend]:
    """Backends whose forward and backward give the same bits every run in deterministic mode.

    CPU: math and flash (one thread owns each batch x head slice). CUDA with
    ``use_deterministic_algorithms(True)``: torch switches flash and memory-efficient to their
    deterministic backward and refuses cuDNN; with ``warn_only=True`` they keep their atomics
    and only warn, so only math is left.
    """
    if device_type != "cuda":
        return {SDPBackend.MATH, SDPBackend.FLASH_ATTENTION}
    if warn_only:
        return {SDPBackend.MATH}
    return {SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION}


_SWITCH = {SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.FLASH_ATTENTION: "flash",
           SDPBackend.EFFICIENT_ATTENTION: "mem_efficient", SDPBackend.MATH: "math"}


def disabled_by_caller(backend: SDPBackend) -> str:
    return (f"disabled by the caller (torch.backends.cuda.enable_{_SWITCH[backend]}_sdp(False) or an sdpa_kernel "
            f"context around the model): not measured")


# Why cuDNN is not measured for a call whose keys outnumber its queries (a KV cache: decoding, chunked
# prefill). cuDNN attention builds a graph per key length, and a cache grows every step: decoding spent
# tens of ms of host time per step in it, several times the GPU's work (measured: docs/attention.md).
# A measurement at one length cannot see that cost.
GROWING_KEYS = ("the keys outnumber the queries (a KV cache, growing every step), and cuDNN builds its graph "
                "again for each new key length: tens of ms of host time per step")


def candidates(device: torch.device, deterministic: bool, warn_only: bool, *,
               cached_keys: bool = False) -> tuple[list[SDPBackend], dict[str, str]]:
    """(backends to measure in PyTorch's priority order, {name: why left out}). Backends the caller
    disabled (outside trainstream's pins) are left out: turning one on again is not ours to do.
    ``cached_keys``: the call attends to more keys than it has queries (see GROWING_KEYS); cuDNN is
    left out while another backend remains."""
    order = priority_order()
    enabled = caller_state().enabled
    left = {name_of(b): disabled_by_caller(b) for b in order if b not in enabled}
    order = [b for b in order if b in enabled]
    if cached_keys and SDPBackend.CUDNN_ATTENTION in order and len(order) > 1:
        order.remove(SDPBackend.CUDNN_ATTENTION)
        left["cudnn"] = GROWING_KEYS
    if not deterministic:
        return order, left
    allowed = deterministic_backends(device.type, warn_only)
    mode = "torch.use_deterministic_algorithms(True" + (", warn_only=True)" if warn_only else ")")
    left.update({name_of(b): f"not deterministic on {device.type} under {mode}" for b in order if b not in allowed})
    return [b for b in order if b in allowed], left


def _same(tensor):
    return tensor


def _leaves(call: SdpaCall, dtype: torch.dtype | None, grad: bool) -> tuple[torch.Tensor, ...]:
    out = []
    for t in (call.query, call.key, call.value):
        t = t.detach() if dtype is None else t.detach().to(dtype)
        out.append(t.requires_grad_(grad and t.is_floating_point()))
    return tuple(out)


def run_backend(backend: SDPBackend, call: SdpaCall, *, dropout_p: float | None = None,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Forward (under ``backend`` only) and, when the call needs gradients, backward of ``call`` on
    detached copies of its inputs; returns (output, gradients of q, k, v). Saved tensors bypass any
    hooks of the model (checkpointing, activation paging)."""
    grad = call.needs_grad
    q, k, v = _leaves(call, dtype, grad)
    options = call.options(dropout_p)
    if dtype is not None and options["attn_mask"] is not None and options["attn_mask"].is_floating_point():
        options["attn_mask"] = options["attn_mask"].to(dtype)
    with torch.enable_grad() if grad else contextlib.nullcontext(), \
            torch.autograd.graph.saved_tensors_hooks(_same, _same):
        with Pin([backend], call.device.type):
            out = F.scaled_dot_product_attention(q, k, v, **options)
        inputs = [t for t in (q, k, v) if t.requires_grad]
        if not inputs:
            return out, ()
        grads = torch.autograd.grad(out, inputs, _grad_output(call, out))
    return out, grads


def _grad_output(call: SdpaCall, out: torch.Tensor) -> torch.Tensor:
    # Made once per shape (not inside the timed runs), from a seed of its own: the model's random
    # streams are not advanced by measuring.
    # Drawn in float32 and rounded, so the float32 reference and the candidates get the same values.
    key = (tuple(out.shape), out.dtype)
    grad = call.grad_cache.get(key)
    if grad is None:
        wide = call.grad_cache.get(tuple(out.shape))
        if wide is None:
            generator = torch.Generator(out.device).manual_seed(1234)
            wide = call.grad_cache[tuple(out.shape)] = torch.randn(out.shape, dtype=torch.float32, device=out.device,
                                                                   generator=generator)
        grad = call.grad_cache[key] = wide.to(out.dtype)
    return grad


def default_timer(reps: int = 3, min_total_ms: float = 20.0) -> Timer:
    """Median milliseconds of at least ``reps`` runs after one warm-up; on a GPU, CUDA events and as
    many runs (up to 50) as fill ``min_total_ms``, so short kernels are timed as steadily as long ones."""
    def timer(backend: SDPBackend, run: Callable[[], object], device: torch.device) -> float:
        run()
        if device.type == "cuda":
            def timed(count: int) -> list[float]:
                pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                         for _ in range(count)]
                for start, end in pairs:
                    start.record()
                    run()
                    end.record()
                pairs[-1][1].synchronize()
                return [s.elapsed_time(e) for s, e in pairs]
            first = timed(1)[0]
            count = max(reps, min(50, int(min_total_ms / max(first, 1e-3))))
            return statistics.median(timed(count))
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)
    return timer


def refusal(backend: SDPBackend, error: BaseException, caught: list) -> str:
    """Why torch would not run ``backend``: its own warnings when it printed them, else the error."""
    lines = [str(w.message).split(" (Triggered internally")[0].strip() for w in caught]
    header = _HEADERS.get(backend)
    section, inside = [], header is None
    for line in lines:
        if line.endswith("not used because:"):
            inside = header is not None and line.startswith(header)
            continue
        if inside and line:
            section.append(line)
    if section:
        return "; ".join(dict.fromkeys(section))
    text = str(error).strip()
    if "No viable backend" in text:
        return "this torch build has no such kernel for this device"
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


@dataclasses.dataclass
class Measurement:
    """One call shape's result: milliseconds per valid backend, why the others were skipped, the
    relative errors against the float32 math reference, and the fastest valid backend."""

    label: str
    timings_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    chosen: str | None = None
    failed: str | None = None  # the measurement itself failed: this shape is left to PyTorch

    def pick(self) -> str | None:
        """The backend to pin for this shape alone (tie_ranked's first); None when none is valid."""
        ranked = tie_ranked(self.timings_ms, list(self.timings_ms))
        return ranked[0] if ranked else None


def tie_ranked(times_ms: dict[str, float], order: list[str]) -> list[str]:
    """The backends of ``times_ms`` fastest first, except that the first place goes to the earliest in
    ``order`` (PyTorch's priority) within NEAR_TIE of the fastest."""
    ranked = sorted(times_ms, key=lambda n: (times_ms[n], order.index(n)))
    if not ranked:
        return ranked
    limit = times_ms[ranked[0]] + abs(times_ms[ranked[0]]) * NEAR_TIE
    first = min((n for n in ranked if times_ms[n] <= limit), key=order.index)
    return [first, *(n for n in ranked if n != first)]


def _reduced(call: SdpaCall, max_heads: int) -> SdpaCall:
    """The same call on batch 1 and at most ``max_heads`` key/value heads (with their query heads):
    enough to check numerics without the math backend's full attention matrix."""
    q, k, v, mask = call.query, call.key, call.value, call.attn_mask
    if q.dim() < 4:
        return dataclasses.replace(call, dropout_p=0.0)
    hk = min(k.shape[-3], max_heads)
    hq = hk * max(1, q.shape[-3] // k.shape[-3])
    q, k, v = q[:1, :hq], k[:1, :hk], v[:1, :hk]
    if mask is not None:
        if mask.dim() == 4:
            mask = mask[:1] if mask.shape[0] > 1 else mask
            mask = mask[:, :hq] if mask.shape[1] > 1 else mask
        elif mask.dim() == 3 and mask.shape[0] > 1:
            mask = mask[:hq]
    return dataclasses.replace(call, query=q, key=k, value=v, attn_mask=mask, dropout_p=0.0)


def _relative_error(got: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> float:
    worst = 0.0
    for a, b in zip(got, ref):
        b = b.detach().to(torch.float64)
        scale = b.abs().max().item() if b.numel() else 0.0
        diff = (a.detach().to(torch.float64) - b).abs().max().item() if b.numel() else 0.0
        worst = max(worst, diff / max(scale, 1e-12))
    return worst


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


Runner = Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]]


def measure(call: SdpaCall, backends: list[SDPBackend], timer: Timer, *, runner: Runner = run_backend,
            max_check_heads: int = 2) -> Measurement:
    """Times each of ``backends`` on ``call`` (forward + backward when it needs gradients) and checks
    its output and gradients against the math backend in float32 on a slice of the call. A backend
    that torch refuses, that fails, runs out of memory or disagrees is skipped with the reason."""
    device = call.device
    with contextlib.ExitStack() as stack:
        if call.dropout_p > 0:  # timing with dropout draws random numbers: the model's streams stay put
            cuda = device.type == "cuda"
            index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
            stack.enter_context(torch.random.fork_rng(devices=[index] if cuda else []))
        return _measure(call, backends, timer, runner, max_check_heads)


def _measure(call: SdpaCall, backends: list[SDPBackend], timer: Timer, runner: Runner,
             max_check_heads: int) -> Measurement:
    result = Measurement(call.label())
    device = call.device
    small = _reduced(call, max_check_heads)
    with torch.autocast(device.type, enabled=False):
        wide = torch.float64 if call.query.dtype == torch.float64 else torch.float32
        ref_out, ref_grads = runner(SDPBackend.MATH, small, dtype=wide)
    reference = (ref_out, *ref_grads)
    base_out, base_grads = runner(SDPBackend.MATH, small)
    dtype = base_out.dtype
    math_error = _relative_error((base_out, *base_grads), reference)
    limit = max(TOLERANCE.get(dtype, 1e-2), 4 * math_error)
    del base_out, base_grads
    for backend in backends:
        name = name_of(backend)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                runner(backend, call)  # can it run the real shape? (also the warm-up)
            except Exception as error:
                result.skipped[name] = "out of memory at this shape" if _is_oom(error) else \
                    f"refused: {refusal(backend, error, caught)}"
                continue
        try:
            if backend == SDPBackend.MATH:
                error_now = math_error
            else:
                out, grads = runner(backend, small)
                error_now = _relative_error((out, *grads), reference)
                del out, grads
            result.errors[name] = error_now
            if not error_now <= limit:
                result.skipped[name] = (f"disagrees with the math backend: relative error {error_now:.2g} > "
                                        f"{limit:.2g} allowed for {str(dtype).removeprefix('torch.')}")
                continue
            result.timings_ms[name] = float(timer(backend, lambda b=backend: runner(b, call), device))
        except Exception as error:
            result.skipped[name] = "out of memory at this shape" if _is_oom(error) else \
                f"failed: {type(error).__name__}: {str(error).strip()[:200]}"
    result.chosen = result.pick()
    return result
