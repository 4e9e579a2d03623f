"""guard_params=False: a forward orders itself after the upload of the update it waited for, not an older one.

The worker sets a slot's ``upload_event`` when it applies the update and launches the upload; a forward that
finds the update still queued must read the event after waiting for it. Reading it before (the previous
step's upload) let a forward on a GPU read a weight while its new upload was still landing: a load-dependent
difference from the resident run (test_weights_trained_cuda.py, under parallel tests)."""

from __future__ import annotations

import torch
import trainstream


class _Recorder:
    """A CUDA-like channel that records which event each ordering waited on."""

    is_cuda = True

    def __init__(self):
        self.waited_on = []

    def order_compute_after(self, marks, sequence, wait_applied, event=None):
        wait_applied(sequence)
        self.waited_on.append((sequence, event))


def test_a_forward_waits_on_the_upload_of_the_update_it_waited_for(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model, _opt = trainstream.wrap(model, lr=1e-2, guard_params=False, optimizer_mode="cpu", offload=True)
    try:
        engine = model._trainstream_session.engine
        slot = engine.slots[0]
        slot.written, slot.upload_event = 7, "upload of the previous step"

        def worker_applies(sequence):  # what the host worker does before wait_applied returns
            slot.upload_event = f"upload of update {sequence}"

        recorder = _Recorder()
        monkeypatch.setattr(engine.host, "wait_applied", worker_applies)
        monkeypatch.setattr(engine, "channel", recorder)
        engine.order_after(slot)
        assert recorder.waited_on == [(7, "upload of update 7")]
        assert slot.written is None
    finally:
        monkeypatch.undo()
        trainstream.unwrap(model)
