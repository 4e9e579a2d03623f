"""wrap() options: one dataclass, validated up front with errors that name the valid values."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import field
from typing import Any

import torch
import ts_adamw

from .activations.policy import check_block_choice, check_param_offload
from .attention import WRAP_DEFAULT, check_attention_mode
from .weights.peer import check_peer_option
from .weights.quantize import check_quantize

__all__ = ["WrapOptions", "parse_options"]

_CHOICES: dict[str, tuple[Any, ...]] = {
    "optimizer_mode": ("cpu", "gpu", "auto"),
    "offload": ("auto", True),
    "moment_dtype": ("auto", "float32", "bfloat16"),
    "recompute_variant": ("full", "selective"),
    "compact_lora_inputs": ("auto", True, False),
    "stream_packing": ("auto", True, False),
    "host_embedding": ("auto", True, False),
    "prefer": ("exact", "speed"),
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _doc(values: str, *doc: str, shown: str | None = None) -> dict[str, str]:
    """A ``WrapOptions`` field's documentation, in Markdown with links relative to docs/: the values it accepts,
    what it does (``doc``, joined) and, where the default's repr does not say it all, how the default reads
    (``shown``). docs/options.md's option tables are generated from it
    (``python packages/trainstream/tests/test_options_docs.py --write``)."""
    return {"values": values, "doc": "".join(doc), **({"default": shown} if shown is not None else {})}


@dataclasses.dataclass
class WrapOptions:
    """Every option of ``wrap()``: its default, and in its metadata what it accepts and does. docs/options.md's
    option tables, one per ``trainstream.Config`` group, are generated from these fields."""

    optimizer_mode: str = field(default="cpu", metadata=_doc(
        '`"cpu"`, `"gpu"`, `"auto"`',
        'Where AdamW runs. `"cpu"`: on host threads. `"gpu"`: ts-adamw\'s CUDA kernel reads and writes the state in '
        "mapped page-locked host memory (zero-copy: no host threads, the link carries the state); for a machine "
        'whose host cores are busy with other work. `"auto"`: host AdamW, and after the first step the state of as '
        "many parameters as fit in the VRAM the step left free moves to the GPU, first layers first (their gradients"
        " arrive last, so their host updates could not overlap backward); use it when the GPU has room left after a "
        "step"))
    offload: str | bool = field(default="auto", metadata=_doc(
        '`"auto"`, `True`',
        '`"auto"`: once the activation policy has settled, if all the optimizer state (and its gradients, which then'
        " wait for `step()` in VRAM) fits beside the measured peak, it moves to VRAM (fp32 master weights, one fused"
        " AdamW launch per step) and the log says so. `True`: it stays in host memory; use it to keep that VRAM for "
        "something else. See also `mapped_trial`"))
    moment_dtype: str = field(default="auto", metadata=_doc(
        '`"auto"`, `"float32"`, `"bfloat16"` (also `"fp32"`, `"bf16"`, `torch.float32`, `torch.bfloat16`)',
        "Precision of the AdamW moments: fp32 unless that would not fit in the page-lock budget. bf16 moments take 4"
        " bytes per trained value instead of 8 and use stochastic rounding (unbiased, seeded, reproducible). Name "
        "one to fix it"))
    max_grad_norm: float | None = field(default=None, metadata=_doc(
        "`None`, number > 0",
        "Global-norm clipping, as `clip_grad_norm_` computes it; updates then start at `step()`, after the norm. Use"
        " it instead of `torch.nn.utils.clip_grad_norm_`: the gradients have left the GPU"))
    accumulation_steps: int = field(default=1, metadata=_doc(
        "integer ≥ 1",
        "Backward passes per `step()`: set it to your gradient accumulation "
        "([guarantees.md](guarantees.md#using-a-wrapped-model))"))
    threads: int | None = field(default=None, metadata=_doc(
        "`None`, integer in [1, `ts_adamw.max_host_threads()`]",
        "Host AdamW threads (default: the physical cores this process may use; at most 4 x the CPUs its affinity and"
        " cgroup quota allow). One pool serves every TrainStream core in the process. Lower it to leave cores to "
        "data loading"))
    device: torch.device | None = field(default=None, metadata=_doc(
        '`None`, `"cuda"`, `"cuda:N"`, `"cpu"`, `torch.device`',
        "Where the model trains; the model is moved there if needed"))
    check_memory: bool = field(default=True, metadata=_doc(
        "`True`, `False`",
        "Refuse at `wrap()` (`trainstream.PlanRefused`, a `ValueError` and a `MemoryError`), before anything is "
        "allocated and with the numbers, a run whose optimizer state does not fit in the page-lock budget, or whose "
        "plan (ts-planner's memory model at one sequence of 2,048 tokens, or weights and optimizer state for models "
        "without a decoder config) does not fit even at one token per step. `False` goes ahead anyway"))
    host_budget: int | None = field(default=None, metadata=_doc(
        "`None`, integer ≥ 1 (bytes)",
        "Host RAM the optimizer state may take (master weights, moments, gradient and upload buffers). `None`: the "
        "page-lock budget ts-pinned measures (a share of available RAM within the memlock limit; under torchrun "
        "1/N per local process). Set it lower to leave RAM to something else on the machine; with `nvme_path` what "
        "does not fit goes to disk, without it `check_memory` refuses the run",
        shown="`None` (the measured page-lock budget)"))
    nvme_path: str | None = field(default=None, metadata=_doc(
        "`None`, a directory (str or path)",
        "A directory on a fast local disk for the optimizer state that does not fit in host RAM: the plan puts the "
        "fp32 master weights and moments of the fewest parameters there (the last registered first: backward "
        "reaches them first), in one scratch file read and written with direct I/O through a few staging buffers "
        "([adamw.md](adamw.md#optimizer-state-on-disk)); each bucket's update reads, updates and writes its "
        "state on the host worker as its gradients arrive. The file has no name on disk and disappears at "
        "`unwrap()` or when the process ends. Bit-exact against the state in RAM (CPU tests). `None`: the state "
        "stays in RAM, and a run whose state does not fit is refused with the numbers"))
    vram_headroom: float = field(default=0.10, metadata=_doc(
        "fraction in [0, 1)",
        "Share of the usable VRAM the automatic placement leaves free. Raise it when something else shares the GPU"))
    lr: float = field(default=1e-3, metadata=_doc(
        "number ≥ 0",
        "Used only when `optimizer` is `None`"))
    seed: int = field(default=0, metadata=_doc(
        "integer in [0, 2**63)",
        "Seed of the stochastic rounding of bf16 moments"))
    verbose: bool = field(default=False, metadata=_doc(
        "`True`, `False`",
        'Print each decision to stderr as it is made, one line each (`trainstream plan: ...`), clear of a tqdm '
        'progress bar. Every decision goes to `logging.getLogger("trainstream")` whatever `verbose` says: INFO, '
        "failures at WARNING, details that do not apply to this machine (a GPU feature on a CPU run) at DEBUG. "
        "Without any logging configuration only the failures are printed; a decision your own logging already "
        "prints to the console is not printed twice"))
    quantize: str | None = field(default="auto", metadata=_doc(
        '`"auto"`, `None`, `False`, `"none"`, `"int8"`, `"nf4"`, `"fp8"`, `"nvfp4"`',
        "Store the frozen `nn.Linear` weights of the repeated blocks quantized (`quantize_model` below), where they "
        "are, before the model moves to `device`; the layers then compute with the dequantized weight (on Hopper "
        "GPUs through ts-quant's fused kernel, FP8 through blockwise `scaled_mm`), as QLoRA does, so training is not"
        ' bit-exact with the full-precision base. `"auto"`: on a GPU, the least of none, int8, NF4 with which the '
        "plan made at `wrap()` fits one sequence of 2,048 tokens (NF4 when none does; models without a decoder "
        "config: only when the weights would not fit in the usable VRAM as they are); with an explicit "
        '`param_offload` nothing is quantized, with `param_offload="auto"` `prefer` decides; on the CPU nothing is '
        "quantized. Give `None` to keep the base exact, or a format to choose it. The decision is in the event log. "
        "Formats: [quant.md](quant.md)"))
    guard_params: bool = field(default=True, metadata=_doc(
        "`True`, `False`",
        "`True`: a read of a weight after `step()` (logging, an EMA, evaluation, a parent reading a child's weight) "
        "sees its update: `step()` returns once the last host update is issued and the compute stream waits on the "
        "device for the uploads. `False`: `step()` returns at once and only forwards wait for the weights they read;"
        " other reads may see the previous weight until `optimizer.synchronize()`. Turn it off only when nothing "
        "reads weights outside the model's forward. Evidence: [earlier single-run "
        "notes](results/notebook-before-harness.md#from-readmemd-moved-2026-12-05)"))
    activation_offload: Any = field(default="auto", metadata=_doc(
        '`"auto"`, `False`, `True`, a fraction in [0, 1], a list of block indices',
        "Blocks whose saved activations wait for backward in page-locked host memory: each saved tensor of at least "
        "`min_offload_bytes` leaves on the D2H stream during forward and comes back on the H2D stream ahead of "
        "backward (`prefetch_depth` blocks ahead); bit-exact against keeping them. A fraction takes the earliest "
        'blocks (backward reaches them last). `"auto"` (with `recompute="auto"`): each block kept, paged or '
        "recomputed, chosen by measuring the first steps ([below](#how-auto-chooses-the-activation-policy)). Give a "
        "value to fix the policy and skip the trials"))
    recompute: Any = field(default="auto", metadata=_doc(
        '`"auto"`, `False`, `True`, a fraction in [0, 1], a list of block indices',
        "Blocks whose activations are recomputed in backward (non-reentrant checkpointing, RNG state restored, so "
        "dropout recomputes bit for bit; buffers the forward writes, such as BatchNorm's running statistics, are put"
        " back after the recomputation, so they count each step once, unlike `torch.utils.checkpoint`); a block "
        "takes one policy; an explicit setting is refused beside Hugging Face's `gradient_checkpointing_enable()`. "
        '`"auto"`: see `activation_offload` (`recompute=False` with `activation_offload="auto"` pages what does not '
        'fit; `activation_offload=False` with `recompute="auto"` recomputes it)'))
    recompute_variant: str = field(default="full", metadata=_doc(
        '`"full"`, `"selective"`',
        'How a recomputed block recomputes. `"full"` keeps only its inputs and runs its forward again in backward. '
        '`"selective"` is a **Prototype, off by default** ([`trainstream.prototype`](#prototype-features)): it keeps'
        " the outputs of the block's matrix products (`mm`, `addmm`, `bmm`: the projections) and recomputes the rest"
        " (attention core, norms, rotary embedding, activation functions) through torch's selective checkpointing: "
        'more memory than `"full"`, less than keeping, no matmul redone (ts-quant\'s fused kernels, which are not '
        "those ops, are redone either way). Bit-exact against keeping (CPU tests, "
        "`packages/trainstream/tests/test_recompute_selective.py`); the plan made at `wrap()` prices selective "
        'blocks as kept. It applies to blocks named by `recompute=True` or a list; `recompute="auto"` recomputes '
        "whole blocks (an event says so), since its tuner prices a recomputed block at its inputs. Evidence: "
        "[earlier single-run notes](results/notebook-before-harness.md#from-readmemd-moved-2026-12-05)"))
    compact_lora_inputs: Any = field(default=False, metadata=_doc(
        '`"auto"`, `True`, `False`',
        "**Prototype, off by default** ([`trainstream.prototype`](#prototype-features)). PEFT LoRA layers save their"
        " input for backward as the 16-bit tensor PEFT cast to float32, not the float32 copy (PEFT keeps adapters in"
        " float32 and casts each layer's input; `lora_A` saves that copy): the same gradients bit for bit (CPU and "
        "GPU tests), 2 bytes a value instead of 4, and one saved tensor for the inputs q/k/v (gate/up) share. Plain "
        'adapters only (no dropout, no DoRA). `"auto"` applies it to the layers that qualify and says nothing when '
        "none do, `True` says so with an event, `False` leaves PEFT as it is; the plan made at `wrap()` prices what "
        "applies. Try it when a LoRA run's activations do not all stay in VRAM. "
        '`memory_report(model)["activations"]["compact_lora_layers"]` counts the layers. Evidence: [earlier '
        "single-run notes](results/notebook-before-harness.md#from-readmemd-moved-2026-12-05)"))
    prefetch_depth: int = field(default=1, metadata=_doc(
        "integer in [1, 64]",
        "Paged activation blocks brought back ahead of the one backward is in"))
    weights_prefetch_depth: int = field(default=1, metadata=_doc(
        "integer in [1, 64]",
        "Streamed blocks (`param_offload`) fetched ahead of the one running (at most this + 2 resident). Where the "
        "host runs ahead of the GPU (compiled blocks) the copies already queue back to back and the link, not the "
        "depth, bounds the step; raise it only where fetches start late. Evidence: [earlier single-run "
        "notes](results/notebook-before-harness.md#from-readmemd-moved-2026-12-05)"))
    max_inflight_bytes: int | None = field(default=None, metadata=_doc(
        "`None`, integer ≥ 1",
        "VRAM held by activation copies to the host not yet complete; beyond it forward waits for the oldest",
        shown="`None` (1 GiB)"))
    min_offload_bytes: int = field(default=1 << 20, metadata=_doc(
        "integer ≥ 0",
        "Smaller saved tensors stay in VRAM"))
    blocks: Any = field(default=None, metadata=_doc(
        "`None`, list of modules",
        "The repeated layer stack the activation and weight policies apply to (default `find_blocks(model)`); give "
        "it when `find_blocks` picks the wrong stack"))
    attention: Any = field(default=WRAP_DEFAULT, metadata=_doc(
        '`"auto"`, `"default"`, `"cudnn"`, `"efficient"`, `"flash"`, `"math"`',
        'The `scaled_dot_product_attention` backend. `"auto"` times each backend that accepts the model\'s shapes '
        "(forward and backward, checked against `math`) at the first forward of each new shape and pins the fastest "
        "around forward, backward and recomputation; timings within 5 % count as a tie that goes to PyTorch's "
        'earlier backend. A named backend is tried first; `"default"` leaves PyTorch\'s choice. Name a backend (or '
        '`"default"`) for bit-for-bit repeatable runs. Generation (a forward whose keys outnumber its queries) is '
        "not timed and runs without cuDNN, which builds a graph for every new key length. With data parallel an "
        'explicit `"auto"` makes the ranks agree on one kernel. Hugging Face models loaded with '
        '`attn_implementation="eager"` are left alone (an event says so). `memory_report(model)["attention"]` has '
        "`mode`, `backend`, `timings_ms`. Details: [attention.md](attention.md)",
        shown='`"auto"` on one GPU; `"default"` on the CPU and with data parallel (an event says why)'))
    param_offload: Any = field(default=False, metadata=_doc(
        '`False`, `True`, `"auto"`, a fraction in [0, 1], a list of block indices',
        "Blocks whose frozen weights live in host memory and stream to the GPU, one copy per block just before it "
        "runs (forward, recomputation, backward), `weights_prefetch_depth` blocks ahead; bit-exact against keeping "
        "them (CPU and GPU tests). A fraction streams that share of the blocks, spread through the stack. Weights "
        'stream as stored: bf16, or the codes of `quantize`\'s format. `"auto"`: the fewest blocks with which the '
        "plan fits one sequence of 2,048 tokens. Use it when the frozen weights do not fit in VRAM beside training; "
        "a full fine-tune's trained weights stream with their blocks. Details: "
        "[below](#streamed-weights-param_offload)"))
    stream_packing: Any = field(default=False, metadata=_doc(
        '`"auto"`, `True`, `False`',
        "**Prototype, off by default** ([`trainstream.prototype`](#prototype-features)). With `param_offload`: the "
        "streamed blocks' frozen bf16 weights cross the host-to-device link exponent-packed, a lossless 12-bit form "
        "(ts-quant's `pack_bf16`: sign and mantissa in a byte, the exponent as 4 bits from the tensor's most common "
        "window of 15, the rest stored whole beside their index), 0.7505 of the bytes for weights initialized as "
        "Hugging Face does; each fetch copies the packed bytes into one device staging buffer and decodes them on "
        "the GPU into the block's buffer. Bit-exact against streaming them as stored (CPU and GPU tests, with "
        "recompute and paging; a weight written in place or loaded is packed again before its next fetch). The "
        'packed copy sits in host memory beside the plain one (which reads and `load_state_dict` use): `"auto"` '
        "packs unless only the plan without the packed copies fits host RAM; blocks that would not shrink by 10 % "
        "stream as stored; not with quantized blocks or streamed trained weights. Try it when a streamed run is "
        'bound by the link. `memory_report(model)["params"]["streaming"]`: `packed_blocks`, `packed_bytes`, '
        "`packed_ratio`, `link_bytes` (what crossed; `load_bytes` is it per step), `repacks`. Evidence: [earlier "
        "single-run notes](results/notebook-before-harness.md#from-readmemd-moved-2026-12-05)"))
    host_embedding: Any = field(default=False, metadata=_doc(
        '`"auto"`, `True`, `False`',
        "**Prototype, off by default** ([`trainstream.prototype`](#prototype-features)). On a GPU, a frozen input "
        "embedding not tied to the output layer (a LoRA run of Qwen2.5 7B-72B, Llama 3) lives in page-locked host "
        "memory: each lookup is a kernel that reads the looked-up rows over the link (ts-pinned's `gather_rows`; "
        "unified addressing), so the table takes no VRAM (1.45 GiB at a 14B shape: room for more resident blocks or "
        "kept activations) and no lookup waits for the host. Training is bit-exact against the table in VRAM, with "
        "and without streamed blocks ([GPU test log](results/gpu-tests-h200-2026-12-03-s15-e.log)). The weight reads"
        " as a CPU tensor while wrapped (`state_dict`, copies), and returns to the GPU at `unwrap()`. An id outside "
        "the table gives a zero row and an `IndexError` at the next lookup (a GPU gather cannot raise where it "
        'runs). `"auto"`: wherever it qualifies; `True` refuses with the reason where it does not; the plan made at '
        "`wrap()` prices it. Try it when VRAM is short by about the embedding's size. "
        '`memory_report(model)["params"]["host_embedding"]`: `bytes`, `lookups`, `rows_read`, `link_bytes`'))
    prefer: str = field(default="exact", metadata=_doc(
        '`"exact"`, `"speed"`',
        'With `quantize="auto"` and `param_offload="auto"`: `"exact"` keeps the weights exact and streams blocks '
        'from host memory when that fits, quantizing only when even every block streamed does not; `"speed"` '
        'quantizes first, so the blocks stay resident instead of streaming. Choose `"speed"` when a quantized base '
        "is acceptable and you want fewer bytes crossing the link each step. No effect with an explicit `quantize` "
        "or `param_offload`; `trainstream plan --prefer` is the same choice. Tested on the CPU (plans of a 7B "
        "shape). Evidence: [earlier single-run "
        "notes](results/notebook-before-harness.md#from-readmemd-moved-2026-12-05)"))
    peer: Any = field(default=False, metadata=_doc(
        '`"auto"`, `False`, `None`, bytes per GPU',
        "**Prototype, off by default** ([`trainstream.prototype`](#prototype-features)). Data parallel on one "
        "machine with `param_offload`: at step 10 (collectively) the streamed frozen blocks are pooled in the ranks'"
        " GPUs (ts-peer: CUDA IPC, GPU-to-GPU copies) and fetched from their owner GPU instead of host memory; "
        '`"auto"`: each GPU gives half the VRAM room left under the budget after the measured peak; bytes: that much'
        " per GPU. Off (with the reason as an event) without a process group of 2+ ranks on one machine, or without "
        "peer access and IPC. While a pool is in use `unwrap()` is collective. Bit-exact against host streaming (CPU"
        " tests over gloo with ts-peer's host backend, and two processes sharing one GPU); between two GPUs it has "
        "not run yet ([peer.md](peer.md))"))
    mapped_trial: bool = field(default=False, metadata=_doc(
        "`True`, `False`",
        '**Prototype, off by default** ([`trainstream.prototype`](#prototype-features)). With `offload="auto"`, when'
        " the optimizer state does not fit in VRAM but its gradients do (twice over): two steps of host AdamW are "
        "timed against two of CUDA AdamW over mapped host memory (no per-tensor hooks: one fused launch at `step()`,"
        " the state crossing the link), and the faster stays, with both medians in the log "
        "(`engine/placement_trial.py`). Written for LoRA's hundreds of small tensors, whose per-tensor hooks weigh "
        "more than their updates"))
    distributed: bool | None = field(default=None, metadata=_doc(
        "`None`, `True`, `False`",
        "Data parallel on `torch.distributed` (launch with `torchrun` as usual): `None` turns it on when an "
        "initialized process group has more than one rank. Each rank owns 1/world of the trained values (split "
        "evenly by element: a tensor may be split between ranks) and keeps only their fp32 master weights and moments; gradients are "
        "averaged into their owner in buckets (4 MiB on gloo, 25 MiB on NCCL) that start during backward, the owners"
        " run host AdamW at `step()` and broadcast the new weights; clipping uses the global norm. "
        "`optimizer.state_dict()` is collective and returns the full state on every rank (a checkpoint from N ranks "
        "resumes on M); `trainstream.distributed.save_checkpoint` / `load_checkpoint` write and read it sharded. "
        "Every rank must wrap the same model (else `ModelMismatch` on every rank). Pass the plain model, or one "
        "sharded by FSDP2 (`fully_shard()` first, then `wrap()`: FSDP2 reduces the gradients and this is off); a model"
        " under `DistributedDataParallel` or FSDP1 is refused at `wrap()`. Tested with 2 and 3 gloo ranks on the "
        "CPU (within 1e-6 of one process on the global batch, with clipping and accumulation) and two gloo ranks "
        "sharing one GPU ([log](results/gpu-tests-h200-2026-12-01-e.log)); NCCL on two GPUs has not run yet. See "
        "[distributed.md](distributed.md)"))
    distributed_timeout: float | None = field(default=None, metadata=_doc(
        "`None`, seconds > 0",
        "How long data parallel waits for each collective (and for the set-up of the streamed weights' shared host "
        "copy) before a rank that died or stalled is reported as `trainstream.distributed.DistributedError`; the "
        "collectives' own process group ends its operation one second later, so the process can tear down at once "
        "([distributed.md](distributed.md#checks-faults-and-timeouts)). Raise it when one rank may work alone for "
        "longer than that between collectives (an evaluation or a checkpoint written by rank 0)",
        shown="`None` (600 s)"))
    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _choice(name: str, value: Any) -> Any:
    if name == "moment_dtype" and isinstance(value, (str, torch.dtype)):
        value = _DTYPE_ALIASES.get(value, value)
    choices = _CHOICES[name]
    # Booleans match only themselves: offload=1 is a typo, not True.
    if not any(value is c if isinstance(c, bool) else (not isinstance(value, bool) and value == c) for c in choices):
        shown = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}={value!r} is not valid; use one of {shown}")
    return value


def _device(value: Any) -> torch.device | None:
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={value!r} is not a device; use None, 'cuda', 'cuda:N' or 'cpu'") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device={value!r} is not supported; use None, 'cuda', 'cuda:N' or 'cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def parse_options(options: dict[str, Any]) -> WrapOptions:
    """Validates wrap()'s keyword options; unknown names and bad values raise ValueError."""
    known = {f.name for f in dataclasses.fields(WrapOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        guesses = [f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
                   for name in unknown for close in [difflib.get_close_matches(name, known, n=1)]]
        raise ValueError(f"unknown wrap() option(s): {', '.join(guesses)}; valid options: {', '.join(sorted(known))}")
    opts = WrapOptions(**options)
    opts.quantize = check_quantize(opts.quantize)
    for name in _CHOICES:
        setattr(opts, name, _choice(name, getattr(opts, name)))
    if opts.max_grad_norm is not None:
        opts.max_grad_norm = _real("max_grad_norm", opts.max_grad_norm, "None or a finite number > 0", positive=True)
    opts.accumulation_steps = _integer("accumulation_steps", opts.accumulation_steps, 1, _MAX_INT32)
    if opts.threads is not None:
        opts.threads = _integer("threads", opts.threads, 1, thread_limit(), "None (all usable cores) or ")
    if opts.host_budget is not None:
        opts.host_budget = _integer("host_budget", opts.host_budget, 1, 2**62, "None (the measured budget) or ")
    opts.nvme_path = _directory_option(opts.nvme_path)
    opts.vram_headroom = _real("vram_headroom", opts.vram_headroom, "a fraction in [0, 1)", upper=1.0)
    opts.lr = _real("lr", opts.lr, "a finite number >= 0")
    opts.seed = _integer("seed", opts.seed, 0, 2**63 - 1)
    for flag in ("check_memory", "verbose", "guard_params", "mapped_trial"):
        if not isinstance(getattr(opts, flag), bool):
            raise ValueError(f"{flag}={getattr(opts, flag)!r} is not valid; use True or False")
    opts.device = _device(opts.device)
    if opts.attention != WRAP_DEFAULT:
        opts.attention = check_attention_mode(opts.attention)
    opts.param_offload = check_param_offload(opts.param_offload)
    opts.peer = check_peer_option(opts.peer)
    if opts.distributed is not None and not isinstance(opts.distributed, bool):
        raise ValueError(f"distributed={opts.distributed!r} is not valid; use None (on when an initialized process "
                         f"group has more than one rank), True or False")
    if opts.distributed_timeout is not None:
        opts.distributed_timeout = _real("distributed_timeout", opts.distributed_timeout,
                                         "None (600 s) or a finite number of seconds > 0", positive=True)
    opts.activation_offload = check_block_choice("activation_offload", opts.activation_offload)
    opts.recompute = check_block_choice("recompute", opts.recompute)
    opts.prefetch_depth = _integer("prefetch_depth", opts.prefetch_depth, 1, 64)
    opts.weights_prefetch_depth = _integer("weights_prefetch_depth", opts.weights_prefetch_depth, 1, 64)
    if opts.max_inflight_bytes is not None:
        opts.max_inflight_bytes = _integer("max_inflight_bytes", opts.max_inflight_bytes, 1, 2**62,
                                           "None (1 GiB) or ")
    opts.min_offload_bytes = _integer("min_offload_bytes", opts.min_offload_bytes, 0, 2**62)
    if opts.blocks is not None and not (isinstance(opts.blocks, (list, tuple)) and opts.blocks
                                        and all(isinstance(b, torch.nn.Module) for b in opts.blocks)):
        raise ValueError(f"blocks={opts.blocks!r} is not valid; use None (find_blocks) or a list of the model's "
                         f"repeated layer modules")
    return opts


_MAX_INT32 = 2**31 - 1


def _directory_option(value: Any) -> str | None:
    """nvme_path's value as a string path (it need not exist yet: planning checks it, naming it)."""
    if value is None:
        return None
    try:
        path = os.fspath(value)
    except TypeError:
        path = None
    if not isinstance(path, str) or not path:
        raise ValueError(f"nvme_path={value!r} is not valid; use None or a directory path (str or os.PathLike)")
    return path


def thread_limit() -> int:
    """The most host threads ``threads=`` accepts: 4 x the cores this process may use (affinity, cgroup quota)."""
    return ts_adamw.max_host_threads()


def _integer(name: str, value: Any, low: int, high: int, prefix: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} is not valid; use {prefix}an integer in [{low}, {high}]")
    return int(value)


def _real(name: str, value: Any, valid: str, *, positive: bool = False, upper: float | None = None) -> float:
    try:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float (10**400)
        ok = False
    ok = ok and (value > 0 if positive else value >= 0) and (upper is None or value < upper)
    if not ok:
        raise ValueError(f"{name}={value!r} is not valid; use {valid}")
    return float(value)
