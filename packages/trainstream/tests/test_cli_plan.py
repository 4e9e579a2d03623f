"""`trainstream plan`: the plan from a config alone (no weights, no network), its JSON, exit codes 0 / 3 / 2."""

from __future__ import annotations

import json

import pytest
import torch
from trainstream import cli
from trainstream._plan_cli import plan_main, plan_parser

# Qwen2.5's published config.json fields (the part the planner reads), bundled so no test needs the Hub.
QWEN25 = {
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
REQUIRED = {"fits", "quantize", "moment_dtype", "resident_blocks", "streamed_blocks", "activations",
            "peak_vram_bytes", "host_bytes", "lower_bound_s", "reason"}


@pytest.fixture
def config_dir(tmp_path):
    def make(size: str):
        folder = tmp_path / f"Qwen2.5-{size}"
        folder.mkdir(exist_ok=True)
        fields = {**QWEN25[size], "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                  "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
        (folder / "config.json").write_text(json.dumps(fields))
        return folder

    return make


@pytest.fixture(autouse=True)
def no_models_no_network(monkeypatch):
    """The command reads configs only: building any module, or reaching the Hub, fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("trainstream plan built a module")

    monkeypatch.setattr(torch.nn.Module, "__init__", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)


def _run(argv, capsys) -> tuple[int, str]:
    code = cli.main(["plan", *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize(("size", "train", "fits"), [
    ("1.5b", ["--full"], True), ("7b", ["--full"], True), ("14b", ["--lora", "16"], True),
    ("32b", ["--lora-rank", "16"], True), ("32b", ["--full"], False)])
def test_plans_for_the_qwen_shapes(config_dir, capsys, size, train, fits):
    code, out = _run([str(config_dir(size)), *train, "--vram-gb", "24", "--host-gb", "128", "--json"], capsys)
    plan = json.loads(out)
    assert set(plan) >= REQUIRED and {"compute", "link", "host_optimizer", "total"} <= set(plan["lower_bound_s"])
    assert code == (0 if fits else cli.PLAN_EXIT_REFUSED) and plan["fits"] is fits
    assert plan["resident_blocks"] + plan["streamed_blocks"] == QWEN25[size]["num_hidden_layers"]
    assert sum(plan["activations"].values()) == QWEN25[size]["num_hidden_layers"]
    if fits:
        assert plan["peak_vram_bytes"] <= plan["budget"]["usable_vram_bytes"] <= 24 * 2**30  # --vram-gb 24: GiB
        assert plan["host_bytes"] <= 128e9
    else:
        assert plan["reason"].startswith("no plan fits") and "host RAM" in plan["reason"]


def test_the_sources_agree_and_the_table_is_printed(config_dir, capsys, monkeypatch):
    folder = config_dir("14b")
    outputs = []
    for source in ([str(folder)], ["--config", str(folder / "config.json")], ["--size", "14b"]):
        code, out = _run([*source, "--lora", "16", "--vram-gb", "24", "--host-gb", "100", "--json"], capsys)
        outputs.append({k: v for k, v in json.loads(out).items() if k != "model"})
    assert outputs[0] == outputs[1] == outputs[2]
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(**QWEN25["14b"])
    seen = []
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda name, **kw: seen.append(name) or config)
    code, out = _run(["Qwen/Qwen2.5-14B", "--lora", "16", "--vram-gb", "24", "--host-gb", "100"], capsys)
    assert seen == ["Qwen/Qwen2.5-14B"] and code == 0
    assert out.startswith("trainstream plan: Qwen/Qwen2.5-14B") and "\nfits: " in out
    for line in ("frozen_weights", "output_and_loss", "lower bound", "blocks resident"):
        assert line in out


def test_a_refusal_exits_3_and_says_why(capsys):
    code, out = _run(["--size", "32b", "--full", "--vram-gb", "24", "--host-gb", "64"], capsys)
    assert code == cli.PLAN_EXIT_REFUSED
    assert "does not fit: no plan fits" in out and "GiB of host RAM" in out and "optimizer_state" in out


def test_the_choices_follow_the_options(capsys):
    common = ["--size", "14b", "--lora", "16", "--vram-gb", "24", "--host-gb", "100", "--json"]
    exact = json.loads(_run(common, capsys)[1])
    speed = json.loads(_run([*common, "--prefer", "speed"], capsys)[1])
    assert exact["quantize"] is None and exact["streamed_blocks"] > 0
    assert speed["quantize"] in ("int8", "nf4") and speed["streamed_blocks"] == 0
    fixed = json.loads(_run([*common, "--quantize", "nf4", "--streamed-blocks", "0", "--moment-dtype", "bfloat16"],
                            capsys)[1])
    assert (fixed["quantize"], fixed["streamed_blocks"], fixed["moment_dtype"]) == ("nf4", 0, "bfloat16")
    chunked = json.loads(_run([*common, "--loss-chunk", "1024"], capsys)[1])
    assert chunked["vram"]["output_and_loss"] < exact["vram"]["output_and_loss"]


def test_default_budget_is_this_machine_split_between_local_processes(capsys, monkeypatch):
    one = json.loads(_run(["--size", "tiny", "--vram-gb", "1", "--json"], capsys)[1])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    two = json.loads(_run(["--size", "tiny", "--vram-gb", "1", "--json"], capsys)[1])
    assert two["budget"]["host_bytes"] == pytest.approx(one["budget"]["host_bytes"] / 2, rel=0.05)


def test_local_ranks_split_the_ram_and_share_the_streamed_copy(capsys, monkeypatch):
    """--local-ranks N: one of N data-parallel processes: 1/N of the RAM, and 1/N of the streamed frozen
    weights' one copy per machine (what each rank maps of /dev/shm)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    common = ["--size", "14b", "--lora", "16", "--vram-gb", "24", "--quantize", "none", "--streamed-blocks", "40",
              "--json"]
    one = json.loads(_run([*common, "--host-gb", "200"], capsys)[1])
    four = json.loads(_run([*common, "--host-gb", "200", "--local-ranks", "4"], capsys)[1])
    assert four["streamed_shared_by"] == 4 and one["streamed_shared_by"] == 1
    whole = one["host"]["streamed_weights"]
    assert whole > 20e9 and four["host"]["streamed_weights"] == -(-whole // 4)
    assert four["host_bytes"] < one["host_bytes"]
    default = json.loads(_run(common, capsys)[1])
    split = json.loads(_run([*common, "--local-ranks", "2"], capsys)[1])
    assert split["budget"]["host_bytes"] == pytest.approx(default["budget"]["host_bytes"] / 2, rel=0.05)


@pytest.mark.parametrize(("argv", "message"), [
    ([], "name one model"),
    (["--size", "7b", "--config", "x.json"], "not allowed with argument"),
    (["--size", "7b", "--full", "--lora", "8"], "not allowed with argument"),
    (["--size", "7b", "--full", "--quantize", "nf4", "--vram-gb", "24"], "full fine-tuning trains them all"),
    (["--size", "7b", "--batch", "0", "--vram-gb", "24"], "--batch"),
    (["--size", "7b", "--vram-gb", "-3"], "--vram-gb"),
    (["--size", "7b", "--vram-gb", "24", "--host-gb", "1e300"], "argument --host-gb/--ram-gb: takes a size in (0, 1e6] GiB"),
    (["--size", "7b", "--vram-gb", "24 XB"], "argument --vram-gb: takes a size in (0, 1e6] GiB"),
    (["--size", "7b", "--streamed-blocks", "99", "--vram-gb", "24"], "streamed_blocks=99"),
    (["no/such-model-offline", "--vram-gb", "24"], "cannot load the config of 'no/such-model-offline'"),
])
def test_bad_arguments_exit_2_with_the_reason(argv, message, capsys):
    pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as stop:
        cli.main(["plan", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("case", ["device", "large", "list", "environment"])
def test_bad_input_is_refused_with_exit_2_before_any_unbounded_work(case, tmp_path, capsys, monkeypatch):
    """Before: /dev/zero was read until the OOM killer came, a 300 MB file was read whole, and a JSON list or
    LOCAL_WORLD_SIZE=zero ended in a traceback."""
    argv = {"device": ["--config", "/dev/zero"], "large": [str(tmp_path / "big.bin")],
            "list": ["--config", str(tmp_path / "list.json")], "environment": ["--size", "7b"]}[case]
    (tmp_path / "big.bin").write_bytes(b"{" + b" " * (2 << 20) + b"}")
    (tmp_path / "list.json").write_text("[1, 2]")
    if case == "environment":
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "zero")
    with pytest.raises(SystemExit) as stop:
        cli.main(["plan", *argv, "--vram-gb", "24"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert {"device": "not a regular file", "large": "a model config is a JSON file of a few KB",
            "list": "holds a JSON list", "environment": "LOCAL_WORLD_SIZE='zero' is not a process count"}[case] in err


def test_a_bad_config_and_no_gpu_exit_2(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "model_type": "bert"}))
    with pytest.raises(SystemExit) as stop:
        cli.main(["plan", str(tmp_path), "--vram-gb", "24"])
    assert stop.value.code == 2 and "lacks intermediate_size" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        cli.main(["plan", "--size", "7b"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "pass --vram-gb" in err and "vram_bytes" not in err  # the flag, not the argument


def test_a_mixture_of_experts_config_counts_every_expert(tmp_path, capsys):
    # Mixtral-8x7B's published config: 46.7 B parameters, not the 7.24 B of one expert per block.
    fields = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=4096,
                  intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  vocab_size=32000, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    _code, out = _run([str(tmp_path), "--lora", "16", "--vram-gb", "24", "--host-gb", "128"], capsys)
    assert "46.70 B parameters" in out
    plan = json.loads(_run([str(tmp_path), "--lora", "16", "--vram-gb", "24", "--host-gb", "128", "--json"],
                           capsys)[1])
    # Its bf16 weights alone are 87 GiB: in 24 GB only quantized codes, streamed blocks or both can fit.
    assert plan["quantize"] is not None or plan["streamed_blocks"] > 0


# Flags that describe the run or the machine rather than set an option of wrap().
RUN_FLAGS = {"--help", "--model", "--config", "--size", "--batch", "--seq", "--lora-rank", "--full", "--vram-gb",
             "--host-gb", "--local-ranks", "--world-size", "--fsdp", "--measure", "--json"}  # the run, not wrap()'s


def test_flags_and_decisions_use_the_configuration_s_names(capsys):
    import argparse

    from trainstream import _config

    options = set(_config.GROUP_OF) | {"loss_chunk_size"}  # TrainStreamTrainer's own option
    for action in plan_parser()._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or action.help == argparse.SUPPRESS or flags[0] in RUN_FLAGS:
            continue
        assert flags[0][2:].replace("-", "_") in options, flags[0]
    _code, out = _run(["--size", "14b", "--lora", "16", "--vram-gb", "24", "--host-gb", "100", "--json"], capsys)
    decisions = json.loads(out)["decisions"]
    assert {d["option"] for d in decisions} <= options and all(d["reason"] for d in decisions)
    by_option = {d["option"]: d["value"] for d in decisions}
    assert by_option["param_offload"] and by_option["quantize"] is None  # prefer="exact": bf16 blocks stream
    # The older spellings still work and mean the same.
    old = json.loads(_run(["--size", "14b", "--lora", "16", "--vram-gb", "24", "--host-gb", "100", "--json",
                           "--streamed-blocks", "12", "--optimizer", "host", "--loss-chunk", "512"], capsys)[1])
    new = json.loads(_run(["--size", "14b", "--lora", "16", "--vram-gb", "24", "--host-gb", "100", "--json",
                           "--param-offload", "0.25", "--offload", "true", "--loss-chunk-size", "512"], capsys)[1])
    assert old == new and new["streamed_blocks"] == 12 and new["optimizer"] == "host"


def test_world_size_prices_one_rank_s_share_of_the_host_state(capsys):
    """--world-size N: each rank holds the host state of the values it owns, 1/N of them split by element (at 128
    ranks too, where the output layer alone is 6.7x a share). Before: every process was given the whole state."""
    state = {}
    for ranks in (1, 8, 128):
        code, out = _run(["--size", "14b", "--full", "--vram-gb", "80", "--host-gb", "2000", "--json",
                          "--world-size", str(ranks)], capsys)
        state[ranks] = json.loads(out)["host"]["optimizer_state"]
    assert state[8] == pytest.approx(state[1] / 8, rel=1e-6)
    assert state[128] == pytest.approx(state[1] / 128, rel=1e-6)
    # Replicated, every rank holds the whole bf16 model and its gradients twice (until step(), and the buckets'
    # copies): a 14B full fine-tune does not fit 24 GB at any number of ranks, nothing streams (its blocks train),
    # and the advice is FSDP2, whose 64 shards fit.
    args = ["--size", "14b", "--full", "--vram-gb", "24", "--host-gb", "64", "--world-size", "64", "--json"]
    code, out = _run(args, capsys)
    replicated = json.loads(out)
    assert not replicated["fits"] and replicated["streamed_blocks"] == 0
    assert replicated["vram"]["gradients"] == 2 * replicated["vram"]["trained_weights"]  # bf16, twice
    code, out = _run(args[:-1], capsys)
    assert code != 0 and "use FSDP2 (fully_shard the model, then wrap()" in out, out
    code, out = _run([*args[:-1], "--fsdp"], capsys)
    assert code == 0, out  # sharded over 64 ranks: fits 24 GB and 64 GB per rank


def test_fsdp_plans_one_rank_of_the_sharded_model_and_its_network(capsys):
    args = ["--size", "14b", "--full", "--vram-gb", "80", "--host-gb", "200", "--world-size", "128", "--json"]
    replicated = json.loads(_run(args, capsys)[1])
    code, out = _run([*args, "--fsdp"], capsys)
    sharded = json.loads(out)
    assert code == 0 and sharded["fsdp_shards"] == 128 and replicated["fsdp_shards"] == 1
    # Each rank holds 1/128 of the weights (and the two blocks it gathers), not all of them.
    assert sharded["vram"]["trained_weights"] < replicated["vram"]["trained_weights"] / 8
    assert sharded["network_bytes"] > replicated["network_bytes"] > 0  # gathers twice, reduces at fp32
    assert sharded["lower_bound_s"]["network"] == pytest.approx(sharded["network_bytes"] / 50e9)
    for bad in (["--world-size", "1"], ["--param-offload", "4"]):
        with pytest.raises(SystemExit):
            plan_main(["--size", "14b", "--full", "--vram-gb", "80", "--fsdp", *bad])
    assert "--fsdp shards" in capsys.readouterr().err


@pytest.mark.parametrize("spelling", [["24"], ["24GiB"], ["24 gib"], ["24G"], [f"{24 * 2**30 / 1e9!r}GB"]])
def test_vram_and_host_sizes_are_gib_as_printed_or_carry_their_unit(spelling, capsys):
    """A bare --vram-gb / --host-gb is GiB, the unit every line of the plan prints (before: 10**9-byte GB, so a
    24 GB card was planned as 22.35 GiB); 24GB still says 24 * 10**9 bytes."""
    plain = json.loads(_run(["--size", "7b", "--lora", "16", "--vram-gb", "24", "--host-gb", "64", "--json"],
                            capsys)[1])
    given = json.loads(_run(["--size", "7b", "--lora", "16", "--vram-gb", *spelling, "--host-gb", "64GiB", "--json"],
                            capsys)[1])
    assert given["budget"] == plain["budget"]
    _code, out = _run(["--size", "7b", "--lora", "16", "--vram-gb", *spelling, "--host-gb", "64"], capsys)
    assert "budget: 24.00 GiB VRAM, 64.00 GiB host RAM" in out.splitlines()[0]
    decimal = json.loads(_run(["--size", "7b", "--lora", "16", "--vram-gb", "24GB", "--host-gb", "64GB", "--json"],
                              capsys)[1])
    assert decimal["budget"]["host_bytes"] == 64 * 10**9 and plain["budget"]["host_bytes"] == 64 * 2**30
    _code, out = _run(["--size", "7b", "--lora", "16", "--vram-gb", "24GB", "--host-gb", "64GB"], capsys)
    assert "budget: 22.35 GiB VRAM, 59.60 GiB host RAM" in out.splitlines()[0]


def test_the_help_says_gib():
    text = plan_parser().format_help()
    assert "--vram-gb SIZE" in text and "10**9" in text and "GiB" in text
