"""Sharded checkpoints through torch.distributed.checkpoint (DCP): each rank writes only the optimizer state
it owns, and reads only the state it will own.

``optimizer.state_dict()`` under data parallel gathers the whole state on every rank (collective, about 3x the
state size transiently per rank). ``save_checkpoint`` instead hands DCP each rank's own slots (fp32 master,
moments, step, under keys named by the parameter's index) beside the model's weights, which every rank holds
alike and DCP writes once; ``load_checkpoint`` asks DCP for the slots this rank owns now, so a checkpoint
from N ranks resumes on M (ownership is recomputed at ``wrap()``), in one process too. Both are collective
when a process group is initialized: every rank calls them with the same path.

Under FSDP2 (``distributed/fsdp.py``) each rank's state is its shards': every field goes to DCP as a DTensor
laid out as its parameter, so DCP writes each rank's shard and, at another world size, reads the rows each
rank holds now.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["load_checkpoint", "save_checkpoint"]

_STATE = "optimizer.state"
_FIELDS = ("step", "exp_avg", "exp_avg_sq", "master_param")


def _session(model: torch.nn.Module, optimizer):
    session = getattr(model, "_trainstream_session", None)
    if session is None or getattr(optimizer, "_session", None) is not session:
        raise ValueError("save_checkpoint / load_checkpoint take a model returned by trainstream.wrap() and the "
                         "optimizer wrapped with it")
    return session


def _groups(optimizer) -> list[dict]:
    """The param groups in optimizer.state_dict()'s format (hyper-parameters, parameter indices)."""
    groups, index = [], 0
    for group in optimizer.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        groups.append(packed)
    return groups


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_alone():
    """DCP warns that it assumes one process when no process group exists: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_checkpoint(model: torch.nn.Module, optimizer, path: str | os.PathLike) -> None:
    """Writes the model's weights and this rank's optimizer state to the folder ``path`` (collective)."""
    session = _session(model, optimizer)
    session.synchronize()
    state = {"model": model.state_dict(), "optimizer": {"param_groups": _groups(optimizer), "state": {}}}
    for slot in session.engine.active:
        if slot.owned:
            if slot.weight_changed():
                slot.follow_weight()  # a weight edited since the last update is what training continues from
            entry = slot.export()
            if session.shards is not None:
                entry = {k: v if k == "step" else session.shards.as_global(slot.param, v) for k, v in entry.items()}
            state["optimizer"]["state"][str(slot.index)] = entry
    with _quiet_alone():
        dcp.save(state, checkpoint_id=os.fspath(path), no_dist=_no_dist())


def load_checkpoint(model: torch.nn.Module, optimizer, path: str | os.PathLike) -> None:
    """Loads what ``save_checkpoint`` wrote, at any number of ranks: the weights into the model, and into the
    optimizer the state of the parameters this rank owns (collective). Checked before anything changes, as
    ``optimizer.load_state_dict`` checks."""
    session = _session(model, optimizer)
    path = os.fspath(path)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    indices = sorted({int(key.split(".")[2]) for key in saved if key.startswith(_STATE + ".")})
    slots = {s.index: s for s in session.engine.slots}
    unknown = [i for i in indices if i not in slots]
    if unknown:
        raise ValueError(f"the checkpoint in {path} has optimizer state for parameters {unknown}, which this "
                         f"optimizer does not train")
    shards = session.shards
    weights = {k: torch.empty_like(v) if shards is not None else torch.empty_like(v, device="cpu")
               for k, v in model.state_dict().items()}
    mine = [i for i in indices if slots[i].owned or session.engine.step_hook is None]

    def target(i: int) -> torch.Tensor:
        field = torch.empty(slots[i].param.shape, dtype=torch.float32)
        return field if shards is None else shards.as_global(slots[i].param, field)

    state = {"model": weights, "optimizer": {"param_groups": _groups(optimizer), "state": {
        str(i): {"step": torch.zeros(()), **{name: target(i) for name in _FIELDS[1:]}} for i in mine}}}
    for key in (f"{_STATE}.{i}.{name}" for i in mine for name in _FIELDS):
        if key not in saved:
            raise ValueError(f"the checkpoint in {path} lacks {key}")
    with _quiet_alone():
        dcp.load(state, checkpoint_id=path, no_dist=_no_dist())
    if shards is not None:  # this rank's rows, read into the DTensors' local tensors
        for entry in state["optimizer"]["state"].values():
            for name in _FIELDS[1:]:
                entry[name] = entry[name].to_local().cpu()
    # The optimizer checks its share as load_state_dict checks a whole state, before the model changes.
    load = optimizer.shared_loader(state["optimizer"], indices)
    model.load_state_dict(state["model"])
    load()
