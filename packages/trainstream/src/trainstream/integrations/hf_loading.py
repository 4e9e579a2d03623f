"""load_model: a Hugging Face causal LM read one tensor at a time, its block weights quantized as they
arrive, so a base larger than the RAM never exists in full precision.

The model is built on the meta device (``with torch.device("meta")``: a per-thread mode, so other
threads and the rest of the process are untouched), its buffers (rotary frequencies) are then computed
for real by the model's own ``_init_weights``, and every checkpoint tensor replaces its meta parameter:
a linear weight of the block stack becomes a ``ts_quant.QuantLinear`` straight from the tensor just
read, everything else a parameter of ``dtype``. Peak extra memory is one tensor.

Like ``from_pretrained``: the shard index (``model.safetensors.index.json``) says which files are read
and which tensor comes from which shard; without one, ``model.safetensors`` is the checkpoint. Before
any tensor is read, shapes are checked against the model the config builds (an error names the tensor
and both shapes), a parameter the checkpoint lacks is an error (tied weights excepted), and checkpoint
tensors the model has no place for are skipped with a warning that lists them (as transformers does).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import warnings

import torch
from tqdm.auto import tqdm
from ts_pinned import _core as _pinned_core
from ts_quant import QuantLinear

from .. import find_blocks
from ..weights.quantize import block_linears, check_quantize, quantize_model, refuse_saving, size_estimates

__all__ = ["load_model"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Hub ids: "name" or "owner/name", letters, digits and "-_." (huggingface_hub's rule, without "--" or "..").
_REPO_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?$")
_SHOWN = 8  # names listed in an error or warning before "... and N more"


def _listing(names: list[str]) -> str:
    more = f", ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _local_folder(name_or_path: str) -> str | None:
    """The local folder ``name_or_path`` names; None for a Hub id. A path-like name that is not a
    folder is an error here, not a Hub lookup."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"load_model takes a folder or a Hub id as a string, not {type(name_or_path).__name__}")
    text = os.fspath(name_or_path)
    path = os.path.expanduser(text)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise NotADirectoryError(f"load_model: {text!r} is a file; give the folder that holds config.json and "
                                 f"the .safetensors files")
    separators = [os.sep, *([os.altsep] if os.altsep else [])]
    looks_like_path = text.startswith((".", "/", "~")) or any(s in text for s in separators)
    if looks_like_path and not (_REPO_ID.match(text) and not text.startswith((".", "/", "~"))):
        raise FileNotFoundError(f"load_model: no such folder {text!r} (resolved to {os.path.abspath(path)!r}); "
                                f"a Hub id looks like 'owner/name'")
    if not _REPO_ID.match(text):
        raise ValueError(f"load_model: {text!r} is neither a local folder nor a Hub id ('owner/name')")
    return None


# The refusal of an index naming a shard that lacks the tensor (load_model's and the quantizer's); transformers
# itself would leave such a tensor at its random initialization with a generic "newly initialized" report.
SHARDS_DISAGREE = "{index} in {folder} names shards that do not hold the tensor: "


def shard_mismatches(folder: str, by_file: dict[str, list[str]], seen=None) -> list[str]:
    """``"key (in file)"`` for each key that its file (relative to ``folder``) does not hold; reads the
    safetensors headers only. ``seen(key, shape)`` is called for each key a file holds."""
    from safetensors import safe_open

    absent = []
    for file, keys in by_file.items():
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    absent.append(f"{key} (in {file})")
                elif seen is not None:
                    seen(key, list(f.get_slice(key).get_shape()))
    return absent


def _weight_map(folder: str) -> dict[str, str]:
    """Checkpoint tensor name -> file (relative to ``folder``), from the index if there is one."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"load_model: {index_path} is not a shard index with a 'weight_map' ({error})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"load_model: the 'weight_map' of {index_path} must map tensor names to shard files")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if os.path.isabs(shard) or os.path.normpath(shard).startswith(".."):
                raise ValueError(f"load_model: {index_path} names the shard {shard!r} outside its folder")
        if os.path.isfile(os.path.join(folder, SINGLE_FILE)) and SINGLE_FILE not in shards:
            # transformers would read model.safetensors here, the index's shards elsewhere: refuse to guess.
            raise ValueError(f"load_model: {folder} holds both {SINGLE_FILE} and {INDEX_FILE} (which does not list "
                             f"it); remove the stale one")
        absent = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if absent:
            raise FileNotFoundError(f"load_model: {INDEX_FILE} in {folder} lists shards that are not there: "
                                    f"{_listing(absent)}")
        return weight_map
    single = os.path.join(folder, SINGLE_FILE)
    if not os.path.isfile(single):
        found = sorted(n for n in os.listdir(folder) if n.endswith((".safetensors", ".bin", ".pt", ".pth")))
        raise ValueError(f"load_model reads {SINGLE_FILE} or a {INDEX_FILE} with its shards; {folder} has neither"
                         + (f" (found: {_listing(found)})" if found else ""))
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)


def _hub_snapshot(repo_id: str, trust_remote_code: bool) -> str:
    """The repo's config and index first, then only the checkpoint files they name."""
    from huggingface_hub import snapshot_download

    folder = snapshot_download(repo_id, allow_patterns=["*.json", *(["*.py"] if trust_remote_code else [])])
    if os.path.isfile(os.path.join(folder, INDEX_FILE)):
        with open(os.path.join(folder, INDEX_FILE)) as f:
            wanted = sorted(set(json.load(f).get("weight_map", {}).values()))
    else:
        wanted = [SINGLE_FILE]
    return snapshot_download(repo_id, allow_patterns=["*.json", *(["*.py"] if trust_remote_code else []), *wanted])


def _config_with(folder: str, overrides: dict, trust_remote_code: bool):
    """The folder's config with ``overrides`` applied the way ``from_pretrained`` applies them; each
    must be a config field, counts and sizes integers >= 1, numbers finite, flags booleans."""
    from transformers import AutoConfig

    base = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    for key, value in overrides.items():
        current = getattr(base, key, None)
        count = key.startswith("num_") or key.endswith(("_size", "_dim", "_layers", "_heads", "_experts"))
        if count and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"load_model: {key}={value!r} is not valid; use an integer >= 1")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"load_model: {key}={value!r} is not valid; use a finite number")
        if isinstance(current, bool) and not isinstance(value, bool):
            raise ValueError(f"load_model: {key}={value!r} is not valid; {key} is True or False")
        if type(current) in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"load_model: {key}={value!r} is not valid; {key} is a number ({current!r} here)")
    config, unused = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code,
                                                return_unused_kwargs=True, **overrides)
    if unused:
        key = next(iter(unused))
        near = difflib.get_close_matches(key, [k for k in base.to_dict() if not k.startswith("_")], 1)
        raise ValueError(f"load_model: {type(base).__name__} has no field {key!r}"
                         + (f"; did you mean {near[0]!r}?" if near else ""))
    return config


def _build_on_meta(config, dtype: torch.dtype, trust_remote_code: bool) -> tuple[torch.nn.Module, set[str]]:
    """The model with every tensor on the meta device, floating parameters in ``dtype``, then its
    buffers computed on the CPU; returns (model, names of buffers that could not be computed)."""
    from transformers import AutoModelForCausalLM

    # from_config would otherwise switch torch's process-wide default dtype to config.dtype while it builds.
    saved = config.dtype if hasattr(config, "dtype") else None
    config.dtype = None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    finally:
        config.dtype = saved
    converted: dict[int, torch.nn.Parameter] = {}  # one conversion per tensor keeps tied weights tied
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                if id(param) not in converted:
                    converted[id(param)] = torch.nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
                module._parameters[name] = converted[id(param)]
    model.config.dtype = dtype
    return model, _compute_buffers(model)


def _compute_buffers(model: torch.nn.Module) -> set[str]:
    """Real buffers from the model's ``_init_weights`` (transformers >= 5 computes rotary frequencies
    there, as from_pretrained does after a meta build); a parameter-free module that keeps its config
    (older rotary embeddings) is rebuilt from it instead. Returns the names neither could compute."""
    init = getattr(model, "_init_weights", None)
    failed = set()
    for prefix, module in list(model.named_modules()):
        meta = [n for n, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        if not meta:
            continue
        for n in meta:
            module._buffers[n] = torch.zeros_like(module._buffers[n], device="cpu")
        versions = {n: module._buffers[n]._version for n in meta}
        if init is not None:
            with torch.no_grad():
                init(module)  # its parameters are still meta: initializing them is free and discarded
        left = [n for n in meta if module._buffers[n]._version == versions[n]]
        if left and _rebuild_from_config(model, prefix, module, left):
            left = []
        failed.update(f"{prefix}.{n}" if prefix else n for n in left)
    return failed


def _rebuild_from_config(model: torch.nn.Module, prefix: str, module: torch.nn.Module, names: list[str]) -> bool:
    config = getattr(module, "config", None)
    if config is None or next(module.parameters(), None) is not None or not prefix:
        return False
    try:
        fresh = type(module)(config)
    except Exception:  # no config-only constructor: reported as a buffer that could not be computed
        return False
    if any(getattr(fresh, n, None) is None or getattr(fresh, n).shape != module._buffers[n].shape for n in names):
        return False
    parent_name, _, attr = prefix.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, fresh)
    return True


def _check_against_model(model: torch.nn.Module, folder: str, weight_map: dict[str, str], overrides: dict,
                         uncomputed: set[str]) -> list[str]:
    """Shapes, missing and unexpected keys, checked from the safetensors headers before any data is
    read. Returns the checkpoint names to read (those the model has a place for)."""

    expected = model.state_dict(keep_vars=True)
    non_persistent = {f"{p}.{n}" if p else n for p, m in model.named_modules() for n in m._non_persistent_buffers_set}
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unexpected = [k for k in weight_map if k not in expected and k not in non_persistent
                  and not any(p.search(k) for p in ignore)]
    if unexpected:
        warnings.warn(f"load_model: {len(unexpected)} checkpoint tensors in {folder} have no place in "
                      f"{type(model).__name__} and are not read: {_listing(unexpected)}", stacklevel=3)
    # Tied names share one tensor: the group is satisfied by any of its names.
    groups: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        groups.setdefault(id(tensor), []).append(name)
    computed = {n for n, b in model.named_buffers() if b.device.type != "meta" and n not in uncomputed}
    missing = [names[0] for names in groups.values() if not any(n in weight_map or n in computed for n in names)]
    if missing:
        raise ValueError(f"load_model: the checkpoint in {folder} has no values for {len(missing)} tensors of "
                         f"{type(model).__name__}: {_listing(missing)}"
                         + (f" (config overrides: {overrides})" if overrides else ""))
    wanted = [k for k in weight_map if k in expected]
    by_file: dict[str, list[str]] = {}
    for key in wanted:
        by_file.setdefault(weight_map[key], []).append(key)
    order = {k: i for i, k in enumerate(expected)}  # errors list tensors in model order
    wrong = []
    absent = shard_mismatches(folder, by_file, lambda key, shape: wrong.append(
        (order[key], f"{key}: checkpoint {shape}, model {list(expected[key].shape)}"))
        if shape != list(expected[key].shape) else None)
    if absent:
        raise ValueError(f"load_model: {SHARDS_DISAGREE.format(index=INDEX_FILE, folder=folder)}{_listing(absent)}")
    if wrong:
        wrong = [text for _, text in sorted(wrong)]
        raise ValueError(f"load_model: {len(wrong)} checkpoint tensors disagree in shape with the model built "
                         f"from the config" + (f" and overrides {overrides}" if overrides else "")
                         + f": {'; '.join(wrong[:_SHOWN])}" + (f"; ... and {len(wrong) - _SHOWN} more"
                                                               if len(wrong) > _SHOWN else ""))
    return wanted


def _choose_quantize(value, model: torch.nn.Module, ram_fraction: float) -> str | None:
    """'auto': None if the model fits in ram_fraction of the available RAM as built, else int8, else NF4."""
    if value != "auto":
        return check_quantize(value)
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    weights = [linear.weight for _, _, linear in block_linears(find_blocks(model), frozen_only=False)]
    budget = ram_fraction * _pinned_core.host_memory()["available"]
    return next((fmt for fmt, size in size_estimates(total, weights) if size <= budget), "nf4")


def _block_linears(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """Qualified weight name -> (parent module, attribute) for every nn.Linear of the block stack."""
    names = {id(module): name for name, module in model.named_modules()}
    found = {}
    for parent, attr, _ in block_linears(find_blocks(model), frozen_only=False):
        prefix = f"{names[id(parent)]}.{attr}" if names[id(parent)] else attr
        found[f"{prefix}.weight"] = (parent, attr)
    return found


def _set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if attr in module._parameters:
        old = module._parameters[attr]
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        module._buffers[attr] = value


def _quantized_layer(linear: torch.nn.Linear, weight: torch.Tensor, fmt: str, block_size: int | None) -> QuantLinear:
    """The layer ``wrap(quantize=fmt)`` makes of ``linear`` holding ``weight``: ``quantize_model``'s own path,
    run on a holder of this one layer. The bias is its own checkpoint tensor: already read (real) or still a
    meta placeholder that the loader replaces on the new layer. Shared by load_model and the HF quantizer."""
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)  # frozen: quantize_model skips trainable ones
    holder = torch.nn.Module()
    holder.layer = linear
    quantize_model(holder, fmt, blocks=[holder], block_size=block_size)
    return holder.layer


def load_model(name_or_path: str, *, quantize: str | None = "auto", dtype: torch.dtype = torch.bfloat16,
               quant_block_size: int | None = None, random_weights: bool = False, ram_fraction: float = 0.85,
               trust_remote_code: bool = False, progress: bool = True, **config_overrides) -> torch.nn.Module:
    """A causal LM from a Hub id or a local folder (``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists), on the CPU, in ``dtype``, with the linear weights of its
    block stack stored as ``quantize`` (``"int8"``, ``"nf4"``, ``"fp8"``, ``"nvfp4"``; ``None`` / ``"none"``
    keeps them; ``"auto"``: only if ``dtype`` would not fit in ``ram_fraction`` of the available RAM,
    int8 before NF4) while the checkpoint is read, one tensor at a time.

    Errors before any tensor is read: a path-like name that is not a folder (FileNotFoundError), a
    shape that differs from the model the config builds, a parameter the checkpoint lacks, a bad
    override. Checkpoint tensors the model has no place for are skipped with a warning naming them.
    ``random_weights``: the model's own initialization instead of the checkpoint (benchmarks).
    ``config_overrides``: config fields, e.g. ``num_hidden_layers=4``. ``progress``: a tqdm bar of the
    tensors read (shown on a terminal only).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype} is not valid; use torch.bfloat16, torch.float16 or torch.float32")
    if isinstance(ram_fraction, bool) or not isinstance(ram_fraction, (int, float)) or not 0.0 < ram_fraction <= 1.0:
        raise ValueError(f"ram_fraction={ram_fraction!r} must be in (0, 1]")
    if quantize != "auto":
        check_quantize(quantize)
    folder = _local_folder(name_or_path)
    if folder is None:
        folder = _hub_snapshot(os.fspath(name_or_path), trust_remote_code)
    config = _config_with(folder, config_overrides, trust_remote_code)
    weight_map = None if random_weights else _weight_map(folder)
    model, uncomputed = _build_on_meta(config, dtype, trust_remote_code)
    model.config._name_or_path = os.fspath(name_or_path)
    wanted = [] if weight_map is None else _check_against_model(model, folder, weight_map, config_overrides,
                                                                             uncomputed)
    uncomputed -= set(wanted)
    if uncomputed:
        raise ValueError(f"load_model: cannot compute the buffers {_listing(sorted(uncomputed))} of "
                         f"{type(model).__name__} on a meta-device build, and the checkpoint does not hold them")
    fmt = _choose_quantize(quantize, model, ram_fraction)
    targets = _block_linears(model) if fmt else {}
    if random_weights:
        _materialize_random(model, targets, fmt, quant_block_size)
    else:
        _read_checkpoint(model, folder, weight_map, wanted, targets, fmt, quant_block_size, dtype, progress)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:  # a guard: the checks above should have named these already
        raise ValueError(f"load_model: the checkpoint has no values for {len(left)} tensors: {_listing(left)}")
    model.eval()
    model.trainstream_quantize = fmt  # what load_model decided, for the caller's log
    if fmt is not None:
        refuse_saving(model)  # as quantize_model does for the whole model
    return model


def _read_checkpoint(model, folder, weight_map, wanted, targets, fmt, block_size, dtype, progress) -> None:
    """Each wanted tensor from the file the index names, in file order; other files are never opened."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for key in wanted:
        by_file.setdefault(weight_map[key], []).append(key)
    # A progress bar on a terminal only (tqdm decides), as Hugging Face's own loaders show.
    bar = tqdm(total=len(wanted), desc="trainstream.load_model", unit="tensor", disable=None if progress else True)
    for file in sorted(by_file):
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for key in by_file[file]:
                tensor = f.get_tensor(key)
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                if key in targets:
                    parent, attr = targets[key]
                    setattr(parent, attr, _quantized_layer(getattr(parent, attr), tensor, fmt, block_size))
                else:
                    _set_tensor(model, key, tensor)
                del tensor
                bar.update(1)
    bar.close()


def _materialize_random(model, targets, fmt, block_size) -> None:
    """Each module's meta parameters get real storage and the model's own initialization, one module
    at a time (its computed buffers are kept)."""
    init = getattr(model, "_init_weights", None)
    quantize_ids = {id(getattr(parent, attr)): (parent, attr) for parent, attr in targets.values()}
    for module in list(model.modules()):
        meta = [n for n, p in module._parameters.items() if p is not None and p.device.type == "meta"]
        if not meta:
            continue
        for n in meta:
            p = module._parameters[n]
            module._parameters[n] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
        if init is not None:
            with torch.no_grad():
                init(module)
        if id(module) in quantize_ids:
            parent, attr = quantize_ids[id(module)]
            setattr(parent, attr, _quantized_layer(module, module.weight.detach(), fmt, block_size))
