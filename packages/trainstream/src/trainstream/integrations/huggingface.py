"""Hugging Face integration: TrainStreamTrainer, TrainStreamMixin, TrainStreamCallback, wrap_hf, decoder_layers,
per-sequence log-probs of a causal LM, and quantize-while-loading (TrainStreamQuantConfig for
``from_pretrained``, or the lower-level load_model).

Needs ``transformers`` (``pip install 'trainstream[hf]'``). The losses here run the decoder for its
last hidden states and apply the output projection chunk by chunk, so the [tokens, vocab] logits
never exist during training.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any

import torch

try:
    from transformers import Trainer, TrainerCallback, TrainingArguments
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError("trainstream.integrations.huggingface needs transformers: pip install 'trainstream[hf]'") from error

from .. import OffloadAdamW, causal_lm_loss, compile_blocks, find_blocks, sequence_logprobs, wrap
from .._config import Config, trainer_options
from .._console import write_line
from .._options import parse_options
from .hf_loading import load_model
from .hf_quantizer import TrainStreamQuantConfig  # registers the quantizer with transformers
from .kvcache import TrainStreamCache  # imports ts-kvcache when first used

__all__ = ["TrainStreamCache", "TrainStreamCallback", "TrainStreamMixin", "TrainStreamQuantConfig", "TrainStreamTrainer",
           "causal_lm_logprobs", "decoder_and_head", "decoder_layers", "load_model", "reference_logprobs", "wrap_hf"]

# Config fields that change logits after the projection: the chunked loss cannot reproduce them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder returning last hidden states, output projection) of a causal LM, through PEFT and
    Accelerate wrappers; None when the model's logits are not a plain projection of them."""
    base = _base(model)
    get_decoder = getattr(base, "get_decoder", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    config = getattr(base, "config", None)
    if get_decoder is None or head is None or not isinstance(head, torch.nn.Linear):
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return get_decoder(), head


def _base(model: torch.nn.Module) -> torch.nn.Module:
    base = model.module if hasattr(model, "module") else model
    return base.get_base_model() if hasattr(base, "get_base_model") else base


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's repeated layers (``model.model.layers`` of a Llama), through PEFT and Accelerate
    wrappers: the blocks ``wrap_hf`` gives ``wrap()``. Models without ``get_decoder().layers`` fall back
    to ``find_blocks(model)``; ``[]`` when there are none."""
    base = _base(model)
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None) if decoder is not None else None
    if isinstance(layers, (torch.nn.ModuleList, torch.nn.Sequential)) and len(layers) > 0:
        return list(layers)
    return find_blocks(model)


def _hidden(decoder: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    out = decoder(**{k: v for k, v in inputs.items() if k not in ("labels", "num_items_in_batch")}, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def wrap_hf(model: torch.nn.Module, optimizer=None, **options):
    """``trainstream.wrap`` for a Hugging Face model (PEFT models included), with ``blocks`` preset to
    ``decoder_layers(model)``; returns ``(model, optimizer)``."""
    if options.get("blocks") is None:
        layers = decoder_layers(model)
        if layers:
            options["blocks"] = layers
    if hasattr(model, "config") and getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # a KV cache during training only costs memory
    return wrap(model, optimizer, **options)


def causal_lm_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, *, chunk_size: int = 1024,
                       average: bool = False, **model_kwargs) -> torch.Tensor:
    """Each sequence's log-probability of its labels (default: the input ids; ``-100``: not counted;
    shifted inside), ``[B]`` float32, computed in chunks; differentiable (DPO's policy term).
    ``model_kwargs`` go to the model (``position_ids``, ...). A model whose logits are not a plain
    projection of its last hidden states (soft-capping, logit scales) uses its own logits."""
    labels = input_ids if labels is None else labels
    inputs = {"input_ids": input_ids, **model_kwargs}
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    parts = decoder_and_head(model)
    if parts is None:
        return _logprobs_from_logits(model, inputs, labels, average)
    decoder, head = parts
    return sequence_logprobs(_hidden(decoder, inputs), head.weight, labels, head.bias, chunk_size=chunk_size,
                             average=average)


def _logprobs_from_logits(model: torch.nn.Module, inputs: dict, labels: torch.Tensor, average: bool,
                          ignore_index: int = -100) -> torch.Tensor:
    out = model(**inputs, use_cache=False)
    logits = (out.logits if hasattr(out, "logits") else out[0])[:, :-1, :].float()
    target = labels[:, 1:]
    valid = target != ignore_index
    picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.where(valid, target, 0)[..., None]).squeeze(-1)
    logp = torch.where(valid, picked, 0.0).sum(dim=1)
    return logp / valid.sum(dim=1).clamp(min=1) if average else logp


def reference_logprobs(model: torch.nn.Module, batches, *, chunk_size: int = 1024,
                       average: bool = False) -> torch.Tensor:
    """DPO's reference log-probs without a second model: ``model`` (a PEFT model runs with its adapters
    off) in eval mode and without gradients, over ``batches`` (dicts with ``"input_ids"`` and optionally
    ``"labels"`` and ``"attention_mask"``). One float32 CPU tensor with every sequence's value, in order;
    the model's training mode is restored afterwards."""
    adapters_off = model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
    device = next(model.parameters()).device
    was_training = model.training
    values = []
    model.eval()
    try:
        with torch.no_grad(), adapters_off:
            for batch in batches:
                if "input_ids" not in batch:
                    raise ValueError("reference_logprobs: each batch needs 'input_ids'")
                on_device = {k: batch[k].to(device) for k in ("input_ids", "labels", "attention_mask") if k in batch}
                values.append(causal_lm_logprobs(model, on_device["input_ids"], on_device.get("labels"),
                                                 on_device.get("attention_mask"), chunk_size=chunk_size,
                                                 average=average).float().cpu())
    finally:
        model.train(was_training)
    return torch.cat(values) if values else torch.empty(0)



def _engine_settings(optimizer: OffloadAdamW) -> tuple[float | None, int]:
    """(max_grad_norm, accumulation_steps) the attached engine of ``optimizer`` runs with."""
    config = optimizer._session.config
    return config.max_grad_norm, config.accumulation_steps


def _check_trainer_settings(optimizer, args, where: str = "the Trainer") -> None:
    """ValueError when an attached ``OffloadAdamW`` would not train as the Trainer's arguments say:
    its gradients leave the GPU during backward, so the Trainer's own clipping sees none and its
    micro-batches would each be a step. Nothing to check for an optimizer that is not attached."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer
    if not (isinstance(optimizer, OffloadAdamW) and optimizer.attached):
        return
    clip, accumulation = _engine_settings(optimizer)
    wanted = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    if wanted is not None and clip != wanted:
        raise ValueError(
            f"{where} has max_grad_norm={args.max_grad_norm} but the attached OffloadAdamW clips at "
            f"{clip if clip is not None else 'nothing (max_grad_norm=None)'}: its gradients leave the GPU during "
            f"backward, so the Trainer's clipping would silently do nothing. Pass max_grad_norm={wanted} to "
            f"wrap()/wrap_hf(), or set max_grad_norm=0 in the Trainer's arguments, or let TrainStreamTrainer / "
            f"trainstream.integrations.trl's trainers build the optimizer (no optimizers=)")
    if accumulation != args.gradient_accumulation_steps:
        raise ValueError(
            f"{where} has gradient_accumulation_steps={args.gradient_accumulation_steps} but the attached "
            f"OffloadAdamW steps every {accumulation} backward pass(es): pass "
            f"accumulation_steps={args.gradient_accumulation_steps} to wrap()/wrap_hf(), or let TrainStreamTrainer / "
            f"trainstream.integrations.trl's trainers build the optimizer (no optimizers=)")


def _refuse_unhonoured_trainer(optimizer: OffloadAdamW) -> None:
    """For ``OffloadAdamW.train()``, which ``transformers.Trainer`` calls (through Accelerate) at each
    training step: the calling Trainer, found a few frames up, is checked once by
    ``_check_trainer_settings``, so a stock Trainer given an attached optimizer it would clip or
    accumulate for in vain fails at its first step instead of training differently."""
    frame = sys._getframe(1)
    for _ in range(8):  # OffloadAdamW.train <- AcceleratedOptimizer.train <- Trainer.training_step
        if frame is None:
            return
        trainer = frame.f_locals.get("self")
        if isinstance(trainer, Trainer):
            if getattr(trainer, "_trainstream_checked", None) is not optimizer:
                _check_trainer_settings(optimizer, trainer.args, type(trainer).__name__)
                trainer._trainstream_checked = optimizer
            return
        frame = frame.f_back


def _trainer_optimizer(trainer, options: dict) -> OffloadAdamW:
    """The optimizer of a Trainer made to train with TrainStream (TrainStreamTrainer and the TRL
    trainers' ``create_optimizer``): ``trainer.optimizer`` (torch's AdamW or an ``OffloadAdamW``)
    attached by ``wrap_hf`` with the Trainer's ``max_grad_norm`` and ``gradient_accumulation_steps``;
    one attached already must match them (else ValueError). The Trainer's own clipping is then
    switched off on ``trainer.args``, which must be the trainer's own copy."""
    optimizer, args = trainer.optimizer, trainer.args
    if isinstance(optimizer, OffloadAdamW) and optimizer.attached:
        _check_trainer_settings(optimizer, args, type(trainer).__name__)
    else:
        norm = args.max_grad_norm
        # With the Trainer's clipping off, an OffloadAdamW's own max_grad_norm (if any) stays in effect.
        clip = {"max_grad_norm": norm} if norm and norm > 0 else {}
        _, optimizer = wrap_hf(trainer.model, optimizer, accumulation_steps=args.gradient_accumulation_steps,
                               **clip, **options)
    trainer.optimizer = optimizer
    args.max_grad_norm = 0.0  # the optimizer clips; the Trainer's grads are already gone
    if args.torch_compile:
        _compile_decoder(trainer.model, args)
    return optimizer


def _compile_decoder(model: torch.nn.Module, args) -> None:
    """``torch_compile=True``: the decoder's blocks are compiled in place too, with the config's backend
    and mode (the chunked loss runs the decoder itself, past the model Accelerate compiled), streamed
    blocks too. Once per model."""
    if getattr(model, "_trainstream_compiled", False):
        return
    blocks = decoder_layers(model)
    mode = args.torch_compile_mode or "default"
    compile_blocks(model, mode, blocks=blocks, backend=args.torch_compile_backend or "inductor")
    model._trainstream_compiled = True


def _real_grad_norm(logs: dict | None, optimizer) -> None:
    """A training log's ``grad_norm`` made true: the norm TrainStream's engine measured when it clips,
    else removed (the Trainer measured gradients that had already left, and would log 0)."""
    if not logs or "grad_norm" not in logs:
        return
    optimizer = getattr(optimizer, "optimizer", optimizer)
    norm = optimizer.stats()["last_grad_norm"] if isinstance(optimizer, OffloadAdamW) and optimizer.attached else None
    if norm is None:
        if isinstance(optimizer, OffloadAdamW) and optimizer.attached:
            del logs["grad_norm"]
    else:
        logs["grad_norm"] = float(norm)


class TrainStreamMixin:
    """Put first in the bases of a ``transformers.Trainer`` subclass (TRL's trainers included):
    ``class MyDPO(TrainStreamMixin, DPOTrainer)``. Adds ``trainstream={...}`` (any ``wrap()`` option,
    checked at construction) and trains with the optimizer state in host memory.

    At ``train()``, the Trainer's AdamW (its groups and schedule), or an ``OffloadAdamW`` given through
    ``optimizers=``, is attached by ``wrap_hf`` with the config's ``max_grad_norm`` and
    ``gradient_accumulation_steps``; an optimizer attached beforehand must have been given the same
    two (else ``ValueError``). The Trainer's clipping is switched off on the trainer's own copy of
    the config (yours is not changed). ``grad_norm`` in the logs is the norm TrainStream measured
    before clipping; without clipping no norm is measured and ``grad_norm`` is left out. fp16 loss
    scaling and optimizers other than Adam/AdamW are refused.
    """

    # Keys of trainstream={...} a subclass pops before this __init__ sees them (named in errors).
    _ts_extra_options: tuple[str, ...] = ()

    def __init__(self, *args, trainstream: dict | Config | None = None, **kwargs):
        options = trainer_options(trainstream)
        for name in ("max_grad_norm", "accumulation_steps"):
            if name in options:
                raise ValueError(f"trainstream={{'{name}': ...}} comes from the trainer's config (TrainingArguments) "
                                 f"here; set it there")
        try:
            parse_options(dict(options))  # every key checked now, not when training starts
        except ValueError as error:
            extra = ", ".join(repr(k) for k in self._ts_extra_options)
            raise ValueError(f"trainstream={{...}}: {error}" + (f"; it also takes {extra}" if extra else "")) from None
        self._ts_options = options
        # The trainer's own copy of the config: create_optimizer switches its clipping off there, and
        # the caller may reuse its object with a stock trainer, which must still clip. Shallow: only
        # scalar fields change.
        # Found by type: TRL's GRPOTrainer takes it third, the Trainer second.
        args = tuple(copy.copy(a) if isinstance(a, TrainingArguments) else a for a in args)
        if isinstance(kwargs.get("args"), TrainingArguments):
            kwargs["args"] = copy.copy(kwargs["args"])
        super().__init__(*args, **kwargs)
        name = type(self).__name__
        if self.args.fp16:
            raise ValueError(f"{name} with TrainStream does not support fp16 with loss scaling; use bf16=True or fp32")
        if "adam" not in str(getattr(self.args.optim, "value", self.args.optim)):
            raise ValueError(f"{name} with TrainStream needs an Adam/AdamW optim, not {self.args.optim!r}")

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            super().create_optimizer(model)  # torch's AdamW with the Trainer's groups; wrap() converts it
        return _trainer_optimizer(self, self._ts_options)

    def log(self, logs: dict, *args, **kwargs) -> None:
        _real_grad_norm(logs, self.optimizer)
        super().log(logs, *args, **kwargs)


class TrainStreamTrainer(TrainStreamMixin, Trainer):
    """``transformers.Trainer`` with the optimizer in host memory (``TrainStreamMixin``) and a chunked loss.

    ``trainstream``: any ``wrap()`` option, plus ``"chunked_loss"`` (default True) and
    ``"loss_chunk_size"`` (default 1024: tokens per chunk), so the [tokens, vocab] logits never exist.
    The Trainer's AdamW (groups, learning rate, schedule) is converted; ``max_grad_norm`` and
    ``gradient_accumulation_steps`` move into the optimizer (see ``TrainStreamMixin``).
    """

    _ts_extra_options = ("chunked_loss", "loss_chunk_size")

    def __init__(self, *args, trainstream: dict | Config | None = None, **kwargs):
        options = trainer_options(trainstream)
        self._ts_chunked = options.pop("chunked_loss", True)
        self._ts_chunk = options.pop("loss_chunk_size", 1024)
        if not isinstance(self._ts_chunked, bool):
            raise ValueError(f"chunked_loss={self._ts_chunked!r} is not valid; use True or False")
        if isinstance(self._ts_chunk, bool) or not isinstance(self._ts_chunk, int) or self._ts_chunk < 1:
            raise ValueError(f"loss_chunk_size={self._ts_chunk!r} is not valid; use an integer >= 1")
        super().__init__(*args, trainstream=options, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        parts = decoder_and_head(model) if self._ts_chunked and model.training else None
        if (parts is None or return_outputs or "labels" not in inputs
                or self.label_smoother is not None or self.compute_loss_func is not None):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        decoder, head = parts
        # The stock path runs the model's forward, which Accelerate wraps in its mixed-precision autocast;
        # the decoder called directly here would run outside it (bf16=True training in float32).
        with self.accelerator.autocast():
            loss = causal_lm_loss(_hidden(decoder, inputs), head.weight, inputs["labels"], head.bias,
                                  chunk_size=self._ts_chunk, num_items=num_items_in_batch)
        return loss * _token_average_scale(self, num_items_in_batch)


def _token_average_scale(trainer, num_items_in_batch) -> int:
    """The factor the stock ``Trainer.compute_loss`` applies with ``average_tokens_across_devices``: the loss is
    divided by the tokens of every process's batch, and the gradient average over the processes would
    divide once more, so each process's loss is multiplied back by their number (without it, the loss,
    the gradients and the logged norm are 1/processes of the stock trainer's)."""
    args = trainer.args
    if not (args.average_tokens_across_devices and trainer.model_accepts_loss_kwargs and num_items_in_batch is not None):
        return 1
    if args.n_gpu > 1:  # torch's DataParallel in one process: the batch splits over the GPUs
        return args.n_gpu
    return trainer.accelerator.num_processes // trainer.get_tp_size()


class TrainStreamCallback(TrainerCallback):
    """For a stock ``transformers.Trainer`` given an ``OffloadAdamW`` (``optimizers=(opt, None)``), attached
    or not: at each log step, adds TrainStream's metrics since the previous log to the logs and the
    log history, and prints them on the main process once (``verbose=False``: only records them). Given to the
    Trainer (``callbacks=[...]``), it runs before the Trainer's own printing callback, which prints them in its
    log line; added later (``trainer.add_callback``), it runs after that line and prints them on a line of its
    own, never beside the progress bar.

    Keys: ``trainstream/step_s`` and ``trainstream/host_update_s`` (mean seconds per step inside
    ``optimizer.step()`` and in host AdamW; the latter only where it is measured), ``trainstream/d2h_GB``
    and ``trainstream/h2d_GB`` (moved), ``trainstream/host_state_fraction`` (share of the optimizer
    state's values in host memory) and ``trainstream/grad_norm`` when TrainStream clips. While the
    optimizer is attached, ``grad_norm`` becomes the norm TrainStream measured (or is removed when it
    does not clip: the Trainer saw no gradients), and a Trainer whose ``max_grad_norm`` or
    ``gradient_accumulation_steps`` the engine would not honour is refused at ``on_train_begin``.
    """

    def __init__(self, optimizer: OffloadAdamW, *, verbose: bool = True):
        if not isinstance(optimizer, OffloadAdamW):
            raise ValueError(f"TrainStreamCallback takes the trainstream.OffloadAdamW given to the Trainer, not "
                             f"{type(optimizer).__name__}")
        self.optimizer = optimizer
        self.verbose = verbose
        self._last = optimizer.stats()
        self._in_trainer_line = False  # the Trainer's printing callback prints the logs after this one updates them

    def metrics(self) -> dict[str, float]:
        """The metrics since the previous call."""
        now, last = self.optimizer.stats(), self._last
        self._last = now
        steps = max(1, now["steps"] - last["steps"])
        out = {"trainstream/step_s": (now["step_seconds"] - last["step_seconds"]) / steps,
               "trainstream/d2h_GB": (now["d2h_bytes"] - last["d2h_bytes"]) / 1e9,
               "trainstream/h2d_GB": (now["h2d_bytes"] - last["h2d_bytes"]) / 1e9}
        if now["host_update_seconds"] is not None and last["host_update_seconds"] is not None:
            out["trainstream/host_update_s"] = (now["host_update_seconds"] - last["host_update_seconds"]) / steps
        total = sum(now["placement"].values())
        if total:
            out["trainstream/host_state_fraction"] = now["placement"].get("host", 0) / total
        if now["last_grad_norm"] is not None:
            out["trainstream/grad_norm"] = float(now["last_grad_norm"])
        return out

    def on_init_end(self, args, state, control, **kwargs):
        # Only the callbacks a Trainer is made with hear it; its printing callback (PrinterCallback, or the
        # progress bar's) was added after them, so it prints the logs this callback has updated.
        self._in_trainer_line = True

    def on_train_begin(self, args, state, control, **kwargs):
        # An attached optimizer the Trainer would clip or accumulate for in vain is refused before step 1.
        _check_trainer_settings(self.optimizer, args, "the Trainer")

    def on_log(self, args, state, control, logs=None, **kwargs):
        values = self.metrics()
        if logs is not None:
            _real_grad_norm(logs, self.optimizer)
            logs.update(values)
        if state.log_history:
            entry = state.log_history[-1]  # the entry the Trainer just appended for these logs
            _real_grad_norm(entry, self.optimizer)
            entry.update(values)
        if self.verbose and state.is_world_process_zero and not self._in_trainer_line:
            write_line(" ".join(f"{k}={v:.4g}" for k, v in values.items()), sys.stdout)
