"""One trained parameter's optimizer state, as an explicit state machine.

States (``SlotState``) and who moves a slot between them:

  DORMANT       in the optimizer but frozen at wrap(), or (data parallel) owned by another rank
                (``owned`` False): no buffers, no hook. -> IDLE when it is first seen trainable
                and owned (engine, main thread).
  IDLE          buffers allocated, no gradient held by the engine. -> ACCUMULATING (a backward
                pass of several), -> ARRIVED (clipping), -> QUEUED (host update), or straight back
                to IDLE after a device update is launched (engine, main thread).
  ACCUMULATING  0 < micro < accumulation_steps; the gradient sums in ``param.grad`` as autograd
                does. -> ARRIVED / QUEUED / IDLE as from IDLE; -> IDLE on zero_grad().
  ARRIVED       the gradient is the engine's (host: copied to ``grad_host``; device: kept in
                ``param.grad``) and waits for step()'s global norm. -> QUEUED / IDLE (launch) at
                step(), -> IDLE on zero_grad() (dropped).
  QUEUED        a host update is in the worker's queue or running. -> IDLE only by the worker,
                after it applied the update (``step`` += 1) or failed (nothing changed).

Invariants (checked by tests/test_engine_state_machine.py):
  1. Buffers exist if and only if the state is not DORMANT.
  2. ``grad_host`` is written (by a device-to-host copy) only on the way out of IDLE or
     ACCUMULATING, and read only by the worker in QUEUED: it is never overwritten while read.
     A gradient that arrives while its slot is QUEUED first waits for the worker.
  3. ``step`` counts applied updates. It changes only when an update is applied: by the worker
     (QUEUED -> IDLE) or when a device update is launched; a failed update leaves it.
  4. ``master`` and the moments change only when an update is applied, when the weight was edited
     by the user (the master follows the weight, ``weight_changed``), or by load_state_dict; the
     last two only outside QUEUED.
  5. ``micro`` > 0 only in ACCUMULATING.
  6. ``written`` marks the last write of the weight that the compute stream has not yet been
     ordered after (a channel token); the guard clears it once it is.
  7. A *streamed* slot (``streamed_block`` set: its weight is one of a ``WeightStreamer``'s, in host
     memory, visiting the GPU with its block) is always placed on the host. Its ``out_host`` is the
     streamer's host copy of the weight: the worker writes the rounded update there and uploads
     nothing (the block's next fetch carries it). ``upload_event`` is then the streamer's newest copy
     *reading* that host copy, which the worker waits for before writing it.
  7b. A slot *on disk* (``disk`` set once, at wrap(), to the engine's ``DiskTier``: nvme_path) is placed on
     the host and keeps its master and moments in the tier's file, not in ``master``/``exp_avg``/
     ``exp_avg_sq`` (None); ``grad_host`` and ``out_host`` (never the master) are in RAM as for any host
     slot. It never moves to another placement.
  8. A QUEUED slot's update is in the worker's queue or running (``HostUpdater.holds``), except inside the
     critical section that queues it. Should an exception still separate the two (a failed submit), the
     engine queues the update at the slot's next wait, at step() or at synchronize() (``_requeue_orphans``),
     so nothing waits for an update that does not exist.
  8b. A slot with a *span* (``span``: (lo, hi), set once, at wrap(), by data parallel: distributed/sharding.py)
     keeps the state of values [lo, hi) of its parameter's memory order only: its buffers hold hi - lo values
     (``numel``), it takes that part of a gradient (``grad_view``) and writes that part of the weight
     (``weight_view``); the other ranks own the rest. ``span`` None: the whole parameter.
  9. A hooked slot takes one complete gradient (after ``accumulation_steps`` backward passes) per step()
     (``taken``: set when the gradient leaves ``param.grad``, cleared by step() and zero_grad()): its update
     starts before step(), so a further backward pass could not be summed with it as torch would; its
     gradient is refused at arrival instead. A gradient still waiting in a bucket has not left: the next
     pass adds to it, as autograd does.

Flat buffers follow the parameter's memory order, so any dense layout (``channels_last``
included) trains; ``flat()`` and ``shaped()`` convert.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
import ts_pinned

__all__ = ["PLACEMENTS", "ParamSlot", "SlotState", "dense_layout_problem", "flat", "is_dtensor", "shaped"]

PLACEMENTS = ("host", "device", "mapped")


class SlotState(enum.Enum):
    DORMANT = "dormant"
    IDLE = "idle"
    ACCUMULATING = "accumulating"
    ARRIVED = "arrived"
    QUEUED = "queued"


S = SlotState
_ALLOWED = {
    (S.DORMANT, S.IDLE),
    (S.IDLE, S.ACCUMULATING), (S.IDLE, S.ARRIVED), (S.IDLE, S.QUEUED), (S.IDLE, S.IDLE),
    (S.ACCUMULATING, S.ACCUMULATING), (S.ACCUMULATING, S.ARRIVED), (S.ACCUMULATING, S.QUEUED),
    (S.ACCUMULATING, S.IDLE),
    (S.ARRIVED, S.QUEUED), (S.ARRIVED, S.IDLE),
    (S.QUEUED, S.IDLE),
}


def is_dtensor(t: torch.Tensor) -> bool:
    """A DTensor (FSDP2 or tensor-parallel shard): the engine's buffers and updates take plain tensors only."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed support has no DTensor
        return False
    return isinstance(t, DTensor)


def dense_layout_problem(t: torch.Tensor) -> str | None:
    """None when ``t``'s elements fill its memory exactly once (any permutation of strides), else why not."""
    if t.layout != torch.strided:
        return f"its layout is {t.layout}"
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda x: x[1]):
        if stride != expected:
            return f"its strides {tuple(t.stride())} overlap or leave gaps for shape {tuple(t.shape)}"
        expected *= size
    return None


def flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor in memory order (no copy)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def shaped(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The flat memory-order ``buffer`` seen with ``like``'s shape and strides."""
    return buffer.as_strided(like.shape, like.stride(), buffer.storage_offset())


def grad_in_memory_order(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The gradient as a flat buffer in the parameter's memory order (a copy only when layouts differ)."""
    if grad.stride() != param.stride():
        grad = torch.empty_like(param).copy_(grad)
    return flat(grad)


@dataclasses.dataclass(eq=False)
class ParamSlot:
    """Everything the engine keeps for one trained parameter (see the module docstring)."""

    param: torch.nn.Parameter
    index: int  # position in the optimizer's param_groups order
    group: dict
    name: str = ""
    state: SlotState = SlotState.DORMANT
    placement: str = "host"
    step: int = 0
    micro: int = 0
    taken: bool = False  # invariant 9: a complete gradient was taken since the last step() or zero_grad()
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad_host: torch.Tensor | None = None  # host placement: where the gradient lands
    out_host: torch.Tensor | None = None  # host placement: rounded weight for the upload
    grad_token: object = None  # ARRIVED on the host: the device-to-host copy's completion
    hyper: object = None  # ARRIVED / QUEUED: hyper-parameters read when the gradient arrived
    written: object = None  # invariant 6
    upload_event: object = None  # CUDA: the newest upload of this weight (written by the worker)
    weight_version: int = -1  # the weight as the engine last saw it (user edits change these)
    weight_ptr: int = 0
    hook: object = None
    owned: bool = True  # data parallel: this rank keeps the state and runs the update (set once, at wrap())
    streamed_block: int | None = None  # invariant 7: the streamed block holding the weight (set once, at wrap())
    disk: object = None  # invariant 7b: the DiskTier holding master and moments (set once, at wrap())
    span: tuple[int, int] | None = None  # invariant 8b: the values this rank keeps (set once, at wrap())

    # Counts allocate() and load() calls of every slot (new buffers, or a step set from outside): the
    # engine's cached launch arguments are rebuilt when it moved. A class attribute, not a field.
    buffer_changes = 0

    @property
    def numel(self) -> int:
        """Values of state this slot keeps: the parameter's, or its span's (invariant 8b)."""
        return self.param.numel() if self.span is None else self.span[1] - self.span[0]

    def weight_view(self) -> torch.Tensor:
        """The slot's values of the weight (flat, memory order): where its updates are written."""
        return self._part(flat(self.param.data))

    def grad_view(self, grad: torch.Tensor) -> torch.Tensor:
        """The slot's values of a gradient of the parameter's shape (flat, the parameter's memory order)."""
        return self._part(grad_in_memory_order(grad.detach(), self.param))

    def _part(self, values: torch.Tensor) -> torch.Tensor:
        return values if self.span is None else values[self.span[0]:self.span[1]]

    @property
    def streamed(self) -> bool:
        return self.streamed_block is not None

    @property
    def label(self) -> str:
        return f"parameter {self.index}" + (f" ({self.name})" if self.name else "")

    def move(self, to: SlotState) -> None:
        """The one place a slot changes state; refuses a transition the machine does not have."""
        if (self.state, to) not in _ALLOWED:
            raise AssertionError(f"{self.label}: no transition {self.state.value} -> {to.value}")
        self.state = to

    # ---- the weight as the engine last saw it ---------------------------------

    def note_weight(self) -> None:
        self.weight_version = self.param._version
        self.weight_ptr = self.param.data_ptr()

    def weight_changed(self) -> bool:
        """True when someone other than the engine wrote the weight (in place, load_state_dict, or a new .data).
        A streamed weight's ``.data`` moves between its host copy and its block's device buffer on every
        visit: only its version tells (the streamer writes edits made while resident back to the host)."""
        if self.streamed:
            return self.param._version != self.weight_version
        return self.param._version != self.weight_version or self.param.data_ptr() != self.weight_ptr

    def follow_weight(self) -> None:
        """The master takes the user's weight (moments and step stay, as torch's AdamW keeps them)."""
        if self.disk is not None:
            self.disk.write(self, master=flat(self.param.detach()))
        else:
            self.master.copy_(self._part(flat(self.param.detach())))
        self.note_weight()

    # ---- buffers ----------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of master + moments (+ host gradient / upload buffers)."""
        out = None if self.streamed else self.out_host  # a streamed weight's host copy is the streamer's
        tensors = (self.master, self.exp_avg, self.exp_avg_sq, self.grad_host, out)
        seen, total = set(), 0
        for t in tensors:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def allocate(self, placement: str, moment_dtype: torch.dtype, arena: ts_pinned.PinnedArena,
                 host_copy: torch.Tensor | None = None) -> None:
        """Creates the state buffers for `placement` from the current weight; moments start at zero.
        A streamed slot passes `host_copy`, the streamer's flat host copy of the weight (invariant 7)."""
        if self.streamed != (host_copy is not None) or (self.streamed and placement != "host"):
            raise AssertionError(f"{self.label}: a streamed weight's state is on the host, made from its host copy")
        p = self._part(flat(self.param.detach())) if host_copy is None else host_copy
        if self.span is not None and (self.streamed or self.disk is not None):
            raise AssertionError(f"{self.label}: a streamed weight or a state on disk is kept whole (invariant 8b)")
        n = p.numel()
        if self.disk is not None:
            if placement != "host":
                raise AssertionError(f"{self.label}: a state on disk is updated on the host (invariant 7b)")
            grad_host = arena.empty(n, p.dtype, tag="grads")
            out_host = p if self.streamed else arena.empty(n, p.dtype, tag="weights")
            self.master = self.exp_avg = self.exp_avg_sq = None
            self.grad_host, self.out_host, self.placement = grad_host, out_host, placement
            ParamSlot.buffer_changes += 1
            return
        if placement == "device":
            master = p.to(torch.float32, copy=True)
            exp_avg = torch.zeros(n, dtype=moment_dtype, device=p.device)
            exp_avg_sq = torch.zeros(n, dtype=moment_dtype, device=p.device)
            grad_host = out_host = None
        else:
            master = arena.empty(n, torch.float32, tag="master")
            master.copy_(p)
            exp_avg = arena.empty(n, moment_dtype, tag="moments").zero_()
            exp_avg_sq = arena.empty(n, moment_dtype, tag="moments").zero_()
            grad_host = out_host = None
            if placement == "host":
                grad_host = arena.empty(n, p.dtype, tag="grads")
                if self.streamed:  # invariant 7: the update lands in the streamer's host copy
                    out_host = p
                else:  # fp32 weights upload straight from the master copy.
                    out_host = master if p.dtype == torch.float32 else arena.empty(n, p.dtype, tag="weights")
        # Assigned together once everything exists: a failed allocation leaves the slot as it was.
        self.master, self.exp_avg, self.exp_avg_sq = master, exp_avg, exp_avg_sq
        self.grad_host, self.out_host, self.placement = grad_host, out_host, placement
        ParamSlot.buffer_changes += 1

    def move_to(self, placement: str, arena: ts_pinned.PinnedArena) -> None:
        """Moves master and moments to another placement, keeping their values (slot not QUEUED)."""
        if placement == self.placement:
            return
        if self.streamed or self.disk is not None:
            raise AssertionError(f"{self.label}: a streamed weight's or a disk slot's state stays on the host "
                                 f"(invariants 7, 7b)")
        master, exp_avg, exp_avg_sq = self.master, self.exp_avg, self.exp_avg_sq
        self.allocate(placement, exp_avg.dtype, arena)
        self.master.copy_(master)
        self.exp_avg.copy_(exp_avg)
        self.exp_avg_sq.copy_(exp_avg_sq)

    def export(self) -> dict:
        """The state in torch.optim.AdamW's format (CPU copies, the parameter's shape) plus ``master_param``."""
        like = self.param.detach()

        def out(buffer):
            if self.span is not None:  # its values only, flat: the ranks' pieces are joined by data parallel
                return buffer.detach().to("cpu", copy=True)
            return shaped(buffer.detach(), like).to("cpu", copy=True).contiguous()

        master, exp_avg, exp_avg_sq = ((self.master, self.exp_avg, self.exp_avg_sq) if self.disk is None
                                       else self.disk.read(self))
        return {"step": torch.tensor(float(self.step)), "exp_avg": out(exp_avg),
                "exp_avg_sq": out(exp_avg_sq), "master_param": out(master)}

    def load(self, step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, master: torch.Tensor | None) -> None:
        """Takes saved state (validated by the caller), the master from the weight when none is given,
        and rewrites the weight from the master."""
        like = self.param.detach()
        if self.disk is not None:
            self._load_on_disk(like, exp_avg, exp_avg_sq, master)
        elif self.span is not None:  # each tensor the parameter's whole state, or already this span's values
            self.exp_avg.copy_(self._values_of(exp_avg, like))
            self.exp_avg_sq.copy_(self._values_of(exp_avg_sq, like))
            self.master.copy_(self._values_of(like if master is None else master, like))
        else:
            shaped(self.exp_avg, like).copy_(exp_avg.reshape(like.shape))
            shaped(self.exp_avg_sq, like).copy_(exp_avg_sq.reshape(like.shape))
            if master is not None:
                shaped(self.master, like).copy_(master.reshape(like.shape))
            else:
                self.master.copy_(flat(like))
        self.step = int(step)
        if self.disk is None or master is not None:
            # A streamed weight is written to its host copy; the caller drops a resident device copy.
            new = self.master if self.disk is None else in_memory_order(master, like, torch.float32)
            (self.out_host if self.streamed else self.weight_view()).copy_(new)
        self.note_weight()
        ParamSlot.buffer_changes += 1

    def _values_of(self, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The span's values (flat) of a whole state tensor of ``like``'s shape, or ``values`` when it holds
        exactly the span's already."""
        if values.numel() == self.numel and values.numel() != like.numel():
            return values.reshape(-1)
        return self._part(in_memory_order(values, like, values.dtype))

    def _load_on_disk(self, like: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      master: torch.Tensor | None) -> None:
        """load() for a slot on disk: the file takes the state in the parameter's memory order."""
        moments = self.disk.moment_dtype
        self.disk.write(self, master=in_memory_order(master if master is not None else like, like, torch.float32),
                        exp_avg=in_memory_order(exp_avg, like, moments),
                        exp_avg_sq=in_memory_order(exp_avg_sq, like, moments))


def in_memory_order(values: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (``like``'s shape) as a flat CPU tensor of ``dtype`` (default: its own) in ``like``'s memory
    order."""
    out = torch.empty(like.numel(), dtype=values.dtype if dtype is None else dtype)
    shaped(out, like).copy_(values.reshape(like.shape))
    return out
