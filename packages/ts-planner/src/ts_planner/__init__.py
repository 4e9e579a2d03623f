"""Hardware probes (host memory, the GPU link, a disk) and the memory planner of TrainStream."""

from ._activations import block_saved_tensors, saved_activation_bytes
from ._budget import Budget, machine_budget
from ._decide import Plan, check_plan, plan_memory
from ._disk import DiskRates, disk_rates, measure_disk
from ._formats import weight_bytes
from ._local import LOCAL_PROCESS_VARS, local_process_count
from ._memory import MemoryEstimate, Options, estimate_memory, state_share
from ._planner import Block, ResidencyPlan, plan_residency, spread_order
from ._profile import HardwareProfile, measure_host_bandwidth, measure_link, profile_hardware
from ._shape import LORA_TARGETS, ModelShape

__all__ = [
    "LOCAL_PROCESS_VARS",
    "LORA_TARGETS",
    "Block",
    "Budget",
    "DiskRates",
    "HardwareProfile",
    "MemoryEstimate",
    "ModelShape",
    "Options",
    "Plan",
    "ResidencyPlan",
    "block_saved_tensors",
    "check_plan",
    "disk_rates",
    "estimate_memory",
    "local_process_count",
    "machine_budget",
    "measure_disk",
    "measure_host_bandwidth",
    "measure_link",
    "plan_memory",
    "plan_residency",
    "profile_hardware",
    "saved_activation_bytes",
    "spread_order",
    "state_share",
    "weight_bytes",
]
__version__ = "0.7.0"
