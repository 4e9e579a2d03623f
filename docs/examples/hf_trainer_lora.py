"""LoRA fine-tuning with the Hugging Face Trainer, optimizer state in host RAM.

    python docs/examples/hf_trainer_lora.py --steps 10                  # tiny built-in model
    python docs/examples/hf_trainer_lora.py --model Qwen/Qwen2.5-1.5B --bf16
"""

from __future__ import annotations

import argparse
import tempfile

import peft
import torch
from _tiny import batches, load_model
from trainstream.integrations.huggingface import TrainStreamTrainer
from transformers import TrainingArguments


class _Rows(torch.utils.data.Dataset):
    def __init__(self, count: int, seq: int):
        self.rows = torch.cat(list(batches(1, count, seq)))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hub id (default: a tiny random decoder)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args(argv)
    model = load_model(args.model, torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=2,
                                     gradient_accumulation_steps=2, learning_rate=2e-3, max_grad_norm=1.0,
                                     logging_steps=1, save_strategy="no", report_to=[], bf16=args.bf16,
                                     use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
        trainer = TrainStreamTrainer(model=model, args=training, train_dataset=_Rows(64, args.seq))
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("losses:", " ".join(f"{x:.3f}" for x in losses))
    return losses


if __name__ == "__main__":
    main()
