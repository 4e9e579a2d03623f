"""Sizing decisions: host RAM needed per placement, moment precision, the VRAM room
measured after the first step and which parameters it can hold."""

from __future__ import annotations

import dataclasses

import torch
import ts_pinned
import ts_planner

from ..engine.slots import ParamSlot

__all__ = ["HostPlan", "device_state_bytes", "host_state_bytes", "plan_host_memory", "vram_budget"]

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
    needed: int  # bytes of page-locked host memory
    available: int  # page-lock budget (bytes)
    message: str


def plan_host_memory(params: list[torch.Tensor], placement: str, moment_dtype: str, check: bool) -> HostPlan:
    """Chooses the moment precision and checks that the host state fits the page-lock budget."""
    machine = ts_pinned.page_lock_budget()
    # Processes launched together on one machine (torchrun, Slurm) share its RAM: each plans with 1/n.
    local = ts_planner.local_process_count()
    budget = dataclasses.replace(machine, budget=machine.budget // local) if local > 1 else machine
    needs = {
        name: sum(host_state_bytes(p, placement, size) for p in params)
        for name, size in (("float32", 4), ("bfloat16", 2))
    }
    if moment_dtype == "auto":
        chosen = "float32" if needs["float32"] <= budget.budget else "bfloat16"
        why = ("fp32 moments fit" if chosen == "float32" else
               f"fp32 moments would need {needs['float32'] / GiB:.2f} GiB, more than the {budget.budget / GiB:.2f} GiB budget")
    else:
        chosen, why = moment_dtype, "as requested"
    needed = needs[chosen]
    if check and needed > budget.budget:
        raise MemoryError(
            f"the optimizer state needs {needed / GiB:.2f} GiB of page-locked host RAM ({chosen} moments, "
            f"{placement} placement) but only {budget.budget / GiB:.2f} GiB can be used "
            f"({budget.mem_available / GiB:.2f} GiB available). bfloat16 moments would need "
            f"{needs['bfloat16'] / GiB:.2f} GiB; otherwise train fewer parameters (LoRA), free host RAM, "
            f"or pass check_memory=False to try anyway."
        )
    share = f" (1/{local} of the machine's {machine.budget / GiB:.2f} GiB: {local} local processes)" if local > 1 else ""
    message = (f"{sum(p.numel() for p in params) / 1e6:.1f} M trained parameters: {chosen} moments ({why}); "
               f"{needed / GiB:.2f} GiB of host state, page-lock budget {budget.budget / GiB:.2f} GiB{share}")
    return HostPlan(getattr(torch, chosen), needed, budget.budget, message)


def vram_budget(device: torch.device, headroom: float) -> int:
    """Bytes this process may use on the device: total memory times the per-process
    fraction (set_per_process_memory_fraction), less `headroom`."""
    total = torch.cuda.get_device_properties(device).total_memory
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = get_fraction(device) if get_fraction is not None else 1.0
    return int(total * fraction * (1.0 - headroom))
