"""Helpers for the data-parallel tests: a small model, the global batches, a runner that spawns gloo
ranks with bounded time, and the scenarios each rank runs (results saved as one .pt file per rank)."""

from __future__ import annotations

import datetime
import gc
import os
import pathlib
import socket
import time
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOBAL = 12  # samples per micro-batch of the global batch: divisible by 1, 2 and 3 ranks
STEPS = 5
SAVE_AT = 3
_DEVICE = "cpu"  # where the ranks' models live (set per rank by _worker)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # eps=1e-4: with the default 1e-8, an element whose gradient is near zero at the first step moves by
    # +-lr depending on float noise, so stock AdamW fed the same global gradient summed in another order
    # (2 half batches) already differs by 1.3e-5 after 5 steps with accumulation; at 1e-4 by < 4e-7.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)


def global_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(GLOBAL, 8, generator=g), torch.randn(GLOBAL, 4, generator=g)


def local_batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, micro)
    n = GLOBAL // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def train_steps(model, optimizer, steps, rank: int, world: int, accumulation: int = 1, start: int = 0,
                clip: float | None = None, on_step=None, after_backward=None) -> None:
    """`steps` optimizer steps on this rank's share of the global batches. `clip`: torch's clipping
    (for a stock optimizer); a wrapped one clips itself. `after_backward(step)`: before each step()."""
    device = next(model.parameters()).device
    for step in range(start, steps):
        for micro in range(accumulation):
            x, y = (t.to(device) for t in local_batch(step, micro, rank, world))
            loss = torch.nn.functional.mse_loss(model(x), y) / accumulation
            loss.backward()
        if after_backward is not None:
            after_backward(step)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if on_step is not None:
            on_step(step + 1)


class Branchy(torch.nn.Module):
    """make_model() and a branch that only some samples take (``BRANCH_TAKEN``): at step 1 only rank
    0's share takes it (no gradient for it on the other ranks), at step 3 no sample does (none anywhere)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.net = make_model(seed)
        self.branch = torch.nn.Linear(8, 4)

    def forward(self, x, take):
        out = self.net(x)
        if take.numel():
            out = out.index_add(0, take, self.branch(x[take]))
        return out


BRANCH_TAKEN = {1: [0, 1], 3: []}  # the global samples that take the branch at a step (otherwise all)


def branch_run(model, optimizer, rank: int, world: int, on_step=None) -> None:
    n = GLOBAL // world
    device = next(model.parameters()).device
    for step in range(STEPS):
        x, y = (t.to(device) for t in local_batch(step, 0, rank, world))
        taken = BRANCH_TAKEN.get(step, range(GLOBAL))
        take = torch.tensor([i - rank * n for i in taken if rank * n <= i < (rank + 1) * n], dtype=torch.long,
                            device=device)
        torch.nn.functional.mse_loss(model(x, take), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if on_step is not None:
            on_step(step + 1)


def discard_run(model, optimizer, rank: int, world: int, on_step=None, discard=None) -> None:
    """Accumulation over 2 backward passes; at step 2 a backward first, dropped by zero_grad()
    (then `discard()`, what the engine's discard() is to call)."""
    for step in range(STEPS):
        if step == 2:
            x, y = local_batch(step, 7, rank, world)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.zero_grad()
            if discard is not None:
                discard()
        train_steps(model, optimizer, step + 1, rank, world, accumulation=2, start=step, on_step=on_step)


HAND_SET_STEPS = 7


def hand_set(model, step: int) -> None:
    """Gradients changed by hand between backward and step(): in place at step 2, replaced at step 5
    (both while the reductions started during backward are armed)."""
    if step == 2:
        model[0].weight.grad.mul_(0.5)
    elif step == 5:
        model[2].bias.grad = model[2].bias.grad * 2


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


# ---- scenarios (run on every rank) ------------------------------------------------------------

def _train(rank, world, out, *, clip=None, accumulation=1, save=False, resume=None, with_model=True,
           overlap=True, resume_dcp=None):
    import trainstream
    import trainstream.distributed

    model = make_model(seed=rank).to(_DEVICE)  # rank 0's weights reach every rank at wrap()
    model, optimizer = trainstream.wrap(model, make_optimizer(model), max_grad_norm=clip,
                                        accumulation_steps=accumulation, threads=1)
    model._trainstream_session.engine.step_hook.overlap = overlap
    start = 0
    if resume is not None:
        saved = torch.load(resume, weights_only=True)
        if with_model:
            model.load_state_dict(saved["model"])  # else the weights come from the owners' saved masters
        optimizer.load_state_dict(saved["optimizer"])
        start = SAVE_AT
    if resume_dcp is not None:  # the sharded checkpoint: each rank reads only the state it owns
        trainstream.distributed.load_checkpoint(model, optimizer, resume_dcp)
        start = SAVE_AT

    def on_step(done):
        if save and done == SAVE_AT:
            state = {"model": weights(model), "optimizer": optimizer.state_dict()}  # collective
            if rank == 0:
                torch.save(state, out / "checkpoint-2ranks.pt")
            trainstream.distributed.save_checkpoint(model, optimizer, out / "dcp-2ranks")  # collective, sharded

    train_steps(model, optimizer, STEPS, rank, world, accumulation, start, on_step=on_step)
    report = trainstream.memory_report(model)
    result = {"weights": weights(model), "optimizer": report["optimizer"],
              "distributed": trainstream.distributed.report(model._trainstream_session.engine),
              "owned": [s.index for s in model._trainstream_session.engine.active],
              "spans": {s.index: s.span for s in model._trainstream_session.engine.active},
              "report_distributed": report.get("distributed"),
              "host_state_bytes": model._trainstream_session.host_state_bytes,
              "events": report["events"]}
    dp = model._trainstream_session.engine.step_hook
    session = weakref.ref(model._trainstream_session)
    gc.disable()  # unwrap() leaves no cycle: the session is gone when it returns (test_unwrap_release.py)
    try:
        trainstream.unwrap(model)
        result["session_freed"] = session() is None
    finally:
        gc.enable()
    calls = dp.comm.calls
    x, y = (t.to(_DEVICE) for t in local_batch(0, 0, rank, world))
    torch.nn.functional.mse_loss(model(x), y).backward()  # unwrapped: no reduction starts
    result["calls_after_unwrap"] = dp.comm.calls - calls
    return result


def unfreeze_run(model, optimizer, rank: int, world: int) -> None:
    """The last linear's weight frozen for 2 steps (in the optimizer all along), then trained."""
    model[4].weight.requires_grad_(False)
    train_steps(model, optimizer, 2, rank, world)
    model[4].weight.requires_grad_(True)
    train_steps(model, optimizer, STEPS, rank, world, start=2)


def _dp(model):
    return model._trainstream_session.engine.step_hook


def _overlap_run(rank, world, out, *, what):
    """The overlap's fallback cases, with 512-byte buckets (several per rank); the overlap counters
    of every step in ``"per_step"``."""
    import trainstream

    model = (Branchy(seed=rank) if what == "unused" else make_model(seed=rank)).to(_DEVICE)
    model, optimizer = trainstream.wrap(model, make_optimizer(model), threads=1,
                                        accumulation_steps=2 if what in ("mid_window", "discard") else 1)
    dp = _dp(model)
    dp.bucket_bytes = 512
    per_step = []

    def on_step(done):
        per_step.append(dp.report()["overlap"]["last_step"])

    if what == "unused":
        branch_run(model, optimizer, rank, world, on_step=on_step)
    elif what == "discard":
        discard_run(model, optimizer, rank, world, on_step=on_step, discard=dp.discard)
    elif what == "mid_window":  # accumulation_steps=2 declared, step() after every backward
        train_steps(model, optimizer, STEPS, rank, world, on_step=on_step)
    else:
        train_steps(model, optimizer, HAND_SET_STEPS, rank, world, on_step=on_step,
                    after_backward=lambda step: hand_set(model, step))
    result = {"weights": weights(model), "per_step": per_step, "report": dp.report(),
              "events": trainstream.memory_report(model)["events"]}
    trainstream.unwrap(model)
    return result


def _rewrap(rank, world, out):
    """Unwrapped after 2 steps and wrapped again: the first wrap's hooks start no reduction any more."""
    import trainstream

    model = make_model(seed=rank)
    optimizer = make_optimizer(model)
    model, optimizer = trainstream.wrap(model, optimizer, threads=1)
    first = _dp(model)
    train_steps(model, optimizer, 2, rank, world)
    x, y = local_batch(99, 0, rank, world)
    torch.nn.functional.mse_loss(model(x), y).backward()  # its reductions start, then close() waits for them
    started = first.report()["overlap"]["armed"] and first._eager.in_backward
    first.close()  # what the engine's close() is to call
    optimizer.zero_grad()
    trainstream.unwrap(model)
    calls = first.comm.calls
    model, optimizer = trainstream.wrap(model, optimizer, threads=1)
    train_steps(model, optimizer, STEPS, rank, world, start=2)
    result = {"weights": weights(model), "first_calls_after_unwrap": first.comm.calls - calls,
              "started_before_close": started, "armed_after_close": first.report()["overlap"]["armed"],
              "second": _dp(model).report()["overlap"]}
    trainstream.unwrap(model)
    return result


def _unfreeze(rank, world, out):
    import trainstream

    model = make_model(seed=rank)
    model[4].weight.requires_grad_(False)  # frozen at wrap(): its slot starts DORMANT on every rank
    model, optimizer = trainstream.wrap(model, make_optimizer(model), threads=1)
    unfreeze_run(model, optimizer, rank, world)
    owned = [s.index for s in model._trainstream_session.engine.active]
    result = {"weights": weights(model), "owned": owned}
    trainstream.unwrap(model)
    return result


def _forced_off(rank, world, out):
    import trainstream

    model = make_model(seed=rank)
    model, optimizer = trainstream.wrap(model, make_optimizer(model), threads=1, distributed=False)
    train_steps(model, optimizer, STEPS, rank, world)
    result = {"weights": weights(model), "has_report": "distributed" in trainstream.memory_report(model)}
    trainstream.unwrap(model)
    return result


def _mismatch(rank, world, out, *, what):
    import trainstream

    model = make_model()
    options = {"threads": 1}
    if rank == world - 1:
        if what == "shape":
            model[4] = torch.nn.Linear(16, 5)
        else:
            options["max_grad_norm"] = 1.0
    try:
        model, _ = trainstream.wrap(model, make_optimizer(model), **options)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    trainstream.unwrap(model)
    return {"error": None}


def _rank_dies(rank, world, out):
    import trainstream

    model = make_model()
    model, optimizer = trainstream.wrap(model, make_optimizer(model), threads=1)
    if rank == world - 1:
        return {"exit": True}
    started = time.monotonic()
    try:
        train_steps(model, optimizer, 1, rank, world)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started}
    return {"error": None}


def _skips_step(rank, world, out):
    """The last rank skips step() at step 2 (an exception caught around it): every rank's next step()
    refuses with each rank's step and count of training forwards, at once, instead of pairing steps 2 and 3."""
    import trainstream

    model = make_model()
    model, optimizer = trainstream.wrap(model, make_optimizer(model), threads=1)
    started = time.monotonic()
    try:
        for step in range(4):
            x, y = local_batch(step, 0, rank, world)
            torch.nn.functional.mse_loss(model(x), y).backward()
            if not (rank == world - 1 and step == 1):
                optimizer.step()
            optimizer.zero_grad()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started, "exit": True}
    return {"error": None, "exit": True}


STALL_S = 15.0  # how long the stalled rank sleeps: far beyond the test's timeout, so a wait on it shows


def _rank_stalls(rank, world, out, **options):
    """The last rank stops answering (alive, asleep); the others raise at trainstream's timeout, then
    unwrap and destroy the process group well before the stalled rank wakes (or the group's own timeout)."""
    import trainstream
    import trainstream.distributed as tsd

    model = make_model()
    model, optimizer = trainstream.wrap(model, make_optimizer(model), threads=1, **options)
    if rank == world - 1:
        time.sleep(STALL_S)
        return {"exit": True}
    started = time.monotonic()
    try:
        train_steps(model, optimizer, 1, rank, world)
        error = None
    except tsd.DistributedError as raised:
        error = f"{type(raised).__name__}: {raised}"
    raised_at = time.monotonic() - started
    try:
        optimizer.state_dict()  # a collective on the failed group: refused at once
        again = None
    except tsd.DistributedError as raised:
        again = str(raised)
    again_s = time.monotonic() - started - raised_at
    started = time.monotonic()
    trainstream.unwrap(model)
    dist.destroy_process_group()
    return {"error": error, "raised_s": raised_at, "again": again, "again_s": again_s,
            "teardown_s": time.monotonic() - started}


def as_reduced(grad: torch.Tensor, world: int) -> torch.Tensor:
    """What data parallel makes of `grad` when every rank has it: the reduction's sum, then its division."""
    total = grad
    for _ in range(world - 1):
        total = total + grad
    return total / world


def _bf16_moments(rank, world, out):
    """bf16 moments (stochastically rounded) under data parallel, a cut inside a parameter, against one process
    (``distributed=False``, in this process). Every rank trains on the whole global batch and the one-process
    run's gradients get the reduction's arithmetic (a tensor hook: ``as_reduced``), so both runs update with the
    same gradient bits: any difference is the optimizer's, e.g. a piece rounding with its parameter's bits from
    element 0 instead of from its first value."""
    import trainstream

    runs = {}
    for distributed in (True, False):
        model = make_model()
        if not distributed:
            for p in model.parameters():
                p.register_hook(lambda grad: as_reduced(grad, world))
        model, optimizer = trainstream.wrap(model, make_optimizer(model), threads=1, moment_dtype="bfloat16",
                                            distributed=distributed)
        for step in range(STEPS):
            x, y = global_batch(step, 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        state = optimizer.state_dict()["state"]  # a collective under data parallel: the pieces joined
        runs["dp" if distributed else "alone"] = {
            "weights": weights(model),
            "state": {i: {k: v.clone() for k, v in fields.items() if torch.is_tensor(v)} for i, fields in state.items()},
            "spans": {s.index: s.span for s in model._trainstream_session.engine.active}}
        trainstream.unwrap(model)
    return runs


ATTENTION_TABLES = ({"flash": 1.0, "math": 2.0}, {"flash": 3.0, "math": 1.0})  # alone: rank 0 flash, rank 1 math


def _attention_agree(rank, world, out):
    """attention='auto' under data parallel, each rank timing the kernels differently (fake timers)."""
    import trainstream
    from test_attention import Attention, fake_timer

    model = Attention().to(_DEVICE)
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), threads=1,
                                        attention="auto")
    model._trainstream_session.attention.timer = fake_timer(ATTENTION_TABLES[rank % 2])
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(2, 8, 32, generator=g).to(_DEVICE)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    report = trainstream.memory_report(model)
    result = {"attention": report["attention"], "last": model.last,
              "events": [e for e in report["events"] if "under data parallel" in e]}
    trainstream.unwrap(model)
    return result


SCENARIOS = {
    "plain": lambda r, w, o: _train(r, w, o, save=w == 2),
    "clip": lambda r, w, o: _train(r, w, o, clip=0.05),
    "accumulate": lambda r, w, o: _train(r, w, o, accumulation=2),
    "accumulate_clip": lambda r, w, o: _train(r, w, o, clip=0.05, accumulation=2),
    "no_overlap": lambda r, w, o: _train(r, w, o, clip=0.05, accumulation=2, overlap=False),
    "unused": lambda r, w, o: _overlap_run(r, w, o, what="unused"),
    "mid_window": lambda r, w, o: _overlap_run(r, w, o, what="mid_window"),
    "hand_set": lambda r, w, o: _overlap_run(r, w, o, what="hand_set"),
    "discard": lambda r, w, o: _overlap_run(r, w, o, what="discard"),
    "resume": lambda r, w, o: _train(r, w, o, resume=o / "checkpoint-2ranks.pt"),
    "resume_optimizer_only": lambda r, w, o: _train(r, w, o, resume=o / "checkpoint-2ranks.pt", with_model=False),
    "resume_dcp": lambda r, w, o: _train(r, w, o, resume_dcp=o / "dcp-2ranks"),
    "resume_dcp_alone": lambda r, w, o: _train(r, w, o, resume_dcp=o / "dcp-1process"),
    "rewrap": _rewrap,
    "attention_agree": _attention_agree,
    "bf16_moments": _bf16_moments,
    "unfreeze": _unfreeze,
    "forced_off": _forced_off,
    "mismatch_shape": lambda r, w, o: _mismatch(r, w, o, what="shape"),
    "mismatch_settings": lambda r, w, o: _mismatch(r, w, o, what="settings"),
    "skips_step": _skips_step,  # alone: it fails the group
    "rank_dies": _rank_dies,  # last: it ends the process group
    "rank_stalls": _rank_stalls,  # alone: it destroys the process group
    "rank_stalls_option": lambda r, w, o: _rank_stalls(r, w, o, distributed_timeout=1.5),  # alone, as above
}


def _worker(rank: int, world: int, port: int, out: str, scenarios: list[str], timeout: float, backend: str,
            device: str) -> None:
    global _DEVICE
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import trainstream.distributed as tsd

    tsd.DEFAULT_TIMEOUT_S = timeout
    # NCCL: one GPU per rank; gloo with device="cuda": every rank on the one GPU (host collectives).
    _DEVICE = f"cuda:{rank}" if backend == "nccl" else ("cuda:0" if device == "cuda" else device)
    if _DEVICE.startswith("cuda"):
        torch.cuda.set_device(torch.device(_DEVICE))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    out = pathlib.Path(out)
    results = {}
    for name in scenarios:
        try:
            results[name] = SCENARIOS[name](rank, world, out)
        except Exception:
            results[name] = {"failed": traceback.format_exc()}
        if results[name].get("exit"):
            break
    torch.save(results, out / f"results-{world}-rank{rank}.pt")
    os._exit(0)  # no process-group teardown: after rank_dies it could wait on the dead rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, args: tuple, world: int, what, limit: float) -> None:
    """Runs ``worker(rank, *args)`` on ``world`` spawned ranks and waits for all; TimeoutError naming ``what``
    after ``limit`` s; no rank outlives the call."""
    ctx = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + limit
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish {what} within {limit} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def run_ranks(world: int, scenarios: list[str], out: pathlib.Path, limit: float = 120.0, timeout: float = 10.0,
              backend: str = "gloo", device: str = "cpu") -> list[dict]:
    """Runs `scenarios` on `world` spawned ranks; each rank's results (killed after `limit` s)."""
    spawn_ranks(_worker, (world, free_port(), str(out), scenarios, timeout, backend, device), world, scenarios, limit)
    return [torch.load(out / f"results-{world}-rank{r}.pt", weights_only=False) for r in range(world)]
