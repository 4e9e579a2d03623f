"""What the `trainstream` command and `trainstream plan` share: the built-in decoder shapes and the argparse
validators (a bad value becomes "argument --X: <message>", exit code 2, before any work)."""

from __future__ import annotations

import argparse
import math
import os

import torch

from ._units import GiB, parse_size

__all__ = ["DEMO_CONTEXT", "SIZES", "build_model", "size_in_gib"]

DEMO_CONTEXT = 4096  # the built-in decoders' max_position_embeddings
# Random-init Qwen2-style decoders; the 0.5b and 1.5b rows use Qwen2.5's published shapes.
SIZES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=384, vocab_size=256),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1536, vocab_size=256),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
}


def build_model(size: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A random-init Qwen2 causal LM of one of SIZES (needs `transformers`)."""
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError:
        raise SystemExit("the demo model needs transformers: pip install 'trainstream[hf]'") from None
    torch.manual_seed(seed)
    config = Qwen2Config(**SIZES[size], max_position_embeddings=DEMO_CONTEXT, tie_word_embeddings=size != "1.5b",
                         attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).to(dtype)


def number(convert, accept, valid: str):
    """An argparse type: `convert` the text, then `accept` the value, else the message names `valid`."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes {valid}, not {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {valid}, not {text}")
        return value

    return parse


positive_int = number(int, lambda v: v >= 1, "an integer >= 1")
non_negative_int = number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = number(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
seed = number(int, lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)")
MAX_SIZE_GIB = 10**6  # --vram-gb / --host-gb above this are typos (a million GiB)
_LIMIT = f"{MAX_SIZE_GIB:.0e}".replace("e+0", "e")  # 1e6
SIZE_HELP = "GiB, as printed (24 is 24GiB; with a unit: 24GB is 24 * 10**9 bytes, 22.35 GiB)"


def size_in_gib(text: str) -> int:
    """--vram-gb / --host-gb: bytes from a size in GiB (a bare number) or with its unit ("24GB", "22.35GiB")."""
    try:
        value = parse_size(text, default_unit="GiB")
    except ValueError:
        value = None
    if value is None or not 0 < value <= MAX_SIZE_GIB * GiB:
        raise argparse.ArgumentTypeError(f"takes a size in (0, {_LIMIT}] GiB: a number of GiB (24, 22.35) "
                                         f"or one with its unit (24GiB, 24GB), not {text!r}")
    return value


def device(text: str) -> torch.device:
    kind, colon, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"takes cpu, cuda or cuda:N, not {text!r}")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text}: torch {torch.__version__} sees no GPU; use cpu")
        if colon and int(index) >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has cuda:0..cuda:{count - 1}")
    return torch.device(text)


def json_path(text: str) -> str:
    """A file the run can write at the end, checked now without creating or truncating anything."""
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file path")
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):  # append: an existing file keeps its contents
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{text} cannot be written ({error.strerror})") from None
    if not existed:
        os.unlink(path)  # leave no stray file if the run fails before the end
    return path
