"""plan(): every automatic decision of wrap(), made once, before anything changes.

Reads the model (shapes, dtypes, what trains), the options and this machine's budget; allocates
nothing, moves nothing, starts no thread. Each "auto" option is settled by one rule here, in this
order, each step reading only what the steps before it settled:

  1. the training device;
  2. host_embedding: the input embedding's table stays in host memory (a GPU run with a candidate);
  3. moment_dtype: fp32 moments where the optimizer state fits the page-lock budget (or host_budget),
     else bf16 (``memory.sizing.plan_host_memory``; under data parallel the largest rank's share); with
     nvme_path, the state that still does not fit goes to disk (``memory.disk_plan``);
  4. param_offload: which blocks stream (the fewest with which the plan fits, in ts-planner's spread
     order), and the quantization that implies when nothing fits resident;
  5. stream_packing: streamed bf16 weights cross the link packed, where host RAM holds both copies;
  6. quantize: the least format the memory plan fits.

A run that cannot fit is refused here (PlanRefused, a MemoryError) with the numbers.
"""

from __future__ import annotations

import dataclasses
import shutil
import typing

import torch
import ts_planner

from .. import _topology
from .._config import Config
from .._dropped import collect_dropped
from .._options import WrapOptions, parse_options
from .._units import fmt_bytes
from ..activations.lora_inputs import eligible_layers
from ..activations.policy import blocks_of, streamed_blocks_of
from ..distributed.composition import check_composable
from ..distributed.fsdp import sharded_by_fsdp2
from ..engine.slots import is_dtensor
from ..memory.blocks import find_blocks
from ..memory.disk_plan import check_disk_directory, disk_free_bytes
from ..memory.sizing import (
    PLAN_BATCH,
    PLAN_SEQ,
    PlanRefused,
    WrapPlan,
    describe_model,
    host_state_bytes,
    plan_host_memory,
    plan_wrap,
    vram_budget,
    wrap_budget,
)
from ..weights.host_embedding import host_embedding_candidate
from ..weights.quantize import choose_quantize
from ..weights.streamed_block import frozen_params_of, nbytes_of, streams_trained, trained_params_of
from .plan import Decision, Plan, fingerprint

__all__ = ["decide", "plan", "trained_params", "training_device"]


def plan(model: torch.nn.Module, optimizer=None, config: Config | None = None, **options) -> Plan:
    """Every decision ``wrap(model, optimizer, config, **options)`` would make, as a frozen Plan, without
    changing anything. ``wrap(model, optimizer, plan=...)`` then applies it. ``config``: a
    ``trainstream.Config`` (or a dict ``Config.from_dict`` reads); keyword options override it, and it
    overrides an ``OffloadAdamW``'s own settings where it differs from the defaults. PlanRefused (a
    MemoryError) when the run cannot fit, ValueError for bad options."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"plan() takes a torch.nn.Module, not {type(model).__name__}")
    check_composable(model)
    if config is not None:
        config = config if isinstance(config, Config) else Config.from_dict(config)
        options = {**config.changed(), **options}
    own = getattr(optimizer, "wrap_options", None)  # an OffloadAdamW's engine settings (not imported: a cycle)
    if isinstance(own, dict):
        options = {**own, **options}
    return decide(model, optimizer, parse_options(options))


def training_device(model: torch.nn.Module, requested: torch.device | None) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if requested is not None:
        if requested.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(requested)!r} was requested but CUDA is not available "
                             f"(torch {torch.__version__}); use device='cpu' or install a CUDA build of torch")
        return requested
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several devices ({sorted(map(str, devices))}); "
                         "move it to one, or pass device=")
    return next(iter(devices)) if devices else torch.device("cpu")


def decide(model: torch.nn.Module, optimizer, opts: WrapOptions) -> Plan:
    """The plan for validated options (``opts`` is read, never changed)."""
    device = training_device(model, opts.device)
    notes = []
    dropped = collect_dropped(device)  # before anything is measured: what dropped models still held
    if dropped:
        notes.append(("memory", dropped))
    decisions = []
    if sharded_by_fsdp2(model):
        opts = _under_fsdp2(opts, decisions)
    embedding_on, why = _host_embedding(model, device, opts)
    if opts.host_embedding == "auto":
        decisions.append(Decision("host_embedding", embedding_on, why))
    opts = dataclasses.replace(opts, host_embedding=embedding_on)

    blocks = list(opts.blocks) if opts.blocks is not None else find_blocks(model)
    # Given blocks are checked first: a refusal of what cannot stream names the option, not a budget.
    streamed = _streamed_blocks(model, opts, blocks) if opts.param_offload != "auto" else None

    host = _moment_plan(model, optimizer, opts, device)
    if opts.moment_dtype == "auto":
        decisions.append(Decision("moment_dtype", _dtype_name(host.moment_dtype), host.message))
    moments = _dtype_name(host.moment_dtype)
    if host.on_disk:
        decisions.append(Decision("nvme_path", opts.nvme_path, (
            f"the master weights and moments of {len(host.on_disk)} trained parameters ({fmt_bytes(host.disk_bytes)})"
            f" live in a scratch file there: host RAM does not hold all of the optimizer state")))

    facts = describe_model(model, blocks)
    if (opts.quantize not in ("auto", None) and not facts.quantized and blocks
            and all(p.requires_grad for b in blocks for p in b.parameters())):  # nothing frozen to store quantized
        raise ValueError(f"quantize={opts.quantize!r} stores frozen weights, and every parameter of this model trains "
                         f"(a full fine-tune): freeze the base and train LoRA adapters (peft), or use quantize=None")
    budget = wrap_budget(device, opts, facts)
    if host.on_disk:
        budget, rates = _with_disk_rates(budget, opts.nvme_path)
        notes.append(("plan", rates))
    from .. import distributed as tsd

    inputs = _Inputs(blocks, facts, budget, host.disk_share, tsd.world_of(opts.distributed))
    if streamed is None:
        offload, why, implied = _auto_param_offload(opts, inputs, moments)
        decisions.append(Decision("param_offload", offload, why))
        opts = dataclasses.replace(opts, param_offload=offload, quantize=implied or opts.quantize)
        streamed = _streamed_blocks(model, opts, blocks)

    memory, packing = _memory_plan(device, opts, inputs, streamed, moments)
    if _optimizer_priced(opts, inputs.budget) == "auto" and memory.plan is not None:
        on_gpu = memory.plan.options.optimizer == "gpu"
        decisions.append(Decision("offload", "auto", (
            "the plan prices the optimizer state in VRAM: it fits beside the predicted peak, so it moves there "
            "once the activation policy settles" if on_gpu else
            "the plan prices the optimizer state in host memory: it does not fit in VRAM beside the predicted peak")))
    if opts.stream_packing == "auto" and streamed:
        decisions.append(Decision("stream_packing", packing, "host RAM holds the packed copies beside the plain ones"
                                  if packing else "host RAM does not hold packed copies beside the plain ones"))
    opts = dataclasses.replace(opts, stream_packing=packing)

    if streamed and opts.quantize == "auto":
        fmt, why = None, "auto: param_offload streams the weights as they are stored, so none are quantized"
    else:
        fmt, why = _quantize_decision(model, device, opts, memory)
    if why:
        decisions.append(Decision("quantize", fmt, why))
    # The blocks found here are the ones applying uses (the streamer, the activation policy): found once.
    resolved = dataclasses.replace(opts, quantize=fmt, blocks=blocks or None)
    return Plan(device=device, streamed_blocks=tuple(streamed), quantize=fmt, moment_dtype=host.moment_dtype,
                memory=memory, host_message=host.message, host_state_bytes=host.needed_own,
                disk_state=host.on_disk, disk_state_bytes=host.disk_bytes,
                decisions=tuple(decisions), notes=tuple(notes), resolved=tuple(resolved.as_dict().items()),
                made_for=fingerprint(model, optimizer))


def _under_fsdp2(opts: WrapOptions, decisions: list) -> WrapOptions:
    """FSDP2 owns the weights and reduces the gradients: trainstream's data parallel is off and its weight
    placements (streaming, quantizing, the host embedding) do not apply to sharded parameters yet, nor does
    paging activations (a block's saved tensors include FSDP2's gathered weights, which it frees and gathers
    again itself; recomputation composes); set explicitly, they are refused."""
    given = {"distributed": opts.distributed is True, "param_offload": opts.param_offload not in (False, "auto"),
             "quantize": opts.quantize not in ("auto", None), "host_embedding": opts.host_embedding is True,
             "nvme_path": opts.nvme_path is not None,
             "activation_offload": opts.activation_offload not in (False, "auto")}
    refused = [name for name, on in given.items() if on]
    if refused:
        raise ValueError(f"{', '.join(refused)} cannot be used on a model sharded by FSDP2 (fully_shard): FSDP2 "
                         f"reduces the gradients and owns the sharded weights; leave "
                         f"{'it' if len(refused) == 1 else 'them'} at the default")
    decisions.append(Decision("distributed", False, "the model is sharded by FSDP2 (fully_shard): FSDP2 reduce-"
                                                    "scatters the gradients, and each rank trains its own shards"))
    return dataclasses.replace(opts, distributed=False, param_offload=False, host_embedding=False,
                               quantize=None if opts.quantize == "auto" else opts.quantize, activation_offload=False)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- 2. host_embedding ---------------------------------------------------------------------------

def _host_embedding(model: torch.nn.Module, device: torch.device, opts) -> tuple[bool, str]:
    """(whether the embedding's table stays in host memory, why); True that cannot apply is refused."""
    embedding, why = host_embedding_candidate(model)
    if device.type != "cuda":
        embedding, why = None, "the model trains on the CPU, where it is in host memory already"
    if opts.host_embedding is True and embedding is None:
        raise ValueError(f"host_embedding=True cannot apply: {why}; use 'auto' or False")
    if opts.host_embedding is False:
        return False, "off"
    return embedding is not None, why if embedding is None else "the input embedding's table stays in host memory"


# ---- 3. moment_dtype -----------------------------------------------------------------------------

class _Inputs(typing.NamedTuple):
    """What steps 4-6 plan with: the repeated blocks, the model's facts, this process's budget (with the
    disk's rates when state lives on disk), the share of the trained values on disk, and the data-parallel
    ranks the host optimizer state is split over (1: one process, or FSDP2's shards, which the facts count)."""

    blocks: list
    facts: object
    budget: object
    disk_share: float
    ranks: int = 1


@dataclasses.dataclass(frozen=True)
class _HostState:
    moment_dtype: torch.dtype
    needed_own: int  # this rank's host bytes of optimizer state (page-locked, and the disk tier's staging)
    message: str
    on_disk: tuple[int, ...] = ()  # positions in trained_params() whose master and moments live on disk
    disk_bytes: int = 0
    disk_share: float = 0.0  # the share of the trained values on disk, as ts-planner prices it


def trained_params(model: torch.nn.Module, optimizer) -> list[torch.Tensor]:
    """The tensors the engine will train, in its slot order (the optimizer's groups, or the model's
    trainable parameters when there is no optimizer, as wrap() makes one); an FSDP2-sharded parameter
    counts as this rank's local shard, which is what the engine trains (distributed/fsdp.py)."""
    params = (model.parameters() if optimizer is None else (p for g in optimizer.param_groups for p in g["params"]))
    return [p._local_tensor if is_dtensor(p) else p for p in params if p.requires_grad]


def _moment_plan(model, optimizer, opts, device: torch.device) -> _HostState:
    """The moment dtype and, with nvme_path, which state lives on disk: the one rule (plan_host_memory)
    over the largest rank's share of the trained parameters; PlanRefused (check_memory) when even that
    share's state does not fit the host budget."""
    from .. import distributed as tsd
    from ..distributed.sharding import host_shares

    if opts.optimizer_mode == "gpu" and device.type != "cuda":
        raise ValueError("optimizer_mode='gpu' needs a CUDA device; use 'cpu' or 'auto'")
    placement = "mapped" if opts.optimizer_mode == "gpu" else "host"
    params = trained_params(model, optimizer)
    world = tsd.world_of(opts.distributed)
    if opts.nvme_path is not None:
        _check_disk_tier(opts, placement, world)
    own, largest = host_shares(params, world, torch.distributed.get_rank() if world > 1 else 0)
    try:
        host = plan_host_memory(largest, placement, opts.moment_dtype, opts.check_memory,
                                on_gpu=device.type == "cuda", limit=opts.host_budget, nvme_path=opts.nvme_path)
    except MemoryError as error:
        raise PlanRefused(str(error)) from None
    if host.on_disk:  # one process (_check_disk_tier): its share is every trained parameter
        free = disk_free_bytes(opts.nvme_path)
        if opts.check_memory and host.disk_bytes > free:
            raise PlanRefused(f"the optimizer state put on disk needs {fmt_bytes(host.disk_bytes)} at "
                              f"nvme_path={opts.nvme_path!r} but that filesystem has {fmt_bytes(free)} free; free "
                              f"space there, give a larger disk, or pass check_memory=False to try anyway")
        share = sum(own[i].numel() for i in host.on_disk) / max(1, sum(p.numel() for p in own))
        return _HostState(host.moment_dtype, host.needed, host.message, host.on_disk, host.disk_bytes, share)
    needed = sum(host_state_bytes(p, placement, host.moment_dtype.itemsize) for p in own)
    return _HostState(host.moment_dtype, needed, host.message)


def _with_disk_rates(budget, directory: str):
    """The budget with the measured rates of the disk at ``directory`` (ts-planner's probe, cached per
    filesystem), and the line that says so."""
    try:
        rates = ts_planner.disk_rates(directory)
    except OSError as error:
        raise ValueError(f"nvme_path={directory!r}: measuring the disk failed: {error}") from None
    return (dataclasses.replace(budget, disk_read_gbps=rates.read_gbps, disk_write_gbps=rates.write_gbps,
                                disk_mixed_gbps=rates.mixed_gbps),
            rates.summary())


def _check_disk_tier(opts, placement: str, world: int) -> None:
    """nvme_path needs the host optimizer in one process, and a directory this process can write."""
    if placement != "host":
        raise ValueError("nvme_path= keeps the state host AdamW reads on disk; optimizer_mode='gpu' reads it from "
                         "mapped host memory instead. Use optimizer_mode='cpu' (or 'auto') with nvme_path")
    if world > 1:
        raise ValueError("nvme_path= is not supported under data parallel yet (each rank's share on its own disk "
                         "has not been tested); run one process, or leave nvme_path=None")
    check_disk_directory(opts.nvme_path)


# ---- 4. param_offload ----------------------------------------------------------------------------

def _streamed_blocks(model: torch.nn.Module, opts, blocks: list) -> list[int]:
    """The blocks param_offload= streams (blocks without weights to stream are left out), checked."""
    if opts.param_offload is False:
        return []
    if not blocks:
        raise ValueError("param_offload= needs the model's repeated blocks, and find_blocks() found none: "
                         "pass blocks=[...]")
    chosen = [i for i in streamed_blocks_of(opts.param_offload, len(blocks)) if _stream_params(blocks[i])]
    trained = [i for i in chosen if streams_trained(blocks[i], None)]
    if trained:
        why = _why_trained_cannot_stream(opts)
        if why:
            raise ValueError(f"param_offload would stream the trained weights of {len(trained)} blocks "
                             f"(a full fine-tune: they are most of those blocks' bytes), which needs {why}. Use "
                             f"param_offload=False (or fewer blocks), or train LoRA adapters")
    return chosen


def _stream_params(block: torch.nn.Module) -> list:
    """What a streamed block carries: its frozen weights, and its trained ones where they are most of it."""
    return frozen_params_of(block) + (trained_params_of(block) if streams_trained(block, None) else [])


def _why_trained_cannot_stream(opts) -> str | None:
    """None when streamed trained weights can train with these options, else what they need: their
    AdamW runs on host threads and writes the host copy a fetch reads (one process owns it)."""
    from .. import distributed as tsd

    if opts.optimizer_mode == "gpu":
        return "the optimizer on host threads, not optimizer_mode='gpu' (use 'cpu' or 'auto')"
    if tsd.world_of(opts.distributed) > 1:
        return "one process: under data parallel every rank would write its machine's one host copy"
    return None


def _auto_param_offload(opts, inputs, moments: str) -> tuple[list[int] | bool, str, str | None]:
    """param_offload='auto': (the blocks to stream, why, the quantization it implies or None): the
    fewest blocks with which the plan fits (spread through the stack in ts-planner's order), with the
    weights as ``quantize`` stores them. With quantize='auto': ``prefer="exact"`` streams the exact
    weights when that fits and quantizes nothing; ``prefer="speed"`` (or exact weights that do not fit
    even streamed) streams nothing while some quantization fits resident (the faster way to fit), else
    NF4 codes stream."""
    blocks, facts, budget, disk_share, ranks = inputs
    if facts.shape is None or not blocks:
        return False, "param_offload='auto': none stream (no decoder config or repeated blocks to plan with)", None
    activations = _activations(opts, len(blocks))
    optimizer = _optimizer_priced(opts, budget)

    def fewest(fmt):
        return _fewest_streamed(inputs, opts, fmt, moments)

    fmt, implied, note, plan = opts.quantize, None, "", None
    if fmt == "auto" and opts.prefer == "exact":
        exact = fewest(None)
        if exact.plan is not None and exact.plan.fits:
            fmt, plan = None, exact
            note = " (prefer='exact': the exact weights stream rather than quantized ones; prefer='speed' quantizes first)"
        else:
            note = " (prefer='exact': even with every block streamed the exact weights do not fit, so they are quantized)"
    if fmt == "auto":
        resident = plan_wrap(facts, budget, quantize="auto", moment_dtype=moments, activations=activations,
                             streamed_blocks=0, embedding_on_host=_embedding_on_host(opts, facts), optimizer=optimizer,
                             disk_state_share=disk_share, state_shared_by=ranks)
        if resident.plan is not None and resident.plan.fits:
            return False, ("param_offload='auto': none stream, quantize='auto' fits the weights"
                           + (note or " (prefer='speed'; pass quantize=None to stream exact weights instead)")), None
        fmt = implied = "nf4"  # nothing fits resident: the smallest codes stream
    if plan is None:
        plan = fewest(fmt)
    chosen = list(plan.plan.streamed) if plan.plan is not None else []
    stored = "as stored" if fmt is None else f"as {fmt} codes"
    if not chosen:
        return False, f"param_offload='auto': none stream ({plan.message})", None
    if not plan.plan.fits:
        return chosen, (f"param_offload='auto': all {len(blocks)} blocks stream {stored} and the plan's tokens still "
                        f"do not fit: the activation policy finds what does{note} ({plan.message})"), implied
    return chosen, (f"param_offload='auto': {len(chosen)} of {len(blocks)} blocks stream {stored}, the fewest with "
                    f"which the plan fits" + (" (quantize='auto': no quantization fits with every block resident)"
                                              if implied else "") + f"{note} ({plan.message})"), implied


def _fewest_streamed(inputs, opts, fmt, moments: str, tokens=(PLAN_BATCH, PLAN_SEQ)) -> WrapPlan:
    """The plan with the fewest streamed blocks that fits `tokens` with the weights stored as `fmt` (the
    plan with all of them streamed when none does)."""
    blocks, facts, budget, disk_share, ranks = inputs
    activations = _activations(opts, len(blocks))
    optimizer = _optimizer_priced(opts, budget)
    frozen = sum(nbytes_of(frozen_params_of(b)) for b in blocks)
    shared_by = _streamed_shared_by(opts, frozen)  # an upper bound of what streams: room for it is room for less
    for count in range(len(blocks) + 1):
        plan = plan_wrap(facts, budget, quantize=fmt, moment_dtype=moments, activations=activations,
                         streamed_blocks=count, streamed_shared_by=shared_by, tokens=tokens,
                         compact_lora_inputs=_compact_lora_inputs(opts, blocks),
                         stream_packing=opts.stream_packing is not False,
                         embedding_on_host=_embedding_on_host(opts, facts), optimizer=optimizer,
                         disk_state_share=disk_share, state_shared_by=ranks)
        if plan.plan is not None and plan.plan.fits:
            break
    return plan


# ---- 5. the memory plan and stream_packing -------------------------------------------------------

def _memory_plan(device: torch.device, opts, inputs, streamed: list[int], moments: str) -> tuple[WrapPlan, bool]:
    """(ts-planner's plan for these options, stream_packing settled); PlanRefused (check_memory=True)
    when even one token per step does not fit."""
    blocks, facts, budget, disk_share, ranks = inputs
    optimizer = _optimizer_priced(opts, budget)
    auto = opts.quantize == "auto"
    quantize = ("auto" if device.type == "cuda" and not streamed else None) if auto else opts.quantize
    host_bytes = sum(nbytes_of(_stream_params(blocks[i])) for i in streamed)
    shared_by = _streamed_shared_by(opts, host_bytes) if streamed else 1

    def planned(packing: bool) -> WrapPlan:
        return plan_wrap(facts, budget, quantize=quantize, moment_dtype=moments,
                         activations=_activations(opts, len(blocks)), streamed_blocks=len(streamed),
                         streamed_shared_by=shared_by, compact_lora_inputs=_compact_lora_inputs(opts, blocks),
                         stream_packing=packing, embedding_on_host=_embedding_on_host(opts, facts), optimizer=optimizer,
                         disk_state_share=disk_share, state_shared_by=ranks)

    packing = opts.stream_packing is not False
    plan = planned(packing)
    if opts.stream_packing == "auto":  # packed copies live beside the plain ones: only where host RAM has room
        unpacked = planned(False) if streamed and not plan.fits else None
        packing = not (unpacked is not None and unpacked.fits)
        plan = unpacked if unpacked is not None and unpacked.fits else plan
    if not plan.fits and opts.check_memory:
        raise PlanRefused(plan.message)
    return plan, packing


def _optimizer_priced(opts, budget) -> str:
    """Where the plan prices the optimizer state: as the runtime will place it. On a GPU with offload='auto'
    (host AdamW to start with) the state moves to VRAM once the activation policy settles, if it fits beside
    the peak: the planner's "auto" prices it there exactly when it fits. Elsewhere it stays on the host.
    (A budget read off a GPU knows the device's memory; the CPU's has none.)"""
    on_gpu = budget.device_bytes is not None
    on_disk = opts.nvme_path is not None  # state on disk stays host AdamW's (engine.place skips it)
    return "auto" if on_gpu and opts.offload == "auto" and opts.optimizer_mode != "gpu" and not on_disk else "host"


def _embedding_on_host(opts, facts) -> bool:
    """What the plan prices: the embedding in host memory (ts-planner models a LoRA run's untied one) once
    host_embedding is settled to True."""
    shape = facts.shape
    return opts.host_embedding is True and facts.train == "lora" and shape is not None and not shape.tie_word_embeddings


def _compact_lora_inputs(opts, blocks) -> bool:
    """Whether the plan prices LoRA inputs saved compact: as ActivationPolicy applies the option."""
    if opts.compact_lora_inputs == "auto":
        return bool(eligible_layers(blocks))
    return opts.compact_lora_inputs


def _streamed_shared_by(opts, nbytes: int) -> int:
    """How many processes of this machine will map one host copy of ``nbytes`` of streamed weights, as
    WeightStreamer shares them (weights/shared_host.py): the local ranks under data parallel when
    /dev/shm has room for the copy, else 1 (private copies)."""
    from .. import distributed as tsd
    from ..weights import shared_host

    world = tsd.world_of(opts.distributed)
    if world < 2 or nbytes <= 0:
        return 1
    try:
        room = shutil.disk_usage(shared_host.SHM_DIR).free
    except OSError:
        return 1
    return max(1, min(_topology.local_process_count(), world)) if room >= nbytes else 1


def _activations(opts, count: int):
    """The planner's activations for wrap()'s activation_offload= / recompute= ("auto" while either is)."""
    if "auto" in (opts.activation_offload, opts.recompute) or count == 0:
        return "auto"
    page = set(blocks_of("activation_offload", opts.activation_offload, count))
    recompute = set(blocks_of("recompute", opts.recompute, count)) - page
    if opts.recompute_variant == "selective":  # it keeps the matmul outputs: priced as kept (an upper bound)
        recompute = set()
    return (count - len(page) - len(recompute), len(page), len(recompute))


# ---- 6. quantize ---------------------------------------------------------------------------------

def _quantize_decision(model: torch.nn.Module, device: torch.device, opts,
                       plan: WrapPlan | None = None) -> tuple[str | None, str | None]:
    """(format or None, why) for wrap()'s quantize option; "auto" takes the plan's choice, or without a
    decoder shape measures the weights against the VRAM."""
    if opts.quantize != "auto":
        return opts.quantize, None
    if device.type != "cuda":
        return None, "auto: training on the CPU, no VRAM to fit; weights stay as they are"
    if plan is not None and plan.plan is not None:
        return plan.quantize, ("auto: " + ("none needed" if plan.quantize is None else
                                           f"{plan.quantize}: the least quantization the plan fits"))
    fmt, why = choose_quantize(model, vram_budget(device, opts.vram_headroom))
    return fmt, f"auto: {why}"
