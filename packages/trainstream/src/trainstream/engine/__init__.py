"""The update engine: every trained parameter's optimizer state and the path of its updates.

``slots`` holds the per-parameter state machine (states, transitions, invariants) and is the
only place a slot changes state; ``engine`` drives it from autograd's gradient hooks and
``step()``; ``updates`` runs AdamW on the host worker or as CUDA kernels; ``channel`` moves bytes
on dedicated streams and orders the compute stream after uploads on the device; ``guard``
orders forwards after the updates they read; ``interrupts`` keeps Ctrl-C out of transitions;
``hooks`` makes a copy of a wrapped model a plain one. Weight streaming and gradient buckets
extend these rooms rather than adding new ones.
"""

from .channel import transfer_stats
from .engine import UpdateEngine, UpdateFailed
from .guard import ForwardGuard
from .slots import PLACEMENTS, ParamSlot, SlotState

__all__ = ["PLACEMENTS", "ForwardGuard", "ParamSlot", "SlotState", "UpdateEngine", "UpdateFailed", "transfer_stats"]
