"""Recompute: a block's activations are not kept but recomputed in backward (non-reentrant
checkpointing, RNG state restored so dropout recomputes bit for bit).

Two variants (``recompute_variant=``): "full" keeps only the block's inputs and runs its whole
forward again in backward; "selective" keeps the outputs of the matrix products (``mm``, ``addmm``,
``bmm``, ``baddbmm``: the projections, the costly part to redo) and recomputes the rest (attention
core, norms, rotary embedding, activation functions, elementwise ops), through torch's selective
activation checkpointing. Selective holds more memory than full and less than keeping everything.
Matmuls that do not dispatch as those ops (ts-quant's fused kernels) are recomputed either way.

A forward that writes buffers (BatchNorm's running statistics) writes them once per step, as without
recomputation: the recomputation puts back what it wrote (torch's own checkpointing updates them twice).

The block's ``forward`` is replaced by an instance attribute that runs the original under
``torch.utils.checkpoint``; removing it restores what was there. A copy of the model
(``copy.deepcopy``, ``torch.save``) gets the plain forward back.

Under ``compile_blocks`` a "full" block compiles the forward that checkpoint runs (``Recompute.compile``),
not the checkpoint: dynamo's checkpoint operator refuses side effects inside it (transformers' decoder
layers set a global through the ``kernels`` package's forward wrapper), and its fallback ran the whole
block eagerly. The checkpoint itself stays eager around the compiled forward, which runs again in backward.

An exception that a signal handler raises (Ctrl-C, a time limit) can land inside torch's checkpoint after it
pushed its saved-tensor hooks and before the ``try`` that pops them: the hooks then stay on autograd's global
stack, and the next forward saves its tensors (the embedding's token ids) into that dead checkpoint, whose
backward fails on the mismatch. When the checkpoint raises, the hooks pushed under it are popped here.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from .compiled_forward import CompiledForward, plain_forward

__all__ = ["RECOMPUTE_VARIANTS", "Recompute", "uses_hf_checkpointing"]

_MISSING = object()
RECOMPUTE_VARIANTS = ("full", "selective")


def _saved_products():
    aten = torch.ops.aten
    return {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def _keep_products(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


_SAVED = _saved_products()


def _selective_contexts():
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_keep_products)


def _top_saved_tensor_hooks():
    """The pack hook on top of autograd's saved-tensor hook stack, or None when it is empty."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return None if top is None else top[0]


def _pop_saved_tensor_hooks_above(below) -> None:
    """Pops the hooks pushed since `below` was on top (what an interrupted checkpoint left behind). Signals are
    held back meanwhile: a second Ctrl-C must not stop the cleanup halfway."""
    from ..engine.interrupts import critical

    with critical():
        while (top := _top_saved_tensor_hooks()) is not None and top is not below:
            torch._C._autograd._pop_saved_tensors_default_hooks()


_plain_forward = plain_forward  # the name models pickled by earlier versions refer to


class Recompute:
    """Installed as ``block.forward``: checkpoints the original forward when gradients are on."""

    def __init__(self, block: torch.nn.Module, variant: str = "full"):
        if variant not in RECOMPUTE_VARIANTS:
            raise ValueError(f"recompute_variant={variant!r} is not valid; use 'full' or 'selective'")
        self.block = block
        self.variant = variant
        self.previous = block.__dict__.get("forward", _MISSING)
        self.original = self.previous if self.previous is not _MISSING else plain_forward(block)
        self.calls = 0
        self.enabled = True  # the automatic policy switches blocks between steps
        self.compiled: CompiledForward | None = None  # set by compile(): what runs, checkpointed or not
        # Buffers the block's forward writes (BatchNorm's running statistics), learned at the first checkpointed
        # forward: the recomputation in backward restores them, so each forward counts once, as without it.
        self.mutated: list[str] | None = None

    def __call__(self, *args, **kwargs):
        forward = self.original if self.compiled is None else self.compiled.now()
        if not self.enabled or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        self.calls += 1
        extra = {"context_fn": _selective_contexts} if self.variant == "selective" else {}
        learning = self.mutated is None
        if learning:  # once: which buffers does this forward write? (kernels such as batch_norm's may not
            # bump the version counter of what they update, so the values are compared)
            before = {name: b.detach().clone() for name, b in self.block.named_buffers()}
        below = _top_saved_tensor_hooks()
        try:
            out = torch.utils.checkpoint.checkpoint(self._buffers_kept(forward), *args, use_reentrant=False,
                                                    preserve_rng_state=True, **extra, **kwargs)
        except BaseException:
            _pop_saved_tensor_hooks_above(below)
            raise
        if learning:
            self.mutated = [name for name, b in self.block.named_buffers()
                            if name not in before or not torch.equal(b, before[name])]
        return out

    def _buffers_kept(self, forward):
        """`forward`, which in the recomputation (inside backward) puts back the buffers it writes. The copies
        are made outside any dispatch mode of the checkpoint (the selective variant's policy sees every op)."""
        from torch.utils._python_dispatch import _disable_current_modes

        def run(*args, **kwargs):
            if not self.mutated or torch._C._current_graph_task_id() < 0:  # the first forward: as it is
                return forward(*args, **kwargs)
            buffers = dict(self.block.named_buffers())
            with _disable_current_modes(), torch.no_grad():
                kept = {name: buffers[name].clone() for name in self.mutated if name in buffers}
            try:
                return forward(*args, **kwargs)
            finally:
                with _disable_current_modes(), torch.no_grad():
                    for name, value in kept.items():
                        buffers[name].copy_(value)
        return run

    def compile(self, **options) -> None:
        """Compiles the block's forward under the checkpoint (``torch.compile`` options). "full" only: the
        selective variant's policy picks aten ops as they dispatch, which a compiled graph hides."""
        if self.variant != "full":
            raise ValueError("only recompute_variant='full' compiles the forward inside its checkpoint")
        if self.compiled is None:
            self.compiled = CompiledForward(self.block, self.original, options)

    def install(self) -> Recompute:
        self.block.forward = self
        return self

    def remove(self) -> None:
        if self.block.__dict__.get("forward") is self:
            if self.previous is _MISSING:
                del self.block.forward
            else:
                self.block.forward = self.previous
            if self.compiled is not None:  # unwrapped, the block stays compiled, as compile_blocks left the others
                self.block.compile(**self.compiled.options)

    def __reduce__(self):  # copies of the model run the plain forward
        return (plain_forward, (self.block,))


def uses_hf_checkpointing(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> bool:
    """True when Hugging Face gradient checkpointing is on (``gradient_checkpointing_enable()``): some module's
    ``gradient_checkpointing`` flag is set, which is what transformers' own property reads (its name changed
    in transformers 5, ``is_gradient_checkpointing`` deprecated for ``is_activation_checkpointing``; the flag
    did not)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in (*model.modules(), *blocks))
