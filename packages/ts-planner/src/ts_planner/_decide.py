"""The decision: does a set of options fit the budget (check_plan), and which options fit, changing as
little as possible (plan_memory). Both return a Plan: the numbers, what overflows, and why."""

from __future__ import annotations

import dataclasses

from ._budget import Budget
from ._memory import MemoryEstimate, Options, estimate_memory
from ._planner import spread_order
from ._shape import LORA_TARGETS, ModelShape

__all__ = ["Plan", "check_plan", "plan_memory"]

GiB = float(1 << 30)
_QUANT_AUTO = (None, "int8", "nf4")
# What to try when a budget overflows, by (budget, largest category), in trainstream.wrap()'s option names:
# the words reach users through trainstream's refusals and `trainstream plan`.
_STREAM = "param_offload='auto' (the blocks' weights stream from host RAM)"
_ADVICE = {
    ("VRAM", "activations_kept"): "activation_offload='auto' and recompute='auto' (page or recompute them)",
    ("VRAM", "activations_recompute"): "a smaller batch or shorter sequences",
    ("VRAM", "activations_paged"): "a smaller batch or shorter sequences",
    ("VRAM", "optimizer_state"): "offload=True (AdamW state in host RAM)",
    ("VRAM", "gradients"): "optimizer_mode='cpu' (gradients leave for host RAM as they are made)",
    ("VRAM", "frozen_weights"): f"quantize='nf4' or {_STREAM}",
    ("VRAM", "trained_weights"): f"{_STREAM} or LoRA adapters",
    ("VRAM", "stream_buffers"): "quantize='nf4' (smaller blocks to stream)",
    ("VRAM", "output_and_loss"): "the chunked loss (trainstream.chunked_cross_entropy; TrainStreamTrainer's "
                                 "chunked_loss) or fewer tokens per step",
    ("VRAM", "hidden_states"): "fewer tokens per step",
    ("VRAM", "backward_working_set"): "fewer tokens per step",
    ("VRAM", "cuda_context"): "a GPU with more memory",
    ("host RAM", "optimizer_state"): "moment_dtype='bfloat16', LoRA adapters, or more host RAM",
    ("host RAM", "streamed_weights"): "quantize='nf4' (smaller streamed blocks) or more host RAM",
    ("host RAM", "activation_pages"): "recompute=True instead of paging (activation_offload=False)",
    ("host RAM", "runtime"): "more host RAM",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A plan and its numbers. ``fits``: every budget holds. ``overflow``: (budget, largest category there,
    bytes over) for each budget that does not. Lower bound of a step (seconds) = max of ``compute_s``,
    ``link_s``, ``host_optimizer_s``, ``disk_s`` (the state on disk read, and written: the longest of
    reading it at the read rate, writing it at the write rate, and moving both at the rate the disk reads
    and writes at once) and ``network_s`` (what the rank sends to the others, data parallel or FSDP2). ``choices``: what the planner decided, and why."""

    fits: bool
    shape: ModelShape
    options: Options
    budget: Budget
    estimate: MemoryEstimate
    overflow: tuple[tuple[str, str, int], ...]
    compute_s: float
    link_s: float
    host_optimizer_s: float
    reason: str
    choices: tuple[str, ...] = ()
    disk_s: float = 0.0
    network_s: float = 0.0

    @property
    def lower_bound_s(self) -> float:
        return max(self.compute_s, self.link_s, self.host_optimizer_s, self.disk_s, self.network_s)

    @property
    def peak_vram_bytes(self) -> int:
        """Predicted peak of the caching allocator (the CUDA context is apart)."""
        return self.estimate.allocator_bytes

    @property
    def host_bytes(self) -> int:
        return self.estimate.host_bytes

    @property
    def streamed(self) -> tuple[int, ...]:
        """Indices of the blocks whose weights stream from host RAM: spread through the stack, as
        plan_residency spreads them."""
        layers = self.shape.num_hidden_layers
        return tuple(sorted(spread_order(layers)[:self.options.streamed_blocks]))

    @property
    def resident(self) -> tuple[int, ...]:
        streamed = set(self.streamed)
        return tuple(i for i in range(self.shape.num_hidden_layers) if i not in streamed)

    def to_dict(self) -> dict:
        """The plan as plain JSON types (bytes as integers, seconds as floats)."""
        keep, page, recompute = self.options.activation_counts(self.shape.num_hidden_layers)
        o = self.options
        return {
            "fits": self.fits, "reason": self.reason, "train": o.train,
            "lora_rank": o.lora_rank if o.train == "lora" else None, "batch": o.batch, "seq": o.seq,
            "quantize": o.quantize, "moment_dtype": o.moment_dtype, "optimizer": o.optimizer,
            "loss_chunk": o.loss_chunk, "resident_blocks": len(self.resident), "streamed_blocks": len(self.streamed),
            "streamed_block_indices": list(self.streamed), "streamed_shared_by": o.streamed_shared_by,
            "compact_lora_inputs": o.compact_lora_inputs, "stream_packing": o.stream_packing,
            "embedding_on_host": o.embedding_on_host, "disk_state_share": o.disk_state_share,
            "disk_bytes": self.estimate.disk_bytes, "fsdp_shards": o.fsdp_shards,
            "network_bytes": self.estimate.network_bytes,
            "activations": {"keep": keep, "page": page, "recompute": recompute},
            "peak_vram_bytes": self.peak_vram_bytes, "cuda_context_bytes": self.estimate.vram["cuda_context"],
            "host_bytes": self.host_bytes, "pinned_bytes": self.estimate.pinned_bytes,
            "budget": {"vram_bytes": self.budget.vram_bytes, "usable_vram_bytes": self.budget.usable_vram,
                       "host_bytes": self.budget.host_bytes, "pinned_bytes": self.budget.pinned_bytes},
            "vram": dict(self.estimate.vram), "host": dict(self.estimate.host),
            "activation_bytes_per_block": self.estimate.saved_bytes,
            "lower_bound_s": {"total": self.lower_bound_s, "compute": self.compute_s, "link": self.link_s,
                              "host_optimizer": self.host_optimizer_s, "disk": self.disk_s,
                              "network": self.network_s},
            "overflow": [{"budget": b, "category": c, "bytes": n} for b, c, n in self.overflow],
            "choices": list(self.choices),
        }

    def explain(self) -> str:
        """The plan as text: the verdict, the choices, VRAM and host RAM by category, the lower bound."""
        o, e, b = self.options, self.estimate, self.budget
        keep, page, recompute = o.activation_counts(self.shape.num_hidden_layers)
        what = "full fine-tune" if o.train == "full" else f"LoRA r={o.lora_rank}"
        lines = [f"{'fits' if self.fits else 'does not fit'}: {self.reason}",
                 f"model: {self.shape.total_params / 1e9:.2f} B parameters, {self.shape.num_hidden_layers} blocks; "
                 f"{what}, {o.batch} x {o.seq} tokens, {e.trained_params / 1e6:.1f} M trained",
                 f"plan: quantize={o.quantize or 'none'}, optimizer on the {o.optimizer}, moments {o.moment_dtype}, "
                 f"{len(self.resident)} blocks resident / {len(self.streamed)} streamed, activations: {keep} kept, "
                 f"{page} paged, {recompute} recomputed ({e.saved_bytes / GiB:.3f} GiB per block)"]
        lines += [f"  - {c}" for c in self.choices]
        lines.append(f"VRAM: {e.allocator_bytes / GiB:.2f} GiB peak of {b.usable_vram / GiB:.2f} GiB usable "
                     f"({b.vram_bytes / GiB:.2f} GiB less {b.headroom:.0%} headroom), CUDA context "
                     f"{e.vram['cuda_context'] / GiB:.2f} GiB apart")
        lines += [f"  {k:<22} {v / GiB:8.3f} GiB" for k, v in e.vram.items() if v and k != "cuda_context"]
        lines.append(f"host RAM: {e.host_bytes / GiB:.2f} GiB of {b.host_bytes / GiB:.2f} GiB, page-locked "
                     f"{e.pinned_bytes / GiB:.2f} GiB of {b.pinned_bytes / GiB:.2f} GiB")
        lines += [f"  {k:<22} {v / GiB:8.3f} GiB" for k, v in e.host.items() if v]
        lines.append(f"lower bound {self.lower_bound_s:.3f} s/step = max(compute {self.compute_s:.3f} s at "
                     f"{b.matmul_tflops:.0f} TFLOP/s, link {self.link_s:.3f} s at {b.link_gbps:.1f} GB/s, host AdamW "
                     f"{self.host_optimizer_s:.3f} s at {b.host_adamw_params_per_s / 1e9:.2f} G params/s"
                     + (f", disk {self.disk_s:.3f} s for {e.disk_bytes / GiB:.2f} GiB read and written at "
                        f"{b.disk_read_gbps:.2f} / {b.disk_write_gbps:.2f} / {b.disk_mixed_gbps:.2f} GB/s (read / "
                        f"write / both)" if e.disk_bytes else "")
                     + (f", network {self.network_s:.3f} s for {e.network_bytes / GiB:.2f} GiB sent at "
                        f"{b.network_gbps:.0f} GB/s" if e.network_bytes else "") + ")")
        return "\n".join(lines)


# The budgets _overflow names, by the part of the search that can change them.
_PARTS = {"vram": ("VRAM",), "host": ("host RAM", "page-locked RAM")}


def _overflow(e: MemoryEstimate, budget: Budget) -> tuple[tuple[str, str, int], ...]:
    """The fit rule, the only one: (budget, its largest category, bytes over) for each budget `e` exceeds."""
    def largest(parts: dict, skip=()) -> str:
        return max((k for k in parts if k not in skip), key=lambda k: parts[k])

    out = []
    if e.allocator_bytes > budget.usable_vram:
        out.append(("VRAM", largest(e.vram, ("cuda_context",)), e.allocator_bytes - budget.usable_vram))
    elif budget.device_bytes is not None and e.device_bytes > budget.device_bytes:
        out.append(("VRAM", "cuda_context", e.device_bytes - budget.device_bytes))
    if e.host_bytes > budget.host_bytes:
        out.append(("host RAM", largest(e.host), e.host_bytes - budget.host_bytes))
    if e.pinned_bytes > budget.pinned_bytes:
        out.append(("page-locked RAM", largest(e.pinned), e.pinned_bytes - budget.pinned_bytes))
    return tuple(out)


# Advice that the options already follow, replaced by what is left to try.
_ADVICE_TAKEN = {
    ("host RAM", "optimizer_state"): (lambda o: o.moment_dtype == "bfloat16", "LoRA adapters, or more host RAM"),
    ("VRAM", "frozen_weights"): (lambda o: o.quantize == "nf4", _STREAM),
    ("VRAM", "activations_kept"): (lambda o: o.page + o.recompute > 0, "more blocks recomputed or paged"),
    # Data parallel keeps every gradient until step(), whatever the optimizer's place: only sharding frees it.
    ("VRAM", "gradients"): (lambda o: o.state_shared_by > 1,
                            "FSDP2 (fully_shard the model, then wrap(); `trainstream plan --fsdp`): data parallel "
                            "keeps every gradient, and its bucket copy, in VRAM until step()"),
}


def _refusal(plan_overflow, e: MemoryEstimate, budget: Budget, options: Options) -> str:
    parts = []
    for name, category, over in plan_overflow:
        need, have = {"VRAM": (e.allocator_bytes, budget.usable_vram), "host RAM": (e.host_bytes, budget.host_bytes),
                      "page-locked RAM": (e.pinned_bytes, budget.pinned_bytes)}[name]
        if category == "cuda_context":
            need, have = e.device_bytes, budget.device_bytes or 0
        size = (e.vram if name == "VRAM" else e.host)[category]
        key = ("host RAM" if name == "page-locked RAM" else name, category)
        advice = _ADVICE.get(key, "more memory")
        if key in _ADVICE_TAKEN and _ADVICE_TAKEN[key][0](options):
            advice = _ADVICE_TAKEN[key][1]
        parts.append(f"needs {need / GiB:.1f} GiB of {name}, {have / GiB:.1f} available, {over / GiB:.1f} short "
                     f"(the largest part: {category} {size / GiB:.1f} GiB): use {advice}")
    return "; ".join(parts)


def check_plan(shape: ModelShape, budget: Budget, options: Options, choices: tuple[str, ...] = ()) -> Plan:
    """Whether `options` fit `budget` for `shape`, with the numbers (never raises for a plan that does not fit)."""
    e = estimate_memory(shape, options)
    over = _overflow(e, budget)
    compute = e.flops / (budget.matmul_tflops * 1e12)
    link = max(e.h2d_bytes, e.d2h_bytes) / (budget.link_gbps * 1e9)
    host = e.host_optimizer_params / budget.host_adamw_params_per_s
    disk = max(e.disk_bytes / (budget.disk_read_gbps * 1e9), e.disk_bytes / (budget.disk_write_gbps * 1e9),
               2 * e.disk_bytes / (budget.disk_mixed_gbps * 1e9))
    network = e.network_bytes / (budget.network_gbps * 1e9)
    if over:
        reason = _refusal(over, e, budget, options)
    else:
        reason = (f"{e.allocator_bytes / GiB:.2f} GiB of {budget.usable_vram / GiB:.2f} GiB usable VRAM, "
                  f"{e.host_bytes / GiB:.2f} GiB of {budget.host_bytes / GiB:.2f} GiB host RAM")
    return Plan(not over, shape, options, budget, e, over, compute, link, host, reason, tuple(choices), disk, network)


def _auto(value, name: str, choices: tuple) -> tuple:
    if value == "auto":
        return choices
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; use 'auto' or one of {', '.join(map(repr, choices))}")
    return (value,)


def plan_memory(shape: ModelShape, budget: Budget, *, batch: int = 1, seq: int = 2048, train: str = "full",
                lora_rank: int = 16, lora_targets: tuple[str, ...] = LORA_TARGETS, adapter_dtype: str = "float32",
                dtype: str = "bfloat16", quantize="auto", optimizer: str = "auto", moment_dtype: str = "auto",
                activations="auto", streamed_blocks="auto", loss_chunk: int | None = None,
                prefer: str = "exact", streamed_shared_by: int = 1, state_shared_by: int = 1,
                compact_lora_inputs: bool = False,
                stream_packing: float = 1.0, embedding_on_host: bool = False, disk_state_share: float = 0.0,
                fsdp_shards: int = 1) -> Plan:
    """The plan that fits changing the least, or the closest one with ``fits=False`` and the reason.

    Every argument given a value stays as given; each "auto" is chosen. In order of preference: no
    quantization (int8, then NF4, only when nothing else fits; ``prefer="speed"`` takes them before any
    block streams), fewest streamed blocks, fewest blocks recomputed or paged (whichever the rates make
    cheaper per block), the optimizer on the GPU, fp32 moments. ``activations``: "auto", "keep",
    "recompute", "page" or (keep, page, recompute). More memory never quantizes, streams or recomputes more.
    ``streamed_shared_by``: processes of this machine sharing one host copy of the streamed frozen weights.
    ``state_shared_by``: data-parallel ranks splitting the host optimizer state (``state_share``).
    ``compact_lora_inputs``: LoRA layers save their 16-bit input (``Options``). ``stream_packing``: the fraction
    of a streamed block's frozen bytes that cross the link; ``embedding_on_host``: the frozen input embedding
    lives in host memory (both ``Options``).
    """
    if prefer not in ("exact", "speed"):
        raise ValueError(f"prefer={prefer!r} is not valid; use 'exact' or 'speed'")
    if disk_state_share and optimizer == "auto":
        optimizer = "host"  # the state on disk is host AdamW's
    layers = shape.num_hidden_layers
    base = Options(batch=batch, seq=seq, train=train, lora_rank=lora_rank, lora_targets=tuple(lora_targets),
                   adapter_dtype=adapter_dtype, dtype=dtype, loss_chunk=loss_chunk,
                   streamed_shared_by=streamed_shared_by, state_shared_by=state_shared_by,
                   compact_lora_inputs=compact_lora_inputs,
                   stream_packing=stream_packing, embedding_on_host=embedding_on_host,
                   disk_state_share=disk_state_share, fsdp_shards=fsdp_shards)
    if quantize == "none":
        quantize = None
    if quantize == "auto":
        quants = (None,) if train == "full" else _QUANT_AUTO
    else:
        quants = (dataclasses.replace(base, quantize=quantize).quantize,)  # validated by Options
    # fp32 moments before the optimizer's place: bf16 moments only where no fp32 combination fits at these
    # reductions (trainstream's rule too: fp32 unless it does not fit), never to keep the state in VRAM.
    combos = [(opt, mom) for mom in _auto(moment_dtype, "moment_dtype", ("float32", "bfloat16"))
              for opt in _auto(optimizer, "optimizer", ("gpu", "host"))]
    if fsdp_shards > 1 and streamed_blocks == "auto":
        streamed_blocks = 0  # FSDP2 owns the sharded weights: nothing streams
    if streamed_blocks == "auto":
        s_range = None
    elif isinstance(streamed_blocks, int) and not isinstance(streamed_blocks, bool) and 0 <= streamed_blocks <= layers:
        s_range = streamed_blocks
    else:
        raise ValueError(f"streamed_blocks={streamed_blocks!r} is not valid; use 'auto' or 0..{layers}")
    fixed_acts = _fixed_activations(activations, layers)

    def make(q, s, n, combo, method) -> Options | None:
        opt, mom = combo
        if fixed_acts is not None:
            keep, page, rec = fixed_acts
        else:
            keep, page, rec = layers - n, (n if method == "page" else 0), (n if method == "recompute" else 0)
        if opt == "gpu" and train == "full" and s:
            return None  # a streamed full-FT block is updated where its state lives, on the host
        return dataclasses.replace(base, quantize=q, optimizer=opt, moment_dtype=mom, streamed_blocks=s,
                                   keep=keep, page=page, recompute=rec)

    # Which is cheaper per block, at these rates: recomputing its forward, or its pages' round trip.
    probe = estimate_memory(shape, base)
    page_s = 2 * probe.paged_bytes / (budget.link_gbps * 1e9)
    recompute_s = probe.block_forward_flops / (budget.matmul_tflops * 1e12)
    methods = ("page", "recompute") if page_s < recompute_s else ("recompute", "page")
    search = _Search(shape, budget, make, layers, fixed_acts is not None, methods, combos)
    phases = [(q, 0) for q in quants] if prefer == "speed" and s_range is None else []
    phases += [(q, s_range) for q in quants]
    for q, s in phases:
        found = search.best(q, s)
        if found is not None:
            return check_plan(shape, budget, found, _choices(shape, found, quantize, streamed_blocks, activations,
                                                             optimizer, moment_dtype, methods, budget))
    return search.closest(quants[-1], s_range)


def _fixed_activations(activations, layers: int):
    if activations == "auto":
        return None
    named = {"keep": (layers, 0, 0), "recompute": (0, 0, layers), "page": (0, layers, 0)}
    if isinstance(activations, str) and activations in named:
        return named[activations]
    if (isinstance(activations, (tuple, list)) and len(activations) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in activations)
            and sum(activations) == layers):
        return tuple(activations)
    raise ValueError(f"activations={activations!r} is not valid; use 'auto', 'keep', 'recompute', 'page' or "
                     f"(keep, page, recompute) adding up to the {layers} blocks")


class _Search:
    """Lexicographically least fitting (streamed, reduced, combo, method) for one quantization. VRAM falls as
    more blocks stream or reduce (from one on: the first adds the buffer or recomputed block it saves), host
    RAM rises, so the least fitting count is the least that fits VRAM, when host RAM holds it."""

    def __init__(self, shape, budget, make, layers, fixed_acts, methods, combos):
        self.shape, self.budget, self.make, self.layers = shape, budget, make, layers
        self.fixed_acts, self.methods, self.combos = fixed_acts, methods, combos

    def _fits(self, options, part: str) -> bool:
        """Whether `options` fit the budget's VRAM (``part="vram"``) or host side: the refusal's own rule
        (_overflow), so the search and check_plan never disagree on what fits."""
        names = _PARTS[part]
        return not any(name in names for name, _, _ in _overflow(estimate_memory(self.shape, options), self.budget))

    def _least(self, low: int, high: int, ok) -> int | None:
        """Least x in [low, high] with ok(x), for ok false-then-true from `low + 1` on (x = low checked alone)."""
        if ok(low):
            return low
        if low == high or not ok(high):
            return None
        lo, hi = low + 1, high
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
        return lo

    def _for(self, q, s_fixed, combo, method):
        """Least (s, n) fitting for one combo and method, or None."""
        top = self.layers
        n_max = 0 if self.fixed_acts else top

        def vram(s, n):
            options = self.make(q, s, n, combo, method)
            return options is not None and self._fits(options, "vram")

        s_values = [s_fixed] if s_fixed is not None else None
        if s_values is None:
            s_v = self._least(0, top, lambda s: vram(s, n_max))
            if s_v is None:
                return None
            s_values = range(s_v, top + 1)
        for s in s_values:
            n = self._least(0, n_max, lambda n, s=s: vram(s, n))
            if n is None:
                if s_fixed is not None:
                    return None
                continue
            options = self.make(q, s, n, combo, method)
            if self._fits(options, "host"):
                return s, n, options
            if method == "recompute" or self.fixed_acts:
                return None  # host RAM only grows with more streamed blocks
        return None

    def best(self, q, s_fixed) -> Options | None:
        found = []
        for rank, combo in enumerate(self.combos):
            for m_rank, method in enumerate(self.methods[:1] if self.fixed_acts else self.methods):
                hit = self._for(q, s_fixed, combo, method)
                if hit is not None:
                    found.append((hit[0], hit[1], rank, m_rank, hit[2]))
        return min(found, key=lambda f: f[:4])[4] if found else None

    def closest(self, q, s_fixed) -> Plan:
        """With every reduction the arguments allow, the plan closest to fitting (least overflow ratio)."""
        s = self.layers if s_fixed is None else s_fixed
        best = None
        for combo in self.combos:
            for method in self.methods:
                for streamed in {s, 0}:
                    options = self.make(q, streamed, 0 if self.fixed_acts else self.layers, combo, method)
                    if options is None:
                        continue
                    plan = check_plan(self.shape, self.budget, options)
                    e, b = plan.estimate, self.budget
                    ratio = max(e.allocator_bytes / max(b.usable_vram, 1), e.host_bytes / max(b.host_bytes, 1),
                                e.pinned_bytes / max(b.pinned_bytes, 1))
                    if best is None or ratio < best[0]:
                        best = (ratio, plan)
        plan = best[1]
        return dataclasses.replace(plan, reason=f"no plan fits; the closest {plan.reason}",
                                   choices=("every reduction the options allow was tried",))


def _choices(shape, o: Options, quantize, streamed, activations, optimizer, moment_dtype, methods, budget) -> tuple:
    keep, page, rec = o.activation_counts(shape.num_hidden_layers)
    out = []
    if quantize == "auto":
        out.append("quantize: none needed" if o.quantize is None else
                   f"quantize: {o.quantize} frozen block weights (nothing fitted without)")
    if streamed == "auto":
        out.append("weights: every block resident" if not o.streamed_blocks else
                   f"weights: {o.streamed_blocks} blocks stream from host RAM (the fewest that fit)")
    if activations == "auto":
        how = "recomputing a block costs less than its pages' round trip" if methods[0] == "recompute" else \
            "paging a block costs less than recomputing it at these rates"
        out.append("activations: every block keeps its own" if keep == shape.num_hidden_layers else
                   f"activations: {keep} kept, {page} paged, {rec} recomputed (the fewest that fit; {how})")
    if optimizer == "auto":
        out.append(f"optimizer: on the {o.optimizer}" + (" (its state fits in VRAM)" if o.optimizer == "gpu"
                                                         else " (its state does not fit in VRAM beside the rest)"))
    if moment_dtype == "auto":
        out.append(f"moments: {o.moment_dtype}" + ("" if o.moment_dtype == "float32" else
                                                   " (fp32 moments did not fit beside this plan's other choices)"))
    return tuple(out)
