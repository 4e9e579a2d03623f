"""trainstream.Config: the options grouped by concern, one-to-one with wrap()'s keywords, validated when built;
wrap() with the reference's flat keywords trains exactly as wrap() with the equivalent Config."""

from __future__ import annotations

import dataclasses
import json

import pytest
import trainstream
from trainstream import _config as cfg
from trainstream._options import WrapOptions
from ts_testing import batches, tiny_llama, train

# The keywords the reference documents (../shared/spec: 0.4.1 and 0.6 option tables) that this wrap() has.
REFERENCE = {"optimizer_mode": "cpu", "offload": True, "moment_dtype": "bfloat16", "max_grad_norm": 0.5,
             "accumulation_steps": 2, "threads": 1, "device": "cpu", "check_memory": True, "vram_headroom": 0.2,
             "lr": 2e-3, "seed": 3, "verbose": False, "quantize": None, "activation_offload": [1], "recompute": [0],
             "prefetch_depth": 1, "param_offload": 0.5, "prefer": "exact", "attention": "default"}


def test_the_groups_hold_every_option_once_with_wrap_s_defaults():
    fields = [f.name for f in dataclasses.fields(WrapOptions)]
    assert sorted(cfg.GROUP_OF) == sorted(fields)  # every keyword in exactly one group (a dict: once)
    assert trainstream.Config().options() == WrapOptions().as_dict()
    assert trainstream.Config().changed() == {}


def test_bad_values_are_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match="quantize='fp4' is not valid"):
        trainstream.Config(weights=trainstream.WeightsConfig(quantize="fp4"))
    with pytest.raises(ValueError, match="accumulation_steps=0 is not valid"):
        trainstream.Config(optimizer=trainstream.OptimizerConfig(accumulation_steps=0))
    with pytest.raises(ValueError, match="must be a WeightsConfig"):
        trainstream.Config(weights={"quantize": "nf4"})
    config = trainstream.Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.weights = trainstream.WeightsConfig()


def test_from_dict_takes_flat_keywords_groups_or_both():
    flat = trainstream.Config.from_dict({"quantize": "nf4", "max_grad_norm": 1.0})
    nested = trainstream.Config.from_dict({"weights": {"quantize": "nf4"}, "optimizer": {"max_grad_norm": 1.0}})
    mixed = trainstream.Config.from_dict({"weights": trainstream.WeightsConfig(quantize="nf4"), "max_grad_norm": 1.0})
    assert flat == nested == mixed and flat.changed() == {"quantize": "nf4", "max_grad_norm": 1.0}
    assert trainstream.Config.from_dict(flat.to_dict()) == flat
    assert flat.replace(quantize="int8").weights.quantize == "int8" and flat.weights.quantize == "nf4"
    with pytest.raises(ValueError, match="unknown option 'quantise'"):
        trainstream.Config.from_dict({"quantise": "nf4"})
    with pytest.raises(ValueError, match="it belongs in 'weights'"):
        trainstream.Config.from_dict({"optimizer": {"quantize": "nf4"}})
    with pytest.raises(ValueError, match="given twice"):
        trainstream.Config.from_dict({"quantize": "nf4", "weights": {"quantize": "int8"}})


def test_files_json_and_yaml(tmp_path):
    expected = trainstream.Config.from_dict({"weights": {"quantize": "nf4", "param_offload": [0, 1]},
                                             "activations": {"recompute": True}})
    (tmp_path / "run.json").write_text(json.dumps(expected.to_dict()))
    assert trainstream.Config.from_file(tmp_path / "run.json") == expected
    yaml = pytest.importorskip("yaml")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"weights": {"quantize": "nf4", "param_offload": [0, 1]},
                                                       "recompute": True}))
    assert trainstream.Config.from_file(tmp_path / "run.yaml") == expected
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a mapping"):
        trainstream.Config.from_file(tmp_path / "bad.json")


def _run(**wrap_args) -> tuple[list[float], list]:
    model, opt = trainstream.wrap(tiny_llama(layers=4), **wrap_args)
    losses = train(model, opt, batches(4))
    decisions = [(d["option"], d["value"]) for d in trainstream.memory_report(model)["plan"]["decisions"]]
    trainstream.unwrap(model)
    return losses, decisions


def test_reference_keywords_and_the_equivalent_config_train_alike():
    by_keywords = _run(**REFERENCE)
    by_config = _run(config=trainstream.Config.from_dict(REFERENCE))
    by_dict = _run(config={"optimizer": {k: v for k, v in REFERENCE.items() if cfg.GROUP_OF[k] == "optimizer"},
                           **{k: v for k, v in REFERENCE.items() if cfg.GROUP_OF[k] != "optimizer"}})
    assert by_keywords == by_config == by_dict  # losses bit for bit, the same decisions
    assert by_keywords != _run(lr=2e-3)  # the options matter: the check could fail


def test_keywords_override_the_config_which_overrides_an_offload_adamw_where_it_differs():
    model = tiny_llama()
    config = trainstream.Config.from_dict({"max_grad_norm": 0.5, "accumulation_steps": 2})
    plan = trainstream.plan(model, config=config, accumulation_steps=3)
    assert dict(plan.resolved)["max_grad_norm"] == 0.5 and dict(plan.resolved)["accumulation_steps"] == 3
    opt = trainstream.OffloadAdamW(model.parameters(), lr=1e-3, moment_dtype="bfloat16", max_grad_norm=1.0)
    resolved = dict(trainstream.plan(model, opt, config=config).resolved)
    assert resolved["moment_dtype"] == "bfloat16"  # the Config left it at its default
    assert resolved["max_grad_norm"] == 0.5  # the Config changed it


def test_trainers_take_a_config_or_groups():
    assert cfg.trainer_options(None) == {}
    assert cfg.trainer_options(trainstream.Config.from_dict({"quantize": "nf4"})) == {"quantize": "nf4"}
    assert cfg.trainer_options({"weights": {"quantize": "nf4"}, "chunked_loss": False}) == {
        "quantize": "nf4", "chunked_loss": False}  # the trainer's own keys pass through to it
    with pytest.raises(ValueError, match=r"takes a dict of options or a trainstream\.Config"):
        cfg.trainer_options(["quantize"])


def test_offload_adamw_takes_the_optimizer_group_of_the_config():
    model = tiny_llama()
    config = trainstream.OptimizerConfig(max_grad_norm=0.5, moment_dtype="bfloat16", offload=True)
    opt = trainstream.OffloadAdamW(model.parameters(), lr=1e-3, config=config, accumulation_steps=2)
    assert opt.wrap_options == {"max_grad_norm": 0.5, "moment_dtype": "bfloat16", "offload": True,
                                "accumulation_steps": 2}
    resolved = dict(trainstream.plan(model, opt).resolved)
    assert (resolved["max_grad_norm"], resolved["offload"], resolved["accumulation_steps"]) == (0.5, True, 2)
    with pytest.raises(ValueError, match="the learning rate is OffloadAdamW's lr argument"):
        trainstream.OffloadAdamW(model.parameters(), lr=1e-3, config=trainstream.OptimizerConfig(lr=0.5))
    with pytest.raises(ValueError, match=r"takes a trainstream\.OptimizerConfig"):
        trainstream.OffloadAdamW(model.parameters(), config={"max_grad_norm": 1.0})
