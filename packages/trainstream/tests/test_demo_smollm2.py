"""The SmolLM2 demo, `trainstream --model`, offline: a tiny randomly initialised model of SmolLM2's architecture (a
Llama with tied embeddings) saved with a tiny byte-level BPE tokenizer (trained here on the built-in text) to a
folder, loaded by the same `from_pretrained` path a Hub id takes. The run trains, prints a greedy sample before
and after training, each on one labelled line, and stays a short console (at most 60 lines, no JSON)."""

from __future__ import annotations

import json
import math
import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
from test_cli_console import screen
from trainstream import cli
from trainstream._pretrained import SAMPLE_PROMPT

SAMPLE = re.compile(r'^sample (before|after) training: +"(.*)" -> "(.*)"$')


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from trainstream._demo_text import DEMO_TEXT
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([DEMO_TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                             show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def _tiny_smollm2(folder, tokenizer=None, vocab: int = 300) -> str:
    """A 2-layer model of SmolLM2's architecture (LlamaForCausalLM, tied embeddings, grouped KV heads, SiLU) with
    random weights, saved to `folder` with `tokenizer` (None: no tokenizer files)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer) if tokenizer is not None else vocab,
                         max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True, hidden_act="silu")
    LlamaForCausalLM(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _tiny_smollm2(tmp_path_factory.mktemp("tiny-smollm2"), _tokenizer())


def _run(argv, capsys) -> tuple[list[str], list[str], str]:
    """(stdout's lines, every line a terminal shows, stdout) of a run that succeeds."""
    assert cli.main(argv) == 0
    printed = capsys.readouterr()
    return printed.out.splitlines(), screen(printed.out) + screen(printed.err), printed.out


def test_the_demo_prints_a_sample_before_and_after_training_within_the_line_limit(checkpoint, tmp_path, capsys):
    out_json = tmp_path / "run.json"
    out, lines, text = _run(["--model", checkpoint, "--steps", "6", "--seq", "32", "--lr", "3e-2", "--device", "cpu",
                             "--json", str(out_json)], capsys)
    assert len(lines) <= 60, "\n".join(lines)
    assert not any("{" in line for line in lines), "no JSON without --json PATH"
    samples = [(i, SAMPLE.match(line)) for i, line in enumerate(out) if line.startswith("sample ")]
    assert [m.group(1) for _, m in samples if m] == ["before", "after"], out
    (first, before), (second, after) = samples
    header = next(i for i, line in enumerate(out) if line.startswith("trainstream demo: "))
    done = next(i for i, line in enumerate(out) if line.startswith("done: "))
    assert header < first < second < done  # before training, then after it, then the summary
    assert before.group(2) == after.group(2) == SAMPLE_PROMPT
    assert before.group(3) != after.group(3), "the trained model continues the prompt differently"
    assert f"{checkpoint}, " in out[header] and "LoRA r=16" in out[header]
    assert re.search(r"held-out perplexity [\d.]+ -> [\d.]+", text)
    result = json.loads(out_json.read_text())
    assert result["samples"] == {"prompt": SAMPLE_PROMPT, "before": json.loads(f'"{before.group(3)}"'),
                                 "after": json.loads(f'"{after.group(3)}"')}
    assert len(result["losses"]) == 6 and all(math.isfinite(x) for x in result["losses"])
    assert result["model"] == checkpoint


def test_full_fine_tune_and_a_quantized_base(checkpoint, capsys):
    out, lines, _ = _run(["--model", checkpoint, "--full", "--steps", "2", "--seq", "16", "--device", "cpu"], capsys)
    assert "every weight trained" in out[0] and len(lines) <= 60
    assert sum(line.startswith("sample ") for line in out) == 2
    out, _, text = _run(["--model", checkpoint, "--lora", "4", "--quantize", "int8", "--steps", "2", "--seq", "16",
                         "--device", "cpu"], capsys)
    assert "LoRA r=4" in out[0] and "quantized         int8: 2 blocks" in text


def test_a_folder_without_a_tokenizer_trains_on_bytes_and_prints_no_sample(tmp_path, capsys):
    folder = _tiny_smollm2(tmp_path / "bare", vocab=256)
    out, lines, _ = _run(["--model", folder, "--steps", "2", "--seq", "16", "--device", "cpu"], capsys)
    assert "no tokenizer: the text as bytes, no samples" in out[0]
    assert not any(line.startswith("sample ") for line in out) and len(lines) <= 60


@pytest.mark.parametrize(("argv", "message"), [
    (["--lora", "8"], "--lora: with --model"),
    (["--quantize", "nf4"], "--quantize: with --model"),
    (["--model", "x", "--full", "--quantize", "nf4"], "with --full every weight trains"),
    (["--model", "x", "--full", "--lora", "4"], "not allowed with argument"),
])
def test_options_of_the_pretrained_demo_are_checked_first(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_source_that_is_neither_file_folder_nor_hub_id_is_refused(tmp_path, capsys):
    assert cli.main(["--model", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainstream: error: --model ") and "no such file or folder" in err, err
