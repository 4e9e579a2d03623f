"""Typed configuration: every option of ``wrap()`` / ``plan()``, grouped by concern in frozen dataclasses.

``Config(weights=WeightsConfig(quantize="nf4"), optimizer=OptimizerConfig(max_grad_norm=1.0))`` is the
same run as ``wrap(model, quantize="nf4", max_grad_norm=1.0)``: each field has the name of the flat
keyword it stands for (the reference's documented names), so the two spellings map one to one.
``Config.from_dict`` takes either form, nested by group or flat, as JSON or YAML files and the
trainers' ``trainstream={...}`` write it. A Config is validated when it is built (ValueError naming the
valid values) and never changes; ``replace`` makes a changed copy.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from ._options import WrapOptions, parse_options

__all__ = ["ActivationsConfig", "Config", "OptimizerConfig", "PrototypeConfig", "RuntimeConfig", "WeightsConfig",
           "flat_options", "trainer_options"]

# The one place defaults live: WrapOptions. The groups below read them from there.
_DEFAULT: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(WrapOptions)}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW in host memory: where it runs, its state's precision, clipping and accumulation."""

    optimizer_mode: str = _DEFAULT["optimizer_mode"]  # "cpu" (host threads), "gpu" (mapped), "auto"
    offload: Any = _DEFAULT["offload"]  # "auto": the state moves to VRAM once it fits beside the settled peak
    moment_dtype: Any = _DEFAULT["moment_dtype"]  # "auto", "float32", "bfloat16"
    max_grad_norm: float | None = _DEFAULT["max_grad_norm"]
    accumulation_steps: int = _DEFAULT["accumulation_steps"]
    threads: int | None = _DEFAULT["threads"]  # host AdamW threads (None: the usable physical cores)
    lr: float = _DEFAULT["lr"]  # only when wrap() makes the optimizer
    seed: int = _DEFAULT["seed"]  # stochastic rounding of bf16 moments
    guard_params: bool = _DEFAULT["guard_params"]  # reads after step() see the update
    nvme_path: Any = _DEFAULT["nvme_path"]  # a directory for the state that does not fit in host RAM


@dataclasses.dataclass(frozen=True)
class WeightsConfig:
    """Frozen and streamed weights: quantization, which blocks stream from host memory, how far ahead."""

    quantize: Any = _DEFAULT["quantize"]  # "auto", None, "int8", "nf4", "fp8", "nvfp4"
    param_offload: Any = _DEFAULT["param_offload"]  # False, True, "auto", a fraction, block indices
    prefer: str = _DEFAULT["prefer"]  # "exact" streams exact weights before quantizing; "speed" quantizes first
    weights_prefetch_depth: int = _DEFAULT["weights_prefetch_depth"]


@dataclasses.dataclass(frozen=True)
class ActivationsConfig:
    """Saved activations: which blocks keep, page to host memory or recompute them."""

    activation_offload: Any = _DEFAULT["activation_offload"]
    recompute: Any = _DEFAULT["recompute"]
    recompute_variant: str = _DEFAULT["recompute_variant"]  # "full"; "selective" is a prototype
    prefetch_depth: int = _DEFAULT["prefetch_depth"]  # paged blocks brought back ahead of backward
    max_inflight_bytes: int | None = _DEFAULT["max_inflight_bytes"]
    min_offload_bytes: int = _DEFAULT["min_offload_bytes"]
    blocks: Any = _DEFAULT["blocks"]  # the repeated layer modules (None: find_blocks)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the run happens: device, memory checks, attention kernels, data parallel, logging."""

    device: Any = _DEFAULT["device"]
    check_memory: bool = _DEFAULT["check_memory"]  # refuse up front what cannot fit
    host_budget: int | None = _DEFAULT["host_budget"]  # host RAM the optimizer state may take (None: measured)
    vram_headroom: float = _DEFAULT["vram_headroom"]
    attention: Any = _DEFAULT["attention"]
    distributed: bool | None = _DEFAULT["distributed"]
    distributed_timeout: float | None = _DEFAULT["distributed_timeout"]  # each collective's wait (None: 600 s)
    verbose: bool = _DEFAULT["verbose"]


@dataclasses.dataclass(frozen=True)
class PrototypeConfig:
    """Features off until a same-run GPU A/B shows a win (``trainstream.prototype`` says what would)."""

    compact_lora_inputs: Any = _DEFAULT["compact_lora_inputs"]
    stream_packing: Any = _DEFAULT["stream_packing"]
    host_embedding: Any = _DEFAULT["host_embedding"]
    peer: Any = _DEFAULT["peer"]
    mapped_trial: bool = _DEFAULT["mapped_trial"]


_GROUPS: dict[str, type] = {"optimizer": OptimizerConfig, "weights": WeightsConfig, "activations": ActivationsConfig,
                            "runtime": RuntimeConfig, "prototype": PrototypeConfig}
# Flat keyword -> its group: every WrapOptions field exactly once (packages/trainstream/tests/test_config.py checks it).
GROUP_OF: dict[str, str] = {f.name: group for group, cls in _GROUPS.items() for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True)
class Config:
    """Every option of ``wrap()`` and ``plan()``, grouped; validated at construction."""

    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    weights: WeightsConfig = dataclasses.field(default_factory=WeightsConfig)
    activations: ActivationsConfig = dataclasses.field(default_factory=ActivationsConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    prototype: PrototypeConfig = dataclasses.field(default_factory=PrototypeConfig)

    def __post_init__(self) -> None:
        for group, cls in _GROUPS.items():
            if not isinstance(getattr(self, group), cls):
                raise ValueError(f"Config.{group} must be a {cls.__name__}, not {type(getattr(self, group)).__name__}")
        parse_options(self.options())  # ValueError naming the option and its valid values

    def options(self) -> dict[str, Any]:
        """The flat ``wrap()`` keywords this configuration stands for (every one of them)."""
        return {f.name: getattr(getattr(self, group), f.name)
                for group, cls in _GROUPS.items() for f in dataclasses.fields(cls)}

    def changed(self) -> dict[str, Any]:
        """The flat keywords whose value differs from the default (what a Config adds to other settings,
        such as an ``OffloadAdamW``'s own)."""
        return {name: value for name, value in self.options().items() if not _same(value, _DEFAULT[name])}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested by group: what ``from_dict`` reads back."""
        return {group: _fields(getattr(self, group)) for group in _GROUPS}

    def replace(self, **options: Any) -> Config:
        """A copy with flat keywords (or whole groups) changed."""
        return Config.from_dict({**self.options(), **flat_options(options)})

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Config:
        """From flat keywords, groups of them (``{"weights": {"quantize": "nf4"}}``), or both."""
        grouped: dict[str, dict[str, Any]] = {group: {} for group in _GROUPS}
        for name, value in flat_options(values).items():
            grouped[GROUP_OF[name]][name] = value
        return cls(**{group: _GROUPS[group](**fields) for group, fields in grouped.items()})

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Config:
        """From a JSON file, or a YAML one (``.yaml`` / ``.yml``, with PyYAML installed)."""
        path = os.fspath(path)
        with open(path) as f:
            text = f.read()
        if path.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError:
                raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); or use JSON") from None
            values = yaml.safe_load(text) or {}
        else:
            try:
                values = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} is not JSON ({error.msg} at line {error.lineno})") from None
        if not isinstance(values, Mapping):
            raise ValueError(f"{path} must hold a mapping of options, not {type(values).__name__}")
        return cls.from_dict(values)


def trainer_options(values: Config | Mapping[str, Any] | None) -> dict[str, Any]:
    """What a trainer's ``trainstream=`` gives (None, a Config, or a dict of flat keys and groups) as flat
    keys: a Config's changed options; a dict's groups expanded and its other keys (the trainers' own, such
    as ``chunked_loss``) left for the trainer to take."""
    if values is None:
        return {}
    if isinstance(values, Config):
        return values.changed()
    if not isinstance(values, Mapping):
        raise ValueError(f"trainstream= takes a dict of options or a trainstream.Config, not {type(values).__name__}")
    groups = {k: v for k, v in values.items() if k in _GROUPS}
    return {**{k: v for k, v in values.items() if k not in _GROUPS}, **flat_options(groups)}


def flat_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """Flat ``wrap()`` keywords from flat keys and group dicts (a Config's groups expanded); an unknown key,
    or the same option given twice, is a ValueError."""
    if isinstance(values, Config):
        return values.options()
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in _GROUPS:
            fields = _fields(value) if dataclasses.is_dataclass(value) else value
            if not isinstance(fields, Mapping):
                raise ValueError(f"{key!r} groups options: give it a mapping or a {_GROUPS[key].__name__}")
            items: list[tuple[str, Any, str | None]] = [(name, v, key) for name, v in fields.items()]
        else:
            items = [(key, value, None)]
        for name, v, group in items:
            if name not in GROUP_OF or (group is not None and GROUP_OF[name] != group):
                where = f" in {group!r}" if group else ""
                owner = f" (it belongs in {GROUP_OF[name]!r})" if name in GROUP_OF else ""
                raise ValueError(f"unknown option {name!r}{where}{owner}; valid options: {', '.join(sorted(GROUP_OF))}")
            if name in flat:
                raise ValueError(f"option {name!r} is given twice")
            flat[name] = v
    return flat


def _fields(group: Any) -> dict[str, Any]:
    # Not dataclasses.asdict: it deep-copies values, and `blocks` holds the model's modules.
    return {f.name: getattr(group, f.name) for f in dataclasses.fields(group)}


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and not isinstance(a, (list, tuple)) and a == b)
