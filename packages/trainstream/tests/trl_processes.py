"""One process of test_trainer_processes.py's TRL case, started by torchrun: TRL's SFTTrainer, then
TrainStreamSFTTrainer, with LoRA on every linear layer, clipping and accumulation, on the same data and seed;
writes the logged losses and norms and the trained adapters to OUT/trl-rank{N}.pt."""

from __future__ import annotations

import os
import sys

import datasets
import torch
import transformers
import trl

sys.path.insert(0, os.path.dirname(__file__))
from test_trl import TEXTS, _common, _lora, _tokenizer
from trainstream.integrations import trl as ts_trl
from ts_testing import tiny_llama


def run(cls, out: str) -> dict:
    transformers.set_seed(0)
    config = trl.SFTConfig(**_common(out, max_steps=3, ddp_backend="gloo"))
    trainer = cls(model=tiny_llama(), args=config, train_dataset=datasets.Dataset.from_list(TEXTS * 2),
                  processing_class=_tokenizer(), peft_config=_lora("all-linear"))
    trainer.train()
    model = trainer.model
    session = getattr(model, "_trainstream_session", None)
    if session is not None:
        session.synchronize()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logged], "grad_norm": [h["grad_norm"] for h in logged],
            "adapters": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
            "world": trainer.accelerator.num_processes,
            "events": [str(e) for e in session.events] if session is not None else []}


if __name__ == "__main__":
    out = sys.argv[1]
    result = {"stock": run(trl.SFTTrainer, os.path.join(out, "trl-stock")),
              "ours": run(ts_trl.TrainStreamSFTTrainer, os.path.join(out, "trl-ours"))}
    torch.save(result, os.path.join(out, f"trl-rank{os.environ['RANK']}.pt"))
