"""One process of test_trainer_processes.py, started by torchrun: the stock Trainer, then TrainStreamTrainer,
on the same data and seed; writes the logged losses and norms and the trained weights to OUT/rank{N}.pt."""

from __future__ import annotations

import os
import sys

import torch
import transformers
from transformers import Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(__file__))
from trainstream.integrations.huggingface import TrainStreamTrainer
from ts_testing import tiny_llama


class Rows(torch.utils.data.Dataset):
    def __init__(self, count=16, seq=12):
        self.ids = torch.randint(0, 97, (count, seq), generator=torch.Generator().manual_seed(5))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run(cls, out: str, **kwargs) -> dict:
    transformers.set_seed(0)
    model = tiny_llama()
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=3, learning_rate=5e-3, max_grad_norm=0.5, logging_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, data_seed=0,
                             ddp_backend="gloo")
    trainer = cls(model=model, args=args, train_dataset=Rows(), **kwargs)
    trainer.train()
    session = getattr(model, "_trainstream_session", None)
    if session is not None:
        session.synchronize()
    events = [str(e) for e in session.events] if session is not None else []
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logged], "grad_norm": [h["grad_norm"] for h in logged],
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "world": trainer.accelerator.num_processes, "events": events}


if __name__ == "__main__":
    out = sys.argv[1]
    result = {"stock": run(Trainer, os.path.join(out, "stock")), "ours": run(TrainStreamTrainer, os.path.join(out, "ours")),
              "ours_model_loss": run(TrainStreamTrainer, os.path.join(out, "ours2"), trainstream={"chunked_loss": False})}
    torch.save(result, os.path.join(out, f"rank{os.environ['RANK']}.pt"))
