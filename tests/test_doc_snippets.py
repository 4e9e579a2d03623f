"""Every code block of README.md and docs/*.md runs here, on the CPU with tiny sizes, or says in the page why not.

docs/api.md and docs/benchmarks.md are generated (no code blocks); docs/results/ is an archive. A Markdown comment
on the line before a block's fence tells this test what the block needs:

    <!-- snippet: not-run: REASON -->     not run (a Hub download, a launcher, an install); REASON is required
    <!-- snippet: gpu: REASON -->         run only where a CUDA GPU is (the cuda-marked test below, which the GPU
                                         runner tools/gpu_run.sh runs); REASON says what for; the block is
                                         self-contained (no setup)
    <!-- snippet: continues -->           appended to the page's previous block and run with it (that block is
                                         then run only as part of this one)
    <!-- snippet: setup: NAME[, NAME] --> runs after SETUPS[NAME]: the names the page leaves to the reader
                                         (``model``, ``loader``, ...), tiny, on the CPU

A block with no comment runs as it is. ``python`` blocks run with this interpreter, ``bash`` blocks with bash
(``trainstream`` on the PATH); each in its own process, in an empty folder, offline, with CUDA hidden. The names a
setup defines are handed to the block one by one: a module the block uses must be imported by the block itself.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GENERATED = {"api.md", "benchmarks.md"}
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED)]
TIMEOUT_S = 240
WORKERS = 2  # the CI machine's cores

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_MARK = re.compile(r"<!--\s*snippet:\s*(.*?)\s*-->\s*$")

# Names the pages leave to the reader, made tiny. Each: (code, names handed to the block).
_TINY_LLAMA = """
import sys, torch
sys.path.insert(0, EXAMPLES)  # docs/examples
from _tiny import batches, load_model
model = load_model(None, torch.float32)   # trainstream's built-in tiny Qwen2 shape, random weights
"""
SETUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    # A plain PyTorch model whose forward takes (x, y) and returns the loss, and a few batches for it.
    "my-model": ("""
import torch
class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    def forward(self, x, y=None):
        out = self.net(x.to(self.net[0].weight.dtype))
        return out if y is None else torch.nn.functional.mse_loss(out.float(), y.float())
torch.manual_seed(0)
loader = [(torch.randn(8, 64), torch.randn(8, 64)) for _ in range(3)]
loss_fn = torch.nn.functional.mse_loss
model = MyModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
""", ("MyModel", "loader", "loss_fn", "model", "optimizer")),
    # `.cuda()` as the identity, so a GPU-shaped example runs its code path on the CPU here.
    "cuda-on-cpu": ("""
import torch
torch.nn.Module.cuda = lambda self, *args, **kwargs: self
torch.Tensor.cuda = lambda self, *args, **kwargs: self
""", ()),
    # The tiny built-in decoder (docs/examples/_tiny.py) and an optimizer over it.
    "tiny-llama": (_TINY_LLAMA + """
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
""", ("model", "optimizer")),
    # The same with PEFT LoRA adapters on its attention projections, the optimizer over the adapters.
    "tiny-lora": (_TINY_LLAMA + """
import peft
model = peft.get_peft_model(model, peft.LoraConfig(r=4, task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"]))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
""", ("model", "optimizer")),
    # transformers refuses bf16=True on a machine without a GPU unless use_cpu=True: set here for every
    # TrainingArguments (TRL's configs included), so a GPU-shaped trainer config runs on the CPU (bf16 autocast).
    "trainer-on-cpu": ("""
import torch, transformers
_post_init = transformers.TrainingArguments.__post_init__
def __post_init__(self):
    if not torch.cuda.is_available():
        self.use_cpu = True
    _post_init(self)
transformers.TrainingArguments.__post_init__ = __post_init__
""", ()),
    # The same model and what a trainer or generate() takes: 8 byte-level sequences of 32 tokens, a character
    # tokenizer, preference pairs, a batch of prompts.
    "tiny-hf-data": (_TINY_LLAMA + """
import datasets
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
ids = [row for batch in batches(2, 4, 32) for row in batch.tolist()]
ds = datasets.Dataset.from_list([{"input_ids": r, "labels": r} for r in ids])
vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz .,"])}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
pairs = datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in [
    ("the cat", " sat.", " flew."), ("a dog", " ran.", " sang."), ("the sky", " is blue.", " is loud."),
    ("hello", " there.", " never."), ("one two", " three.", " nine."), ("red", " green.", " fish."),
    ("up", " down.", " cat."), ("day", " night.", " shoe.")]])
prompt_len = 8
inputs = {"input_ids": torch.randint(3, 30, (2, prompt_len))}
""", ("model", "ds", "tokenizer", "pairs", "inputs", "prompt_len")),
    # A checkpoint of the tiny model where a page reads one: ./path/or/hub-id, and arguments and data for a trainer.
    "tiny-checkpoint": (_TINY_LLAMA + """
import datasets
from transformers import TrainingArguments
model.save_pretrained("path/or/hub-id")
args = TrainingArguments(output_dir="out", max_steps=1, report_to=[])
ds = datasets.Dataset.from_list([{"input_ids": r, "labels": r} for b in batches(1, 4, 16) for r in b.tolist()])
""", ("args", "ds")),
    # ts-adamw's buffers: 4096 fp32 master values, their bf16 gradient and weight copy, moments, hyper-parameters.
    "adamw-buffers": ("""
import torch
n = 4096
param, exp_avg, exp_avg_sq = torch.randn(n), torch.zeros(n), torch.zeros(n)
grad, bf16_copy = torch.randn(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
t, accumulation = 1, 2
hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
ready_buffers = [(torch.randn(n), torch.randn(n, dtype=torch.bfloat16), torch.zeros(n), torch.zeros(n)) for _ in range(3)]
""", ("param", "grad", "exp_avg", "exp_avg_sq", "bf16_copy", "t", "accumulation", "hyper", "ready_buffers")),
    # A bf16 weight, a linear layer of the same shape, an input and a bias for ts-quant.
    "quant-tensors": ("""
import torch
torch.manual_seed(0)
weight = torch.randn(256, 512, dtype=torch.bfloat16)
linear = torch.nn.Linear(512, 256, dtype=torch.bfloat16)
x = torch.randn(4, 512, dtype=torch.bfloat16)
bias = torch.randn(256, dtype=torch.bfloat16)
""", ("weight", "linear", "x", "bias")),
}

_RUNNER = """
import json, sys
setup, code, names, where, examples = json.load(sys.stdin)
scope = {"__name__": "__setup__", "EXAMPLES": examples}
exec(compile(setup, "<snippet setup>", "exec"), scope)
given = {name: scope[name] for name in names}
exec(compile(code, where, "exec"), {"__name__": "__main__", **given})
"""


@dataclasses.dataclass
class Block:
    page: pathlib.Path
    line: int  # of the opening fence
    lang: str
    code: str
    mark: str  # the comment's text after "snippet:", "" when there is none

    @property
    def id(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"

    @property
    def kind(self) -> str:
        return self.mark.split(":", 1)[0].strip() if self.mark else "run"

    @property
    def reason(self) -> str:
        return self.mark.split(":", 1)[1].strip() if ":" in self.mark else ""


def blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text()
    out = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        out.append(Block(page, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2),
                         mark.group(1) if mark else ""))
    return out


@dataclasses.dataclass
class Job:
    block: Block  # the last block of the chain: its id and marker name the job
    lang: str
    code: str
    setups: tuple[str, ...]


def jobs(page: pathlib.Path) -> tuple[list[Job], list[Block]]:
    """The page's runnable jobs (continuations joined) and its blocks marked as not run."""
    runs: list[Job] = []
    skipped: list[Block] = []
    for block in blocks(page):
        if block.kind in ("not-run", "gpu"):
            skipped.append(block)
        elif block.kind == "continues":
            assert runs and runs[-1].block.page == page, f"{block.id}: 'continues' without a block before it"
            previous = runs.pop()
            runs.append(Job(block, previous.lang, previous.code + "\n" + block.code, previous.setups))
        elif block.kind in ("run", "setup"):
            setups = tuple(s.strip() for s in block.reason.split(",") if s.strip()) if block.kind == "setup" else ()
            runs.append(Job(block, block.lang, block.code, setups))
        else:
            raise AssertionError(f"{block.id}: unknown snippet marker {block.mark!r}")
    return runs, skipped


def run(job: Job, folder: str, gpu: bool = False) -> subprocess.CompletedProcess:
    """Runs the job in its own process; CUDA hidden unless ``gpu``."""
    hidden = {} if gpu else {"CUDA_VISIBLE_DEVICES": ""}
    env = {**os.environ, **hidden, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if job.lang == "bash":
        return subprocess.run(["bash", "-euo", "pipefail", "-c", job.code], capture_output=True, text=True,
                              timeout=TIMEOUT_S, cwd=folder, env=env)
    setup, names = "", []
    for name in job.setups:
        code, given = SETUPS[name]
        setup += textwrap.dedent(code)
        names += given
    payload = json.dumps([setup, job.code, names, job.block.id, str(ROOT / "docs" / "examples")])
    return subprocess.run([sys.executable, "-c", _RUNNER], input=payload, capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=folder, env=env)


ALL = [job for page in PAGES for job in jobs(page)[0]]
SKIPPED = [block for page in PAGES for block in jobs(page)[1]]
GPU = [Job(block, block.lang, block.code, ()) for block in SKIPPED if block.kind == "gpu"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every job at once, two at a time (a job is a process that spends most of its time importing)."""
    unique: dict[tuple, Job] = {}
    for job in ALL:
        unique.setdefault((job.lang, job.code, job.setups), job)
    base = tmp_path_factory.mktemp("snippets")
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        futures = {key: pool.submit(run, job, tempfile.mkdtemp(dir=base)) for key, job in unique.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("job", ALL, ids=[job.block.id for job in ALL])
def test_snippet_runs(job, results):
    done = results[(job.lang, job.code, job.setups)]
    assert done.returncode == 0, f"{job.block.id} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


@pytest.mark.cuda
@pytest.mark.parametrize("job", GPU, ids=[job.block.id for job in GPU])
def test_gpu_snippet_runs_on_a_gpu(job, tmp_path):
    done = run(job, str(tmp_path), gpu=True)
    assert done.returncode == 0, f"{job.block.id} failed on the GPU:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_every_block_is_run_or_says_why_not():
    for block in SKIPPED:
        assert len(block.reason) >= 10, f"{block.id}: '{block.kind}' needs a reason (<!-- snippet: {block.kind}: why -->)"
        if block.kind == "gpu":
            assert block.lang in ("python", "bash"), f"{block.id}: a gpu block must be python or bash: it is run on a GPU"
    for job in ALL:
        unknown = [name for name in job.setups if name not in SETUPS]
        assert not unknown, f"{job.block.id}: unknown setup {unknown}; known: {sorted(SETUPS)}"
        assert job.lang in ("python", "bash"), f"{job.block.id}: a {job.lang or 'plain'} block runs nowhere: mark it"
    # Most blocks run: a marker is the exception (the counts are in the report's summary line below).
    print(f"\n{len(ALL)} jobs run ({sum(1 for p in PAGES for b in blocks(p))} blocks), {len(SKIPPED)} marked not run")
    assert len(ALL) >= len(SKIPPED), "more blocks are marked not run than run"


def test_the_markers_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n<!-- snippet: continues -->\n```python\nprint(x)\n```\n"
                    "<!-- snippet: gpu: needs CUDA graphs -->\n```python\nimport nothing\n```\n"
                    "<!-- snippet: setup: my-model, cuda-on-cpu -->\n```python\nmodel.cuda()\n```\n"
                    "<!-- snippet: not-run -->\n```bash\nexit 1\n```\n")
    runs, skipped = jobs(page)
    assert [(j.code, j.setups) for j in runs] == [("x = 1\n\nprint(x)\n", ()), ("model.cuda()\n", ("my-model", "cuda-on-cpu"))]
    assert [(b.kind, b.reason) for b in skipped] == [("gpu", "needs CUDA graphs"), ("not-run", "")]
    done = run(runs[0], str(tmp_path))
    assert done.returncode == 0 and done.stdout == "1\n", done.stderr
    done = run(Job(runs[1].block, "python", "print(torch)", ("my-model",)), str(tmp_path))
    assert "NameError" in done.stderr, "a setup's imports must not leak into the block"
