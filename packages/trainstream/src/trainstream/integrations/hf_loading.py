"""load_model: a Hugging Face causal LM read one tensor at a time, its block weights quantized as they
arrive, so a base larger than the RAM never exists in full precision.

The model is built with its parameters on the meta device (buffers, such as rotary frequencies, are
computed for real), then every checkpoint tensor replaces its meta parameter: a linear weight of the
block stack becomes a ``ts_quant.QuantLinear`` straight from the tensor just read, everything else a
parameter of ``dtype``. Peak extra memory is one tensor.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys

import torch
from ts_pinned import _core as _pinned_core
from ts_quant import QuantLinear
from ts_quant import quantize as quantize_tensor

from .._blocks import find_blocks
from .._quantize import block_linears, check_quantize, size_estimates

__all__ = ["load_model"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device and their buffers for real."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """The parameters' dtype, without from_config's dtype keyword (renamed across transformers versions)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _checkpoint_files(name_or_path: str) -> list[str]:
    if os.path.isdir(name_or_path):
        folder = name_or_path
    else:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"])
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"load_model reads .safetensors checkpoints; {name_or_path!r} has none")
    return files


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
    elif attr in module._buffers:
        module._buffers[attr] = value
    else:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")


def _quantized_layer(linear: torch.nn.Linear, weight: torch.Tensor, fmt: str, block_size: int | None) -> QuantLinear:
    # The bias is its own checkpoint tensor: already read (real) or still a meta placeholder.
    return QuantLinear(quantize_tensor(weight, fmt, block_size), linear.bias)


def load_model(name_or_path: str, *, quantize: str | None = "auto", dtype: torch.dtype = torch.bfloat16,
               quant_block_size: int | None = None, random_weights: bool = False, ram_fraction: float = 0.85,
               trust_remote_code: bool = False, progress: bool = True, **config_overrides) -> torch.nn.Module:
    """A causal LM from a Hub id or a local folder of ``.safetensors`` files, on the CPU, in ``dtype``, with
    the linear weights of its block stack stored as ``quantize`` (``"int8"``, ``"nf4"``, ``"fp8"``, ``"nvfp4"``;
    ``None`` / ``"none"`` keeps them; ``"auto"``: only if ``dtype`` would not fit in ``ram_fraction`` of the
    available RAM, int8 before NF4) while the checkpoint is read, one tensor at a time.

    ``random_weights``: build the shapes with the model's own initialization instead of reading weights
    (benchmarks). ``config_overrides``: config fields, e.g. ``num_hidden_layers=4``. ``progress``: print
    how many tensors are done to stderr on long loads.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype} is not valid; use torch.bfloat16, torch.float16 or torch.float32")
    if not 0.0 < ram_fraction <= 1.0:
        raise ValueError(f"ram_fraction={ram_fraction!r} must be in (0, 1]")
    if quantize != "auto":
        check_quantize(quantize)
    files = [] if random_weights else _checkpoint_files(name_or_path)
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **config_overrides)
    with _parameters_on_meta(), _default_dtype(dtype):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    fmt = _choose_quantize(quantize, model, ram_fraction)
    targets = _block_linears(model) if fmt else {}
    if random_weights:
        _materialize_random(model, targets, fmt, quant_block_size, dtype)
    else:
        _read_checkpoint(model, files, targets, fmt, quant_block_size, dtype, progress)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if missing:
        raise ValueError(f"the checkpoint has no values for {len(missing)} tensors, e.g. {missing[:3]}")
    model.eval()
    model.trainstream_quantize = fmt  # what load_model decided, for the caller's log
    return model


def _read_checkpoint(model, files, targets, fmt, block_size, dtype, progress) -> None:
    from safetensors import safe_open

    names = set(model.state_dict().keys())
    done = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                if key not in names:
                    continue  # e.g. a tied lm_head stored twice, or buffers the model recomputes
                tensor = f.get_tensor(key)
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                if key in targets:
                    parent, attr = targets[key]
                    setattr(parent, attr, _quantized_layer(getattr(parent, attr), tensor, fmt, block_size))
                else:
                    _set_tensor(model, key, tensor)
                del tensor
                done += 1
                if progress and done % 200 == 0:
                    print(f"trainstream.load_model: {done} tensors read", file=sys.stderr, flush=True)


def _materialize_random(model, targets, fmt, block_size, dtype) -> None:
    """Each leaf module gets real storage and the model's own initialization, one module at a time."""
    init = getattr(model, "_init_weights", None)
    quantize_ids = {id(getattr(parent, attr)): (parent, attr) for parent, attr in targets.values()}
    for module in list(model.modules()):
        if not any(p.device.type == "meta" for p in module.parameters(recurse=False)):
            continue
        module.to_empty(device="cpu", recurse=False)
        if init is not None:
            init(module)
        if id(module) in quantize_ids:
            parent, attr = quantize_ids[id(module)]
            layer = QuantLinear(quantize_tensor(module.weight.detach(), fmt, block_size), module.bias)
            setattr(parent, attr, layer)
