"""Sharded checkpoints through torch.distributed.checkpoint (DCP): each rank writes only the optimizer state
it owns, and reads only the state it will own.

``optimizer.state_dict()`` under data parallel gathers the whole state on every rank (collective, about 3x the
state size transiently per rank). ``save_checkpoint`` instead hands DCP each rank's own slots (fp32 master,
moments, step, under keys named by the parameter's index) beside the model's weights, which every rank holds
alike and DCP writes once; ``load_checkpoint`` asks DCP for the slots this rank owns now, so a checkpoint
from N ranks resumes on M (ownership is recomputed at ``wrap()``), in one process too. Both are collective
when a process group is initialized: every rank calls them with the same path.

A parameter split between ranks (``sharding.split_evenly``) is saved as its owners' pieces: flat fields
under ``<field>@<first value>`` (``step`` once, the same on every rank). Loading reads, of each parameter
this rank owns, the saved pieces or whole fields that overlap its values, and nothing else.

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

from ..engine.slots import in_memory_order, shaped

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
            if slot.span is not None:
                entry = {k if k == "step" else f"{k}@{slot.span[0]}": v for k, v in entry.items()}
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
    if shards is None:
        state, pieces = _plain_state(saved, weights, _groups(optimizer), {i: slots[i] for i in mine}, path)
    else:
        state, pieces = _sharded_state(saved, weights, _groups(optimizer), {i: slots[i] for i in mine}, shards, path)
    with _quiet_alone():
        dcp.load(state, checkpoint_id=path, no_dist=_no_dist())
    if shards is not None:  # this rank's rows, read into the DTensors' local tensors
        for entry in state["optimizer"]["state"].values():
            for name in _FIELDS[1:]:
                entry[name] = entry[name].to_local().cpu()
    for i, read in pieces.items():  # saved in pieces: this rank's values joined from those read
        entry = state["optimizer"]["state"][str(i)]
        entry.update(_joined(slots[i], entry, read))
    # The optimizer checks its share as load_state_dict checks a whole state, before the model changes.
    load = optimizer.shared_loader(state["optimizer"], indices)
    model.load_state_dict(state["model"])
    load()


def _sharded_state(saved, weights: dict, groups: list, mine: dict, shards, path: str) -> tuple[dict, dict]:
    """What DCP reads under FSDP2: each field as a DTensor laid out as its parameter (this rank's rows)."""
    for key in (f"{_STATE}.{i}.{name}" for i in mine for name in _FIELDS):
        if key not in saved:
            raise ValueError(f"the checkpoint in {path} lacks {key}")

    def target(slot) -> torch.Tensor:
        return shards.as_global(slot.param, torch.empty(slot.param.shape, dtype=torch.float32))

    return {"model": weights, "optimizer": {"param_groups": groups, "state": {
        str(i): {"step": torch.zeros(()), **{name: target(slot) for name in _FIELDS[1:]}}
        for i, slot in mine.items()}}}, {}


def _saved_pieces(saved, index: int, name: str) -> list[tuple[int, int, str]]:
    """(lo, hi, field key) of each piece of the saved field; one covering everything when it was saved whole."""
    prefix = f"{_STATE}.{index}.{name}"
    if prefix in saved:
        return [(0, saved[prefix].size.numel(), name)]
    found = [(int(key.rsplit("@", 1)[1]), key[len(f"{_STATE}.{index}."):]) for key in saved
             if key.startswith(prefix + "@")]
    return [(lo, lo + saved[f"{_STATE}.{index}.{field}"].size.numel(), field) for lo, field in sorted(found)]


def _plain_state(saved, weights: dict, groups: list, mine: dict, path: str) -> tuple[dict, dict]:
    """What DCP reads with data parallel or in one process: the fields of each parameter this rank owns that
    overlap its values (whole fields in the parameter's shape, pieces flat), and per split parameter the
    pieces read, to join (``_joined``)."""
    entries: dict = {}
    pieces: dict = {}
    for i, slot in mine.items():
        if f"{_STATE}.{i}.step" not in saved:
            raise ValueError(f"the checkpoint in {path} lacks {_STATE}.{i}.step")
        lo, hi = slot.span if slot.span is not None else (0, slot.param.numel())
        entry = {"step": torch.zeros(())}
        for name in _FIELDS[1:]:
            found = _saved_pieces(saved, i, name)
            if sum(b - a for a, b, _ in found) != slot.param.numel() or not found:
                raise ValueError(f"the checkpoint in {path} lacks {_STATE}.{i}.{name} (or some of its pieces)")
            if len(found) == 1 and slot.span is None:  # saved whole, read whole
                entry[name] = torch.empty(slot.param.shape, dtype=torch.float32)
                continue
            for a, b, field in found:
                if a < hi and b > lo:
                    shape = saved[f"{_STATE}.{i}.{field}"].size
                    entry[field] = torch.empty(shape, dtype=torch.float32)
                    pieces.setdefault(i, []).append((a, b, name, field))
        entries[str(i)] = entry
    return {"model": weights, "optimizer": {"param_groups": groups, "state": entries}}, pieces


def _joined(slot, entry: dict, read: list) -> dict:
    """`slot`'s fields (its span's values, or the whole parameter's, flat) from the overlapping pieces that
    DCP read into `entry`; the pieces' keys are dropped from it."""
    like = slot.param.detach()
    lo, hi = slot.span if slot.span is not None else (0, like.numel())
    joined: dict = {}
    for a, b, name, field in read:
        source = entry.pop(field)
        if field == name:  # saved whole, in the parameter's shape: its values in memory order
            source = in_memory_order(source, like)
        values = joined.setdefault(name, torch.empty(hi - lo, dtype=torch.float32))
        values[max(a, lo) - lo:min(b, hi) - lo] = source[max(a, lo) - a:min(b, hi) - a]
    if slot.span is None:  # a whole parameter (one process, or owned whole) takes its shape
        joined = {name: shaped(values, like).contiguous() for name, values in joined.items()}
    return joined


