"""The activation policy of each block: keep (in VRAM), offload (page to host memory), recompute.

``wrap(activation_offload=..., recompute=...)`` each name a set of blocks (``True``: all, ``False``:
none, a fraction: that share of the blocks, the earliest first (backward reaches them last, so their
pages have the longest to come back), or a list of block indices); a block cannot be in both.
``'auto'`` (the default of both) lets measurement decide (``autotune.py``, rules in ``tuner.py``).
"""

from __future__ import annotations

import numbers

import torch
import ts_planner

from .._units import fmt_bytes
from ..engine.hooks import EngineHook
from ..memory.blocks import find_blocks
from .autotune import ActivationTuner, CudaMeter, Meter
from .lora_inputs import CompactLoraInputs, eligible_layers
from .offload import ActivationOffloader
from .recompute import Recompute, uses_hf_checkpointing
from .tuner import Choice

__all__ = ["ActivationPolicy", "blocks_of", "check_block_choice", "check_param_offload", "streamed_blocks_of"]


def check_block_choice(name: str, value):
    """Validates the form of activation_offload= / recompute= (the block count is checked later)."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    if value == "auto":
        return "auto"
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        if 0.0 <= value <= 1.0:
            return float(value)
    elif isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                  for i in value) and len(set(value)) == len(value):
        return list(value)
    raise ValueError(f"{name}={value!r} is not valid; use 'auto', True, False, a fraction in [0, 1] or a list of "
                     f"distinct block indices >= 0")


def check_param_offload(value):
    """param_offload=: the blocks whose frozen weights stream from host memory."""
    if value == "auto":
        return "auto"  # wrap() asks the plan (memory/sizing.py) which blocks must stream
    try:
        return check_block_choice("param_offload", value)
    except ValueError:
        raise ValueError(f"param_offload={value!r} is not valid; use 'auto', True, False, a fraction in [0, 1] or a "
                         f"list of distinct block indices >= 0") from None


def streamed_blocks_of(value, count: int) -> list[int]:
    """The blocks a checked param_offload= value streams. A fraction streams the first blocks of
    ts_planner.spread_order, the blocks the plan prices for that many; listed indices stream as listed."""
    if isinstance(value, float):
        return sorted(ts_planner.spread_order(count)[:round(value * count)])
    return _blocks_of("param_offload", value, count)


def blocks_of(name: str, value, count: int) -> list[int]:
    return _blocks_of(name, value, count)


def _blocks_of(name: str, value, count: int) -> list[int]:
    if value is True:
        return list(range(count))
    if value is False:
        return []
    if isinstance(value, float):
        return list(range(round(value * count)))
    bad = [i for i in value if i >= count]
    if bad:
        raise ValueError(f"{name}={value!r}: the model has {count} blocks, indices {bad} do not exist")
    return sorted(value)


class ActivationPolicy:
    """Applies the policy to the model's blocks; ``remove()`` undoes it; ``report()`` describes it.

    Owns the Recompute wrappers and the ActivationOffloader; with ``'auto'`` also the tuner, whose
    settings it applies between steps (``step_finished()``), never inside one.
    """

    def __init__(self, model: torch.nn.Module, options, device: torch.device, arena, events, *,
                 meter: Meter | None = None, reserved_link_bytes=lambda: 0, reserved_vram_bytes=lambda: 0):
        self.blocks = list(options.blocks) if options.blocks is not None else find_blocks(model)
        offload, recompute = options.activation_offload, options.recompute
        n = len(self.blocks)
        self._events = events
        self.reserved_link_bytes = reserved_link_bytes
        self.reserved_vram_bytes = reserved_vram_bytes
        self._headroom = options.vram_headroom
        self.tuner: ActivationTuner | None = None
        self._pool_trimmed = False  # 'auto': the page pool is cut to the settled setting once
        self._recompute: dict[int, Recompute] = {}
        self.offloader = None
        self.compact: CompactLoraInputs | None = None
        self._config, self._use_cache = getattr(model, "config", None), None
        self._handles, self._hooks = [], []
        self.asked = f"activation_offload={offload!r}, recompute={recompute!r}"
        auto = "auto" in (offload, recompute)
        if auto:
            offload, recompute = self._resolve_auto(model, offload, recompute, device, meter)
        wanted = offload is not False or recompute is not False
        if wanted and not self.blocks:
            raise ValueError("activation_offload= / recompute= need the model's repeated blocks, and find_blocks() "
                             "found none: pass blocks=[...]")
        if wanted and uses_hf_checkpointing(model, self.blocks):
            raise ValueError("the model has Hugging Face gradient checkpointing on (gradient_checkpointing_enable()) "
                             "and trainstream was asked to page or recompute activations too; use one: "
                             "model.gradient_checkpointing_disable(), or leave activation_offload/recompute False")
        tuned = self.tuner is not None
        self.offloaded = [] if tuned else _blocks_of("activation_offload", offload, n)
        self.recomputed = [] if tuned else _blocks_of("recompute", recompute, n)
        both = sorted(set(self.offloaded) & set(self.recomputed))
        if both:
            raise ValueError(f"blocks {both} are asked both to page their activations and to recompute them; "
                             f"give each block one policy")
        try:
            may_recompute = range(n) if tuned and self.tuner.recompute else self.recomputed
            if may_recompute and getattr(self._config, "use_cache", False) is True:
                # A recomputed layer would append its keys and values to the cache a second time.
                self._use_cache, self._config.use_cache = True, False
                events.add("activations", "recompute: the model's KV cache is off while wrapped (use_cache=False), "
                                          "as Hugging Face does for gradient checkpointing")
            variant = options.recompute_variant
            if may_recompute and variant == "selective" and tuned:
                # The tuner prices a recomputed block at its inputs alone; selective blocks also keep
                # their matmul outputs, so the plan ran out of memory in its probe step (docs/benchmarks.md).
                variant = "full"
                events.add("activations", "recompute_variant='selective' is for blocks named with recompute=True "
                                          "or a list; recompute='auto' recomputes whole blocks, since it prices a "
                                          "recomputed block as keeping its inputs only")
            elif may_recompute and variant == "selective":
                events.add("activations", "recompute_variant='selective': recomputed blocks keep their matmul outputs "
                                          "and recompute the rest (attention core, norms, elementwise ops)")
            for i in may_recompute:
                self._recompute[i] = Recompute(self.blocks[i], variant).install()
                self._recompute[i].enabled = i in self.recomputed
            if tuned:
                self._probe_hooks(model)
            candidates = list(range(n)) if tuned and self.tuner.page else ([self._probe] if tuned else self.offloaded)
            if candidates:
                self.offloader = ActivationOffloader(self.blocks, self.offloaded, device=device,
                                                     prefetch_depth=options.prefetch_depth,
                                                     max_inflight_bytes=options.max_inflight_bytes,
                                                     min_bytes=options.min_offload_bytes, arena=arena,
                                                     candidates=candidates).attach()
            self._compact_lora_inputs(model, options.compact_lora_inputs)
        except BaseException:
            self.remove()
            raise
        if tuned:
            self.decision = "'auto': decided at the first forward (a probe of one block)"
        else:
            self.decision = self._describe()
            if wanted:
                events.add("activations", self.decision)

    def _compact_lora_inputs(self, model, asked) -> None:
        """compact_lora_inputs ("auto": on where PEFT layers qualify, silently off elsewhere). Saving the bf16
        source instead of PEFT's float32 copy shrinks what a LoRA block saves (a quarter to a third less), so more
        blocks' activations stay in VRAM and the step can be faster (measured: docs/benchmarks.md)."""
        if asked is False:
            return
        layers = eligible_layers(self.blocks or [model])
        if not layers:
            if asked is True:
                self._events.add("activations", "compact_lora_inputs=True: no PEFT LoRA Linear layer with plain "
                                                "adapters (no dropout, no variant) in the blocks; nothing changed")
            return
        self.compact = CompactLoraInputs(layers)
        self._events.add("activations", f"compact_lora_inputs: {len(layers)} PEFT LoRA layers save the input they "
                                        f"cast to float32 as the 16-bit tensor it was cast from, for backward (half "
                                        f"the bytes, one saved tensor per shared input; gradients bit for bit the same)")

    # ---- 'auto' -------------------------------------------------------------------------

    def _resolve_auto(self, model, offload, recompute, device, meter):
        """Returns the explicit settings left after 'auto' (False for an 'auto' that cannot act),
        creating the tuner when it can."""
        explicit = [v for v in (offload, recompute) if v not in ("auto", False)]
        why = None
        if explicit:
            why = "the other option names its blocks explicitly"
        elif not self.blocks:
            why = "find_blocks() found no repeated blocks (pass blocks=[...] to tune them)"
        elif uses_hf_checkpointing(model, self.blocks):
            why = "Hugging Face gradient checkpointing already recomputes the blocks"
        meter = meter if meter is not None else (CudaMeter(device, self._headroom) if device.type == "cuda" else Meter())
        if why is None and meter.budget() is None:
            why = "the model trains on the CPU: nothing to save in VRAM"
        if why is not None:
            self._events.add("activations", f"'auto' keeps every block's activations: {why}")
            return (False if offload == "auto" else offload), (False if recompute == "auto" else recompute)
        self.tuner = ActivationTuner(len(self.blocks), meter, self._events, page=offload == "auto",
                                     recompute=recompute == "auto", reserved_link_bytes=self._reserved_link,
                                     reserved_vram_bytes=lambda: int(self.reserved_vram_bytes()))
        return False, False

    def _reserved_link(self) -> int:
        return int(self.reserved_link_bytes())

    @property
    def _probe(self) -> int:
        """The block the probe measures: the second when there are two or more (the first's input
        often needs no gradient, so it saves less: 0.62 against 0.70 GiB at 14B LoRA 1 x 2048)."""
        return 1 if len(self.blocks) > 1 else 0

    def _probe_hooks(self, model) -> None:
        probe = self._probe

        def forward_started(_module, _args):
            if torch.is_grad_enabled():
                self.tuner.forward_started()

        def probe_begin(_module, _args):
            if self.tuner.phase == "probe" and torch.is_grad_enabled():
                self.tuner.probe_begin()
                if self.tuner.page:
                    self.offloader.set_paged([probe])
                else:
                    self.offloader.set_paged([], counted=[probe])
                if probe in self._recompute:
                    self._recompute[probe].enabled = False

        def probe_end(_module, _args, _output):
            if self.tuner.phase == "probe" and torch.is_grad_enabled():
                choice = self.tuner.probe_end(self.offloader.block_bytes[probe])
                self._apply(choice, keep_probe=True)

        def timer(index, finished):
            def hook(_module, _args, *_output):
                if torch.is_grad_enabled():
                    (self.tuner.block_finished if finished else self.tuner.block_started)(index)
            return hook

        def first_block(_module, args, kwargs):
            # The watchdog: the first block's input says how many tokens this forward carries.
            if torch.is_grad_enabled():
                hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
                if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
                    choice = self.tuner.forward_tokens(hidden.numel() // hidden.shape[-1])
                    if choice is not None:
                        self._apply(choice)

        self._handles.append(self.blocks[0].register_forward_pre_hook(self._hook(first_block), with_kwargs=True))
        pairs = [(model.register_forward_pre_hook, forward_started),
                 (self.blocks[probe].register_forward_pre_hook, probe_begin),
                 (self.blocks[probe].register_forward_hook, probe_end)]
        for i, block in enumerate(self.blocks):
            pairs += [(block.register_forward_pre_hook, timer(i, False)), (block.register_forward_hook, timer(i, True))]
        for register, fn in pairs:
            self._handles.append(register(self._hook(fn)))

    def _hook(self, fn) -> EngineHook:
        # Eager also around compiled blocks: the tuner's clocks and decisions are host state (traced, CUDA
        # events recorded in a graph were never recorded when their times were read).
        hook = EngineHook(torch.compiler.disable(fn))
        self._hooks.append(hook)
        return hook

    def _apply(self, choice: Choice, keep_probe: bool = False) -> None:
        """Puts a setting in place (between steps, or for the blocks after the probed one during the
        probe, which keeps its own pages this step)."""
        paged, recomputed = list(choice.paged), list(choice.recomputed)
        probe = self._probe
        if self.offloader is not None:
            if keep_probe and self.offloader.paged == [probe]:
                self.offloader.set_paged(sorted(set(paged) | {probe}))
            else:
                self.offloader.set_paged(paged if self.tuner.page else [])
        for i, r in self._recompute.items():
            r.enabled = i in recomputed and not (keep_probe and i == probe)
        self.offloaded, self.recomputed = paged, recomputed
        self.decision = self._describe()

    def step_finished(self) -> None:
        """At each optimizer step, before the updates are issued: the tuner's next setting."""
        if self.tuner is None:
            return
        choice = self.tuner.step_finished()
        if choice is not None:
            self._apply(choice)

    @property
    def settled(self) -> bool:
        return self.tuner is None or self.tuner.settled

    def _describe(self) -> str:
        n = len(self.blocks)
        return (f"{len(self.offloaded)} of {n} blocks page their activations to host memory, "
                f"{len(self.recomputed)} recompute them, {n - len(self.offloaded) - len(self.recomputed)} "
                f"keep them in VRAM ({'chosen by measurement' if self.tuner else 'as asked'}: {self.asked})")

    def policy(self) -> list[str]:
        kinds = ["keep"] * len(self.blocks)
        for i in self.offloaded:
            kinds[i] = "offload"
        for i in self.recomputed:
            kinds[i] = "recompute"
        return kinds

    def sweep(self) -> None:
        """At each step: frees host pages whose copies are done, and grows the page pool to what the
        step needed (page-locking between steps, not inside them)."""
        if self.offloader is None:
            return
        self.offloader._sweep()
        expected = 0
        if self.tuner is not None and self.tuner.measured is not None:
            expected = len(self.offloaded) * self.tuner.measured.block_bytes  # the next step's setting
        if self.tuner is not None and self.tuner.settled and not self._pool_trimmed:
            self._pool_trimmed = True
            released = self.offloader.shrink_pool(expected)
            if released:
                self._events.add("activations", f"released {fmt_bytes(released)} of page-locked memory the "
                                                f"settled setting does not page into")
            return
        try:
            grown = self.offloader.grow_pool(expected)
        except MemoryError as error:
            self.offloader.peak_live_bytes = 0
            self._events.add("activations", f"the page pool could not grow ({error}); pages beyond it are "
                                            f"page-locked one by one, or pageable")
            return
        if grown:
            self._events.add("activations", f"reserved {fmt_bytes(grown)} more page-locked memory for "
                                            f"activation pages (what the next step pages, or the most the "
                                            f"last step held at once)")

    def remove(self) -> None:
        if self.compact is not None:
            self.compact.remove()
            self.compact = None
        for r in self._recompute.values():
            r.remove()
        self._recompute = {}
        for handle in self._handles:
            handle.remove()
        for hook in self._hooks:
            hook.disable()
        self._handles, self._hooks = [], []
        if self._use_cache is not None:
            self._config.use_cache, self._use_cache = self._use_cache, None
        if self.offloader is not None:
            self.offloader.detach()
            self.offloader.synchronize()

    def report(self) -> dict:
        stats = self.offloader.stats() if self.offloader is not None else {}
        out = {"policy": self.policy(), "offloaded_blocks": list(self.offloaded),
               "recompute_blocks": list(self.recomputed),
               "block_bytes": list(self.offloader.block_bytes) if self.offloader else [0] * len(self.blocks),
               "decision": self.decision, "paging": stats,
               "compact_lora_layers": len(self.compact.layers) if self.compact is not None else 0}
        if self.tuner is not None:
            out["tuning"] = {"phase": self.tuner.phase, "history": list(self.tuner.history),
                             "trials": [{"policy": c.policy(len(self.blocks)), "seconds": t, "peak_bytes": p}
                                        for c, t, p in self.tuner.trials],
                             "cap_backoffs": self.tuner.cap_backoffs}
        return out
