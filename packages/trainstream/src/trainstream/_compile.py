"""compile_blocks: torch.compile of a model's blocks in place, where that is correct.

What compiles (tests/test_compile.py): plain blocks and blocks of quantized LoRA layers whole (no graph
break: ts-quant's quantized_linear is a custom op under tracing); blocks recomputed whole (variant
"full") compile the forward their checkpoint runs, with the checkpoint eager around it (memory/recompute.py
says why); paged blocks compile their forward, with the paging hooks eager around it (CompiledForward);
selectively recomputed blocks with graph breaks around what dynamo cannot trace.
What is refused: blocks whose weights stream from host memory
(a compiled block is one backward node; streaming fetches a block from hooks on its modules' outputs).
Measured on the H200 (docs/results/compile-lora14b-nf4-h200-2026-12-04.log): the NF4 14B LoRA step at
1 x 512, host-bound in eager, stepped in 0.240 s against 0.291 s with mode "default".
"""

from __future__ import annotations

import torch

from .memory import find_blocks
from .memory.compiled_forward import CompiledForward, plain_forward
from .memory.recompute import Recompute

__all__ = ["COMPILE_MODES", "compile_blocks"]

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# Refused: on the H200 (2026-12-04) CUDA graph trees stopped the 14B NF4 LoRA step at its second step
# ("3 tensors in the cudagraph pool not tracked as outputs"). Likely ts-quant's per-stream stream-K state,
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

    Compilation happens at each block's first call. Refuses, before compiling anything, blocks whose
    weights stream from host memory (``skip_streamed=True`` compiles the others: which blocks stream is
    fixed at ``wrap()``, none starts streaming later) and the modes that capture CUDA graphs
    (``reduce-overhead``, ``max-autotune``: not working with wrapped blocks yet).
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
    if streamed and not skip_streamed:
        raise ValueError(f"blocks {streamed} stream their weights from host memory; a compiled block cannot "
                         f"fetch them where backward needs them: pass skip_streamed=True to compile the others, "
                         f"or wrap with param_offload=False")
    compiled = [i for i in range(len(blocks)) if i not in streamed]
    compile_options.setdefault("dynamic", False)
    paged = _paged_ids(model)
    for i in compiled:
        forward = blocks[i].__dict__.get("forward")
        if isinstance(forward, Recompute) and forward.variant == "full":
            forward.compile(mode=mode, **compile_options)
        elif forward is None and id(blocks[i]) in paged:
            # Its paging hooks stay eager around the compiled forward: a whole-block compile traced them into
            # the graph, and backward failed in their bookkeeping (a weak reference rebuilt as a strong one).
            # Stays after unwrap(), as a compiled block would.
            blocks[i].forward = CompiledForward(blocks[i], plain_forward(blocks[i]), dict(mode=mode, **compile_options))
        elif not isinstance(forward, CompiledForward):  # compiled already
            blocks[i].compile(mode=mode, **compile_options)
    session = getattr(model, "_trainstream_session", None)
    if session is not None:
        skipped = f"; {len(streamed)} streamed blocks left eager" if streamed else ""
        session.events.add("compile", f"{len(compiled)} blocks compiled in place (torch.compile mode {mode!r}) "
                                      f"at their first call{skipped}")
    return compiled
