"""Model construction and engine setup for compare.py (one engine per process).

LoRA bases are built on the meta device and materialised one decoder block at a time, in bf16,
on the GPU (CPU without one): a 14B base never exists in fp32, and never whole on the GPU unless
the engine keeps it there. Each block is initialised where it lands, then converted (bitsandbytes
NF4) or moved to host memory (trainstream quantizes in wrap(), where the weights are) before the
next one is built, so the GPU never holds more than one bf16 block it does not keep.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import torch

# Qwen2.5-14B's published shape (untied embeddings, biases on q/k/v, 14.77 B parameters).
SHAPES = {
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
    "lora-tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK = 16
FULL_ENGINES = ["stock-bf16", "stock-mixed", "deepspeed-zero2", "deepspeed-zero3", "trainstream-cpu",
                "trainstream-gpu", "trainstream-auto"]
# guard_params=False variants (what ordering reads after step() costs) and stock bf16 without the VRAM cap.
FULL_EXTRA = ["trainstream-cpu-noguard", "trainstream-auto-noguard", "stock-bf16-uncapped"]
LORA_ENGINES = ["stock-lora-uncapped", "bnb-qlora", "bnb-qlora-ckpt", "trainstream-lora"]
LORA_EXTRA = ["stock-lora", "trainstream-lora-bf16"]
# Other projects' engines (_external_engines.py): DeepSpeed ZeRO-2/3 offload and the reference 0.4.1 in
# both kinds of scenario, Unsloth in LoRA ones.
EXTERNAL_ENGINES = ["deepspeed-zero2", "deepspeed-zero3", "reference-0.4.1", "unsloth"]
ALL_ENGINES = FULL_ENGINES + FULL_EXTRA + LORA_ENGINES + LORA_EXTRA + [
    e for e in EXTERNAL_ENGINES if e not in FULL_ENGINES]
# Engines whose forward+backward is timed: the GPU-compute term of the lower bound.
STOCK_TIMED = ("stock-bf16", "stock-bf16-uncapped", "stock-lora", "stock-lora-uncapped")


class EngineUnavailable(Exception):
    """The engine cannot run on this machine; its message is the outcome."""


def _shape(size: str) -> dict:
    if size in SHAPES:
        return SHAPES[size]
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "packages", "trainstream", "src"))
    from trainstream.cli import PLAN_SIZES, SIZES

    if size in SIZES:
        return SIZES[size]
    # Qwen2.5's published 3B-32B shapes (trainstream plan --size), untied as the bases built here are.
    return {k: v for k, v in PLAN_SIZES[size].items() if k != "tie_word_embeddings"}


def full_model(size: str, device: torch.device, dtype: torch.dtype):
    """The full fine-tune model, as compare.py always built it (tied embeddings, HF init)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**_shape(size), max_position_embeddings=4096, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(dtype)


def _init_(module: torch.nn.Module) -> None:
    """HF's Qwen2 init for the tensors `module` owns: normal(0, 0.02), biases 0, norms 1."""
    is_norm = "norm" in type(module).__name__.lower()
    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            if is_norm:
                p.fill_(1.0)
            elif name == "bias":
                p.zero_()
            else:
                p.normal_(0.0, 0.02)


def _materialize(module: torch.nn.Module, device: torch.device) -> None:
    for m in module.modules():
        m.to_empty(device=device, recurse=False)
        _init_(m)


def lora_base(size: str, *, device: torch.device, dtype: torch.dtype, host: bool = False, convert_block=None):
    """Random-init Qwen2 base (untied), built block by block from the meta device.

    Each block is initialised on `device`, then `convert_block(block)` runs (bnb: quantize it in
    place) and with `host=True` the block moves to host memory before the next one is built.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**_shape(size), max_position_embeddings=4096, tie_word_embeddings=False,
                         attn_implementation="sdpa", use_cache=False)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(dtype)
    blocks = list(model.model.layers)
    for block in blocks:
        _materialize(block, device)
        if convert_block is not None:
            convert_block(block)
        if host:
            block.to("cpu")
    inside = {id(m) for block in blocks for m in block.modules()}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if hasattr(child, "inv_freq"):  # rotary tables are computed, not initialised: build anew
                setattr(parent, name, type(child)(config=child.config).to(device))
    for m in model.modules():  # embeddings, final norm, lm_head
        if id(m) not in inside and _owns_meta(m):
            m.to_empty(device=device, recurse=False)
            _init_(m)
    if host:
        model.to("cpu")
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device after building: {left[:5]}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model.train()


def _owns_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


def lora_config():
    import peft

    # Rank 16 on all seven projections of every block; alpha 2r and no dropout (alpha does not change the step time).
    return peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, bias="none",
                           target_modules=LORA_TARGETS, task_type="CAUSAL_LM")


def _block_linears(block: torch.nn.Module):
    for parent in block.modules():
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear:
                yield parent, name, child


def bnb_nf4_converter(device: torch.device):
    """transformers' BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype=bfloat16) path, done by hand because a
    random-init model has no checkpoint: each block linear becomes a meta `Linear4bit` whose
    `Params4bit(weight).to(device)` quantizes the bf16 weight on `device`."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise EngineUnavailable("not installed on this machine")
    try:
        import bitsandbytes as bnb
    except Exception as e:  # a broken install is an outcome, not a crash
        raise EngineUnavailable(f"bitsandbytes failed to import: {type(e).__name__}: {e}") from None

    def convert(block: torch.nn.Module) -> None:
        for parent, name, linear in list(_block_linears(block)):
            layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=False, quant_type="nf4",
                                      quant_storage=torch.uint8, device="meta")
            layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=False,
                                             quant_type="nf4", quant_storage=torch.uint8, module=layer).to(device)
            if linear.bias is not None:
                layer.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
            setattr(parent, name, layer)

    return convert


def _checkpointing(model) -> None:
    """Hugging Face's non-reentrant checkpointing of every decoder layer (older transformers spell it
    gradient_checkpointing_enable)."""
    base = model.get_base_model()
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def child_env(engine: str) -> dict:
    """The environment of an engine's process: this one's, with the reference's prefix first for it."""
    env = dict(os.environ)
    if engine in EXTERNAL_ENGINES:
        import _external_engines

        env = _external_engines.child_env(engine, env)
    return env


def not_applicable(engine: str, scenario: dict) -> str | None:
    """Why `engine` does not run in `scenario` (a LoRA engine in a full fine-tune one, or back), or None."""
    lora = bool(scenario.get("lora"))
    if engine in EXTERNAL_ENGINES:
        import _external_engines

        return _external_engines.not_applicable(engine, scenario)
    if (engine in LORA_ENGINES + LORA_EXTRA) == lora:
        return None
    kind, other = ("full fine-tune", "LoRA") if lora else ("LoRA", "full fine-tune")
    return f"not applicable: a {kind} engine in a {other} scenario"


def _built(info: dict, device: torch.device, start: float) -> None:
    """The model exists: record the build time and start the peak-VRAM count from here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    info["build_s"] = time.perf_counter() - start


def _base_model(scenario: dict, device: torch.device, dtype: torch.dtype, host: bool) -> torch.nn.Module:
    """The scenario's model without PEFT, as the stock engines build it: in host memory when `host`."""
    if scenario.get("lora") or scenario.get("host"):
        return lora_base(scenario["size"], device=device, dtype=dtype, host=host)
    return full_model(scenario["size"], torch.device("cpu") if host else device, dtype)


def setup(engine: str, scenario: dict, device: torch.device, dtype: torch.dtype, wrap_options: dict,
          info: dict):
    """(model, optimizer) for one engine; fills `info` (build_s, wrap_s, trainable_values, failed_in).
    Raises EngineUnavailable for an engine that cannot run here; anything else propagates, with
    info["failed_in"] naming the phase it came from."""
    lora = bool(scenario.get("lora"))
    if not_applicable(engine, scenario):
        raise EngineUnavailable(not_applicable(engine, scenario))
    fused = device.type == "cuda"
    start = time.perf_counter()
    info["failed_in"] = "model build"
    if engine in EXTERNAL_ENGINES:
        import _external_engines

        return _external_engines.setup_external(engine, scenario, device, dtype, info,
                                                lambda host: _base_model(scenario, device, dtype, host),
                                                wrap_options=wrap_options)
    if not lora:
        mixed = engine == "stock-mixed"
        if scenario.get("host") and engine.startswith("trainstream"):  # all trainable, in host memory
            model = lora_base(scenario["size"], device=device, dtype=dtype, host=True)
        else:
            model = full_model(scenario["size"], device, torch.float32 if mixed else dtype)
        _built(info, device, start)
        if engine.startswith("stock"):
            return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
        mode = engine.split("-")[1]
        kwargs = dict(optimizer_mode=mode, offload=True if mode != "auto" else "auto",
                      guard_params=not engine.endswith("-noguard"), device=device)  # a host-built model moves
        return _wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-5), kwargs, wrap_options, info)

    import peft

    size = scenario["size"]
    if engine.startswith("bnb"):
        model = lora_base(size, device=device, dtype=dtype, convert_block=bnb_nf4_converter(device))
        model.is_loaded_in_4bit = True  # what from_pretrained sets; PEFT then picks its bnb LoRA layer
    elif engine.startswith("stock"):
        model = lora_base(size, device=device, dtype=dtype)
    else:  # trainstream: the bf16 base in host memory, as a checkpoint loads; wrap() quantizes and moves it
        model = lora_base(size, device=device, dtype=dtype, host=True)
    model = peft.get_peft_model(model, lora_config())
    if engine == "bnb-qlora-ckpt":
        _checkpointing(model)
    _built(info, device, start)
    info["trainable_values"] = sum(p.numel() for p in trainable(model))
    if not engine.startswith("trainstream"):
        return model, torch.optim.AdamW(trainable(model), lr=1e-4, fused=fused)
    kwargs = dict(quantize=None if engine.endswith("-bf16") else "nf4", device=device)
    return _wrap(model, torch.optim.AdamW(trainable(model), lr=1e-4), kwargs, wrap_options, info)


def _wrap(model, opt, kwargs: dict, wrap_options: dict, info: dict):
    import trainstream

    kwargs = {**kwargs, **wrap_options}  # --wrap-option wins over the engine's own choice
    info["wrap_options"] = {k: repr(v) for k, v in kwargs.items()}
    info["failed_in"] = "wrap()"
    start = time.perf_counter()
    model, opt = trainstream.wrap(model, opt, **kwargs)
    info["wrap_s"] = time.perf_counter() - start
    return model, opt


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")  # reduce-overhead: refused


def compile_blocks(model, mode: str, skip_streamed: bool = False) -> int:
    """trainstream.compile_blocks for every engine (stock and bitsandbytes too); the count compiled."""
    import trainstream

    return len(trainstream.compile_blocks(model, mode, skip_streamed=skip_streamed))


def trainstream_settled(model) -> bool:
    """Whether a wrapped model's plan has settled: no placement trial, no activation policy still tuning
    (memory_report()["plan"]["settled"]); True for a model without a plan."""
    import trainstream

    plan = trainstream.memory_report(model).get("plan") or {}
    return bool(plan.get("settled", True))


def trainstream_report(model) -> dict:
    """What the bench keeps from memory_report(model): placements, events, transfers, the recent steps'
    stalls (with the host AdamW busy time of each), and the activation and weight reports when the engine
    has them."""
    import trainstream

    report = trainstream.memory_report(model)
    out = {"placements": report["optimizer"]["placements"], "events": report["events"],
           "transfers": report["transfers"], "stalls": report.get("stalls") or []}
    if report.get("activations") is not None:
        out["activations"] = report["activations"]
    if report.get("params") is not None:
        out["weights"] = report["params"]
    return out
