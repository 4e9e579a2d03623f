"""Rank side of test_fsdp.py: FSDP2 (fully_shard) + trainstream.wrap() against FSDP2 + torch.optim.AdamW, both
on the same global batches, run on spawned gloo ranks."""

from __future__ import annotations

import datetime
import os
import pathlib
import traceback

import torch
import torch.distributed as dist
import trainstream  # before init_process_group (trainstream warns otherwise)
from distributed_testing import free_port, spawn_ranks

WIDTH, BLOCKS, BATCH = 32, 3, 8


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    blocks = [torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(), torch.nn.Linear(2 * WIDTH, WIDTH))
              for _ in range(BLOCKS)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(WIDTH, 1))


def shard(model: torch.nn.Module, mixed: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mixed else {}
    for block in list(model)[:BLOCKS]:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)
    share = BATCH // world
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def train(model, opt, steps: int, rank: int, world: int, accumulation: int = 1, clip: float | None = None) -> list:
    losses = []
    for step in range(steps):
        for micro in range(accumulation):
            x, y = batch(step, micro, rank, world)
            loss = torch.nn.functional.mse_loss(model(x), y) / accumulation
            loss.backward()
            losses.append(loss.item())
        if clip is not None and not hasattr(opt, "_session"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses


def full_weights(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def compare(rank: int, world: int, *, mixed: bool = False, accumulation: int = 1, clip: float | None = None,
            **options) -> dict:
    """FSDP2 + wrap(..., **options) against FSDP2 + torch AdamW, 4 steps on the same global batches."""
    reference = shard(make_model(), mixed)
    ref_losses = train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01), 4, rank,
                       world, accumulation, clip)
    ours = shard(make_model(), mixed)
    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.01)
    planned = trainstream.plan(ours, optimizer, max_grad_norm=clip).host_state_bytes  # this rank's shards
    whole = trainstream.plan(make_model(), lr=1e-2, distributed=False).host_state_bytes  # one process, unsharded
    if "recompute" in options:
        options["blocks"] = list(ours)[:BLOCKS]  # the sharded blocks (FSDP2's own classes now)
    model, opt = trainstream.wrap(ours, optimizer, max_grad_norm=clip, accumulation_steps=accumulation, **options)
    losses = train(model, opt, 4, rank, world, accumulation, clip)
    report = trainstream.memory_report(model)
    trainstream.unwrap(model)
    return {"ref_losses": ref_losses, "losses": losses, "ref": full_weights(reference), "ours": full_weights(model),
            "host_values": sum(p["values"] for p in report["optimizer"]["placements"].values()),
            "total_values": sum(p.numel() for p in make_model().parameters()),
            "planned_share": planned / whole, "activations": report.get("activations"),
            "events": report["events"], "optimizer_params_after_unwrap": [type(p).__name__ for g in opt.param_groups
                                                                           for p in g["params"]]}


def overlap(rank: int, world: int) -> dict:
    """Without clipping, host AdamW starts on a group's shards during backward: updates are under way (or
    done) when backward() returns, before step()."""
    model = shard(make_model(), False)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = batch(0, 0, rank, world)
    torch.nn.functional.mse_loss(model(x), y).backward()
    session = model._trainstream_session
    session.engine.host.drain()  # the updates queued during backward finish (step() has not run)
    before_step = trainstream.memory_report(model)["optimizer"]["host_updates"]
    opt.step()
    opt.zero_grad()
    trainstream.unwrap(model)
    return {"host_updates_before_step": before_step, "sharded": len(session.shards.pairs)}


def refusals(rank: int, world: int) -> dict:
    """What does not compose, refused at wrap() with its reason."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    blocks_only = make_model()
    for block in list(blocks_only)[:BLOCKS]:
        fully_shard(block)
    for name, model, options in (("root_unsharded", blocks_only, {}),
                                 ("quantize", shard(make_model(), False), {"quantize": "int8"}),
                                 ("distributed", shard(make_model(), False), {"distributed": True}),
                                 ("activation_offload", shard(make_model(), False), {"activation_offload": True})):
        try:
            trainstream.wrap(model, torch.optim.AdamW(model.parameters()), **options)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


def planned(rank: int, world: int) -> dict:
    """What the wrap() plan prices for a model before and after fully_shard(), on a GPU budget: the facts it reads,
    the generic plan (no decoder config: this file's model) and ts-planner's (a tiny Llama, 8 blocks)."""
    import ts_planner
    from torch.distributed.fsdp import fully_shard
    from trainstream.memory.sizing import describe_model, plan_wrap
    from ts_testing import tiny_llama

    gib = 1 << 30
    budget = ts_planner.Budget(vram_bytes=80 * gib, host_bytes=200 * gib, pinned_bytes=100 * gib, device_bytes=80 * gib)
    out: dict = {}
    model = make_model()
    for key in ("whole", "sharded"):
        if key == "sharded":
            shard(model, mixed=False)
        facts = describe_model(model, list(model)[:BLOCKS])
        out[f"generic_{key}"] = {"facts": facts, **plan_wrap(facts, budget, quantize=None).generic}
    llama = tiny_llama(layers=8)
    for key in ("whole", "sharded"):
        if key == "sharded":
            for layer in llama.model.layers:
                fully_shard(layer)
            fully_shard(llama)
        facts = describe_model(llama, list(llama.model.layers))
        estimate = plan_wrap(facts, budget, quantize=None).plan.estimate
        out[f"llama_{key}"] = {"facts": facts, "vram": dict(estimate.vram), "host": dict(estimate.host),
                               "network_bytes": estimate.network_bytes}
    return out


def checkpoint(rank: int, world: int, out: pathlib.Path, *, save: bool) -> dict:
    """save: 2 steps, a sharded checkpoint, 2 more (the uninterrupted weights); else: load that checkpoint
    (written at any world size) into a fresh model and run the same 2 more steps."""
    from trainstream.distributed import load_checkpoint, save_checkpoint

    model = shard(make_model(seed=1), False)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), max_grad_norm=0.5)
    if save:
        train(model, opt, 2, rank, world)
        save_checkpoint(model, opt, out / "fsdp-checkpoint")
    else:
        load_checkpoint(model, opt, out / "fsdp-checkpoint")
    losses = [train_from(model, opt, step, rank, world) for step in (2, 3)]
    weights = full_weights(model)
    trainstream.unwrap(model)
    return {"losses": losses, "weights": weights}


def train_from(model, opt, step: int, rank: int, world: int) -> float:
    x, y = batch(step, 0, rank, world)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


CASES = {
    "plain": lambda r, w: compare(r, w),
    "clip_accumulate": lambda r, w: compare(r, w, clip=0.05, accumulation=2),
    "mixed": lambda r, w: compare(r, w, mixed=True, clip=0.5),
    "recompute": lambda r, w: compare(r, w, mixed=True, recompute=True),
    "refusals": refusals,
    "overlap": overlap,
    "planned": planned,
    "save": lambda r, w, o: checkpoint(r, w, o, save=True),
    "resume": lambda r, w, o: checkpoint(r, w, o, save=False),
}
NEEDS_OUT = ("save", "resume")


def _worker(rank: int, world: int, port: int, out: str, cases: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {}
    for name in cases:
        try:
            results[name] = (CASES[name](rank, world, pathlib.Path(out)) if name in NEEDS_OUT
                             else CASES[name](rank, world))
        except Exception:
            results[name] = {"failed": traceback.format_exc()}
    dist.barrier()  # every rank's part of a checkpoint is written before any rank leaves
    torch.save(results, pathlib.Path(out) / f"fsdp-{world}-rank{rank}.pt")
    os._exit(0)


def run(world: int, cases: list[str], out: pathlib.Path, limit: float = 180.0) -> list[dict]:
    spawn_ranks(_worker, (world, free_port(), str(out), cases), world, cases, limit)
    return [torch.load(out / f"fsdp-{world}-rank{r}.pt", weights_only=False) for r in range(world)]
