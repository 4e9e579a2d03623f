"""TRL integration: SFTTrainer, DPOTrainer and GRPOTrainer trained with TrainStream.

TRL builds the PEFT model inside its trainers' ``__init__``, so an optimizer made beforehand misses
the adapters. ``TrainStreamMixin`` (from ``trainstream.integrations.huggingface``, the base of
``TrainStreamTrainer`` too) makes the optimizer when training starts instead: the Trainer's AdamW,
converted by ``wrap_hf``, with the config's ``max_grad_norm`` and ``gradient_accumulation_steps``
moved into the engine, since gradients leave the GPU during backward and the Trainer's own
clipping would see none. ``grad_norm`` in the logs is
the norm the engine measured. Ready-made: ``TrainStreamSFTTrainer``, ``TrainStreamDPOTrainer``,
``TrainStreamGRPOTrainer``; any other TRL trainer: ``class MyKTO(TrainStreamMixin, KTOTrainer)``.
Tested with trl 1.16 and transformers 5.24. Needs ``pip install trl``.
"""

from __future__ import annotations

import torch

try:
    import trl
except ImportError as error:  # pragma: no cover - exercised only without trl
    raise ImportError("trainstream.integrations.trl needs TRL: pip install trl") from error

from .._config import Config, trainer_options
from .huggingface import TrainStreamMixin, reference_logprobs

__all__ = ["TrainStreamDPOTrainer", "TrainStreamGRPOTrainer", "TrainStreamMixin", "TrainStreamSFTTrainer"]

# Keys TRL's preference collator adds beside the model inputs.
_DPO_NON_MODEL_KEYS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}


class TrainStreamSFTTrainer(TrainStreamMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` trained with TrainStream (see ``TrainStreamMixin``)."""


class TrainStreamGRPOTrainer(TrainStreamMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` trained with TrainStream (see ``TrainStreamMixin``); generation runs on the
    wrapped model. ``trainstream={"kv_cache": True}`` (or a dict of ``TrainStreamCache`` options such as
    ``resident_layers`` and ``page_tokens``) generates with the paged KV cache, its pages in host
    memory, released after each generation; transformers' generation only (not vLLM)."""

    _ts_extra_options = ("kv_cache",)

    def __init__(self, *args, trainstream: dict | Config | None = None, **kwargs):
        options = trainer_options(trainstream)
        kv = options.pop("kv_cache", False)
        if not isinstance(kv, (bool, dict)):
            raise ValueError(f"trainstream={{'kv_cache': {kv!r}}} is not valid; use True, False or a dict of "
                             f"TrainStreamCache options")
        self._ts_kv_cache = {} if kv is True else (dict(kv) if isinstance(kv, dict) else None)
        super().__init__(*args, trainstream=options, **kwargs)
        if self._ts_kv_cache is not None and getattr(self.args, "use_vllm", False):
            raise ValueError("trainstream={'kv_cache': ...} is for transformers' generate(); with use_vllm=True "
                             "vLLM keeps its own cache: leave kv_cache out")

    def _generate_single_turn(self, *args, **kwargs):
        if self._ts_kv_cache is None:
            return super()._generate_single_turn(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model_wrapped)
        generate = model.generate
        options = self._ts_kv_cache
        new_tokens = self.max_completion_length

        def paged_generate(*g_args, **g_kwargs):
            from .kvcache import TrainStreamCache

            prompt = g_kwargs["input_ids"].shape[1] if "input_ids" in g_kwargs else 0
            cache = TrainStreamCache(model, max_tokens=prompt + new_tokens, **options)
            try:
                return generate(*g_args, past_key_values=cache, **g_kwargs)
            finally:
                cache.release()  # training needs the memory back

        # TRL calls model.generate inside; the instance attribute shadows the method for this call only.
        model.generate = paged_generate
        try:
            return super()._generate_single_turn(*args, **kwargs)
        finally:
            del model.generate


class TrainStreamDPOTrainer(TrainStreamMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` trained with TrainStream (see ``TrainStreamMixin``). With
    ``precompute_ref_log_probs=True``, TRL's ``ref_chosen_logps`` / ``ref_rejected_logps`` columns are
    filled by ``trainstream``'s ``reference_logprobs`` (adapters off, eval mode, log-probs in chunks)
    where it computes what TRL does: TRL's own reference pass otherwise (``ld_alpha``, a "ref"
    adapter, vision inputs)."""

    def compute_ref_log_probs(self, model, inputs):
        extra = set(inputs) - _DPO_NON_MODEL_KEYS - {"input_ids", "attention_mask"}
        unwrapped = self.accelerator.unwrap_model(model)
        peft_config = getattr(unwrapped, "peft_config", {})
        if self.ld_alpha is not None or extra or "ref" in peft_config or not isinstance(unwrapped, torch.nn.Module):
            return super().compute_ref_log_probs(model, inputs)
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        batch = {"input_ids": inputs["input_ids"], "labels": labels}
        if "attention_mask" in inputs:
            batch["attention_mask"] = inputs["attention_mask"]
        with self.accelerator.autocast():  # the precision TRL's pass and training use (bf16=True: bf16)
            logps = reference_logprobs(unwrapped, [batch]).to(inputs["input_ids"].device)
        return logps.chunk(2, dim=0)  # the batch is [chosen, rejected]
