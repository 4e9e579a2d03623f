"""AttentionChooser: which scaled-dot-product-attention backend a wrapped model's forward and backward use.

How the pin is applied:
- The first forward of each new input signature (shapes, dtypes, grad mode, autocast, deterministic
  mode) runs under a TorchFunctionMode that sees each ``F.scaled_dot_product_attention`` call; a
  call shape not seen before is measured there (``"auto"``) or checked (a named backend). Later
  forwards of a known signature only enter the pin around the model's forward: a few
  microseconds, no per-op cost.
- Backward: autograd replays the backward of the kernel the forward chose, so the forward's pin
  decides. Recomputation (``torch.utils.checkpoint``, Hugging Face gradient checkpointing,
  ``wrap(recompute=...)``) runs forward again inside backward, outside the forward's context: a hook
  on the model's outputs enters the same pin when the first gradient reaches them and leaves it when
  that backward pass ends, so recomputed attention uses the measured backend too.
- Every pin goes through ``_pin.Pin`` (one process-wide stack), never ``sdpa_kernel``: the switches
  and the priority order are global, pins here end out of order (autograd's final callback, two
  models in one backward, a backward that raised), and ``sdpa_kernel`` restores neither exactly
  (see ``_pin``). When the last pin leaves, the caller's settings are back bit for bit.
- One backward applies one pin, process-wide: a second model's outputs reached in the same backward
  with another pin get an event (its recomputation runs under the first). Settings are global, so
  models trained concurrently in several threads of one process cannot each have their own pin.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from .._events import EventLog
from .._units import fmt_bytes
from ..engine.hooks import EngineHook
from ._calls import SdpaCall, determinism, forward_signature
from ._measure import (
    BACKENDS,
    GROWING_KEYS,
    Measurement,
    Timer,
    candidates,
    default_timer,
    deterministic_backends,
    measure,
    name_of,
    priority_order,
    refusal,
    run_backend,
    tie_ranked,
)
from ._pin import Pin, caller_state, initialize_order

__all__ = ["ATTENTION_MODES", "WRAP_DEFAULT", "AttentionChooser", "AttentionHandle", "check_attention_mode",
           "resolve_wrap_default"]

ATTENTION_MODES = ("auto", "default", "cudnn", "efficient", "flash", "math")
# wrap()'s default when attention= is not given: "auto" for a model on one GPU, "default" otherwise.
WRAP_DEFAULT = "auto on one GPU"


def resolve_wrap_default(mode: str, device: torch.device, world: int, events) -> str:
    """``mode`` as given, or for WRAP_DEFAULT the mode it stands for here (with an event saying why).

    "auto" is the reference's default. It was as fast or faster at 2,048 tokens; on a host-bound
    LoRA step at 512 tokens every mode's kernels took about the same GPU time and the wall times
    differed only by run-to-run spread (measured: docs/attention.md, "What ran where"). On the
    CPU torch has two kernels and its own pick is fine: measuring each
    new shape would cost more than it saves. With data parallel every rank would measure on its own
    and might pin a different kernel (different numerics per rank): a named backend pins one on all.
    """
    if mode != WRAP_DEFAULT:
        return mode
    if device.type != "cuda":
        why = "the model is not on a GPU"
    elif world > 1:
        why = (f"data parallel over {world} ranks: a shape first seen after the ranks' agreement (the first "
               f"steps) would be measured by each rank alone; attention='auto' opts in, a named backend "
               f"(attention='cudnn', 'flash', ...) pins one on every rank")
    else:
        return "auto"
    events.add("attention", f"attention not given: 'default' (PyTorch's choice), since {why}")
    return "default"


def check_attention_mode(value) -> str:
    """Validates ``attention=``: one of ATTENTION_MODES, ``None`` (= ``"default"``) or an SDPBackend."""
    if value is None:
        return "default"
    if isinstance(value, SDPBackend) and value in BACKENDS.values():
        return name_of(value)
    if isinstance(value, str) and value in ATTENTION_MODES:
        return value
    raise ValueError(f"attention={value!r} is not valid; use one of 'auto' (the fastest measured on the model's "
                     f"shapes), 'default' or None (PyTorch's own choice), 'cudnn', 'efficient', 'flash', 'math'")


def attn_implementation(model: torch.nn.Module) -> str | None:
    """The Hugging Face ``config._attn_implementation`` of the model (or of a wrapped inner model)."""
    for module in model.modules():
        config = module.__dict__.get("config")
        impl = getattr(config, "_attn_implementation", None)
        if isinstance(impl, str):
            return impl
    return None


class _Entry:
    """One forward signature: the call shapes its forward made and the pin they give."""

    __slots__ = ("cached_keys", "complete", "device_type", "keys", "pin", "train", "used")

    def __init__(self, train: bool):
        self.train = train  # gradients on when the forward began
        self.device_type = "cpu"
        self.keys: dict[tuple, Measurement] = {}
        self.pin: list[SDPBackend] | None = None
        self.complete = True  # False: a call shape was left unmeasured (no gradients), look again later
        self.used: set[str] = set()  # first backends the discovery forward ran calls under
        # An unmeasured call (no gradients) attended to more keys than it has queries: generation with
        # a KV cache, whose key length grows every step (see _measure.GROWING_KEYS).
        self.cached_keys = False


class _Discovery(TorchFunctionMode):
    def __init__(self, chooser: AttentionChooser, entry: _Entry):
        super().__init__()
        self.chooser, self.entry = chooser, entry

    @torch.compiler.disable  # dynamo mis-traces user modes (a Tensor.device read gave a torch.Size)
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.chooser._discovered_call(self.entry, func, args, kwargs)


_LIVE: list[_BackwardPin] = []  # the backward pin in force now, process-wide (at most one)
_LIVE_LOCK = threading.Lock()


def _in_backward() -> bool:
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # a torch without the getter: assume not
        return False


def release_stale_backward_pins() -> None:
    """Leaves backward pins whose backward raised (autograd runs no final callback then). Called when
    a forward starts outside any backward on this thread: no backward of this process is running."""
    with _LIVE_LOCK:
        stale = list(reversed(_LIVE))
    for pin in stale:
        pin.release()


class _BackwardPin:
    """Enters the pin when the first gradient reaches one of a forward's outputs; leaves it when that
    backward pass ends (autograd's final callback). One backward through several forwards' outputs
    (DPO's chosen and rejected, two wrapped models) enters only the first pin reached; a different
    pin reached later is reported (``conflict``): its recomputation runs under the first."""

    def __init__(self, backends: list[SDPBackend], device_type: str, conflict: Callable[[list, list], None]):
        self.backends, self.conflict = backends, conflict
        self.pin = Pin(backends, device_type)

    @torch.compiler.disable  # hooks and pins run eagerly, also under compiled autograd
    def __call__(self, grad):
        with _LIVE_LOCK:
            if self in _LIVE:
                return None
            if _LIVE:
                running = _LIVE[0]
                if running.backends != self.backends:
                    self.conflict(running.backends, self.backends)
                return None
            self.pin.enter()
            _LIVE.append(self)
        torch.autograd.Variable._execution_engine.queue_callback(self.release)
        return None

    @torch.compiler.disable
    def release(self) -> None:
        with _LIVE_LOCK:
            if self in _LIVE:
                _LIVE.remove(self)
        self.pin.exit()


def _output_tensors(value, out: list, depth: int = 0) -> None:
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            out.append(value)
    elif depth < 3 and isinstance(value, Mapping):
        for item in value.values():
            _output_tensors(item, out, depth + 1)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            _output_tensors(item, out, depth + 1)


class AttentionHandle:
    """What ``AttentionChooser.install`` returns; ``remove()`` takes the hooks off (idempotent)."""

    def __init__(self, chooser: AttentionChooser, handles: list, hooks: list[EngineHook]):
        self._chooser, self._handles, self._hooks = chooser, handles, hooks

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for hook in self._hooks:
            hook.disable()
        self._handles, self._hooks = [], []
        if self._chooser is not None:
            self._chooser._detached()
            self._chooser = None


class AttentionChooser:
    """Chooses the attention backend of one model: ``mode`` as ``wrap(attention=...)``.

    ``"auto"``: each new call shape is measured (forward + backward, ``timer``) and the fastest
    backend that runs it and agrees with the math backend is pinned; ``"default"``: nothing is
    changed; a backend name: that backend first, PyTorch's order for shapes it cannot run.
    ``events``: an EventLog (or anything with ``add(kind, message)``). ``timer(backend, run,
    device) -> ms`` replaces the CUDA-event timer (tests). ``may_reset_peak()``: when it returns
    True, a measurement that raised the CUDA peak-memory counter resets it, so the measurement
    does not count as the step's peak. ``max_shapes``: after that many call shapes measured (or
    checked), a new shape of a known family (the same call but for batch size and lengths: dynamic
    padding) reuses the choice of the nearest measured length instead of measuring.
    """

    def __init__(self, mode="auto", *, events=None, timer: Timer | None = None, reps: int = 3,
                 max_check_heads: int = 2, may_reset_peak: Callable[[], bool] | None = None,
                 max_shapes: int = 16):
        self.mode = check_attention_mode(mode)
        self.events = events if events is not None else EventLog()
        self.timer = timer if timer is not None else default_timer(reps)
        self.max_check_heads = max_check_heads
        self.may_reset_peak = may_reset_peak
        self.max_shapes = max_shapes
        self.left_alone: str | None = None
        self._measured = 0
        self._families: dict[tuple, list[tuple[tuple[int, int, int], Measurement]]] = {}
        self._reused = 0
        self._known: dict[tuple, Measurement] = {}
        self._entries: dict[tuple, _Entry] = {}
        self._labels: dict[str, Measurement] = {}
        self._installed = False
        self._depth = 0
        self._current: _Entry | None = None
        self._signature: tuple = ()
        self._forward_pin: Pin | None = None
        self._mode_ctx: _Discovery | None = None
        self._last_backend: str | None = None
        self._no_calls_reported = False
        self._conflict_reported = False
        self._generation_reported = False

    # ---- install / remove -------------------------------------------------------------

    def install(self, model: torch.nn.Module) -> AttentionHandle:
        """Hooks ``model``'s forward (nothing for ``"default"`` or a model that does not use SDPA)."""
        if self._installed:
            raise RuntimeError("this AttentionChooser is already installed on a model; remove() its handle first")
        if self.mode == "default":
            self.events.add("attention", "attention='default': PyTorch picks the kernel of each attention call")
            return AttentionHandle(None, [], [])
        impl = attn_implementation(model)
        if impl is not None and "sdpa" not in impl.split("|"):
            self.left_alone = (f"the model computes attention with attn_implementation={impl!r}, not "
                               f"scaled_dot_product_attention")
            self.events.add("attention", f"attention={self.mode!r} left alone: {self.left_alone}; load the model "
                                         f"with attn_implementation='sdpa' to let trainstream choose the kernel")
            return AttentionHandle(None, [], [])
        pre, post = EngineHook(self._pre), EngineHook(self._post)
        handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
                   model.register_forward_hook(post, with_kwargs=True, always_call=True)]
        self._installed = True
        what = ("the fastest backend measured on each new attention shape (forward + backward)"
                if self.mode == "auto" else f"the {self.mode} backend first, PyTorch's order where it cannot run")
        self.events.add("attention", f"attention={self.mode!r}: {what}, pinned around forward and backward")
        return AttentionHandle(self, handles, [pre, post])

    def _detached(self) -> None:
        if self._mode_ctx is not None:
            mode, self._mode_ctx = self._mode_ctx, None
            mode.__exit__(None, None, None)
        self._exit_forward_pin()
        if not _in_backward():
            release_stale_backward_pins()
        self._installed, self._depth = False, 0

    # ---- forward hooks ------------------------------------------------------------------

    # Hooks, measuring and pins run eagerly under torch.compile (dynamo would trace the measurement
    # and the locks): a graph break at each, and the compiled region is traced under the pin.
    @torch.compiler.disable
    def _pre(self, module, args, kwargs):
        if self._depth == 0 and not _in_backward():
            release_stale_backward_pins()
        self._depth += 1
        if self._depth > 1:
            return None
        signature = forward_signature(args, kwargs)
        entry = self._entries.get(signature)
        if entry is None:
            entry = _Entry(torch.is_grad_enabled())
            self._entries[signature] = entry
            mode = _Discovery(self, entry)
            mode.__enter__()
            self._mode_ctx = mode
        elif entry.pin:
            self._forward_pin = Pin(entry.pin, entry.device_type).enter()
        self._current = entry
        self._signature = signature
        return None

    @torch.compiler.disable
    def _post(self, module, args, kwargs, output):
        if self._depth == 0:  # a hook before ours raised: our pre-hook never ran
            return None
        self._depth -= 1
        if self._depth > 0:
            return None
        entry, self._current = self._current, None
        if self._mode_ctx is not None:
            mode, self._mode_ctx = self._mode_ctx, None
            mode.__exit__(None, None, None)
            if output is None:  # the forward raised (or returned nothing): look at its calls again next time
                self._entries.pop(self._signature, None)
            else:
                self._finish(entry)
        self._exit_forward_pin()
        if entry is None:
            return None
        if entry.pin:
            self._last_backend = name_of(entry.pin[0])
        if entry.pin and output is not None and torch.is_grad_enabled():
            tensors: list[torch.Tensor] = []
            _output_tensors(output, tensors)
            if tensors:
                pin = _BackwardPin(entry.pin, entry.device_type, self._conflict)
                for tensor in tensors:
                    tensor.register_hook(pin)
        return None

    def _exit_forward_pin(self) -> None:
        if self._forward_pin is not None:
            pin, self._forward_pin = self._forward_pin, None
            pin.exit()

    def _conflict(self, running: list[SDPBackend], wanted: list[SDPBackend]) -> None:
        if not self._conflict_reported:
            self._conflict_reported = True
            self.events.add("attention", f"one backward runs through forwards pinned differently "
                                         f"({[name_of(b) for b in running]} and {[name_of(b) for b in wanted]}): "
                                         f"recomputation in that backward uses the first")

    def _finish(self, entry: _Entry) -> None:
        if not entry.keys and entry.complete and not self._no_calls_reported and torch.is_grad_enabled():
            self._no_calls_reported = True
            self.events.add("attention", "the model's forward made no scaled_dot_product_attention call: "
                                         "nothing to choose")
        if (entry.pin and len(entry.used) > 1) or (entry.pin and entry.used and name_of(entry.pin[0]) not in entry.used):
            self.events.add("attention", f"this forward's attention shapes differ in their fastest backend; "
                                         f"the first forward ran them under {sorted(entry.used)}, later ones under "
                                         f"{[name_of(b) for b in entry.pin]} in that order")

    # ---- one attention call in a discovery forward ----------------------------------------

    @torch.compiler.disable
    def _discovered_call(self, entry: _Entry, func, args, kwargs):
        try:
            call = SdpaCall.from_args(args, kwargs)
            call.train = entry.train
            key = call.key_of()
        except Exception:  # e.g. nested tensors (no strides): left to PyTorch
            entry.complete = False
            return func(*args, **kwargs)
        result = self._known.get(key)
        wanted = result is None and (self.mode != "auto" or call.needs_grad)
        if wanted and self._measured >= self.max_shapes:
            result = self._nearest(call)  # None for a new family: measured all the same
        if wanted and result is None:
            result = self._guarded(self._check_named if self.mode != "auto" else self._measure, call)
            self._measured += 1
            if result.failed is None:
                self._families.setdefault(call.family_of(), []).append((call.size_of(), result))
        elif result is None:
            entry.complete = False
            entry.cached_keys |= call.cached_keys
        if result is not None:
            self._known[key] = result
            entry.keys.setdefault(key, result)
        entry.device_type = call.device.type
        entry.pin = self._pin(entry)
        if not entry.pin:
            return func(*args, **kwargs)
        entry.used.add(name_of(entry.pin[0]))
        with Pin(entry.pin, entry.device_type):
            return func(*args, **kwargs)

    def _nearest(self, call: SdpaCall) -> Measurement | None:
        """The measurement of the same family nearest in lengths (then batch), or None (measure)."""
        measured = self._families.get(call.family_of())
        if not measured:
            return None
        batch, q_len, k_len = call.size_of()
        _, result = min(measured, key=lambda m: (abs(m[0][1] - q_len) + abs(m[0][2] - k_len), abs(m[0][0] - batch)))
        self._reused += 1
        if self._reused == 1:
            self.events.add("attention", f"{self.mode}: {self.max_shapes} attention shapes measured; new shapes of a "
                                         f"known kind use the choice made at the nearest length ({call.label()} -> "
                                         f"{result.label}), the next ones without an event; "
                                         f"memory_report()['attention']['reused_shapes'] counts them")
        return result

    def _guarded(self, how, call: SdpaCall) -> Measurement:
        """Measuring must never break the forward: a failure leaves this shape to PyTorch's order."""
        try:
            return how(call)
        except Exception as error:  # reported in the events
            label = call.label()
            why = f"{type(error).__name__}: {str(error).strip()[:200]}"
            self.events.add("attention", f"{self.mode}, {label}: measuring failed ({why}); PyTorch's own order "
                                         f"runs this shape")
            result = Measurement(label, failed=why)
            self._labels[label] = result
            return result

    def _runner(self, backend: SDPBackend, call: SdpaCall, **kwargs):
        """Runs one backend on a call (forward + backward); tests override it to fake a wrong kernel."""
        return run_backend(backend, call, **kwargs)

    def _measure(self, call: SdpaCall) -> Measurement:
        device = call.device
        initialize_order(device)  # torch's own (lazy) default order decides ties and the fallbacks
        deterministic, warn_only = determinism()
        backends, left_out = candidates(device, deterministic, warn_only, cached_keys=call.cached_keys)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        result = measure(call, backends, self.timer, runner=self._runner, max_check_heads=self.max_check_heads)
        result.skipped.update(left_out)
        self._labels[result.label] = result
        reset = ""
        if device.type == "cuda" and torch.cuda.max_memory_allocated(device) > peak:
            extra = torch.cuda.max_memory_allocated(device) - peak
            if self.may_reset_peak is not None and self.may_reset_peak():
                torch.cuda.reset_peak_memory_stats(device)
                reset = f"; its {fmt_bytes(extra)} peak is not counted in the step's peak"
            else:
                reset = f"; it raised the peak by {fmt_bytes(extra)}"
        times = ", ".join(f"{name} {ms:.3f} ms" for name, ms in sorted(result.timings_ms.items(), key=lambda x: x[1]))
        skipped = "; ".join(f"{name} skipped: {why}" for name, why in result.skipped.items())
        self.events.add("attention", f"auto, {result.label}: {times or 'no backend ran'} -> "
                                     f"{result.chosen or 'math'}" + (f"; {skipped}" if skipped else "") + reset)
        # Signatures left incomplete (no-grad forwards that met this shape unmeasured) look again.
        self._entries = {s: e for s, e in self._entries.items() if e.complete}
        return result

    def _check_named(self, call: SdpaCall) -> Measurement:
        name = self.mode
        backend = BACKENDS[name]
        result = Measurement(call.label())
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                self._runner(backend, call)
                result.chosen = name
            except Exception as error:
                result.skipped[name] = refusal(backend, error, caught)
        deterministic, warn_only = determinism()
        if result.chosen and deterministic and backend not in deterministic_backends(call.device.type, warn_only):
            self.events.add("attention", f"attention={name!r} at {result.label}: not deterministic under "
                                         f"torch.use_deterministic_algorithms; used as asked")
        if not result.chosen:
            self.events.add("attention", f"attention={name!r} cannot run {result.label} ({result.skipped[name]}): "
                                         f"PyTorch's next backend in its order runs it")
        self._labels[result.label] = result
        return result

    def _pin(self, entry: _Entry) -> list[SDPBackend] | None:
        """The backends enabled around this signature's forward and backward, in priority order."""
        enabled = caller_state().enabled  # what the caller turned off stays off (a named backend aside)
        if self.mode != "auto":
            if not entry.keys or any(m.failed for m in entry.keys.values()):
                return None
            named = BACKENDS[self.mode]
            ranked = [named, *(b for b in priority_order() if b != named and b in enabled)]
        else:
            measured = [m for m in entry.keys.values() if m.failed is None]
            if not measured:
                return self._generation_pin(entry, enabled)
            order = [name_of(b) for b in priority_order()]
            valid = set.intersection(*(set(m.timings_ms) for m in measured))
            names = tie_ranked({n: sum(m.timings_ms[n] for m in measured) for n in valid}, order)
            ranked = [BACKENDS[n] for n in names]
            if SDPBackend.MATH not in ranked and SDPBackend.MATH in enabled:
                ranked.append(SDPBackend.MATH)  # the fallback that runs every shape
        if entry.device_type == "cpu":
            # torch's CPU dispatcher ignores the priority order (flash, then math): enable only the
            # chosen backend, with math behind it as the fallback.
            return ranked[:1] + ([SDPBackend.MATH] if SDPBackend.MATH in ranked[1:] else [])
        return ranked

    def _generation_pin(self, entry: _Entry, enabled) -> list[SDPBackend] | None:
        """For an unmeasured forward on CUDA whose attention keys outnumber its queries (generation with
        a KV cache): PyTorch's order without cuDNN, which would build a graph for every new key length
        (GROWING_KEYS). None (PyTorch's own choice) elsewhere, or when the caller left only cuDNN on."""
        if not entry.cached_keys or entry.device_type != "cuda" or SDPBackend.CUDNN_ATTENTION not in enabled:
            return None
        ranked = [b for b in priority_order() if b in enabled and b != SDPBackend.CUDNN_ATTENTION]
        if not ranked:
            return None
        if not self._generation_reported:
            self._generation_reported = True
            self.events.add("attention", f"auto: forwards without gradients whose keys outnumber their queries "
                                         f"(generation with a KV cache) run under {[name_of(b) for b in ranked]}, "
                                         f"not cuDNN: {GROWING_KEYS}")
        return ranked

    # ---- data parallel ------------------------------------------------------------------------

    def timings_to_share(self) -> dict[str, dict[str, float]]:
        """{shape label: {backend: ms}} of every shape measured here: what ``adopt`` takes from each rank."""
        return {label: dict(m.timings_ms) for label, m in self._labels.items() if m.failed is None and m.timings_ms}

    def adopt(self, everyone: list[dict[str, dict[str, float]]]) -> int:
        """Data parallel: ``everyone`` is each rank's ``timings_to_share()`` (the same list on every
        rank). A shape every rank measured takes the mean of the ranks' timings over the backends
        valid on all of them, so every rank ranks it alike and pins the same backends (one numerics
        for the whole run). Returns how many shapes changed their choice."""
        if self.mode != "auto" or not everyone:
            return 0
        changed = 0
        for label in set.intersection(*(set(t) for t in everyone)):
            m = self._labels.get(label)
            if m is None or m.failed is not None:
                continue
            names = [n for n in m.timings_ms if all(n in t[label] for t in everyone)]
            if not names:
                continue
            before = m.chosen
            m.timings_ms = {n: sum(t[label][n] for t in everyone) / len(everyone) for n in names}
            m.chosen = m.pick()
            changed += m.chosen != before
        for entry in self._entries.values():
            if entry.keys:
                entry.pin = self._pin(entry)
        return changed

    # ---- report ----------------------------------------------------------------------------

    def report(self) -> dict:
        """For ``memory_report(model)["attention"]``: ``mode``, ``backend`` (of the latest forward),
        ``timings_ms`` {shape: {backend: ms}}, ``chosen`` {shape: backend}, ``skipped`` {shape:
        {backend: reason}}, ``errors`` (relative error against math in float32), ``left_alone`` and
        ``reused_shapes`` (shapes past ``max_shapes`` that took the nearest measured choice)."""
        backend = self.mode if self.mode not in ("auto", "default") and not self.left_alone else self._last_backend
        return {
            "mode": self.mode,
            "backend": None if self.left_alone or self.mode == "default" else backend,
            "timings_ms": {label: dict(m.timings_ms) for label, m in self._labels.items()},
            "chosen": {label: m.chosen for label, m in self._labels.items()},
            "skipped": {label: dict(m.skipped) for label, m in self._labels.items() if m.skipped},
            "errors": {label: dict(m.errors) for label, m in self._labels.items() if m.errors},
            "failed": {label: m.failed for label, m in self._labels.items() if m.failed},
            "left_alone": self.left_alone,
            "reused_shapes": self._reused,
        }
