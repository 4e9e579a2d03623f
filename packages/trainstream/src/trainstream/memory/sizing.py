"""Sizing decisions: host RAM needed per placement, moment precision, the VRAM room
measured after the first step and which parameters it can hold; and the plan wrap() makes
before anything is allocated (ts-planner's memory model applied to the live model)."""

from __future__ import annotations

import dataclasses

import torch
import ts_pinned
import ts_planner

from .. import _topology
from .._units import fmt_bytes, fmt_seconds
from ..engine.slots import ParamSlot, is_dtensor
from .disk_plan import MIN_DISK_VALUES, choose_disk_state

__all__ = ["PLAN_BATCH", "PLAN_SEQ", "HostPlan", "ModelFacts", "PlanRefused", "WrapPlan", "describe_model",
           "device_state_bytes", "host_state_bytes", "plan_host_memory", "plan_wrap", "vram_budget", "wrap_budget"]

GiB = float(1 << 30)


def host_state_bytes(param: torch.Tensor, placement: str, moment_bytes: int) -> int:
    """Host bytes of one parameter's state: fp32 master, two moments, and for host
    placement the gradient landing buffer and (non-fp32 weights) the upload buffer."""
    n = param.numel()
    if placement == "device":
        return 0
    total = n * (4 + 2 * moment_bytes)
    if placement == "host":
        total += n * param.element_size()
        if param.dtype != torch.float32:
            total += n * param.element_size()
    return total


def device_state_bytes(slot: ParamSlot) -> int:
    """VRAM a parameter's state takes when placed on the device: fp32 master, two moments, and its
    gradient, which then waits in VRAM for step() (a host-placed gradient leaves during backward)."""
    moment = torch.empty((), dtype=slot.exp_avg.dtype).element_size() if slot.exp_avg is not None else 4
    return slot.numel * (4 + 2 * moment + slot.param.element_size())


@dataclasses.dataclass(frozen=True)
class HostPlan:
    moment_dtype: torch.dtype
    needed: int  # bytes of page-locked host memory (with the disk tier: its pageable staging included)
    available: int  # page-lock budget (bytes)
    message: str
    on_disk: tuple[int, ...] = ()  # positions (in the parameters planned) whose state is on disk
    disk_bytes: int = 0  # the disk tier's file
    staging_bytes: int = 0  # the disk tier's staging buffers (pageable host RAM, part of ``needed``)


def plan_host_memory(params: list[torch.Tensor], placement: str, moment_dtype: str, check: bool,
                     on_gpu: bool = True, limit: int | None = None, nvme_path: str | None = None) -> HostPlan:
    """Chooses the moment precision, and with ``nvme_path`` the parameters whose state goes to disk
    (``disk_plan.choose_disk_state``), and checks that the host state fits the budget: the page-lock budget,
    or ``limit`` when lower (``on_gpu`` False: the message calls it the host RAM budget, as nothing is
    page-locked for a run on the CPU)."""
    machine = ts_pinned.page_lock_budget()
    # Processes launched together on one machine (torchrun, Slurm) share its RAM: each plans with 1/n.
    local = _topology.local_process_count()
    measured = ts_pinned.page_lock_budget(processes=local) if local > 1 else machine
    budget = measured.budget if limit is None else min(limit, measured.budget)
    needs = {
        name: sum(host_state_bytes(p, placement, size) for p in params)
        for name, size in (("float32", 4), ("bfloat16", 2))
    }
    if moment_dtype == "auto":
        chosen = "float32" if needs["float32"] <= budget else "bfloat16"
        why = ("fp32 moments fit" if chosen == "float32" else
               f"fp32 moments would need {fmt_bytes(needs['float32'])}, more than the {fmt_bytes(budget)} budget")
    else:
        chosen, why = moment_dtype, "as requested"
    needed = needs[chosen]
    disk = None
    if needed > budget and nvme_path is not None:
        size = 4 if chosen == "float32" else 2
        disk = choose_disk_state(params, [host_state_bytes(p, placement, size) for p in params],
                                 getattr(torch, chosen), budget)
        needed = disk.ram_bytes
    kind = "page-lock" if on_gpu else "host RAM"
    named = "host_budget" if limit is not None and limit <= measured.budget else f"{kind} budget"
    if check and needed > budget:
        if disk is not None and disk.on_disk:
            raise MemoryError(
                f"the optimizer state does not fit in host RAM even with {len(disk.on_disk)} of {len(params)} trained "
                f"parameters' master weights and moments ({fmt_bytes(disk.disk_bytes)}) on disk at {nvme_path!r}: "
                f"host RAM still needs {fmt_bytes(needed)} (gradient and upload buffers, "
                f"{fmt_bytes(disk.staging_bytes)} of staging, the state of parameters under "
                f"{MIN_DISK_VALUES} values) but the {named} is {fmt_bytes(budget)} "
                f"({fmt_bytes(measured.mem_available)} available); train fewer parameters (LoRA), free host RAM, "
                f"or pass check_memory=False to try anyway.")
        limited = f" (host_budget={limit})" if named == "host_budget" else ""
        raise MemoryError(
            f"the optimizer state needs {fmt_bytes(needed)} of page-locked host RAM ({chosen} moments, "
            f"{placement} placement) but only {fmt_bytes(budget)} can be used{limited} "
            f"({fmt_bytes(measured.mem_available)} available). bfloat16 moments would need "
            f"{fmt_bytes(needs['bfloat16'])}; otherwise "
            + ("give nvme_path= a directory on a fast local disk for the state that does not fit, " if disk is None
               else f"(nvme_path cannot help: no trained parameter has {MIN_DISK_VALUES} values or more) ")
            + "train fewer parameters (LoRA), free host RAM, or pass check_memory=False to try anyway."
        )
    share = f" (1/{local} of the machine's {fmt_bytes(machine.budget)}: {local} local processes)" if local > 1 else ""
    message = (f"{sum(p.numel() for p in params) / 1e6:.1f} M trained parameters: {chosen} moments ({why}); "
               f"{fmt_bytes(needed)} of host state, {named} {fmt_bytes(budget)}{share}")
    if disk is not None and not disk.on_disk:
        message += (f"; nvme_path={nvme_path!r} takes no state: no trained parameter has {MIN_DISK_VALUES} values "
                    f"or more")
    if disk is None or not disk.on_disk:
        return HostPlan(getattr(torch, chosen), needed, budget, message)
    message += (f"; the master weights and moments of {len(disk.on_disk)} of {len(params)} trained parameters "
                f"({fmt_bytes(disk.disk_bytes)}) live on disk at {nvme_path!r}, the last registered first (backward "
                f"reaches them first), with {fmt_bytes(disk.staging_bytes)} of staging buffers")
    return HostPlan(getattr(torch, chosen), needed, budget, message, disk.on_disk, disk.disk_bytes,
                    disk.staging_bytes)


def vram_budget(device: torch.device, headroom: float) -> int:
    """Bytes this process may use on the device: total memory times the per-process
    fraction (set_per_process_memory_fraction), less `headroom`."""
    total = torch.cuda.get_device_properties(device).total_memory
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = get_fraction(device) if get_fraction is not None else 1.0
    return int(total * fraction * (1.0 - headroom))


# ---- the plan wrap() makes before anything is allocated ----------------------------------------------

# wrap() does not see the batch: its plan prices one sequence of PLAN_SEQ tokens (as `trainstream plan`
# does by default) and refuses only what cannot fit even at one token per step (the state alone).
PLAN_BATCH, PLAN_SEQ = 1, 2048
_NO_VRAM = 1 << 62  # the budget's VRAM on the CPU: nothing to check
_RUNTIME = 2 << 30  # estimate_memory's runtime_host_bytes default
_QUANT_ORDER = (None, "int8", "nf4")


class PlanRefused(MemoryError, ValueError):
    """wrap() refused before allocating anything: the run cannot fit with what its options allow.
    A MemoryError (as check_memory= promises) and a ValueError (the options are what must change)."""


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the planner needs from a live model: its decoder shape (None when it has no usable config, or
    the config does not describe its parameters: ``mismatch`` says why), what trains, and its bytes."""

    shape: ts_planner.ModelShape | None
    train: str  # "full" or "lora"
    lora_rank: int
    lora_targets: tuple[str, ...]
    dtype: str
    adapter_dtype: str
    quantized: str | None  # the format of block weights quantized before wrap()
    blocks: int
    trained_values: int
    trained_bytes: int
    weight_bytes: int  # every parameter and buffer, as stored
    cpu_bytes: int  # the part in host memory now
    mismatch: str | None = None
    # FSDP2 (fully_shard): the ranks its parameters are sharded over (1: not sharded). weight_bytes and cpu_bytes
    # are then this rank's shards'; the trained values and bytes and the shape stay the whole model's.
    fsdp_shards: int = 1


_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _nbytes(t) -> int:
    """Bytes of `t` in this process: an FSDP2 shard's (a DTensor's local tensor), else the tensor's."""
    t = t._local_tensor if is_dtensor(t) else t
    return t.numel() * t.element_size()


def _fsdp_shards(params: list) -> int:
    """The ranks FSDP2 shards `params` over (its 1-D mesh's size: distributed/fsdp.py takes no other); 1 if none is."""
    return max((p.device_mesh.size() for p in params if is_dtensor(p)), default=1)


def describe_model(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> ModelFacts:
    """The facts of `model` (reads sizes and dtypes only)."""
    from ts_quant import QuantLinear

    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    tensors = params + list(model.buffers())
    quantized = [m.qweight for b in blocks for m in b.modules() if isinstance(m, QuantLinear)]
    weight = sum(map(_nbytes, tensors)) + sum(q.nbytes for q in quantized)
    cpu = sum(_nbytes(t) for t in tensors if (t._local_tensor if is_dtensor(t) else t).device.type == "cpu") + sum(
        q.nbytes for q in quantized if q.device.type == "cpu")
    lora = [(name.rsplit(".", 1)[-1], m) for name, m in model.named_modules()
            if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict) and len(m.lora_A)]
    frozen_blocks = any(not p.requires_grad for b in blocks for p in b.parameters()) or bool(quantized)
    dtypes = [_DTYPE.get(p.dtype) for p in params if not p.requires_grad] or [_DTYPE.get(p.dtype) for p in params]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else "float32"
    rank, targets, adapter = 16, ts_planner.LORA_TARGETS, "float32"
    train = "lora" if lora else "full"
    if lora:
        first = next(iter(lora[0][1].lora_A.values())).weight
        rank, adapter = int(first.shape[0]), _DTYPE.get(first.dtype, "float32")
        names = {name for name, _ in lora}
        targets = tuple(t for t in ts_planner.LORA_TARGETS if t in names) + tuple(sorted(names - set(ts_planner.LORA_TARGETS)))
    fmt = str(quantized[0].format) if quantized else None
    facts = dict(train=train, lora_rank=rank, lora_targets=targets, dtype=dtype or "float32",
                 adapter_dtype=adapter, quantized=fmt, blocks=len(blocks),
                 trained_values=sum(p.numel() for p in trained), trained_bytes=sum(p.numel() * p.element_size() for p in trained),
                 weight_bytes=weight, cpu_bytes=cpu, fsdp_shards=_fsdp_shards(params))
    try:
        shape = ts_planner.ModelShape.from_model(model)
    except ValueError as error:
        return ModelFacts(None, **facts, mismatch=str(error).split(";")[0])
    problem = None
    if None in (dtype, adapter) or dtype == "float16":
        problem = "its weights are not bf16 / fp32"
    elif shape.num_hidden_layers != len(blocks):
        problem = f"its config has {shape.num_hidden_layers} layers, find_blocks() found {len(blocks)} blocks"
    elif (train == "full") == frozen_blocks or set(targets) - set(ts_planner.LORA_TARGETS) or (quantized and not fmt):
        problem = "what trains is neither every parameter nor LoRA adapters on the block projections"
    else:
        options = ts_planner.Options(train=train, lora_rank=rank, lora_targets=targets, adapter_dtype=adapter,
                                     dtype=dtype, seq=1)
        expected = ts_planner.estimate_memory(shape, options).trained_params
        if abs(expected - facts["trained_values"]) > 0.02 * max(expected, 1):
            problem = (f"it trains {facts['trained_values']:,} values where its config's shape trains "
                       f"{expected:,}")
    if problem:
        return ModelFacts(None, **facts, mismatch=f"the config does not describe the model: {problem}")
    return ModelFacts(shape, **facts)


def wrap_budget(device: torch.device, opts, facts: ModelFacts) -> ts_planner.Budget:
    """This process's budget for the wrap() plan: VRAM from the device (its per-process fraction applied,
    less ``vram_headroom``); host RAM available now (cgroup-aware, split between LOCAL_WORLD_SIZE
    processes), plus what the model holds there and will leave (or keep as its host copies) and the
    process's own footprint, which the estimate counts. On the CPU no device memory is checked."""
    on_cuda = device.type == "cuda"
    budget = ts_planner.machine_budget(device if on_cuda else None, vram_bytes=None if on_cuda else _NO_VRAM,
                                       headroom=opts.vram_headroom)
    leaving = facts.cpu_bytes if on_cuda else 0  # moves to the GPU, or is the streamed blocks' host copy
    # The estimate counts the process's own footprint (RUNTIME), which the available RAM already excludes.
    return dataclasses.replace(budget, host_bytes=budget.host_bytes + leaving + _RUNTIME,
                               pinned_bytes=budget.pinned_bytes + int(leaving * 0.8))


@dataclasses.dataclass(frozen=True)
class WrapPlan:
    """The wrap() plan. ``plan``: ts-planner's plan at PLAN_BATCH x PLAN_SEQ tokens (``plan.fits`` False:
    those tokens do not fit; the activation policy then finds what does); ``state``: at one token, what
    must fit for the run to start at all (``fits``); ``quantize``: the format wrap() applies (None when the
    weights stay, or were quantized before wrap()); ``message``: why."""

    fits: bool
    quantize: str | None
    message: str
    plan: ts_planner.Plan | None = None
    state: ts_planner.Plan | None = None
    generic: dict | None = None  # the check of a model without a decoder shape

    def to_dict(self) -> dict:
        out = {"fits": self.fits, "quantize": self.quantize, "message": self.message}
        if self.plan is not None:
            out["quantize"] = self.plan.options.quantize
            e = self.state.estimate
            out.update(tokens={"batch": self.plan.options.batch, "seq": self.plan.options.seq,
                               "fits": self.plan.fits},
                       **{k: v for k, v in self.plan.to_dict().items() if k not in ("fits", "quantize")},
                       state={"fits": self.state.fits, "peak_vram_bytes": self.state.peak_vram_bytes,
                              "host_bytes": self.state.host_bytes, "pinned_bytes": e.pinned_bytes,
                              "reason": self.state.reason})
        if self.generic is not None:
            out.update(self.generic)
        return out


PACKED_RATIO = 0.7505  # exponent-packed bf16 of normal weights (1.5 bytes a value and few escapes; ts-quant's tests)


def plan_wrap(facts: ModelFacts, budget: ts_planner.Budget, *, quantize="auto", moment_dtype="auto",
              activations="auto", streamed_blocks: int = 0, streamed_shared_by: int = 1,
              tokens: tuple[int, int] = (PLAN_BATCH, PLAN_SEQ), compact_lora_inputs: bool = False,
              stream_packing: bool = False, embedding_on_host: bool = False, optimizer: str = "host",
              disk_state_share: float = 0.0, state_shared_by: int = 1) -> WrapPlan:
    """The plan for wrap(): ``quantize`` "auto" takes the least of None, int8, NF4 that fits ``tokens``
    (batch, sequence length; wrap() does not see the batch: PLAN_BATCH x PLAN_SEQ), NF4 when none does,
    so more VRAM never quantizes more; the run is refused (``fits`` False) when even one token per step
    does not fit. ``stream_packing``: wrap()'s option (streamed bf16 weights cross the link exponent-packed,
    priced at PACKED_RATIO of their bytes); ``embedding_on_host``: the frozen input embedding lives in host memory
    (wrap()'s ``host_embedding``); ``optimizer``: where the optimizer state is priced ("host", or "auto": in
    VRAM where it fits beside the rest, as offload='auto' moves it); ``disk_state_share``: the share of the
    trained values whose state is on disk (nvme_path); ``state_shared_by``: data-parallel ranks (each keeps its
    share of the host state, and every gradient with its bucket copy in VRAM until step()). Other arguments as
    ``ts_planner.plan_memory``'s."""
    batch, seq = tokens
    if facts.shape is None:
        return _generic_plan(facts, budget, quantize, moment_dtype, streamed_blocks, disk_state_share, state_shared_by)
    shape = facts.shape
    args = dict(train=facts.train, lora_rank=facts.lora_rank, lora_targets=facts.lora_targets,
                adapter_dtype=facts.adapter_dtype, dtype=facts.dtype, optimizer=optimizer, moment_dtype=moment_dtype,
                activations=activations, streamed_blocks=streamed_blocks, streamed_shared_by=streamed_shared_by,
                compact_lora_inputs=compact_lora_inputs, embedding_on_host=embedding_on_host,
                disk_state_share=disk_state_share, fsdp_shards=facts.fsdp_shards, state_shared_by=state_shared_by)
    if stream_packing and streamed_blocks and facts.dtype == "bfloat16" and not facts.quantized and quantize in (None, "auto"):
        args["stream_packing"] = PACKED_RATIO  # the streamer streams exact weights, never quantized ones
    if facts.quantized:
        quantize = facts.quantized
    elif quantize == "auto" and facts.train == "full":
        quantize = None
    plan = ts_planner.plan_memory(shape, budget, batch=batch, seq=seq, quantize=quantize, **args)
    chosen = plan.options.quantize if plan.fits or quantize != "auto" else _QUANT_ORDER[-1]
    if not plan.fits and quantize == "auto":
        plan = ts_planner.plan_memory(shape, budget, batch=batch, seq=seq, quantize=chosen, **args)
    state = ts_planner.plan_memory(shape, budget, batch=1, seq=1, quantize=chosen, **args)
    o = plan.options
    keep, page, recompute = o.activation_counts(shape.num_hidden_layers)
    what = (f"{_count(shape.total_params)} parameters, {_count(facts.trained_values)} trained "
            f"({'full fine-tune' if facts.train == 'full' else f'LoRA r={facts.lora_rank}'})")
    apply = None if facts.quantized else chosen  # quantized before wrap(): nothing more to quantize
    if not state.fits:
        return WrapPlan(False, apply, _refusal(what, state, facts, budget, quantize, moment_dtype,
                                                streamed_blocks, args), plan, state)
    if plan.fits:
        room = ("on the CPU" if budget.vram_bytes >= _NO_VRAM else
                f"of {fmt_bytes(budget.usable_vram)} usable VRAM")
        verdict = (f"at {batch} x {seq} tokens: peak {fmt_bytes(plan.peak_vram_bytes)} {room}, "
                   f"{fmt_bytes(plan.host_bytes)} of "
                   f"{fmt_bytes(budget.host_bytes)} host RAM")
    else:
        e = plan.estimate
        more = _fixes(facts, budget, plan.options, args, moment_dtype, streamed_blocks, seq=seq, batch=batch)
        short = ", ".join(f"{_NAMES[name]} {fmt_bytes(over)} short" for name, _, over in plan.overflow)
        verdict = (f"{batch} x {seq} tokens do not fit even with every reduction the options allow "
                   f"(peak {fmt_bytes(e.allocator_bytes)}, host {fmt_bytes(e.host_bytes)}: {short}); the state alone does "
                   f"({fmt_bytes(state.peak_vram_bytes)} VRAM, {fmt_bytes(state.host_bytes)} host RAM): "
                   f"fewer tokens per step will" + (f", or at {seq} tokens {' or '.join(more)}" if more else ""))
    on_gpu = budget.vram_bytes < _NO_VRAM  # on the CPU nothing streams, pages or crosses a link
    layout = (f"{o.streamed_blocks} of {shape.num_hidden_layers} blocks streamed, activations {keep} kept / {page} "
              f"paged / {recompute} recomputed; " if on_gpu else "")
    link = f", link {fmt_seconds(plan.link_s)}" if on_gpu else ""
    message = (f"{what}: {verdict}; quantize={chosen or 'none'}, moments {o.moment_dtype}, {layout}lower bound "
               f"{fmt_seconds(plan.lower_bound_s)}/step (compute {fmt_seconds(plan.compute_s)}{link}, host AdamW "
               f"{fmt_seconds(plan.host_optimizer_s)} at default rates)")
    return WrapPlan(True, apply, message, plan, state)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


_NAMES = {"VRAM": "VRAM", "host RAM": "host RAM", "page-locked RAM": "page-locked host RAM"}


def _refusal(what: str, state, facts: ModelFacts, budget, quantize, moment_dtype, streamed: int, args) -> str:
    e = state.estimate
    parts = []
    for name, category, over in state.overflow:
        need, have = {"VRAM": (e.allocator_bytes, budget.usable_vram), "host RAM": (e.host_bytes, budget.host_bytes),
                      "page-locked RAM": (e.pinned_bytes, budget.pinned_bytes)}[name]
        if category == "cuda_context":
            need, have = e.device_bytes, budget.device_bytes or 0
        size = (e.vram if name == "VRAM" else e.host)[category]
        parts.append(f"needs {fmt_bytes(need, 'GiB', 1)} of {_NAMES[name]}, {fmt_bytes(have, 'GiB', 1)} available "
                     f"({fmt_bytes(over, 'GiB', 1)} short; the largest part: {category.replace('_', ' ')} "
                     f"{fmt_bytes(size, 'GiB', 1)})")
    fixes = _fixes(facts, budget, state.options, args, moment_dtype, streamed, seq=1)
    advice = (f"use {' or '.join(fixes)}" if fixes else
              "nothing the options allow fits: a smaller model, a GPU with more memory or more host RAM")
    return (f"trainstream.wrap() refused before allocating anything: the model ({what}) does not fit even at "
            f"one token per step: {'; '.join(parts)}: {advice} (check_memory=False tries anyway)")


def _fixes(facts: ModelFacts, budget, options, args: dict, moment_dtype, streamed: int, seq: int,
           batch: int = 1) -> list[str]:
    """The single changes of wrap() options that make a plan at `batch` x `seq` tokens fit."""
    layers, q = facts.shape.num_hidden_layers, options.quantize
    candidates = []
    if moment_dtype != "bfloat16" and options.moment_dtype != "bfloat16":
        candidates.append(("moment_dtype='bf16'", dict(moment_dtype="bfloat16")))
    if facts.train == "lora" and not facts.quantized and q != "nf4" and streamed == 0:
        candidates.append(("quantize='nf4'", dict(quantize="nf4")))
    if facts.train == "lora" and not facts.quantized and streamed < layers:
        text = "param_offload=True" + (" with quantize=None" if q else "")
        candidates.append((text, dict(quantize=None, streamed_blocks=layers)))
    if facts.train == "full":
        candidates.append(("LoRA adapters (peft) instead of training every parameter",
                           dict(train="lora", lora_rank=16, lora_targets=ts_planner.LORA_TARGETS,
                                adapter_dtype="float32", quantize="auto", streamed_blocks=0)))
    fits = []
    for text, change in candidates:
        trial = {**args, "quantize": q, **change}
        if ts_planner.plan_memory(facts.shape, budget, batch=batch, seq=seq, **trial).fits:
            fits.append(text)
    return fits


def _generic_plan(facts: ModelFacts, budget, quantize, moment_dtype, streamed: int,
                  disk_state_share: float = 0.0, ranks: int = 1) -> WrapPlan:
    """A model without a decoder shape: only its state is checked, weights in VRAM (no activation estimate)
    and AdamW's state in host RAM (fp32 master, moments, gradient and upload buffers; the share on disk
    keeps only the last two there). Under FSDP2, this rank's shards' (the units it gathers are not priced:
    their sizes need the decoder shape); under data parallel (``ranks``), this rank's share of the state, and
    every gradient with its bucket copy in VRAM."""
    moment = 2 if moment_dtype == "bfloat16" else 4
    split = facts.fsdp_shards * ranks  # this rank's values: FSDP2's shards, or data parallel's even split
    values = -(-facts.trained_values // split)
    in_ram = values - round(values * disk_state_share)
    host = in_ram * (4 + 2 * moment) + 2 * -(-facts.trained_bytes // split) + (2 << 30)
    gradients = 2 * facts.trained_bytes if ranks > 1 else 0  # reduced at step(), beside their bucket copies
    vram = facts.weight_bytes + gradients if streamed == 0 else None  # streamed: not estimated without a shape
    if moment_dtype == "auto" and host > budget.host_bytes:
        host -= in_ram * 4  # "auto" falls back to bf16 moments
        moment = 2
    numbers = {"model": "generic (no decoder shape: state only)", "peak_vram_bytes": vram, "host_bytes": host,
               "budget": {"usable_vram_bytes": budget.usable_vram, "host_bytes": budget.host_bytes},
               "moment_dtype": "float32" if moment == 4 else "bfloat16"}
    short = []
    if vram is not None and quantize is None and vram > budget.usable_vram:  # "auto": choose_quantize decides
        what = "its weights" + (" and its gradients twice (data parallel's buckets)" if gradients else "")
        short.append(f"needs {fmt_bytes(vram, 'GiB', 1)} of VRAM for {what}, "
                     f"{fmt_bytes(budget.usable_vram, 'GiB', 1)} available: "
                     f"use quantize='nf4' (frozen block weights) or param_offload=True")
    if host > budget.host_bytes:
        short.append(f"needs {fmt_bytes(host, 'GiB', 1)} of host RAM for the optimizer state, "
                     f"{fmt_bytes(budget.host_bytes, 'GiB', 1)} available: use "
                     + ("LoRA adapters or more host RAM" if moment == 2 else "moment_dtype='bf16'"))
    if short:
        return WrapPlan(False, None if quantize == "auto" else quantize,
                        "trainstream.wrap() refused before allocating anything: " + "; ".join(short)
                        + " (check_memory=False tries anyway)", generic=numbers)
    return WrapPlan(True, None if quantize == "auto" else quantize,
                    f"{facts.mismatch or 'no decoder shape'}: only the state is checked (weights "
                    f"{fmt_bytes(facts.weight_bytes)}, host state {fmt_bytes(host)})", generic=numbers)
