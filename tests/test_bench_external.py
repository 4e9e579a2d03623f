"""tools/bench/_external_engines.py: compare.py's DeepSpeed ZeRO-2/3, trainstream 0.4.1 and Unsloth engines.

CI has none of the three packages: there each engine's outcome must be its precise reason. The reference's
isolation (its own prefix, first on the engine process's path) is checked with a fake prefix. Where
DeepSpeed is importable (not in CI) its two engines also train a few CPU steps (DS_ACCELERATOR=cpu, gloo).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "bench"
sys.path.insert(0, str(BENCH))
import _compare_engines  # noqa: E402
import _external_engines as ext  # noqa: E402

TINY = dict(size="tiny", batch=2, seq=64, vram_gb=None, steps=3)
LORA_TINY = dict(size="lora-tiny", lora=True, batch=2, seq=64, vram_gb=None, steps=3)
CPU = torch.device("cpu")


def _never_built(host: bool):
    raise AssertionError("an unavailable engine built its model")


def _outcome(engine: str, scenario: dict) -> str:
    with pytest.raises(_compare_engines.EngineUnavailable) as caught:
        ext.setup_external(engine, scenario, CPU, torch.float32, {}, _never_built)
    return str(caught.value)


# --- DeepSpeed configs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine, stage", [("deepspeed-zero2", 2), ("deepspeed-zero3", 3)])
def test_deepspeed_configs_are_what_the_docstring_says(engine, stage):
    with open(ext.DEEPSPEED_CONFIGS[engine]) as f:
        config = json.load(f)
    zero = config["zero_optimization"]
    assert zero["stage"] == stage
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ("offload_param" in zero) == (stage == 3)
    if stage == 3:
        assert zero["offload_param"]["device"] == "cpu"
    assert zero["overlap_comm"] and zero["contiguous_gradients"]
    assert config["bf16"] == {"enabled": True}
    assert config["gradient_clipping"] == 0.0  # off
    assert config["optimizer"]["type"] == "AdamW" and config["optimizer"]["params"]["torch_adam"] is False
    assert config["train_micro_batch_size_per_gpu"] is None  # filled from the scenario


@pytest.mark.parametrize("engine", ["deepspeed-zero2", "deepspeed-zero3"])
def test_micro_batch_and_learning_rate_come_from_the_scenario(engine):
    full = ext.deepspeed_config(engine, {**TINY, "batch": 4})
    lora = ext.deepspeed_config(engine, {**LORA_TINY, "batch": 1})
    assert (full["train_micro_batch_size_per_gpu"], lora["train_micro_batch_size_per_gpu"]) == (4, 1)
    assert full["optimizer"]["params"]["lr"] == 1e-5 and lora["optimizer"]["params"]["lr"] == 1e-4  # as stock
    assert full["gradient_accumulation_steps"] == 1
    assert full["zero_optimization"]["stage"] == (2 if engine.endswith("2") else 3)
    with open(ext.DEEPSPEED_CONFIGS[engine]) as f:
        assert json.load(f)["train_micro_batch_size_per_gpu"] is None  # the file itself is left alone


def test_single_process_env_fills_only_what_is_unset():
    env = {"MASTER_PORT": "29999", "RANK": "0"}
    ext.single_process_env(env)
    assert env == {"MASTER_PORT": "29999", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "1",
                   "LOCAL_RANK": "0"}
    fresh: dict = {}
    ext.single_process_env(fresh)
    assert 0 < int(fresh["MASTER_PORT"]) < 65536


def test_the_deepspeed_shims_route_backward_and_step_through_the_engine():
    calls = []

    class Engine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.module.config = "hf-config"

        def forward(self, x):
            calls.append("forward")
            return self.module(x)

        def backward(self, loss):
            calls.append("backward")

        def step(self):
            calls.append("step")

    engine = Engine()
    model, opt = ext.DeepSpeedModel(engine), ext.DeepSpeedStep(engine)
    assert model.config == "hf-config" and len(list(model.parameters())) == 2
    model(torch.ones(1, 2))
    opt.backward(torch.zeros(()))
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert calls == ["forward", "backward", "step"]


# --- without the packages ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["deepspeed-zero2", "deepspeed-zero3"])
@pytest.mark.parametrize("scenario", [TINY, LORA_TINY])
def test_without_deepspeed_the_outcome_says_so(monkeypatch, engine, scenario):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # find_spec then answers None, as when not installed
    assert _outcome(engine, scenario) == "deepspeed is not installed"


def test_without_unsloth_the_outcome_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "unsloth", None)
    assert _outcome("unsloth", LORA_TINY) == "unsloth is not installed"
    assert _outcome("unsloth", TINY) == "not applicable: unsloth runs LoRA scenarios only"


def test_an_unsloth_that_fails_to_import_gives_its_words(monkeypatch, tmp_path):
    (tmp_path / "unsloth").mkdir()
    (tmp_path / "unsloth" / "__init__.py").write_text("raise NotImplementedError('Unsloth cannot find any GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "unsloth", raising=False)
    assert _outcome("unsloth", LORA_TINY) == "unsloth failed to import: NotImplementedError: Unsloth cannot find any GPU"


def test_without_the_reference_prefix_the_outcome_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.delenv(ext.REFERENCE_ENV, raising=False)
    text = _outcome("reference-0.4.1", TINY)
    assert text.startswith("the reference 0.4.1 is not installed: build its wheel with tools/bench/fetch_external.sh")
    assert "TS_BENCH_REFERENCE_PREFIX" in text
    monkeypatch.setenv(ext.REFERENCE_ENV, str(tmp_path))  # set, but empty
    assert _outcome("reference-0.4.1", LORA_TINY).startswith(f"TS_BENCH_REFERENCE_PREFIX={tmp_path} holds no trainstream")


def test_no_engine_is_left_unwired(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setitem(sys.modules, "unsloth", None)
    monkeypatch.delenv(ext.REFERENCE_ENV, raising=False)
    for engine in ext.EXTERNAL_ENGINES:
        for scenario in (TINY, LORA_TINY):
            assert "not wired" not in _outcome(engine, scenario)
    with pytest.raises(ValueError, match="not an external engine"):
        ext.setup_external("stock-bf16", TINY, CPU, torch.float32, {}, _never_built)


# --- the reference's own prefix ------------------------------------------------------------------------------------


def _fake_prefix(root: pathlib.Path, version: str) -> pathlib.Path:
    (root / "trainstream").mkdir(parents=True)
    (root / "trainstream" / "__init__.py").write_text(f'__version__ = "{version}"\n\n\ndef wrap(model, opt, **kw):\n'
                                                      "    return model, opt\n")
    return root


def test_child_env_puts_the_prefix_first_for_the_reference_only(tmp_path):
    base = {"PYTHONPATH": "/somewhere/else", ext.REFERENCE_ENV: str(tmp_path), "OTHER": "1"}
    env = ext.child_env("reference-0.4.1", base)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/somewhere/else"]
    assert env["OTHER"] == "1" and base["PYTHONPATH"] == "/somewhere/else"  # a copy
    assert ext.child_env("reference-0.4.1", {ext.REFERENCE_ENV: str(tmp_path)})["PYTHONPATH"] == str(tmp_path)
    for engine in ("deepspeed-zero2", "unsloth", "trainstream-lora"):
        assert ext.child_env(engine, base) == base
    assert "PYTHONPATH" not in ext.child_env("reference-0.4.1", {})  # no prefix: nothing to put first


def _child(code: str, env: dict, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_a_child_started_with_child_env_imports_the_reference(tmp_path):
    prefix = _fake_prefix(tmp_path / "ref-site", "0.4.1")
    env = ext.child_env("reference-0.4.1", {**os.environ, ext.REFERENCE_ENV: str(prefix)})
    done = _child("import trainstream; print(trainstream.__file__, trainstream.__version__)", env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(prefix / "trainstream" / "__init__.py"), "0.4.1"]


def test_import_reference_replaces_an_already_imported_trainstream(tmp_path):
    """compare.py's model build imports this repository's trainstream (for its sizes) before the reference."""
    pytest.importorskip("trainstream")
    prefix = _fake_prefix(tmp_path / "ref-site", "0.4.1")
    code = f"""
        import sys
        sys.path.insert(0, {str(BENCH)!r})
        import trainstream as ours
        import _external_engines as ext
        ref = ext.import_reference({str(prefix)!r})
        import trainstream
        print(ours.__file__); print(ref.__file__); print(trainstream is ref)
    """
    done = _child(code, dict(os.environ), tmp_path)  # no child_env: ours comes first on the path
    assert done.returncode == 0, done.stderr
    ours, ref, same = done.stdout.split()
    assert not ours.startswith(str(prefix)) and ref == str(prefix / "trainstream" / "__init__.py") and same == "True"


def test_a_prefix_holding_another_version_is_refused(tmp_path, monkeypatch):
    prefix = _fake_prefix(tmp_path / "ref-site", "0.3.9")
    monkeypatch.setenv(ext.REFERENCE_ENV, str(prefix))
    assert _outcome("reference-0.4.1", LORA_TINY) == f"the trainstream in {prefix} is version 0.3.9, not the reference 0.4.1"
    # The import itself checks too (in a child: it replaces trainstream in the importing process).
    code = f"""
        import sys
        sys.path.insert(0, {str(BENCH)!r})
        import _compare_engines, _external_engines as ext
        try:
            ext.import_reference({str(prefix)!r})
        except _compare_engines.EngineUnavailable as e:
            print("REFUSED", e)
    """
    done = _child(code, ext.child_env("reference-0.4.1", {**os.environ, ext.REFERENCE_ENV: str(prefix)}), tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"REFUSED the trainstream in {prefix.resolve()} is version 0.3.9, not the reference 0.4.1"


def test_the_reference_needs_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv(ext.REFERENCE_ENV, str(_fake_prefix(tmp_path / "ref-site", "0.4.1")))
    assert _outcome("reference-0.4.1", TINY) == "the reference 0.4.1 trains on CUDA only (its wrap() refuses a CPU device)"


# --- DeepSpeed for real, where it is importable (not in CI) --------------------------------------------------------

_DEEPSPEED_RUN = """
import json, sys
sys.path.insert(0, {bench!r})
import torch
import _compare_engines as ce, _external_engines as ext

scenario = json.loads({scenario!r})
device = torch.device("cpu")


def build_model(host):
    if scenario.get("lora") or scenario.get("host"):
        return ce.lora_base(scenario["size"], device=device, dtype=torch.float32, host=host)
    return ce.full_model(scenario["size"], device, torch.float32)


def value(p):  # ZeRO-3 keeps a parameter partitioned (empty) outside its module's forward
    if not hasattr(p, "ds_id"):
        return p.detach().float().clone()
    import deepspeed

    with deepspeed.zero.GatheredParameters([p]):
        return p.detach().float().clone()


info = {{}}
model, opt = ext.setup_external({engine!r}, scenario, device, torch.float32, info, build_model)
watched = [p for p in model.parameters() if p.requires_grad][0]
before = value(watched)
generator = torch.Generator().manual_seed(0)
losses = []
for _ in range(scenario["steps"]):  # compare.py's loop, with the optimizer's backward where it has one
    ids = torch.randint(0, model.config.vocab_size, (scenario["batch"], scenario["seq"]), generator=generator)
    loss = model(input_ids=ids, labels=ids).loss
    opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
print("RESULT " + json.dumps({{"losses": losses, "moved": (value(watched) - before).abs().max().item(),
                              "deepspeed": info["deepspeed"], "trainable": info.get("trainable_values")}}))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (not in CI)")
@pytest.mark.parametrize("engine, scenario", [("deepspeed-zero2", TINY), ("deepspeed-zero3", LORA_TINY)])
def test_deepspeed_trains_a_few_cpu_steps(tmp_path, engine, scenario):
    code = _DEEPSPEED_RUN.format(bench=str(BENCH), scenario=json.dumps(scenario), engine=engine)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)  # the first run JIT-builds DeepSpeedCPUAdam (about 80 s on 2 cores)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[7:])
    assert len(result["losses"]) == 3 and all(0 < x < 20 for x in result["losses"])
    assert result["moved"] > 0  # the CPU AdamW's update reached the model's weights
    assert result["deepspeed"]["stage"] == int(engine[-1])
    assert result["deepspeed"]["basic_optimizer"] == "DeepSpeedCPUAdam"
    if scenario.get("lora"):
        assert result["trainable"] and result["trainable"] < 100_000  # the adapters only
