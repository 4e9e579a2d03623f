"""Quantize while loading, the Hugging Face way: ``TrainStreamQuantConfig`` for ``from_pretrained``.

``AutoModelForCausalLM.from_pretrained(path, quantization_config=TrainStreamQuantConfig("nf4"))``
builds the model on the meta device as usual; as transformers reads each checkpoint tensor, a linear
weight of the block stack becomes a ``ts_quant.QuantLinear`` at once (the same layer
``trainstream.wrap(quantize="nf4")`` makes: ``load_model``'s code, which runs ``quantize_model``),
so the full-precision block weights never exist together. Embeddings, norms and the output layer
load as transformers loads them. transformers loads sequentially while it quantizes on the fly, so
the extra host memory is about one tensor.

The quantizer is registered with transformers (``register_quantization_config`` /
``register_quantizer``, method ``"trainstream"``) when this module is imported, which
``trainstream.integrations.huggingface`` does. Needs transformers 5 (its per-tensor quantize ops);
``load_model`` is the lower-level path that works without them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from typing import Any

import torch

try:
    import transformers
    from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
    from transformers.utils.quantization_config import QuantizationConfigMixin
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError("trainstream.integrations.hf_quantizer needs transformers: pip install 'trainstream[hf]'") \
        from error

from ts_quant import FORMATS
from ts_quant._formats import check_block

from .._units import fmt_bytes
from ..weights.quantize import SAVE_PRETRAINED_REFUSAL
from .hf_loading import INDEX_FILE, SHARDS_DISAGREE, _block_linears, _listing, _quantized_layer, shard_mismatches

__all__ = ["TrainStreamQuantConfig"]

METHOD = "trainstream"
_log = logging.getLogger("trainstream")
_MAJOR = int(re.match(r"\d+", transformers.__version__).group())

try:  # transformers >= 5: per-tensor conversion ops during loading
    from transformers.core_model_loading import ConversionOps
except ImportError:  # pragma: no cover - transformers 4.x
    ConversionOps = object


class TrainStreamQuantConfig(QuantizationConfigMixin):
    """``quantization_config`` for ``from_pretrained``: the linear weights of the block stack stored as
    ``format`` (``"int8"``, ``"nf4"``, ``"fp8"``, ``"nvfp4"``) while the checkpoint loads.

    ``block_size``: values per scale (the format's default when None; int8/NF4 take any even size).
    ``modules_to_not_convert``: modules kept in full precision, by whole dotted parts of their names
    (``"down_proj"``, ``"layers.0"``). Only the repeated blocks are quantized (``trainstream.find_blocks``): embeddings and the
    output layer never are. Freeze nothing beforehand: the quantized weights are frozen by nature;
    add LoRA adapters (PEFT) to train. Needs transformers >= 5.
    """

    def __init__(self, format: str = "nf4", block_size: int | None = None,
                 modules_to_not_convert: list[str] | None = None, **kwargs: Any):
        if kwargs.pop("quant_method", METHOD) != METHOD:
            raise ValueError(f"TrainStreamQuantConfig is quant_method={METHOD!r}")
        if kwargs:
            raise ValueError(f"TrainStreamQuantConfig has no option {next(iter(kwargs))!r}; it takes format, "
                             f"block_size and modules_to_not_convert")
        if _MAJOR < 5:
            raise RuntimeError(f"TrainStreamQuantConfig needs transformers >= 5 (this is {transformers.__version__}); "
                               f"use trainstream.integrations.huggingface.load_model(path, quantize=...) instead")
        if not isinstance(format, str) or format not in FORMATS:
            raise ValueError(f"format={format!r} is not valid; use one of {', '.join(map(repr, FORMATS))} (leave "
                             f"quantization_config out to load without quantizing)")
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < 2):
            raise ValueError(f"block_size={block_size!r} is not valid; use None (the format's default) or an "
                             f"integer >= 2")
        check_block(format, block_size)  # the format's own rule (even for int8/nf4, 16 for nvfp4), before loading
        names = [] if modules_to_not_convert is None else modules_to_not_convert
        if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"modules_to_not_convert={modules_to_not_convert!r} is not valid; use a list of "
                             f"module names")
        self.quant_method = METHOD
        self.format = format
        self.block_size = block_size
        self.modules_to_not_convert = list(names)


def _kept(name: str, keep: list[str]) -> bool:
    """Whether module ``name`` matches one of ``modules_to_not_convert``: whole dotted parts of it
    (``"down_proj"``, ``"layers.0"``, ``"model.layers.3.self_attn"``)."""
    return any(f".{k}." in f".{name}." for k in keep)


class _QuantizeOnLoad(ConversionOps):
    """The quantize op transformers runs on each block linear weight right after reading it: the
    ``nn.Linear`` (still on the meta device) is replaced by its ``QuantLinear``, and nothing is left for
    transformers to set."""

    def __init__(self, quantizer: TrainStreamHfQuantizer):
        self.quantizer = quantizer

    def convert(self, input_dict: dict[str, Any], full_layer_name: str | None = None,
                model: torch.nn.Module | None = None, missing_keys: set | None = None, **kwargs) -> dict:
        config = self.quantizer.quantization_config
        targets = self.quantizer.targets
        for name, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            parent, attr = targets[name]
            layer = _quantized_layer(getattr(parent, attr), value, config.format, config.block_size)
            setattr(parent, attr, layer)
            self.quantizer.sizes[0] += value.numel() * value.element_size()
            self.quantizer.sizes[1] += layer.qweight.nbytes
            if missing_keys is not None:
                missing_keys.discard(name)
        return {}


class TrainStreamHfQuantizer(HfQuantizer):
    """transformers' side of ``TrainStreamQuantConfig``: which tensors to quantize, and the op that does it."""

    requires_calibration = False
    quantization_config: TrainStreamQuantConfig

    def __init__(self, quantization_config: TrainStreamQuantConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.targets: dict[str, tuple[torch.nn.Module, str]] = {}
        self.sizes = [0, 0]  # bytes of the weights as read, and as stored
        if self.pre_quantized:
            raise ValueError("this checkpoint's config.json names quantization_config quant_method='trainstream', but "
                             "TrainStream does not save quantized checkpoints: load the full-precision checkpoint "
                             "with quantization_config=TrainStreamQuantConfig(...)")

    @property
    def quantized_element_size(self) -> float:
        # int8 / fp8: 1 byte a value, NF4 / NVFP4: half a byte (scales are ignored in transformers' estimate).
        return 1.0 if self.quantization_config.format in ("int8", "fp8") else 0.5

    def validate_environment(self, *args, device_map=None, **kwargs):
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("TrainStreamQuantConfig cannot offload quantized layers to disk (device_map has 'disk'); "
                             "give the layers a device, or use trainstream.wrap()'s param_offload to stream them")

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return param_name in self.targets

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        _check_shard_index(checkpoint_files)
        # The model is on the meta device here: find the block linears by structure, as wrap() does.
        keep = self.quantization_config.modules_to_not_convert
        found = _block_linears(model)
        self.targets = {name: where for name, where in found.items() if not _kept(name.removesuffix(".weight"), keep)}
        unused = [k for k in keep if not any(_kept(name.removesuffix(".weight"), [k]) for name in found)]
        if unused:
            warnings.warn(f"TrainStreamQuantConfig: modules_to_not_convert {unused} match no linear layer of the "
                          f"blocks (only those are quantized; names look like "
                          f"{next(iter(found), 'model.layers.0.mlp.down_proj.weight').removesuffix('.weight')!r})",
                          stacklevel=2)
        model.trainstream_quantize = self.quantization_config.format  # as load_model records it
        return model

    def get_quantize_ops(self) -> _QuantizeOnLoad:
        return _QuantizeOnLoad(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        # A block weight the checkpoint lacked was initialized by transformers (which warned about the
        # missing key): quantized now, so the model is what wrap(quantize=...) would make of it.
        config = self.quantization_config
        for parent, attr in self.targets.values():
            linear = getattr(parent, attr)
            if type(linear) is torch.nn.Linear and linear.weight.device.type != "meta":
                setattr(parent, attr, _quantized_layer(linear, linear.weight.detach(), config.format, config.block_size))
        count, (before, after) = len(self.targets), self.sizes
        _log.info("quantized %d linear weights of the blocks to %s while loading: %s -> %s", count,
                  self.quantization_config.format, fmt_bytes(before), fmt_bytes(after))
        self.targets = {}  # the meta modules are gone; keep no references to the model
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        # transformers' own refusal for False names no way out: refuse here with the ways there are.
        raise ValueError(SAVE_PRETRAINED_REFUSAL)

    @property
    def is_trainable(self) -> bool:
        return True  # adapters (PEFT) on the quantized layers train, as with QLoRA


def _check_shard_index(checkpoint_files: list[str] | None) -> None:
    """A sharded checkpoint whose index names, for some tensor, a shard that lacks it is refused (as load_model
    refuses it) before any tensor is read, instead of loading that tensor as a random initialization."""
    if not checkpoint_files or len(checkpoint_files) < 2:
        return
    folder = os.path.dirname(checkpoint_files[0])
    index = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(index):
        return
    with open(index) as f:
        weight_map = json.load(f).get("weight_map") or {}
    by_file: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        by_file.setdefault(file, []).append(key)
    absent = shard_mismatches(folder, {f: k for f, k in by_file.items() if os.path.isfile(os.path.join(folder, f))})
    if absent:
        raise ValueError(f"TrainStreamQuantConfig: {SHARDS_DISAGREE.format(index=INDEX_FILE, folder=folder)}"
                         f"{_listing(absent)}")


def _register() -> None:
    """Registers the config and quantizer once (a second import, or reload, finds them in place)."""
    if _MAJOR < 5:
        return  # pragma: no cover - TrainStreamQuantConfig refuses itself with the reason
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(METHOD) is None:
        register_quantization_config(METHOD)(TrainStreamQuantConfig)
    else:
        AUTO_QUANTIZATION_CONFIG_MAPPING[METHOD] = TrainStreamQuantConfig
    if AUTO_QUANTIZER_MAPPING.get(METHOD) is None:
        register_quantizer(METHOD)(TrainStreamHfQuantizer)
    else:
        AUTO_QUANTIZER_MAPPING[METHOD] = TrainStreamHfQuantizer


_register()
