"""CPU benchmark of the Python work in ``UpdateEngine.step()`` for resident (device-placed) optimizer
state (issue 13): 672 small bf16 tensors (the LoRA count of a 48-block Qwen2.5-14B), no hooks.

The device path needs CUDA, so this STUBS it (tools/bench/_fake_cuda.py): ``ts_adamw.CudaAdamWBatch``,
``ts_adamw.cuda_adamw_step``, ``torch.cuda.Event``, ``torch.cuda.stream``, ``torch.cuda.device``,
``Tensor.record_stream`` and the channel's stream/event calls are replaced by no-ops that record
launches. What is timed is trainstream's own per-step / per-tensor Python work
(validation, user-edit checks, grouping, argument lists, bookkeeping); the real native call and the
real CUDA event/record_stream calls cost more on a GPU machine and are not included.

    python tools/bench/step_overhead.py                        # this checkout
    python tools/bench/step_overhead.py --baseline <commit>    # that commit's engine, then this one, same run
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(tensors: int, groups: int, steps: int) -> dict:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _fake_cuda

    launches = _fake_cuda.install(setattr, apply=False)
    from trainstream.engine import ParamSlot, UpdateEngine
    from trainstream.engine.slots import SlotState

    class Events:
        def add(self, kind, text):
            pass

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 64, dtype=torch.bfloat16) if i % 2 == 0
                                 else torch.randn(64, 16, dtype=torch.bfloat16)) for i in range(tensors)]
    group_dicts = [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "maximize": False,
                    "params": []} for _ in range(groups)]
    slots = []
    for i, p in enumerate(params):
        g = group_dicts[i * groups // tensors]
        g["params"].append(p)
        slots.append(ParamSlot(param=p, index=i, group=g, name=f"p{i}"))
    engine = UpdateEngine(slots, torch.device("cpu"), torch.float32, None, Events(), max_grad_norm=None,
                          accumulation_steps=1, seed=0, guard_params=True, placement="device", step_hook=None)
    engine.channel = _fake_cuda.FakeChannel(torch.device("cpu"))
    for s in slots:
        engine.activate(s)
    assert all(s.placement == "device" and s.hook is None and s.state is SlotState.IDLE for s in slots)
    grads = [torch.randn_like(p) for p in params]
    times = []
    for _ in range(steps + 3):
        for p, g in zip(params, grads):
            p.grad = g
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    engine.close()
    times = times[3:]  # warm-up (first launch builds whatever is cached)
    median = statistics.median(times)
    return {"median_ms": median * 1e3, "min_ms": min(times) * 1e3, "per_tensor_us": median / tensors * 1e6,
            "launches_per_step": len(launches) / (steps + 3), "tensors": tensors, "groups": groups}


def _report(label: str, r: dict) -> str:
    return (f"{label}: step() median {r['median_ms']:.3f} ms, min {r['min_ms']:.3f} ms, "
            f"{r['per_tensor_us']:.2f} us per tensor, {r['launches_per_step']:.1f} launches/step "
            f"({r['tensors']} tensors, {r['groups']} param groups)")


def _run_at(src: str | None, args) -> str:
    """This script in a fresh interpreter, importing trainstream from `src` (None: the installed one)."""
    env = dict(os.environ)
    command = [sys.executable, os.path.abspath(__file__), "--tensors", str(args.tensors), "--steps",
               str(args.steps), "--groups", str(args.groups), "--child"]
    if src is not None:
        command += ["--src", src]
    return subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=672)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--baseline", help="a git commit: time its engine first, in the same run")
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.src:
            sys.path.insert(0, args.src)
            # The editable install's finder would win over sys.path: drop it for this process.
            sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable_skbc_")]
            for name in [m for m in sys.modules if m.startswith("trainstream")]:
                del sys.modules[name]
        import trainstream
        where = os.path.dirname(trainstream.__file__)
        if args.src:
            assert where.startswith(args.src), f"imported {where}, not {args.src}"
        print(_report(where, measure(args.tensors, args.groups, args.steps)))
        return
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "packages/trainstream/src/trainstream/engine"],
                           capture_output=True, text=True).stdout.strip()
    print(f"# step_overhead.py  {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print(f"# machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}")
    print(f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print("# STUBBED (no-ops): ts_adamw.CudaAdamWBatch.step/cuda_adamw_step, torch.cuda.Event/stream/device, Tensor.record_stream, "
          "the channel's stream waits. Timed: trainstream's Python work in UpdateEngine.step().")
    if args.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            archive = os.path.join(tmp, "src.tar")
            subprocess.run(["git", "-C", REPO, "archive", "-o", archive, args.baseline,
                            "packages/trainstream/src/trainstream"], check=True)
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            line = _run_at(os.path.join(tmp, "packages/trainstream/src"), args)
        print(f"before ({args.baseline}): {line.split(': ', 1)[1]}")
    line = _run_at(None, args)
    print(f"after ({head}{' + uncommitted' if dirty else ''}): {line.split(': ', 1)[1]}")


if __name__ == "__main__":
    main()
