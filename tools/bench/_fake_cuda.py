"""Fake CUDA for the fused device update of trainstream's engine, so its Python side runs on a CPU.

``install(setattr_, apply=...)`` replaces (through ``setattr_``: pytest's ``monkeypatch.setattr`` or the
builtin ``setattr``) ``torch.cuda.Event``/``stream``/``device`` and ``Tensor.record_stream`` by no-ops,
and ``ts_adamw.CudaAdamWBatch`` / ``ts_adamw.cuda_adamw_step`` by recorders: each launch appends
``{"count", "keys", lr, beta1, ..., step}`` to the returned list and, with ``apply=True``, runs
ts-adamw's host step per tensor with the same arguments. ``FakeChannel`` stands in for the engine's
CudaChannel (no streams, no events). Used by tools/bench/step_overhead.py and by
packages/trainstream/tests/test_engine_fused_step.py.
"""

from __future__ import annotations

import contextlib

import torch
import ts_adamw

REAL_ADAMW_STEP = ts_adamw.adamw_step


class FakeEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


class FakeStream:
    cuda_stream = 0

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class FakeChannel:
    is_cuda = True

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cpu")
        self.optimizer = FakeStream()

    def mark_compute(self):
        return FakeEvent()

    def compute_wait(self, token):
        pass

    def host_wait(self, token):
        pass

    def order_compute_after(self, marks, sequence, wait_applied, event=None):
        wait_applied(sequence)

    def synchronize(self):
        pass


def install(setattr_, *, apply: bool) -> list[dict]:
    """Installs the fakes; returns the list every launch is recorded in."""
    seen: list[dict] = []

    def launch(params, grads, exp_avgs, exp_avg_sqs, params_out, keys, offsets, seed, kwargs):
        keys = list(keys or range(len(params)))
        offsets = list(offsets or [0] * len(params))
        seen.append({"count": len(params), "keys": keys, "offsets": offsets, **kwargs})
        if apply:
            outs = params_out or [None] * len(params)
            for p, g, m, v, out, key, offset in zip(params, grads, exp_avgs, exp_avg_sqs, outs, keys, offsets):
                REAL_ADAMW_STEP(p, g.detach().reshape(-1), m, v, param_out=out, seed=seed, key=key, offset=offset,
                                **kwargs)

    def cuda_adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, params_out=None, stream=None, keys=None,
                        offsets=None, seed=0, **kwargs):
        launch(params, grads, exp_avgs, exp_avg_sqs, params_out, keys, offsets, seed, kwargs)

    class Batch:
        def __init__(self, params, exp_avgs, exp_avg_sqs, *, params_out=None, keys=None, offsets=None,
                     grad_dtypes=None):
            self.lists = (params, exp_avgs, exp_avg_sqs)
            self.params_out, self.keys, self.offsets = params_out, keys, offsets

        def __len__(self):
            return len(self.lists[0])

        def step(self, grads, *, stream=None, seed=0, **kwargs):
            if len(grads) != len(self):
                raise ValueError(f"CudaAdamWBatch.step: got {len(grads)} gradients for {len(self)} parameters")
            launch(self.lists[0], grads, *self.lists[1:], self.params_out, self.keys, self.offsets, seed, kwargs)

    setattr_(ts_adamw, "cuda_adamw_step", cuda_adamw_step)
    setattr_(ts_adamw, "CudaAdamWBatch", Batch)
    setattr_(torch.cuda, "Event", FakeEvent)
    setattr_(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    setattr_(torch.cuda, "device", lambda device: contextlib.nullcontext())
    setattr_(torch.Tensor, "record_stream", lambda self, stream: None)
    return seen
