"""TrainStreamSession: the state behind a wrapped model, and its automatic decisions."""

from __future__ import annotations

import sys
import time

import torch
import ts_adamw
import ts_pinned

from ._engine import UpdateEngine
from ._events import EventLog
from ._forward_guard import ForwardGuard
from ._options import WrapOptions
from ._plan import GiB, device_state_bytes, plan_host_memory, vram_budget
from ._slots import ParamSlot

__all__ = ["TrainStreamSession"]


def _reserve_with_progress(arena: ts_pinned.PinnedArena, total: int, verbose: bool) -> None:
    """Reserves `total` bytes slab by slab; with `verbose`, shows progress on large
    reservations (page-locking runs at about 1.5 GB/s, so 20 GB takes over ten seconds)."""
    stats = arena.stats()
    step = max(stats["slab_bytes"], 1)
    # Earlier sessions may hold part of the arena: grow it by what its free space lacks.
    done = stats["arena_bytes"]
    target = done + max(0, total - (done - stats["arena_used"]))
    show = verbose and target - done > 2 * GiB
    started = time.perf_counter()
    while done < target:
        done = arena.reserve(min(target, done + step))
        if show:
            rate = done / max(time.perf_counter() - started, 1e-9) / GiB
            sys.stderr.write(f"\rtrainstream: page-locking host memory {done / GiB:6.1f} / {target / GiB:.1f} GiB "
                             f"({rate:.1f} GiB/s)")
            sys.stderr.flush()
    if show:
        sys.stderr.write("\n")


class TrainStreamSession:
    """Holds the engine, the hooks and the decision log of one wrapped model.

    ``.events`` is the decision log, ``.config`` the options in effect, ``.steps``
    the optimizer steps so far, ``.adapting`` True until the placement is final.
    """

    def __init__(self, model: torch.nn.Module, optimizer, options: WrapOptions, device: torch.device):
        self.model = model
        self.optimizer = optimizer
        self.config = options
        self.device = device
        self.events = EventLog(verbose=options.verbose)
        self.steps = 0
        self.adapting = False
        self.peer = None  # peer-GPU pools arrive with ts-peer
        self.quantized = None  # {"quantize", "tensors", "bytes_before", "bytes_after"} when wrap() quantized

        slots = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                slots.append(ParamSlot(param=p, index=len(slots), group=group))
        if not slots:
            raise ValueError("the optimizer has no parameters to train")
        self._check_devices(slots)

        mode = options.optimizer_mode
        on_gpu = device.type == "cuda"
        if mode == "gpu" and not on_gpu:
            raise ValueError("optimizer_mode='gpu' needs a CUDA device; use 'cpu' or 'auto'")
        initial = "mapped" if mode == "gpu" else "host"
        plan = plan_host_memory([s.param for s in slots], initial, options.moment_dtype, options.check_memory)
        self.moment_dtype = plan.moment_dtype
        self.events.add("plan", plan.message)

        self.arena = ts_pinned.default_arena()
        # Page-lock everything now, in slabs, so no training step ever page-locks.
        slack = 1024 * len(slots) * 5
        _reserve_with_progress(self.arena, plan.needed + slack, options.verbose)
        pinned = self.arena.stats()["pinned"]
        self.events.add("memory", f"reserved {plan.needed / GiB:.2f} GiB of {'page-locked' if pinned else 'pageable'} "
                                  f"host memory for the optimizer state" + ("" if pinned else " (no GPU driver)"))
        for slot in slots:
            slot.allocate(initial, self.moment_dtype, self.arena)
        if options.threads is not None and not ts_adamw.set_host_threads(options.threads):
            self.events.add("optimizer", f"threads={options.threads} ignored: the host pool already runs "
                                         f"with {ts_adamw.host_threads()} threads")
        if on_gpu and ts_adamw.streaming_stores() == "auto":
            # The rounded weights are next read by the H2D DMA, never by this CPU:
            # writing them past the cache saves a read-for-ownership of every line.
            ts_adamw.set_streaming_stores("on")
            self.events.add("optimizer", "host AdamW writes the weights for upload with streaming stores")
        self.engine = UpdateEngine(slots, device, self.moment_dtype, self.arena, self.events,
                                   max_grad_norm=options.max_grad_norm,
                                   accumulation_steps=options.accumulation_steps, seed=options.seed)
        self.guard = ForwardGuard(model, self.engine)
        self._state_hook = model.register_state_dict_pre_hook(lambda *args, **kwargs: self.synchronize())
        what = {"host": "host AdamW on CPU threads", "mapped": "CUDA AdamW over mapped host memory (zero-copy)"}
        self.events.add("optimizer", f"optimizer_mode={mode!r}: {what[initial]}; gradients stream to host memory "
                                     f"during backward" + ("" if on_gpu else " (model on the CPU: memory copies)"))
        self.adapting = on_gpu and (options.offload == "auto" or mode == "auto")
        if not on_gpu and (options.offload == "auto" or mode == "auto"):
            self.events.add("plan", "no CUDA device: the optimizer stays on host threads")

    def _check_devices(self, slots: list[ParamSlot]) -> None:
        for slot in slots:
            if slot.param.device != self.device:
                raise ValueError(f"parameter {slot.index} is on {slot.param.device} but the model trains on "
                                 f"{self.device}; build the optimizer from the model's parameters")

    # ---- called by OffloadAdamW -----------------------------------------------

    def optimizer_step(self) -> None:
        self.engine.step()
        self.steps += 1
        if self.adapting:
            self._adapt()

    def synchronize(self) -> None:
        """Waits until every update is applied and every weight written back."""
        self.engine.synchronize()

    # ---- adaptation after the first measured step --------------------------------

    def _adapt(self) -> None:
        """After the first step: move optimizer state into the VRAM the step left free.

        offload='auto' moves all of it when it fits (the stock fused-AdamW
        arrangement, fp32 master weights in VRAM); optimizer_mode='auto' moves
        the parameters whose gradients arrive last in backward (the first
        layers), whose host updates could not overlap backward anyway.
        """
        self.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        budget = vram_budget(self.device, self.config.vram_headroom)
        room = budget - peak
        movable = [s for s in self.engine.slots if s.placement != "device"]
        need = sum(device_state_bytes(s) for s in movable)
        self.adapting = False
        if not movable:
            return
        if self.config.offload == "auto" and need <= room:
            self.engine.place(movable, "device")
            self.events.add("switch", f"offload='auto': the optimizer state ({need / GiB:.2f} GiB) fits beside the "
                                      f"measured peak ({peak / GiB:.2f} GiB of a {budget / GiB:.2f} GiB budget): "
                                      f"AdamW now runs on the GPU with fp32 master weights, as stock fused AdamW would")
        elif self.config.optimizer_mode == "auto" and room > 0:
            chosen, used = [], 0
            for slot in sorted(movable, key=lambda s: s.index):
                cost = device_state_bytes(slot)
                if used + cost > room:
                    continue
                chosen.append(slot)
                used += cost
            if chosen:
                self.engine.place(chosen, "device")
            share = sum(s.numel for s in chosen) / max(1, sum(s.numel for s in self.engine.slots))
            self.events.add("switch", f"optimizer_mode='auto': {len(chosen)} of {len(movable)} parameters "
                                      f"({share:.0%} of the values, {used / GiB:.2f} GiB) moved their state to VRAM "
                                      f"left free by the measured peak ({peak / GiB:.2f} GiB of {budget / GiB:.2f} GiB); "
                                      f"their updates run on the GPU, the rest on host threads")
        else:
            self.events.add("plan", f"the optimizer state ({need / GiB:.2f} GiB) does not fit in the VRAM left "
                                    f"after the measured peak ({max(room, 0) / GiB:.2f} GiB): it stays in host memory")
        torch.cuda.reset_peak_memory_stats(self.device)

    # ---- teardown -------------------------------------------------------------------

    def close(self) -> None:
        self.engine.close()
        self.guard.remove()
        self._state_hook.remove()
