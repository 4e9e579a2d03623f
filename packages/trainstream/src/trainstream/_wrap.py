"""wrap() and unwrap(): the user's entry points. wrap() is all or nothing: on any exception the
model and the optimizer are as they were before the call."""

from __future__ import annotations

import contextlib
import shutil

import torch
import ts_planner

from ._convert import to_offload_adamw
from ._dropped import collect_dropped
from ._optimizer import OffloadAdamW, _checked_entry
from ._options import parse_options
from ._session import TrainStreamSession
from ._stalls import attach_stall_clock
from .engine import SlotState
from .memory import residency
from .memory.activations import blocks_of
from .memory.allocator import use_expandable_segments
from .memory.blocks import find_blocks
from .memory.host_embedding import host_embedding_candidate
from .memory.lora_inputs import eligible_layers
from .memory.plan import (
    PLAN_BATCH,
    PLAN_SEQ,
    PlanRefused,
    WrapPlan,
    describe_model,
    plan_wrap,
    vram_budget,
    wrap_budget,
)
from .memory.quantize import choose_quantize, quantize_model
from .memory.residency import WeightResidency
from .memory.weights import WeightStreamer, frozen_params_of

__all__ = ["unwrap", "wrap"]


def _training_device(model: torch.nn.Module, requested: torch.device | None) -> torch.device:
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


class _ModelUndo:
    """What wrap() may change in the model, recorded first so a failure can put it back."""

    def __init__(self, model: torch.nn.Module):
        self.params = [(p, p.data, p.grad) for p in model.parameters()]
        self.buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items()]
        self.replaced: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []  # quantize_model's swaps

    def restore(self) -> None:
        for parent, name, child in reversed(self.replaced):
            setattr(parent, name, child)
        for p, data, grad in self.params:
            if p.data is not data:
                p.data = data
            p.grad = grad
        for module, name, buffer in self.buffers:
            module._buffers[name] = buffer


def wrap(model: torch.nn.Module, optimizer=None, **options):
    """Trains ``model`` with its optimizer state in host memory; returns ``(model, optimizer)``.

    ``optimizer``: ``torch.optim.AdamW`` / ``Adam`` (converted, state migrated), a
    ``trainstream.OffloadAdamW``, or ``None`` (one is made with ``lr=``). Options are
    validated up front; see the README for each one. On any error, nothing has changed.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"wrap() takes a torch.nn.Module, not {type(model).__name__}")
    if getattr(model, "_trainstream_session", None) is not None:
        raise ValueError("this model is already wrapped; call trainstream.unwrap(model) first")
    if isinstance(optimizer, OffloadAdamW):
        options = {**optimizer.wrap_options, **options}
    opts = parse_options(options)
    device = _training_device(model, opts.device)
    dropped_why = collect_dropped(device)  # before anything is measured: what dropped models still held
    converted, carried = to_offload_adamw(optimizer, model, opts.lr)
    embedding = _host_embedding_choice(model, device, opts)  # resolves opts.host_embedding
    offload_why = None
    inputs = _plan_inputs(model, device, opts)  # the blocks, the model's facts and the budget, measured once
    streamed_for = None  # param_offload='auto': the streamed blocks at the batch's real size (residency.py)
    if opts.param_offload == "auto":
        opts.param_offload, offload_why, implied = _auto_param_offload(model, device, opts, inputs)
        if implied is not None:
            opts.quantize = implied
        if opts.param_offload:
            streamed_for = _streamed_for(inputs, opts)
    # Quantize where the weights are, before the move: a base too large for the GPU in bf16 moves as codes.
    streamer = _weight_streamer(model, device, opts)
    plan = _plan(model, device, opts, streamer, inputs)  # before anything is allocated; PlanRefused when nothing fits
    if streamer is not None and opts.quantize == "auto":
        fmt, why = None, "auto: param_offload streams the weights as they are stored, so none are quantized"
    else:
        fmt, why = _quantize_decision(model, device, opts, plan)
    undo = _ModelUndo(model)
    session = None
    origin = streamer.origin() if streamer is not None else None
    allocator_why = use_expandable_segments(device)  # before the quantize and move below allocate
    try:
        quantized = quantize_model(model, fmt, _replaced=undo.replaced) if fmt else None
        if streamer is not None and quantized:
            streamer = _weight_streamer(model, device, opts)  # the blocks' frozen weights are codes now
        if streamer is not None:
            streamer.prepare()  # before the move: the streamed weights never reach the GPU whole
            packing_why = streamer.use_packing() if opts.stream_packing else None
            _move_except(model, device, streamer.param_ids)
        elif any(p.device != device for p in model.parameters()) or quantized:
            model.to(device)  # keeps the Parameter objects, so the optimizer still refers to them
        session = TrainStreamSession(model, converted, opts, device, weights=streamer)
        if embedding is not None:
            session.install_host_embedding(embedding)
        session.plan = plan.to_dict()
        session.events.add("plan", plan.message if plan.fits else f"check_memory=False, so it tries: {plan.message}")
        attach_stall_clock(session)
        if streamed_for is not None and residency.FOLLOW_TOKENS and session.weights.keepable():
            events = session.events  # not the session: it owns the residency (no cycle, _weak.py)
            session.follow_tokens(WeightResidency(session.weights, streamed_for,
                                                  lambda text: events.add("weights", text)))
        if dropped_why:
            session.events.add("memory", dropped_why)
        if allocator_why:
            session.events.add("memory", allocator_why)
        if offload_why:
            session.events.add("weights", offload_why)
        if streamer is not None and opts.stream_packing:
            session.events.add("weights", packing_why)
        if why:
            session.events.add("quantize", why)
        if quantized:
            session.quantized = {"quantize": fmt, **quantized}
            session.events.add("quantize", f"{quantized['tensors']} frozen linear weights of the blocks stored as "
                                           f"{fmt}: {quantized['bytes_before'] / 2**30:.2f} GiB -> "
                                           f"{quantized['bytes_after'] / 2**30:.2f} GiB")
        if carried:
            _migrate_state(session, carried)
        converted._session = session
        model._trainstream_session = session
    except BaseException:
        converted._session = None
        with contextlib.suppress(Exception):
            del model._trainstream_session
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()
        elif streamer is not None and origin is not None:
            with contextlib.suppress(Exception):
                streamer.remove(to_device=False, device=origin)  # the weights go back where they were
        undo.restore()
        raise
    if converted is optimizer:
        optimizer.state.clear()  # the state lives in the engine now
    return model, converted


def _weight_streamer(model: torch.nn.Module, device: torch.device, opts) -> WeightStreamer | None:
    """The streamer of param_offload= (None when off), checked before anything changes."""
    if opts.param_offload is False:
        return None
    blocks = list(opts.blocks) if opts.blocks is not None else find_blocks(model)
    if not blocks:
        raise ValueError("param_offload= needs the model's repeated blocks, and find_blocks() found none: "
                         "pass blocks=[...]")
    chosen = blocks_of("param_offload", opts.param_offload, len(blocks))
    streamer = WeightStreamer(blocks, chosen, device=device, prefetch_depth=opts.prefetch_depth,
                              shared=opts.distributed, trained=None)
    if streamer.trained_blocks:
        why = _why_trained_cannot_stream(opts)
        if why:
            raise ValueError(f"param_offload would stream the trained weights of {len(streamer.trained_blocks)} blocks "
                             f"(a full fine-tune: they are most of those blocks' bytes), which needs {why}. Use "
                             f"param_offload=False (or fewer blocks), or train LoRA adapters")
    return streamer


def _why_trained_cannot_stream(opts) -> str | None:
    """None when streamed trained weights can train with these options, else what they need: their
    AdamW runs on host threads and writes the host copy a fetch reads (one process owns it)."""
    from . import distributed as tsd

    if opts.optimizer_mode == "gpu":
        return "the optimizer on host threads, not optimizer_mode='gpu' (use 'cpu' or 'auto')"
    if tsd.world_of(opts.distributed) > 1:
        return "one process: under data parallel every rank would write its machine's one host copy"
    return None


def _plan_inputs(model: torch.nn.Module, device: torch.device, opts) -> tuple[list, object, object]:
    """(blocks, describe_model's facts, wrap_budget's budget): what every plan of one wrap() reads."""
    blocks = list(opts.blocks) if opts.blocks is not None else find_blocks(model)
    facts = describe_model(model, blocks)
    return blocks, facts, wrap_budget(device, opts, facts)


def _auto_param_offload(model: torch.nn.Module, device: torch.device, opts,
                        inputs=None) -> tuple[list[int] | bool, str, str | None]:
    """param_offload='auto': (the blocks to stream, why, the quantization it implies or None): the
    fewest blocks with which the plan fits (spread through the stack, as ts-planner spreads them), with
    the weights as ``quantize`` stores them. With quantize='auto': ``prefer="exact"`` streams the exact
    weights when that fits and quantizes nothing; ``prefer="speed"`` (or exact weights that do not fit
    even streamed) streams nothing while some quantization fits resident (the faster way to fit), else
    NF4 codes stream."""
    blocks, facts, budget = inputs or _plan_inputs(model, device, opts)
    if facts.shape is None or not blocks:
        return False, "param_offload='auto': none stream (no decoder config or repeated blocks to plan with)", None
    activations = _activations(opts, len(blocks))

    def fewest(fmt):
        return _fewest_streamed((blocks, facts, budget), opts, fmt)

    fmt, implied, note, plan = opts.quantize, None, "", None
    if fmt == "auto" and opts.prefer == "exact":
        exact = fewest(None)
        if exact.plan is not None and exact.plan.fits:
            fmt, plan = None, exact
            note = " (prefer='exact': the exact weights stream rather than quantized ones; prefer='speed' quantizes first)"
        else:
            note = " (prefer='exact': even with every block streamed the exact weights do not fit, so they are quantized)"
    if fmt == "auto":
        resident = plan_wrap(facts, budget, quantize="auto", moment_dtype=opts.moment_dtype, activations=activations,
                             streamed_blocks=0, embedding_on_host=_embedding_on_host(opts, facts))
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


def _fewest_streamed(inputs, opts, fmt, tokens=(PLAN_BATCH, PLAN_SEQ)):
    """The plan with the fewest streamed blocks that fits `tokens` with the weights stored as `fmt` (the
    plan with all of them streamed when none does)."""
    blocks, facts, budget = inputs
    activations = _activations(opts, len(blocks))
    frozen = sum(t.numel() * t.element_size() for b in blocks for _m, _n, t in frozen_params_of(b))
    shared_by = _streamed_shared_by(opts, frozen)  # an upper bound of what streams: room for it is room for less
    for count in range(len(blocks) + 1):
        plan = plan_wrap(facts, budget, quantize=fmt, moment_dtype=opts.moment_dtype, activations=activations,
                         streamed_blocks=count, streamed_shared_by=shared_by, tokens=tokens,
                         compact_lora_inputs=_compact_lora_inputs(opts, blocks),
                         stream_packing=opts.stream_packing is not False,
                         embedding_on_host=_embedding_on_host(opts, facts))
        if plan.plan is not None and plan.plan.fits:
            break
    return plan


def _streamed_for(inputs, opts):
    """param_offload='auto' after the choice: how many blocks must stream at (batch, seq) tokens, for
    WeightResidency (memory/residency.py). `opts` as wrap() settled them (quantize: the stored format)."""
    fmt = None if opts.quantize == "auto" else opts.quantize

    def count(batch: int, seq: int) -> int:
        plan = _fewest_streamed(inputs, opts, fmt, tokens=(batch, seq))
        return plan.plan.options.streamed_blocks if plan.plan is not None else len(inputs[0])
    return count


def _move_except(model: torch.nn.Module, device: torch.device, skip: set[int]) -> None:
    """model.to(device) for every parameter and buffer except the streamed weights (`skip`: ids);
    the Parameter objects stay, so the optimizer still refers to them."""
    from ts_quant import QuantizedTensor

    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in skip and p.device != device:
                p.data = p.data.to(device)
        q = module.__dict__.get("qweight")  # a ts-quant QuantLinear's codes, unless they stream
        if isinstance(q, QuantizedTensor) and id(q.data) not in skip and q.device != device:
            module.qweight = q.to(device)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


def _plan(model: torch.nn.Module, device: torch.device, opts, streamer, inputs=None) -> WrapPlan:
    """ts-planner's plan for the live model and these options; PlanRefused (check_memory=True) when
    even one token per step does not fit."""
    blocks, facts, budget = inputs or _plan_inputs(model, device, opts)
    auto = opts.quantize == "auto"
    quantize = ("auto" if device.type == "cuda" and streamer is None else None) if auto else opts.quantize
    streamed = len(streamer.streamed) if streamer is not None else 0
    shared_by = _streamed_shared_by(opts, streamer.host_bytes()) if streamed else 1

    def planned(packing: bool) -> WrapPlan:
        return plan_wrap(facts, budget, quantize=quantize, moment_dtype=opts.moment_dtype,
                         activations=_activations(opts, len(blocks)), streamed_blocks=streamed,
                         streamed_shared_by=shared_by, compact_lora_inputs=_compact_lora_inputs(opts, blocks),
                         stream_packing=packing, embedding_on_host=_embedding_on_host(opts, facts))

    plan = planned(opts.stream_packing is not False)
    if opts.stream_packing == "auto":  # packed copies live beside the plain ones: only where host RAM has room
        unpacked = planned(False) if streamed and not plan.fits else None
        opts.stream_packing = not (unpacked is not None and unpacked.fits)
        plan = unpacked if unpacked is not None and unpacked.fits else plan
    if not plan.fits and opts.check_memory:
        raise PlanRefused(plan.message)
    return plan


def _host_embedding_choice(model: torch.nn.Module, device: torch.device, opts):
    """The embedding to keep in host memory (None: none), resolving opts.host_embedding to a bool; True
    that cannot apply is refused, with the reason, before anything changes."""
    embedding, why = host_embedding_candidate(model)
    if device.type != "cuda":
        embedding, why = None, "the model trains on the CPU, where it is in host memory already"
    if opts.host_embedding is True and embedding is None:
        raise ValueError(f"host_embedding=True cannot apply: {why}; use 'auto' or False")
    if opts.host_embedding is False:
        embedding = None
    opts.host_embedding = embedding is not None
    return embedding


def _embedding_on_host(opts, facts) -> bool:
    """What the plan prices: the embedding in host memory (ts-planner models a LoRA run's untied one) once
    wrap() resolved host_embedding to True (_host_embedding_choice)."""
    shape = facts.shape
    return opts.host_embedding is True and facts.train == "lora" and shape is not None and not shape.tie_word_embeddings


def _compact_lora_inputs(opts, blocks) -> bool:
    """Whether the plan prices LoRA inputs saved compact: as ActivationPolicy applies the option."""
    if opts.compact_lora_inputs == "auto":
        return bool(eligible_layers(blocks))
    return opts.compact_lora_inputs


def _streamed_shared_by(opts, nbytes: int) -> int:
    """How many processes of this machine will map one host copy of ``nbytes`` of streamed weights, as
    WeightStreamer shares them (memory/shared_host.py): the local ranks under data parallel when
    /dev/shm has room for the copy, else 1 (private copies)."""
    from . import distributed as tsd
    from .memory import shared_host

    world = tsd.world_of(opts.distributed)
    if world < 2 or nbytes <= 0:
        return 1
    try:
        room = shutil.disk_usage(shared_host.SHM_DIR).free
    except OSError:
        return 1
    return max(1, min(ts_planner.local_process_count(), world)) if room >= nbytes else 1


def _activations(opts, count: int):
    """The planner's activations for wrap()'s activation_offload= / recompute= ("auto" while either is)."""
    if "auto" in (opts.activation_offload, opts.recompute) or count == 0:
        return "auto"
    page = set(blocks_of("activation_offload", opts.activation_offload, count))
    recompute = set(blocks_of("recompute", opts.recompute, count)) - page
    if opts.recompute_variant == "selective":  # it keeps the matmul outputs: priced as kept (an upper bound)
        recompute = set()
    return (count - len(page) - len(recompute), len(page), len(recompute))


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


def _migrate_state(session: TrainStreamSession, carried: dict) -> None:
    """Existing AdamW state (a converted torch optimizer's, or kept by OffloadAdamW across unwrap), all
    checked before any is applied. A saved master is used only while it still rounds to the weight."""
    entries = []
    for slot in session.engine.slots:
        state = carried.get(id(slot.param))
        if state and slot.state is not SlotState.DORMANT:
            entries.append((slot, _checked_entry(slot, slot.index, state)))
    for slot, (step, exp_avg, exp_avg_sq, master) in entries:
        weight = slot.param.detach()
        if master is not None and not torch.equal(master.reshape(weight.shape).to(weight.dtype).cpu(), weight.cpu()):
            master = None  # the weight was changed since: training continues from the weight
        with torch.no_grad():
            slot.load(step, exp_avg, exp_avg_sq, master)
    session.events.add("optimizer", f"continued from the existing AdamW state of {len(entries)} parameters")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Waits for every update, removes TrainStream's hooks and returns the plain model. The optimizer
    keeps its state (torch.optim.AdamW's format, in ``.state``): wrap() it again to continue. Everything
    is removed even when an update failed; that failure is raised afterwards."""
    session: TrainStreamSession | None = getattr(model, "_trainstream_session", None)
    if session is None:
        raise ValueError("this model is not wrapped by trainstream")
    try:
        session.close()
    finally:
        optimizer = session.optimizer
        if isinstance(optimizer, OffloadAdamW):
            for slot in session.engine.active:
                optimizer.state[slot.param] = slot.export()
            optimizer._session = None
        del model._trainstream_session
    return model
