"""compile_blocks: torch.compile of a model's blocks in place, where that is correct.

What compiles (tests/test_compile.py): plain blocks and blocks of quantized LoRA layers whole (no graph
break: ts-quant's quantized_linear is a custom op under tracing); blocks recomputed whole (variant
"full") compile the forward their checkpoint runs, with the checkpoint eager around it (activations/recompute.py
says why); paged blocks and blocks whose weights stream from host memory compile their forward, with the
paging hooks and the fetch hooks eager around it (CompiledForward; a compiled forward is one backward node,
and the hook on the block output's gradient that fetches a streamed block runs before it); selectively
recomputed blocks compile whole, with graph breaks around what dynamo cannot trace (the checkpoint, and a
streamed block's fetch hooks, which never trace).
Compiling pays where a step is host-bound, as a LoRA step on a large quantized base is in eager: one compiled
forward and backward per block replace most of that host work. Compiled, such a step took about a sixth less
time, and about a quarter less with its bf16 base streamed (measured: docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from .activations.compiled_forward import CompiledForward, plain_forward
from .activations.recompute import Recompute
from .memory import find_blocks

__all__ = ["COMPILE_MODES", "compile_blocks"]

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# Refused: CUDA graph trees stopped an NF4 LoRA step at its second step ("3 tensors in the cudagraph
# pool not tracked as outputs"; docs/benchmarks.md). Likely ts-quant's per-stream stream-K state,
# created during a warm-up run (graph trees send the thread's allocations to their pool) and kept for
# the process; allocating it on a side stream did not help. Not solved yet.
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _paged_ids(model: torch.nn.Module) -> set[int]:
    """The blocks the activation policy may page (their hooks enter saved-tensor hooks), by identity."""
    policy = getattr(getattr(model, "_trainstream_session", None), "activations", None)
    offloader = getattr(policy, "offloader", None)
    return set() if offloader is None else {id(policy.blocks[i]) for i in offloader.candidates}


def _streamed_indices(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[int]:
    session = getattr(model, "_trainstream_session", None)
    weights = getattr(session, "weights", None)
    if weights is None:
        return []
    streamed = {id(weights.blocks[i]) for i in weights.streamed}
    return [i for i, block in enumerate(blocks) if id(block) in streamed]


def compile_blocks(model: torch.nn.Module, mode: str = "default", *, blocks=None, skip_streamed: bool = False,
                   **compile_options) -> list[int]:
    """Compiles each block of ``model`` (default ``find_blocks(model)``) in place with ``torch.compile``
    (``dynamic=False`` unless given): the modules, their parameters and hooks stay the same objects, so
    a wrapped model's engine keeps working. Returns the indices of the compiled blocks.

    Compilation happens at each block's first call. ``skip_streamed=True`` leaves the blocks whose weights
    stream from host memory eager (which blocks stream is fixed at ``wrap()``). Refuses, before compiling
    anything, the modes that capture CUDA graphs (``reduce-overhead``, ``max-autotune``: not working with
    wrapped blocks yet).
    """
    if mode in _CUDA_GRAPH_MODES:
        raise ValueError(f"mode={mode!r} captures CUDA graphs, which do not work with wrapped blocks yet (CUDA "
                         f"graph trees found memory of theirs still held after a step); use one of "
                         f"{', '.join(map(repr, COMPILE_MODES))}")
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode={mode!r}: one of {', '.join(map(repr, COMPILE_MODES))}")
    blocks = find_blocks(model) if blocks is None else list(blocks)
    if not blocks:
        raise ValueError("no blocks found in the model: pass blocks= (the repeated layers to compile)")
    streamed = _streamed_indices(model, blocks)
    skipped = streamed if skip_streamed else []
    compiled = [i for i in range(len(blocks)) if i not in skipped]
    compile_options.setdefault("dynamic", False)
    # Their hooks stay eager around the compiled forward: a whole-block compile traced the paging hooks into
    # the graph (backward failed in their bookkeeping: a weak reference rebuilt as a strong one), and split a
    # streamed block at its fetch hooks (graph breaks). Stays after unwrap(), as a compiled block would.
    hooked = _paged_ids(model) | {id(blocks[i]) for i in streamed}
    for i in compiled:
        forward = blocks[i].__dict__.get("forward")
        if isinstance(forward, Recompute) and forward.variant == "full":
            forward.compile(mode=mode, **compile_options)
        elif forward is None and id(blocks[i]) in hooked:
            blocks[i].forward = CompiledForward(blocks[i], plain_forward(blocks[i]), dict(mode=mode, **compile_options))
        elif not isinstance(forward, CompiledForward):  # compiled already
            blocks[i].compile(mode=mode, **compile_options)
    session = getattr(model, "_trainstream_session", None)
    if session is not None:
        note = (f"; {len(skipped)} streamed blocks left eager (skip_streamed)" if skipped
                else f", {len(streamed)} of them streamed" if streamed else "")
        session.events.add("compile", f"{len(compiled)} blocks compiled in place (torch.compile mode {mode!r}) "
                                      f"at their first call{note}")
    return compiled
