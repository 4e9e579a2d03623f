"""Hardware probes and the memory planner of TrainStream."""

from ._local import local_process_count
from ._planner import Block, ResidencyPlan, plan_residency
from ._profile import HardwareProfile, measure_host_bandwidth, measure_link, profile_hardware

__all__ = [
    "Block",
    "HardwareProfile",
    "ResidencyPlan",
    "local_process_count",
    "measure_host_bandwidth",
    "measure_link",
    "plan_residency",
    "profile_hardware",
]
__version__ = "0.1.0"
