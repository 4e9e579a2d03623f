"""PyTorch habits a wrapped model cannot honour the way torch does, refused where torch would differ silently.

``torch.nn.utils.clip_grad_norm_`` (and ``clip_grad_value_``) clip the gradients in ``param.grad`` before
``step()``. A wrapped model's trained gradients leave ``param.grad`` during backward (to the host, or into a
device update already launched), so such a call would find none, clip nothing and return a norm of 0: the
run would train unclipped without a word. The engine clips with the global norm itself when ``wrap()`` is
given ``max_grad_norm``. So ``install()`` (at every ``wrap()``) puts a checking front on torch's two
functions: given a parameter that a live session trains, they raise with that fix; for every other
parameter they are torch's own. Code that imported the functions by name before the first ``wrap()`` keeps
torch's originals and is not checked (docs/guarantees.md, "Using a wrapped model").
"""

from __future__ import annotations

import functools

import torch

from ._dropped import _sessions

__all__ = ["install"]

_ORIGINALS: dict[str, object] = {}


def _trained_by_a_live_session(params: list) -> str | None:
    """The wrap()'s max_grad_norm setting of the live session that trains one of `params`, as text, or None."""
    wanted = {id(p) for p in params if isinstance(p, torch.Tensor)}
    for session in list(_sessions):
        if session.closed or session.engine is None:
            continue
        if any(id(slot.param) in wanted and slot.param.requires_grad for slot in session.engine.slots):
            return "None" if session.engine.max_grad_norm is None else str(session.engine.max_grad_norm)
    return None


def _checked(name: str, original):
    @functools.wraps(original)
    def front(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        setting = _trained_by_a_live_session(params)
        if setting is not None:
            raise RuntimeError(
                f"torch.nn.utils.{name} on a wrapped model's parameters would clip nothing: their gradients leave "
                f"param.grad during backward (the updates are under way before step()). Pass max_grad_norm= to "
                f"trainstream.wrap() (now {setting}): the engine clips with the global norm at step() and "
                f"reports it as optimizer.stats()['last_grad_norm']; then drop this call")
        return original(params, *args, **kwargs)

    front.__trainstream_front__ = True
    return front


def install() -> None:
    """Puts the checking fronts on torch.nn.utils' clipping functions (once; idempotent)."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        current = getattr(utils, name)
        if getattr(current, "__trainstream_front__", False):
            continue
        _ORIGINALS[name] = current
        front = _checked(name, current)
        setattr(utils, name, front)
        if getattr(clip_grad, name, None) is current:
            setattr(clip_grad, name, front)
