"""TrainStreamTrainer and TRL's SFT trainer under torchrun with 2 processes (gloo, CPU) equal the stock ones:
the same logged loss and gradient norm, the same weights. Before: the chunked loss skipped the x processes the
stock Trainer applies with average_tokens_across_devices=True (the default), so the loss and norm were 1/2."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(script: str, out) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(_port()),
                           str(pathlib.Path(__file__).with_name(script)), str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_trainstream_trainer_in_two_processes_equals_the_stock_trainer(tmp_path):
    _torchrun("trainer_processes.py", tmp_path)
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        stock = result["stock"]
        assert all(norm > 0.5 for norm in stock["grad_norm"])  # clipping was active
        # The chunked loss calls the decoder past DDP's forward (DDP then reduces nothing); the model's own
        # loss runs inside it, and the event says that the gradients are averaged twice.
        for key, inside_ddp in (("ours", False), ("ours_model_loss", True)):
            ours = result[key]
            assert stock["world"] == ours["world"] == 2
            assert len(ours["loss"]) == len(stock["loss"]) == 3
            assert ours["loss"] == pytest.approx(stock["loss"], rel=1e-5), key  # before: half of it
            assert ours["grad_norm"] == pytest.approx(stock["grad_norm"], rel=1e-5), key
            assert any("inside DistributedDataParallel" in e for e in ours["events"]) == inside_ddp, key
            for name, value in stock["weights"].items():  # host AdamW's and the chunked loss's rounding, 3 steps
                torch.testing.assert_close(ours["weights"][name], value, rtol=0, atol=1e-4, msg=f"{key}: {name}")


def test_trl_sft_in_two_processes_equals_the_stock_trl_trainer(tmp_path):
    """LoRA on every linear layer, clipping below the gradient norm, 2 micro-batches per step, 3 steps."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    _torchrun("trl_processes.py", tmp_path)
    results = [torch.load(tmp_path / f"trl-rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    for result in results:
        stock, ours = result["stock"], result["ours"]
        assert stock["world"] == ours["world"] == 2
        assert len(ours["loss"]) == len(stock["loss"]) == 3
        assert all(norm > 0.05 for norm in stock["grad_norm"])  # clipping was active
        assert ours["loss"] == pytest.approx(stock["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(stock["grad_norm"], rel=1e-5)
        assert ours["adapters"].keys() == stock["adapters"].keys() and len(ours["adapters"]) > 2
        for name, value in stock["adapters"].items():
            torch.testing.assert_close(ours["adapters"][name], value, rtol=0, atol=1e-5, msg=name)
    for name, value in results[0]["ours"]["adapters"].items():  # the ranks agree
        assert torch.equal(results[1]["ours"]["adapters"][name], value), name
