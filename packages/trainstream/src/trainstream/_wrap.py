"""wrap() and unwrap(): the user's entry points. wrap() is all or nothing: on any exception the
model and the optimizer are as they were before the call."""

from __future__ import annotations

import contextlib
import sys

import torch

from ._config import Config
from ._convert import to_offload_adamw
from ._optimizer import OffloadAdamW, _checked_entry
from ._session import TrainStreamSession
from ._units import fmt_bytes
from .distributed import check_options
from .distributed.composition import check_composable
from .distributed.fsdp import ShardProxies, sharded_by_fsdp2
from .engine import SlotState
from .engine.hooks import PlainDeepcopy
from .memory.allocator import use_expandable_segments
from .planning import Plan
from .planning import plan as make_plan
from .planning.plan import fingerprint
from .weights.host_embedding import host_embedding_candidate
from .weights.quantize import quantize_model, undo_swaps
from .weights.streamer import WeightStreamer

__all__ = ["unwrap", "wrap"]


class _ModelUndo:
    """What wrap() may change in the model, recorded first so a failure can put it back."""

    def __init__(self, model: torch.nn.Module):
        self.params = [(p, p.data, p.grad) for p in model.parameters()]
        self.buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items()]
        self.replaced: list[tuple] = []  # quantize_model's swaps (undo_swaps)

    def restore(self) -> None:
        undo_swaps(self.replaced)
        for p, data, grad in self.params:
            if p.data is not data:
                p.data = data
            p.grad = grad
        for module, name, buffer in self.buffers:
            module._buffers[name] = buffer


def wrap(model: torch.nn.Module, optimizer=None, plan: Plan | None = None, config: Config | None = None,
         **options):
    """Trains ``model`` with its optimizer state in host memory; returns ``(model, optimizer)``.

    ``optimizer``: ``torch.optim.AdamW`` / ``Adam`` (converted, state migrated), a
    ``trainstream.OffloadAdamW``, or ``None`` (one is made with ``lr=``). ``plan``: what
    ``trainstream.plan(model, optimizer, ...)`` returned, applied as it is (then pass no config or
    options); without it wrap() makes that plan first. ``config``: a ``trainstream.Config`` (or its
    dict); keyword options (every one in docs/options.md) override it. Options are validated up front. On any
    error, nothing has changed.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"wrap() takes a torch.nn.Module, not {type(model).__name__}")
    if getattr(model, "_trainstream_session", None) is not None:
        raise ValueError("this model is already wrapped; call trainstream.unwrap(model) first")
    if plan is None:
        plan = make_plan(model, optimizer, config, **options)
    else:
        _check_plan_applies(plan, model, optimizer, {**options, **({"config": config} if config is not None else {})})
    return _apply(model, optimizer, plan)


def _check_plan_applies(plan, model: torch.nn.Module, optimizer, options: dict) -> None:
    if not isinstance(plan, Plan):
        raise ValueError(f"plan= takes what trainstream.plan() returned, not {type(plan).__name__}")
    if options:
        raise ValueError(f"wrap(plan=...) applies the plan's options; pass {', '.join(sorted(options))} to "
                         f"trainstream.plan() instead")
    check_composable(model)  # a plan made before fully_shard() or DDP(...) has the same fingerprint
    if plan.made_for != fingerprint(model, optimizer):
        raise ValueError("this plan was made for another model or optimizer, or before the model's parameters "
                         "changed; call trainstream.plan() again")


def _apply(model: torch.nn.Module, optimizer, plan: Plan):
    """Applies `plan`: decides nothing (every "auto" is settled in it); all or nothing."""
    opts, device = plan.options(), plan.device
    converted, carried = to_offload_adamw(optimizer, model, opts.lr)
    if sharded_by_fsdp2(model) and carried:
        raise ValueError("the optimizer already holds AdamW state for FSDP2-sharded parameters; wrap() before the "
                         "first step (carrying sharded state over is not supported yet)")
    embedding = host_embedding_candidate(model)[0] if opts.host_embedding else None
    # Quantize where the weights are, before the move: a base too large for the GPU in bf16 moves as codes.
    fmt = plan.quantize
    check_options(plan, device)  # data parallel: before any set-up whose collectives the options decide
    undo = _ModelUndo(model)
    session = streamer = origin = shards = None
    allocator_why = use_expandable_segments(device)  # before the quantize and move below allocate
    try:
        quantized = quantize_model(model, fmt, _replaced=undo.replaced) if fmt else None
        if plan.streamed_blocks:  # after quantizing: the blocks' frozen weights stream as codes
            streamer = _weight_streamer(model, device, opts, plan.streamed_blocks)
            origin = streamer.origin()
            streamer.prepare()  # before the move: the streamed weights never reach the GPU whole
            packing_why = streamer.use_packing() if opts.stream_packing else None
            _move_except(model, device, streamer.param_ids)
        elif any(p.device != device for p in model.parameters()) or quantized:
            model.to(device)  # keeps the Parameter objects, so the optimizer still refers to them
        if sharded_by_fsdp2(model):
            shards = ShardProxies.replace_in(converted)
        session = TrainStreamSession(model, converted, opts, device, plan, weights=streamer,
                                     quantized={"quantize": fmt, **quantized} if quantized else None, shards=shards)
        if embedding is not None:
            session.install_host_embedding(embedding)
        memory = plan.memory
        session.events.add("plan", memory.message if memory.fits else f"check_memory=False, so it tries: {memory.message}")
        for kind, text in plan.notes:
            session.events.add(kind, text)
        if allocator_why:
            session.events.add("memory", allocator_why)
        if plan.decision("param_offload"):
            session.events.add("weights", plan.decision("param_offload").reason)
        if streamer is not None and opts.stream_packing:
            session.events.add("weights", packing_why)
        if plan.decision("quantize"):
            session.events.add("quantize", plan.decision("quantize").reason)
        if quantized:
            session.events.add("quantize", f"{quantized['tensors']} frozen linear weights of the blocks stored as "
                                           f"{fmt}: {fmt_bytes(quantized['bytes_before'])} -> "
                                           f"{fmt_bytes(quantized['bytes_after'])}")
        if carried:
            _migrate_state(session, carried)
        converted._session = session
        converted._loop_check = _training_loop_check()
        model._trainstream_session = session
        model.__deepcopy__ = PlainDeepcopy(model, skip=("_trainstream_session",))
    except BaseException:
        converted._session = None
        converted._loop_check = None
        for name in ("_trainstream_session", "__deepcopy__"):
            model.__dict__.pop(name, None)
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()
        elif streamer is not None and origin is not None:
            with contextlib.suppress(Exception):
                streamer.remove(to_device=False, device=origin)  # the weights go back where they were
        if shards is not None and session is None:
            shards.restore()
        undo.restore()
        raise
    if converted is optimizer:
        optimizer.state.clear()  # the state lives in the engine now
    return model, converted


def _training_loop_check():
    """What an attached optimizer's ``train()`` checks of the loop that drives it: with transformers loaded,
    the Hugging Face integration's refusal of a Trainer whose clipping or accumulation the engine would not
    honour (integrations/huggingface.py, the one place that knows the Trainer); None otherwise."""
    if "transformers" not in sys.modules:
        return None
    from .integrations.huggingface import _refuse_unhonoured_trainer

    return _refuse_unhonoured_trainer


def _weight_streamer(model: torch.nn.Module, device: torch.device, opts, streamed: tuple[int, ...]) -> WeightStreamer:
    """The streamer of the plan's streamed blocks."""
    blocks = list(opts.blocks)  # the plan's (planning/decide.py found them)
    return WeightStreamer(blocks, streamed, device=device, prefetch_depth=opts.weights_prefetch_depth,
                          shared=opts.distributed, timeout=opts.distributed_timeout, trained=None)


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


def _migrate_state(session: TrainStreamSession, carried: dict) -> None:
    """Existing AdamW state (a converted torch optimizer's, or kept by OffloadAdamW across unwrap), all
    checked before any is applied. A saved master is used only while it still rounds to the weight."""
    entries = []
    for slot in session.engine.slots:
        state = carried.get(id(slot.param))
        if state and slot.state is not SlotState.DORMANT:
            span = state.get("span")  # unwrap() under data parallel kept only this rank's piece
            if span is not None and tuple(span) != slot.span:
                raise ValueError(f"the optimizer carries the state of values {tuple(span)} of {slot.label} from its last "
                                 f"wrap(), and this rank now keeps {slot.span or 'all of them'}: wrap() again over the "
                                 f"same ranks, or carry the state in a checkpoint (optimizer.state_dict() or "
                                 f"trainstream.distributed.save_checkpoint) and load it after wrap()")
            entries.append((slot, _checked_entry(slot, slot.index, state)))
    for slot, (step, exp_avg, exp_avg_sq, master) in entries:
        whole = master is not None and master.numel() == slot.param.numel()
        weight = slot.param.detach() if whole else slot.weight_view()
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
            try:
                for slot in session.engine.active:
                    state = optimizer.state[slot.param] = slot.export()
                    if slot.span is not None:  # data parallel: this rank's piece only (flat), for the next wrap()
                        state["span"] = slot.span
            finally:
                session.engine.release_disk()
            optimizer._session = None
            optimizer._loop_check = None
        session.engine.release_disk()
        del model._trainstream_session
        model.__dict__.pop("__deepcopy__", None)
    return model
