"""DPO on a LoRA model: the same base with its adapters off is the reference, log-probs come in chunks.

    python docs/examples/dpo_lora.py --steps 10          # tiny built-in model; "chosen" = the real text
"""

from __future__ import annotations

import argparse

import peft
import torch
import trainstream
from _tiny import batches, load_model
from trainstream.integrations.huggingface import causal_lm_logprobs, wrap_hf


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens (not scored)")
    parser.add_argument("--answer", type=int, default=48, help="answer tokens (scored)")
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model, torch.float32).to(device)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                                                       target_modules=["q_proj", "v_proj"]))
    model, optimizer = wrap_hf(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3))
    seq = args.prompt + args.answer
    margins = []
    for chosen in batches(args.steps, args.batch, seq):
        # A rejected answer: the same prompt followed by shuffled answer bytes.
        rejected = chosen.clone()
        rejected[:, args.prompt:] = rejected[:, args.prompt:][:, torch.randperm(args.answer)]
        pair = []
        for ids in (chosen, rejected):
            ids = ids.to(device)
            labels = ids.clone()
            labels[:, : args.prompt] = -100
            pair.append((ids, labels))
        with torch.no_grad(), model.disable_adapter():
            ref = [causal_lm_logprobs(model, ids, labels) for ids, labels in pair]
        policy = [causal_lm_logprobs(model, ids, labels) for ids, labels in pair]
        loss, chosen_reward, rejected_reward = trainstream.dpo_loss(*policy, *ref, beta=args.beta)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        margins.append((chosen_reward - rejected_reward).mean().item())
        print(f"loss {loss.item():.4f}  reward margin {margins[-1]:+.4f}")
    return margins


if __name__ == "__main__":
    main()
