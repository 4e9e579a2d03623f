"""FSDP2 composition: ``fully_shard()`` the model as usual, then ``wrap(model, optimizer)``.

FSDP2 keeps each parameter as a DTensor sharded on dim 0 over a 1-D mesh; its forward all-gathers from the
shard's local tensor and its backward reduce-scatters the gradient into the sharded parameter's ``.grad``.
The engine trains the local shards: each sharded parameter gets a *proxy*, a plain Parameter over the same
storage as its local tensor, and the optimizer holds the proxies in place of the DTensors. As each FSDP2
parameter group's reduce-scatter assigns its gradient shards, during backward, they are handed to the
proxies and the engine takes them as a post-accumulate hook would (``overlap``); whatever is left is handed
over at ``step()`` (``hand_over_grads``). Host AdamW updates them like any other gradient, and the new
values land in the local tensors FSDP2 all-gathers from next. Clipping is global: the engine's sum of
squares is summed over the mesh (``ShardedNorm``).

Invariants:
  1. A proxy shares storage with its DTensor's local tensor for the whole wrap (FSDP2 re-pads only a
     replaced parameter: ``check_sharded`` runs at wrap() and the forward guard refuses replaced ones).
  2. Between ``hand_over_grads`` and the engine taking them, a gradient lives on the proxy only: the
     DTensor's ``.grad`` is None, so no gradient is counted twice.
  3. ``restore`` puts the DTensors back in the optimizer's groups: unwrap() leaves the user's optimizer
     over the model's own parameters.

What does not compose yet is refused by ``check_sharded`` with its reason (HSDP and tensor-parallel
meshes, unsharded trainable parameters beside sharded ones); streamed or quantized weights are refused by
the plan (``planning/decide.py``).
"""

from __future__ import annotations

import torch

from ..engine.slots import is_dtensor

__all__ = ["ShardProxies", "ShardedNorm", "check_sharded", "sharded_by_fsdp2"]


def _is_fsdp2_module(module: torch.nn.Module) -> bool:
    return any(c.__name__ == "FSDPModule" for c in type(module).__mro__)


def sharded_by_fsdp2(model: torch.nn.Module) -> bool:
    """Whether fully_shard() (FSDP2) sharded the model or one of its modules."""
    return any(_is_fsdp2_module(m) for m in model.modules())


def check_sharded(model: torch.nn.Module) -> None:
    """ValueError unless every trainable parameter is an FSDP2 shard trainstream takes: a DTensor sharded on
    dim 0 over a 1-D mesh, under a root that fully_shard() sharded too."""
    if not _is_fsdp2_module(model):
        raise ValueError("the model's blocks are sharded by fully_shard() but its root is not: call "
                         "fully_shard(model) on the root as well (FSDP2 reduces the root's own parameters' "
                         "gradients only then), and wrap() the root")
    from torch.distributed.tensor import Shard

    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not is_dtensor(p):
            raise ValueError(f"parameter {name!r} trains but is not sharded by fully_shard(): its gradient would "
                             f"not be reduced over the ranks; shard the module that owns it")
        placements = tuple(p.placements)
        if p.device_mesh.ndim != 1 or placements != (Shard(0),):
            raise ValueError(f"parameter {name!r} is placed {placements} over a {p.device_mesh.ndim}-D mesh: "
                             f"trainstream takes FSDP2's dim-0 sharding over a 1-D mesh (HSDP and tensor "
                             f"parallel meshes not yet)")


def _hand_over(p: torch.nn.Parameter, proxy: torch.nn.Parameter) -> None:
    """Moves a sharded parameter's gradient shard to its proxy; one already there (an earlier hand-over that
    step() did not take: accumulation) is summed, as autograd sums."""
    local = p.grad._local_tensor if is_dtensor(p.grad) else p.grad
    proxy.grad = local if proxy.grad is None else proxy.grad + local
    p.grad = None


class ShardProxies:
    """The proxies of an optimizer's sharded parameters (module docstring); built by ``replace_in``."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []  # (DTensor parameter, proxy)
        self._groups: list[tuple[dict, list]] = []  # (param group, its original params), for restore
        self.group = None  # the mesh's process group (the norm's all-reduce)
        self._patched: list = []  # FSDP2 parameter groups whose post_backward overlap() wrapped
        self._by_proxy: dict[int, torch.nn.Parameter] = {}  # id(proxy) -> its DTensor parameter (sharded_of)

    @classmethod
    def replace_in(cls, optimizer) -> ShardProxies:
        """Replaces each DTensor parameter of the optimizer's groups by its proxy (in place)."""
        proxies = cls()
        for group in optimizer.param_groups:
            originals = list(group["params"])
            replaced = []
            for p in originals:
                if not is_dtensor(p):
                    replaced.append(p)
                    continue
                local = p._local_tensor
                proxy = torch.nn.Parameter(local, requires_grad=p.requires_grad)  # same storage (invariant 1)
                proxies.pairs.append((p, proxy))
                proxies.group = proxies.group or p.device_mesh.get_group()
                replaced.append(proxy)
            proxies._groups.append((group, originals))
            group["params"] = replaced
        return proxies

    def sharded_of(self, proxy: torch.Tensor) -> torch.nn.Parameter | None:
        """The DTensor parameter a proxy stands for (None for a parameter that is not sharded)."""
        if len(self._by_proxy) != len(self.pairs):
            self._by_proxy = {id(x): p for p, x in self.pairs}
        return self._by_proxy.get(id(proxy))

    def as_global(self, proxy: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """A state tensor of a proxy's shape as a DTensor laid out as its parameter (DCP then writes each
        rank's shard and reshards at another world size); a tensor of an unsharded parameter as it is."""
        p = self.sharded_of(proxy)
        if p is None:
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local.reshape(proxy.shape).to(p.device), p.device_mesh, p.placements,
                                  run_check=False, shape=p.shape, stride=p.stride())

    def hand_over_grads(self) -> None:
        """step(): each reduce-scattered gradient shard moves to its proxy (invariant 2); a gradient already
        on the proxy (an earlier hand-over that step() did not take) is summed, as autograd would."""
        for p, proxy in self.pairs:
            if p.grad is not None:
                _hand_over(p, proxy)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The sharded parameters' own gradients (FSDP2's, not yet handed over), as the optimizer's zero_grad."""
        for p, _proxy in self.pairs:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def overlap(self, model: torch.nn.Module, engine) -> bool:
        """Hands each FSDP2 parameter group's gradient shards to the engine as soon as that group's
        reduce-scatter assigned them, during backward, so host AdamW runs while backward continues. It wraps
        the groups' ``post_backward`` (FSDP2's own, looked up on the instance at every call); False, and the
        shards go over at step() instead, where this torch's FSDP2 has no such groups."""
        groups = []
        for module in model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            groups += list(getattr(state(), "_fsdp_param_groups", None) or []) if callable(state) else []
        if not groups or not all(callable(getattr(g, "post_backward", None)) for g in groups):
            return False
        proxies = {id(p): proxy for p, proxy in self.pairs}
        for group in groups:
            original = group.post_backward

            def post_backward(*args, _original=original, _group=group):
                out = _original(*args)
                self._arrived(_group, proxies, engine)
                return out

            group.post_backward = post_backward
            self._patched.append(group)
        return True

    @staticmethod
    def _arrived(group, proxies: dict, engine) -> None:
        event = getattr(group, "_post_reduce_event", None)
        if event is not None:  # a GPU: the shards are written on FSDP2's reduce stream
            torch.cuda.current_stream().wait_event(event)
        for fsdp_param in group.fsdp_params:
            p = fsdp_param.sharded_param
            proxy = proxies.get(id(p))
            if proxy is None or p.grad is None:
                continue
            _hand_over(p, proxy)
            engine.gradient_ready(proxy)

    def restore(self) -> None:
        """unwrap(): the optimizer's groups hold the DTensor parameters again (invariant 3), and FSDP2's
        groups their own post_backward."""
        for group in self._patched:
            group.__dict__.pop("post_backward", None)
        self._patched = []
        for group, originals in self._groups:
            group["params"] = originals
        self._groups = []


class ShardedNorm:
    """The engine's step hook under FSDP2: each rank updates its own shards, so the only collective is the
    global gradient norm for clipping (the sum of squares over the mesh); the state stays per rank. Updates
    start during backward as on one process (``updates_at_step`` False) when ShardProxies.overlap hands the
    shards over then."""

    updates_at_step = False

    def __init__(self, group) -> None:
        self.group = group

    def before_step(self, engine) -> None:
        return None

    def after_updates(self, engine) -> None:
        return None

    def discard(self) -> None:  # zero_grad(): no window of its own to restart
        return None

    def share_weights(self, slots) -> None:  # a loaded state rewrote this rank's own shards only
        return None

    def global_sum_of_squares(self, local: float) -> float:
        total = torch.tensor([local], dtype=torch.float64)
        if torch.distributed.get_backend(self.group) == "nccl":
            total = total.cuda()
        torch.distributed.all_reduce(total, group=self.group)
        return float(total.item())

    def gather_state(self, state: dict) -> dict:
        """state_dict(): this rank's shards' state (sharded checkpoints are torch.distributed.checkpoint's job)."""
        return state

    def close(self) -> None:
        return None
