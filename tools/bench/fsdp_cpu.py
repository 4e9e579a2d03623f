r"""FSDP2 + trainstream against FSDP2 with torch's AdamW, FSDP2 with CPUOffloadPolicy and DDP, on the CPU with gloo,
beside trainstream's own (replicated) data parallel.

Each engine runs as `--world` spawned ranks (fresh processes), alternated in rounds (A B C D A B C D ...). A
run's figure is the median step time of its steps after the warm-up (rank 0's clock; every rank steps in
lockstep), beside each rank's resident memory (psutil) at the end. The model is a Llama-shaped decoder from
transformers' config, each decoder layer and the root sharded by fully_shard(); the global batch is split over
the ranks. On a shared 2-core machine the ranks compete for the cores: the record says where it ran.

    python tools/bench/fsdp_cpu.py --json docs/results/cpu-fsdp-<date>.json       # 3 rounds, 2 ranks
    python tools/bench/fsdp_cpu.py --quick                                         # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _record

ENGINES = ["fsdp2-torch-adamw", "fsdp2-cpu-offload", "fsdp2-trainstream", "ddp-torch-adamw", "dp-trainstream"]
SHAPES = {"default": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=2048),
          "quick": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256)}


def _model(shape: dict) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config)


def _setup(engine: str, model: torch.nn.Module):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if engine == "ddp-torch-adamw":
        model = torch.nn.parallel.DistributedDataParallel(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    if engine == "dp-trainstream":  # the plain model in the process group: trainstream's data parallel
        import trainstream

        return trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    kw = {"offload_policy": CPUOffloadPolicy()} if engine == "fsdp2-cpu-offload" else {}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if engine == "fsdp2-trainstream":
        import trainstream

        return trainstream.wrap(model, opt)
    return model, opt


def _rank(rank: int, world: int, port: int, engine: str, args: dict, out: str) -> None:
    import psutil
    import trainstream  # noqa: F401 (before init_process_group, as trainstream asks)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    result: dict = {"engine": engine, "outcome": "ok"}
    try:
        model, opt = _setup(engine, _model(SHAPES[args["shape"]]))
        g = torch.Generator().manual_seed(rank)
        times, losses = [], []
        for _ in range(args["steps"]):
            ids = torch.randint(0, SHAPES[args["shape"]]["vocab_size"], (args["batch"] // world, args["seq"]), generator=g)
            dist.barrier()
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        kept = times[args["warm"]:]
        session = getattr(model, "_trainstream_session", None)  # trainstream: the host state this rank keeps
        result.update(median_s=statistics.median(kept), steps_s=times, losses=losses,
                      rss_bytes=psutil.Process().memory_info().rss,
                      host_state_bytes=None if session is None else session.host_state_bytes)
    except Exception as e:  # an engine's failure is its outcome
        result.update(outcome=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", median_s=None)
    torch.save(result, pathlib.Path(out) / f"{engine}-rank{rank}.pt")
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_engine(engine: str, world: int, args: dict, limit: float) -> dict:
    """One run: `world` fresh ranks; rank 0's figure with every rank's resident memory."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_rank, args=(world, _free_port(), engine, args, out), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + limit
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    return {"engine": engine, "outcome": f"timed out after {limit:.0f} s", "median_s": None}
        except Exception as e:  # a rank died
            return {"engine": engine, "outcome": f"a rank failed: {' '.join(str(e).split())[:300]}", "median_s": None}
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        ranks = [torch.load(pathlib.Path(out) / f"{engine}-rank{r}.pt", weights_only=False) for r in range(world)]
    first = ranks[0]
    return {**first, "rss_bytes_per_rank": [r.get("rss_bytes") for r in ranks],
            "host_state_bytes_per_rank": [r.get("host_state_bytes") for r in ranks],
            "outcomes": [r["outcome"] for r in ranks]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 round of 4 steps: a smoke run")
    parser.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args(argv)
    settings = (dict(shape="quick", batch=4, seq=32, steps=4, warm=2) if args.quick
                else dict(shape="default", batch=8, seq=128, steps=8, warm=3))
    rounds = 1 if args.quick else args.rounds
    runs: dict[str, list[dict]] = {e: [] for e in args.engines}
    for round_index in range(rounds):
        for engine in args.engines:
            result = run_engine(engine, args.world, settings, limit=300)
            result["round"] = round_index
            runs[engine].append(result)
            print(f"round {round_index + 1} {engine}: {result['outcome']} {result.get('median_s') or ''}", flush=True)
    data = _record.record("cpu-fsdp", f"fsdp-{args.world}ranks{'-quick' if args.quick else ''}", runs, "median_s",
                          rounds, gpu=False, settings={**settings, "world": args.world, "model": SHAPES[settings["shape"]]},
                          machine_note=f"{os.cpu_count()}-core machine, {args.world} gloo ranks sharing it"
                                       + ("; shared 2-core VM (CI class): figures are noisy" if os.cpu_count() == 2 else ""))
    for engine, entry in data["engines"].items():
        s = entry["summary"]
        rss = [max(b for b in r.get("rss_bytes_per_rank") or [] if b) for r in entry["runs"] if any(r.get("rss_bytes_per_rank") or [])]
        print(f"{engine:20s} median {s.get('median', float('nan')):.3f} s over {s['runs']} runs "
              f"(min {s.get('min', float('nan')):.3f}, max {s.get('max', float('nan')):.3f}); "
              f"largest rank RSS {max(rss, default=0) / 2**20:.0f} MiB")
    _record.write(args.json, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
