"""ModelShape: the sizes of a decoder-only transformer (Llama / Qwen2 / Mistral family, and their
mixture-of-experts forms: Mixtral, Qwen-MoE), from a Hugging Face config (object, config.json dict or
file) or a model, without allocating any weights. Where transformers is installed a config file is read
through ``AutoConfig``, which fills what the file leaves to the model type's defaults."""

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


# A config.json is a few kilobytes; a larger "config" is some other file, never read whole.
MAX_CONFIG_BYTES = 1 << 20


def _check_config_file(path: str) -> None:
    """ValueError unless `path` is a missing file (reading reports that) or a regular file of a config's size."""
    if not os.path.exists(path):
        return
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a regular file: give a config.json or the folder holding one")
    size = os.path.getsize(path)
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path} is {size / 1e6:.1f} MB; a model config is a JSON file of a few KB "
                         f"(at most {MAX_CONFIG_BYTES // 2**20} MiB is read)")


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
    # Mixture of experts: each block's MLP is `num_experts` routed experts of `expert_intermediate_size`
    # (None: intermediate_size), `experts_per_token` of which run for each token, a router (hidden ->
    # num_experts) and, where `shared_expert_intermediate_size` > 0, one shared expert every token runs
    # with its sigmoid gate (hidden -> 1). num_experts=0: a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{name}={value!r} must be an integer >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be in [1, num_experts="
                             f"{self.num_experts}]")
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

    @property
    def mlp_width(self) -> int:
        """The MLP's intermediate width one token runs through: the dense MLP's, or under experts the
        routed experts a token takes plus the shared expert."""
        if not self.num_experts:
            return self.intermediate_size
        return self.experts_per_token * self.expert_width + self.shared_expert_intermediate_size

    @property
    def expert_width(self) -> int:
        return self.expert_intermediate_size or self.intermediate_size

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """One block's projections as one token runs them: name -> (in_features, out_features, has_bias);
        under experts the MLP's are as wide as ``mlp_width`` (what the token's matmuls and saved
        activations scale with). What is stored is ``weight_linears``."""
        h, i = self.hidden_size, self.mlp_width
        return {"q_proj": (h, self.q_dim, self.qkv_bias), "k_proj": (h, self.kv_dim, self.qkv_bias),
                "v_proj": (h, self.kv_dim, self.qkv_bias), "o_proj": (self.q_dim, h, False),
                "gate_proj": (h, i, False), "up_proj": (h, i, False), "down_proj": (i, h, False)}

    def weight_linears(self) -> list[tuple[str, int, int, bool, int]]:
        """One block's stored linear layers: (role, in_features, out_features, has_bias, how many). The
        experts' gate/up/down projections (and the shared expert's) take those roles, as LoRA targets them."""
        h = self.hidden_size
        attention = [(name, i, o, bias, 1) for name, (i, o, bias) in self.linears().items()
                     if name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if not self.num_experts:
            i = self.intermediate_size
            return [*attention, ("gate_proj", h, i, False, 1), ("up_proj", h, i, False, 1),
                    ("down_proj", i, h, False, 1)]
        e, n = self.expert_width, self.num_experts
        out = [*attention, ("gate_proj", h, e, False, n), ("up_proj", h, e, False, n), ("down_proj", e, h, False, n),
               ("router", h, n, False, 1)]
        if self.shared_expert_intermediate_size:
            s = self.shared_expert_intermediate_size
            out += [("gate_proj", h, s, False, 1), ("up_proj", h, s, False, 1), ("down_proj", s, h, False, 1),
                    ("shared_expert_gate", h, 1, False, 1)]
        return out

    @property
    def block_params(self) -> int:
        """Values in one block: projection (and expert) weights and biases, two norm weights."""
        return sum(n * (a * b + (b if bias else 0)) for _, a, b, bias, n in self.weight_linears()) + 2 * self.hidden_size

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
        a multimodal config's ``text_config`` is used), or a path to a config.json / a folder holding one.
        A dict or file naming its ``model_type`` goes through transformers' ``AutoConfig`` where it is
        installed and knows the type, so fields the file leaves out take that model's defaults (the sizes
        in ``_REQUIRED`` must be in the file itself)."""
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            _check_config_file(path)
            try:
                with open(path) as f:
                    config = json.load(f)
            except OSError as error:
                raise ValueError(f"cannot read a model config from {path}: {error.strerror}") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                where = f" ({error.msg} at line {error.lineno})" if isinstance(error, json.JSONDecodeError) else ""
                raise ValueError(f"{path} is not JSON{where}") from None
            if not isinstance(config, Mapping):
                raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object of config fields")
        if isinstance(config, Mapping) and all(config.get(name) is not None for name in _REQUIRED):
            config = _with_model_defaults(config)  # the sizes come from the file; defaults fill the rest
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
        experts = int(fields.get("num_local_experts") or fields.get("num_experts") or 0)
        if experts and (fields.get("mlp_only_layers") or int(fields.get("decoder_sparse_step") or 1) != 1):
            raise ValueError("the config mixes dense and expert blocks (mlp_only_layers / decoder_sparse_step); "
                             "the planner models models whose every block has the same MLP")
        moe = dict(num_experts=experts, experts_per_token=int(fields.get("num_experts_per_tok") or 0),
                   expert_intermediate_size=int(fields["moe_intermediate_size"])
                   if fields.get("moe_intermediate_size") else None,
                   shared_expert_intermediate_size=int(fields.get("shared_expert_intermediate_size") or 0)) \
            if experts else {}
        return cls(
            hidden_size=int(fields["hidden_size"]), intermediate_size=int(fields["intermediate_size"]),
            num_hidden_layers=int(fields["num_hidden_layers"]), num_attention_heads=int(fields["num_attention_heads"]),
            num_key_value_heads=int(fields.get("num_key_value_heads") or fields["num_attention_heads"]),
            vocab_size=int(fields["vocab_size"]), tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
            head_dim=int(fields["head_dim"]) if fields.get("head_dim") else None,
            qkv_bias=bool(bias) if bias is not None else model_type in _QKV_BIAS_MODELS, **moe)

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


def _with_model_defaults(fields: Mapping) -> Mapping:
    """`fields` completed by transformers' config class for their ``model_type`` (its defaults for what
    they leave out), or as they are without transformers or for a type it does not know."""
    model_type = fields.get("model_type")
    if not model_type:
        return fields
    try:
        from transformers import AutoConfig
    except ImportError:  # ts-planner does not need transformers: the fields are read as given
        return fields
    try:
        config = AutoConfig.for_model(**dict(fields))
    except (ValueError, KeyError, TypeError):
        return fields
    return {**config.to_dict(), **{k: v for k, v in fields.items() if v is not None}}
