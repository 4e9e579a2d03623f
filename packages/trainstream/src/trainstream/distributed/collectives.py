"""The collectives of one data-parallel step, each with a bounded wait and a clear error.

Gradients are summed into their owner's flat bucket (``reduce``; with whole-tensor ownership the
shards are unequal, so this is reduce-scatter done bucket by bucket), then averaged; the owners'
new weights go to every rank by ``broadcast`` per bucket; the global gradient norm is one
``all_reduce`` of a float64 sum of squares. Every call is issued in the same order on every rank
(buckets come from ``sharding.make_buckets``) and waited for with a timeout: a rank that died or
never arrives raises ``DistributedError`` on the others instead of hanging.

``Comm.dedicated`` runs them on a process group of their own, created at wrap() with the same ranks as
the default one and a backend timeout just past trainstream's: an operation a stalled peer never joins
then ends inside the backend too (NCCL's communicator is aborted at once), so ``destroy_process_group``,
``unwrap`` and the interpreter's exit do not wait for the user's group timeout (30 minutes by default).
After a failure every later call raises at once: the group's state is unknown.
"""

from __future__ import annotations

import contextlib
import datetime
import io

import torch
import torch.distributed as dist

__all__ = ["Comm", "DistributedError"]


class DistributedError(RuntimeError):
    """A collective of data parallel failed or timed out (another rank died, diverged or stalled)."""


# The dedicated group's backend timeout beyond trainstream's own: trainstream's wait raises first, with its
# message, and the backend's operation ends shortly after.
BACKEND_TIMEOUT_MARGIN_S = 1.0


class Comm:
    """One process group, the device its collectives run on, and the timeout of every wait (seconds).
    ``owned``: the group was created for this Comm (``dedicated``), which destroys it at ``close()``."""

    def __init__(self, group=None, device: torch.device | None = None, timeout: float = 300.0, *,
                 owned: bool = False):
        self.group = group
        self.owned = owned
        self.failure: str | None = None  # the first failed wait; every later call raises at once
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        # NCCL moves device tensors only; gloo (and anything else) gets host tensors. A group with both
        # (torch's default "cpu:gloo,cuda:nccl") uses NCCL for a model on the GPU.
        on_gpu = device is not None and device.type == "cuda" and "nccl" in self.backend
        self.device = device if on_gpu else torch.device("cpu")
        self.transport = "nccl" if on_gpu else "gloo"
        self.timeout = float(timeout)
        self.calls = 0
        self.bytes = 0  # bytes this rank sent into collectives (its buffers' sizes)

    @classmethod
    def dedicated(cls, device: torch.device | None, timeout: float) -> Comm:
        """A Comm on a new group of every rank of the default one (collective: every rank calls it)."""
        try:
            group = dist.new_group(timeout=datetime.timedelta(seconds=float(timeout) + BACKEND_TIMEOUT_MARGIN_S))
        except Exception as error:  # a rank that never reaches wrap(): the backend's rendezvous times out
            raise DistributedError(f"data parallel: rank {dist.get_rank()} of {dist.get_world_size()}: creating the "
                                   f"collectives' process group failed ({error}); every rank must call wrap() "
                                   f"alike") from error
        return cls(group, device, timeout, owned=True)

    def close(self) -> None:
        """Destroys an owned group (local; after a failure it is already aborted or its work has ended)."""
        group, self.owned = self.group, False
        if group is None or self.failure is not None or not dist.is_initialized():
            return
        if group in dist.distributed_c10d._world.pg_map:  # not destroyed with the default group already
            dist.destroy_process_group(group)

    def _check_alive(self, what: str) -> None:
        if self.failure is not None:
            raise DistributedError(f"data parallel: rank {self.rank} of {self.world}: {what} was not started: an "
                                   f"earlier collective failed ({self.failure}); unwrap the model, or restart the run")

    def global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def wait(self, work, what: str) -> None:
        """Waits for `work` at most ``timeout`` seconds; DistributedError naming `what` otherwise."""
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as error:  # gloo / NCCL report timeouts and lost peers as RuntimeError
            self._fail(f"{what}: {error}")
            raise DistributedError(
                f"data parallel: rank {self.rank} of {self.world}: {what} did not complete ({error}). Another "
                f"rank has probably failed, stopped, or is not running the same steps (every rank must call "
                f"wrap(), backward, step(), state_dict() and load_state_dict() alike); timeout "
                f"{self.timeout:g} s") from error

    def _fail(self, why: str) -> None:
        """Marks the group failed; aborts an owned NCCL group so its in-flight work does not outlive the
        error (gloo's ends by its own timeout, BACKEND_TIMEOUT_MARGIN_S later; its abort would block on it)."""
        self.failure = why
        if self.owned and self.transport == "nccl":
            with contextlib.suppress(Exception):  # best effort: the error being raised is the one that matters
                dist.distributed_c10d._abort_process_group(self.group)

    def _count(self, t: torch.Tensor) -> None:
        self._check_alive("a collective")
        self.calls += 1
        self.bytes += t.numel() * t.element_size()

    # ---- the step's collectives --------------------------------------------------------------

    def reduce_async(self, t: torch.Tensor, owner: int):
        """Starts summing `t` of every rank into owner's `t` (other ranks' `t` is left undefined)."""
        self._count(t)
        return dist.reduce(t, dst=self.global_rank(owner), op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def broadcast_async(self, t: torch.Tensor, owner: int):
        """Starts copying owner's `t` into every rank's `t`."""
        self._count(t)
        return dist.broadcast(t, src=self.global_rank(owner), group=self.group, async_op=True)

    def all_reduce(self, t: torch.Tensor, what: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        self._count(t)
        self.wait(dist.all_reduce(t, op=op, group=self.group, async_op=True), what)
        return t

    def sum_over_ranks(self, value: float, what: str) -> float:
        """The sum of a float over every rank, in float64."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        return float(self.all_reduce(t, what).item())

    def all_gather_bytes(self, data: bytes, what: str) -> list[bytes]:
        """Every rank's `data`, in rank order (two collectives: the lengths, then the padded bytes)."""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        self._count(size)
        self.wait(dist.all_gather(sizes, size, group=self.group, async_op=True), what)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        mine = mine.to(self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        self._count(mine)
        self.wait(dist.all_gather(out, mine, group=self.group, async_op=True), what)
        return [bytes(t.cpu()[:int(n.item())].numpy().tobytes()) for t, n in zip(out, sizes)]

    def all_gather_objects(self, obj, what: str) -> list:
        """Every rank's `obj` (torch.save-able: tensors, numbers, dicts), in rank order."""
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return [torch.load(io.BytesIO(b), weights_only=True) for b in self.all_gather_bytes(buffer.getvalue(), what)]
