"""ModelShape: the sizes of a decoder-only transformer (Llama / Qwen2 family), from a Hugging Face
config (object or config.json dict) or a model, without allocating any weights."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

__all__ = ["LORA_TARGETS", "ModelShape"]

# The seven projections of a decoder block, the usual LoRA targets.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Families whose q/k/v projections carry a bias without saying so in the config.
_QKV_BIAS_MODELS = ("qwen2", "qwen2_moe")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only model: every block has q/k/v/o attention projections (grouped-query
    attention when ``num_key_value_heads`` < ``num_attention_heads``), a gated MLP and two RMSNorms."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{name}={value!r} must be an integer >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                             f"{self.num_attention_heads}; give head_dim")

    # ---- derived sizes --------------------------------------------------------------------------
    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.dim_per_head

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.dim_per_head

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """One block's projections: name -> (in_features, out_features, has_bias)."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim, self.qkv_bias), "k_proj": (h, self.kv_dim, self.qkv_bias),
                "v_proj": (h, self.kv_dim, self.qkv_bias), "o_proj": (self.q_dim, h, False),
                "gate_proj": (h, i, False), "up_proj": (h, i, False), "down_proj": (i, h, False)}

    @property
    def block_params(self) -> int:
        """Values in one block: projection weights and biases, two norm weights."""
        return sum(a * b + (b if bias else 0) for a, b, bias in self.linears().values()) + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """The output layer (0 when tied to the embedding) plus the final norm."""
        return (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size) + self.hidden_size

    @property
    def total_params(self) -> int:
        return self.num_hidden_layers * self.block_params + self.embedding_params + self.head_params

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers ``PretrainedConfig``, a dict with its fields (a loaded ``config.json``;
        a multimodal config's ``text_config`` is used), or a path to a config.json / a folder holding one."""
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            try:
                with open(path) as f:
                    config = json.load(f)
            except OSError as error:
                raise ValueError(f"cannot read a model config from {path}: {error.strerror}") from None
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} is not JSON ({error.msg} at line {error.lineno})") from None
        fields = dict(config) if isinstance(config, Mapping) else (
            config.to_dict() if hasattr(config, "to_dict") else dict(vars(config)))
        text = fields.get("text_config")
        if isinstance(text, Mapping) or hasattr(text, "to_dict"):
            fields = {**fields, **(dict(text) if isinstance(text, Mapping) else text.to_dict())}
        missing = [name for name in _REQUIRED if fields.get(name) is None]
        if missing:
            raise ValueError(f"the model config lacks {', '.join(missing)}: the planner models decoder-only "
                             f"transformers (Llama, Qwen2, Mistral shapes) and needs {', '.join(_REQUIRED)}")
        model_type = str(fields.get("model_type", ""))
        bias = fields.get("attention_bias")
        return cls(
            hidden_size=int(fields["hidden_size"]), intermediate_size=int(fields["intermediate_size"]),
            num_hidden_layers=int(fields["num_hidden_layers"]), num_attention_heads=int(fields["num_attention_heads"]),
            num_key_value_heads=int(fields.get("num_key_value_heads") or fields["num_attention_heads"]),
            vocab_size=int(fields["vocab_size"]), tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
            head_dim=int(fields["head_dim"]) if fields.get("head_dim") else None,
            qkv_bias=bool(bias) if bias is not None else model_type in _QKV_BIAS_MODELS)

    @classmethod
    def from_model(cls, model) -> ModelShape:
        """From a model's ``config`` (a Hugging Face model, or a PEFT model around one); reads no weights."""
        for candidate in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None),
                                                                            "model", None)):
            config = getattr(candidate, "config", None)
            if config is not None:
                return cls.from_config(config)
        raise ValueError(f"{type(model).__name__} has no .config; build a ModelShape(...) from its sizes or use "
                         "ModelShape.from_config")
