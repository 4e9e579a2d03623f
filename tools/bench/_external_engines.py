"""Engines from outside this repository for compare.py: DeepSpeed ZeRO-2/3, trainstream 0.4.1, Unsloth.

None is a dependency of the monorepo or of CI: where its package is missing an engine raises EngineUnavailable,
the reason its outcome. tools/bench/fetch_external.sh fetches them into .whl/ for the GPU machine (no network
there); its header says how to install them there.

deepspeed-zero2   DeepSpeed (pinned in fetch_external.sh: a pure-Python wheel built with DS_BUILD_OPS=0, its
                  ops JIT-built on first use) with deepspeed_zero2.json: ZeRO stage 2, bf16, optimizer state
                  in pinned host memory stepped by DeepSpeedCPUAdam (AdamW, torch_adam false), overlap_comm,
                  contiguous gradients, no clipping; micro batch the scenario's, learning rate the stock one.
deepspeed-zero3   the same with deepspeed_zero3.json: stage 3, parameters offloaded to the host too. The
                  model is built plainly in host memory and then partitioned by deepspeed.zero.Init(module=),
                  one tensor at a time, not built inside zero.Init: for a random-init model both end in
                  the same partitioned state (building inside the context would only spare host memory).
  Both run one process (the torch.distributed variables of a world of one are set where unset, and
  DS_ACCELERATOR after the bench's device); in LoRA scenarios they train the PEFT adapters only. They return
  (DeepSpeedModel, DeepSpeedStep): backward(loss) and step() go through the engine, zero_grad is a no-op
  (step() zeroes). Under ZeRO-3 a parameter is partitioned outside its forward: numel() 0, ds_numel its size.
reference-0.4.1   trainstream 0.4.1 from PyPI, this project's predecessor: a pure-Python wheel whose CUDA
                  extension compiles on its first import (nvcc and ninja, a few minutes; cached in
                  ~/.cache/trainstream). It lives in its own `pip install --target` prefix, named by
                  $TS_BENCH_REFERENCE_PREFIX, so it never meets this repository's trainstream: child_env()
                  puts the prefix first on the engine process's PYTHONPATH and setup_external imports it
                  from there only (checking __version__ and __file__). wrap(model, AdamW) with its own
                  defaults, device= the bench's GPU, quantize="nf4" in LoRA scenarios (its option for frozen
                  base weights, as trainstream-lora's); the model built where the trainstream engines build it.
unsloth           Unsloth (CUDA only; fetch_external.sh does not carry it), LoRA scenarios only: the base is
                  saved as a checkpoint with a one-token tokenizer (FastLanguageModel loads checkpoints), loaded
                  by FastLanguageModel.from_pretrained in 4 bit (its QLoRA path), given the scenario's LoRA by
                  get_peft_model with Unsloth's gradient checkpointing; fused torch AdamW, as bnb-qlora.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import os
import re
import socket
import sys
import tempfile
import time

import torch

EXTERNAL_ENGINES = ("deepspeed-zero2", "deepspeed-zero3", "reference-0.4.1", "unsloth")
HERE = os.path.dirname(os.path.abspath(__file__))
DEEPSPEED_CONFIGS = {"deepspeed-zero2": os.path.join(HERE, "deepspeed_zero2.json"),
                     "deepspeed-zero3": os.path.join(HERE, "deepspeed_zero3.json")}
REFERENCE_VERSION = "0.4.1"
REFERENCE_ENV = "TS_BENCH_REFERENCE_PREFIX"
REFERENCE_HOWTO = ("build its wheel with tools/bench/fetch_external.sh, `pip install --no-index --no-deps --target "
                   "/tmp/ref-site .whl/reference/*.whl` and set TS_BENCH_REFERENCE_PREFIX=/tmp/ref-site")
LR_FULL, LR_LORA = 1e-5, 1e-4  # the stock engines' AdamW learning rates


def _unavailable(reason: str) -> Exception:
    from _compare_engines import EngineUnavailable  # lazy: _compare_engines imports this module lazily too

    return EngineUnavailable(reason)


def not_applicable(engine: str, scenario: dict) -> str | None:
    """Why `engine` does not run in `scenario`, or None (only Unsloth is LoRA-only)."""
    if engine == "unsloth" and not scenario.get("lora"):
        return "not applicable: unsloth runs LoRA scenarios only"
    return None


def child_env(engine: str, env: dict) -> dict:
    """The environment of the engine's process: for the reference, its prefix first on PYTHONPATH."""
    env = dict(env)
    prefix = env.get(REFERENCE_ENV)
    if engine == "reference-0.4.1" and prefix:
        env["PYTHONPATH"] = os.pathsep.join([prefix, *[p for p in [env.get("PYTHONPATH")] if p]])
    return env


def deepspeed_config(engine: str, scenario: dict) -> dict:
    """The engine's JSON config with the scenario's micro batch and the stock engines' learning rate."""
    with open(DEEPSPEED_CONFIGS[engine]) as f:
        config = json.load(f)
    config["train_micro_batch_size_per_gpu"] = int(scenario["batch"])
    config["optimizer"]["params"]["lr"] = LR_LORA if scenario.get("lora") else LR_FULL
    return config


def single_process_env(environ=os.environ) -> None:
    """The torch.distributed variables of a world of one, where unset (MASTER_PORT: a free one)."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        environ.setdefault(key, value)
    if "MASTER_PORT" not in environ:
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.bind(("127.0.0.1", 0))
            environ["MASTER_PORT"] = str(s.getsockname()[1])


def _timed_build(build_model, host: bool, device: torch.device, info: dict):
    from _compare_engines import _built

    start = time.perf_counter()
    info["failed_in"] = "model build"
    model = build_model(host)
    _built(info, device, start)
    return model


def _with_lora(model, scenario: dict, info: dict):
    if not scenario.get("lora"):
        return model
    import peft
    from _compare_engines import lora_config

    model = peft.get_peft_model(model, lora_config())
    info["trainable_values"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model


class DeepSpeedModel(torch.nn.Module):
    """The DeepSpeed engine as compare.py calls a model: forward through it, `.config` the HF config."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.config = engine.module.config

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)


class DeepSpeedStep:
    """The optimizer side of a DeepSpeed engine: backward and step go through the engine."""

    def __init__(self, engine):
        self.engine = engine

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # engine.step() zeroes the gradients


def _deepspeed(engine: str, scenario: dict, device: torch.device, info: dict, build_model):
    if importlib.util.find_spec("deepspeed") is None:
        raise _unavailable("deepspeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    try:
        import deepspeed
    except Exception as e:  # a broken install is an outcome, not a crash
        raise _unavailable(f"deepspeed failed to import: {type(e).__name__}: {e}") from None
    config = deepspeed_config(engine, scenario)
    stage3 = config["zero_optimization"]["stage"] == 3
    single_process_env()
    deepspeed.init_distributed(auto_mpi_discovery=False)
    # Stage 3 partitions from host memory; stage 2 starts where a checkpoint would load (initialize moves it).
    host = stage3 or bool(scenario.get("lora") or scenario.get("host"))
    model = _with_lora(_timed_build(build_model, host, device, info), scenario, info)
    info["failed_in"] = "deepspeed.initialize"
    start = time.perf_counter()
    if config["bf16"]["enabled"]:
        model.to(torch.bfloat16)  # zero.Init's partitions keep the dtype they are given
    if stage3:
        deepspeed.zero.Init(module=model, config_dict_or_path=config)
    trained = [p for p in model.parameters() if p.requires_grad]
    ds_engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=trained)
    info["wrap_s"] = time.perf_counter() - start
    info["deepspeed"] = {"version": deepspeed.__version__, "stage": config["zero_optimization"]["stage"], "optimizer":
                         type(ds_engine.optimizer).__name__, "basic_optimizer": type(ds_engine.basic_optimizer).__name__}
    return DeepSpeedModel(ds_engine), DeepSpeedStep(ds_engine)


def _version_on_disk(prefix: str) -> str | None:
    path = os.path.join(prefix, "trainstream", "__init__.py")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.MULTILINE)
    return found.group(1) if found else "unknown"


class _PrefixFirst:
    """`trainstream` and its submodules from the prefix only, ahead of the sys.path entries that the model
    build puts first (_compare_engines._shape) and of any editable install's import hook."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def find_spec(self, name, path=None, target=None):
        if name == "trainstream":
            return importlib.machinery.PathFinder.find_spec(name, [self.prefix])
        if name.startswith("trainstream.") and path and all(str(p).startswith(self.prefix) for p in path):
            return importlib.machinery.PathFinder.find_spec(name, path)
        return None


def import_reference(prefix: str):
    """trainstream imported from `prefix` (not this repository's), checked to be 0.4.1 from there.
    Any trainstream module imported before (the model build reads sizes from ours) is dropped first."""
    prefix = os.path.realpath(prefix)
    for name in [n for n in sys.modules if n == "trainstream" or n.startswith("trainstream.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _PrefixFirst(prefix))
    import trainstream

    where = os.path.realpath(getattr(trainstream, "__file__", None) or "?")
    version = getattr(trainstream, "__version__", None)
    if not where.startswith(prefix + os.sep):
        raise _unavailable(f"imported trainstream from {where}, not from the reference prefix {prefix}")
    if version != REFERENCE_VERSION:
        raise _unavailable(f"the trainstream in {prefix} is version {version}, not the reference {REFERENCE_VERSION}")
    return trainstream


def _reference(scenario: dict, device: torch.device, info: dict, build_model, wrap_options: dict):
    prefix = os.environ.get(REFERENCE_ENV)
    if not prefix:
        raise _unavailable(f"the reference {REFERENCE_VERSION} is not installed: {REFERENCE_HOWTO}")
    version = _version_on_disk(prefix)
    if version is None:
        raise _unavailable(f"{REFERENCE_ENV}={prefix} holds no trainstream package: {REFERENCE_HOWTO}")
    if version != REFERENCE_VERSION:
        raise _unavailable(f"the trainstream in {prefix} is version {version}, not the reference {REFERENCE_VERSION}")
    if device.type != "cuda":
        raise _unavailable(f"the reference {REFERENCE_VERSION} trains on CUDA only (its wrap() refuses a CPU device)")
    lora = bool(scenario.get("lora"))
    model = _with_lora(_timed_build(build_model, lora or bool(scenario.get("host")), device, info), scenario, info)
    info["failed_in"] = "import of the reference"  # its first import compiles the CUDA extension
    start = time.perf_counter()
    reference = import_reference(prefix)
    info["import_s"] = time.perf_counter() - start
    kwargs = {"device": device, **({"quantize": "nf4"} if lora else {}), **(wrap_options or {})}
    info["wrap_options"] = {k: repr(v) for k, v in kwargs.items()}
    info["failed_in"] = "wrap()"
    trained = [p for p in model.parameters() if p.requires_grad]
    start = time.perf_counter()
    model, opt = reference.wrap(model, torch.optim.AdamW(trained, lr=LR_LORA if lora else LR_FULL), **kwargs)
    info["wrap_s"] = time.perf_counter() - start
    info["reference"] = {"version": reference.__version__, "file": reference.__file__}
    return model, opt


def _unsloth(scenario: dict, device: torch.device, info: dict, build_model):
    if importlib.util.find_spec("unsloth") is None:
        raise _unavailable("unsloth is not installed")
    try:
        from unsloth import FastLanguageModel
    except Exception as e:  # no CUDA, or a broken install: its own words are the outcome
        raise _unavailable(f"unsloth failed to import: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    from _compare_engines import LORA_RANK, LORA_TARGETS
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    base = _timed_build(build_model, True, device, info)
    start = time.perf_counter()
    info["failed_in"] = "FastLanguageModel.from_pretrained"
    with tempfile.TemporaryDirectory(prefix="ts-bench-unsloth-") as folder:
        base.save_pretrained(folder, safe_serialization=True)  # what from_pretrained reads, with a tokenizer
        del base
        vocab = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
        PreTrainedTokenizerFast(tokenizer_object=vocab, unk_token="<unk>", pad_token="<unk>").save_pretrained(folder)
        model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=scenario["seq"], dtype=torch.bfloat16,
                                                     load_in_4bit=True)
    info["failed_in"] = "FastLanguageModel.get_peft_model"
    model = FastLanguageModel.get_peft_model(model, r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                                             bias="none", target_modules=list(LORA_TARGETS),
                                             use_gradient_checkpointing="unsloth", random_state=0)
    info["wrap_s"] = time.perf_counter() - start
    trained = [p for p in model.parameters() if p.requires_grad]
    info["trainable_values"] = sum(p.numel() for p in trained)
    return model, torch.optim.AdamW(trained, lr=LR_LORA, fused=device.type == "cuda")


def setup_external(engine: str, scenario: dict, device: torch.device, dtype: torch.dtype, info: dict, build_model,
                   *, wrap_options: dict | None = None):
    """(model, optimizer) of an external engine, as _compare_engines.setup returns them; fills `info`.

    build_model(host: bool) -> torch.nn.Module builds the scenario's base model as the stock engines do
    (no PEFT: LoRA is added here), in `dtype`, in host memory when host is True, else on `device`.
    wrap_options go to the reference's wrap() only. Raises EngineUnavailable where the engine cannot run."""
    if engine not in EXTERNAL_ENGINES:
        raise ValueError(f"not an external engine: {engine!r} (one of {', '.join(EXTERNAL_ENGINES)})")
    why = not_applicable(engine, scenario)
    if why:
        raise _unavailable(why)
    if engine.startswith("deepspeed"):
        return _deepspeed(engine, scenario, device, info, build_model)
    if engine == "reference-0.4.1":
        return _reference(scenario, device, info, build_model, wrap_options or {})
    return _unsloth(scenario, device, info, build_model)
