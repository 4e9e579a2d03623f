"""The memory model: bytes of VRAM, host RAM and page-locked host RAM one training step needs, by
category, for a model shape and a set of concrete choices (``Options``), plus the step's lower bound
from the budget's rates. Sizes in bytes, rates in GB/s (1e9 bytes/s), params/s and TFLOP/s."""

from __future__ import annotations

import dataclasses
import math

from ._activations import block_backward_bytes, block_saved_tensors, checkpoint_bytes
from ._formats import DTYPE_BYTES, WEIGHT_FORMATS, weight_bytes
from ._shape import LORA_TARGETS, ModelShape

__all__ = ["MemoryEstimate", "Options", "estimate_memory"]

MiB, GiB = 1 << 20, 1 << 30


@dataclasses.dataclass(frozen=True)
class Options:
    """One concrete way to run a step.

    ``train``: "full" (every parameter) or "lora" (adapters of ``lora_rank`` on ``lora_targets``, base frozen).
    ``quantize``: format of the frozen block projections (None: ``dtype``). ``optimizer``: where AdamW's
    state lives and runs, "host" (trainstream's offload) or "gpu". Activations per block: ``keep`` in VRAM
    (None: the blocks neither paged nor recomputed), ``page`` to host memory, ``recompute`` in backward.
    ``streamed_blocks``: blocks whose weights live in host memory and stream in. ``loss_chunk``: tokens per
    chunk of trainstream's chunked loss (None: the full [tokens, vocab] logits, as Hugging Face computes them).
    ``streamed_shared_by``: processes of this machine that map one host copy of the streamed frozen
    weights (data parallel); each counts its share, as each gets its share of the machine's RAM.
    ``state_shared_by``: data-parallel ranks among which trainstream splits the trained parameters' host
    optimizer state by element (``state_share``: the busiest rank's part is priced); every gradient then waits
    in VRAM for ``step()``, beside its copy in the bucket reduced during backward (twice the gradients' bytes).
    ``compact_lora_inputs``: LoRA layers save their 16-bit input instead of a float32 copy (trainstream's
    option of that name). ``stream_packing``: the fraction of a streamed block's frozen bytes that cross the
    link (trainstream's ``stream_packing``: exponent-packed bf16, about 0.75; 1.0: as stored); below 1 a
    packed copy sits in host memory beside the plain one, and one staging buffer of it in VRAM.
    ``embedding_on_host``: a LoRA run's frozen input embedding lives in page-locked host memory and the GPU
    reads the rows it looks up over the link (trainstream's ``host_embedding``). ``disk_state_share``: the
    fraction of the host optimizer's values whose fp32 master and moments live on disk (trainstream's
    ``nvme_path``): taken off host RAM, read and written once per step (``MemoryEstimate.disk_bytes``).
    ``fsdp_shards``: FSDP2 (``fully_shard``) over that many ranks: each holds 1/N of every weight, gradient and
    optimizer state by element, all-gathers a block's weights to run it (the running block and the next one
    in flight) and reduce-scatters its gradients (priced at fp32, FSDP2's ``reduce_dtype`` in trainstream's
    tests); ``MemoryEstimate.network_bytes`` counts what each rank sends. Not with streamed blocks or
    ``state_shared_by`` (trainstream's own data parallel).
    """

    batch: int = 1
    seq: int = 2048
    train: str = "full"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = LORA_TARGETS
    adapter_dtype: str = "float32"
    dtype: str = "bfloat16"
    quantize: str | None = None
    moment_dtype: str = "float32"
    optimizer: str = "host"
    master_weights: bool = True
    keep: int | None = None
    page: int = 0
    recompute: int = 0
    streamed_blocks: int = 0
    loss_chunk: int | None = None
    streamed_shared_by: int = 1
    state_shared_by: int = 1
    compact_lora_inputs: bool = False
    stream_packing: float = 1.0
    embedding_on_host: bool = False
    disk_state_share: float = 0.0
    fsdp_shards: int = 1

    def __post_init__(self) -> None:
        def count(name, value, low):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")

        count("batch", self.batch, 1)
        count("seq", self.seq, 1)
        count("page", self.page, 0)
        count("recompute", self.recompute, 0)
        count("streamed_blocks", self.streamed_blocks, 0)
        count("streamed_shared_by", self.streamed_shared_by, 1)
        count("state_shared_by", self.state_shared_by, 1)
        count("fsdp_shards", self.fsdp_shards, 1)
        if self.fsdp_shards > 1 and (self.streamed_blocks or self.state_shared_by > 1):
            raise ValueError("fsdp_shards: FSDP2 owns the sharded weights; streamed blocks and trainstream's own "
                             "data parallel (state_shared_by) do not apply")
        if self.keep is not None:
            count("keep", self.keep, 0)
        if isinstance(self.stream_packing, bool) or not (isinstance(self.stream_packing, (int, float))
                                                         and 0 < self.stream_packing <= 1):
            raise ValueError(f"stream_packing={self.stream_packing!r} must be a fraction in (0, 1]")
        if self.loss_chunk is not None:
            count("loss_chunk", self.loss_chunk, 1)
        if isinstance(self.disk_state_share, bool) or not (isinstance(self.disk_state_share, (int, float))
                                                           and 0 <= self.disk_state_share <= 1):
            raise ValueError(f"disk_state_share={self.disk_state_share!r} must be a fraction in [0, 1]")
        if self.disk_state_share and self.optimizer != "host":
            raise ValueError("disk_state_share: the state on disk is host AdamW's; use optimizer='host'")
        if self.train not in ("full", "lora"):
            raise ValueError(f"train={self.train!r} is not valid; use 'full' or 'lora'")
        if self.train == "lora":
            count("lora_rank", self.lora_rank, 1)
            unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
            if unknown or not self.lora_targets:
                raise ValueError(f"lora_targets={self.lora_targets!r}: use a non-empty subset of {LORA_TARGETS}")
        for name in ("dtype", "adapter_dtype", "moment_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name}={getattr(self, name)!r} is not valid; use one of {', '.join(DTYPE_BYTES)}")
        if self.quantize not in WEIGHT_FORMATS:
            raise ValueError(f"quantize={self.quantize!r} is not a format; use None, int8, nf4, fp8 or nvfp4")
        if self.quantize is not None and self.train == "full":
            raise ValueError(f"quantize={self.quantize!r} stores frozen weights; full fine-tuning trains them all "
                             "(use train='lora', or quantize=None)")
        if self.optimizer not in ("host", "gpu"):
            raise ValueError(f"optimizer={self.optimizer!r} is not valid; use 'host' or 'gpu'")
        if self.embedding_on_host and self.train != "lora":
            raise ValueError("embedding_on_host is for a frozen embedding (train='lora'): a trained one updates in VRAM")
        if self.optimizer == "gpu" and self.train == "full" and self.streamed_blocks:
            raise ValueError("streamed_blocks needs optimizer='host' for full fine-tuning: a block whose weights "
                             "stream in is updated where its state lives, on the host")

    def activation_counts(self, layers: int) -> tuple[int, int, int]:
        """(keep, page, recompute) for a stack of `layers` blocks; ValueError when they do not add up."""
        keep = layers - self.page - self.recompute if self.keep is None else self.keep
        if keep < 0 or keep + self.page + self.recompute != layers:
            raise ValueError(f"keep={self.keep}, page={self.page}, recompute={self.recompute} do not add up to the "
                             f"{layers} blocks of the model")
        return keep, self.page, self.recompute


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes by category: ``vram`` (the CUDA caching allocator's peak, plus ``cuda_context`` which lies outside
    it), ``host`` (RAM, page-locked parts included) and ``pinned`` (the page-locked parts). Per block:
    ``saved_bytes`` (unique storage a kept block holds), ``paged_bytes`` (what paging one block copies out),
    ``block_weight_bytes`` (one block's weights as stored on the device). Per step: ``h2d_bytes`` and
    ``d2h_bytes`` over the link, ``flops``, ``host_optimizer_params`` (values host AdamW updates), ``block_forward_flops`` (what
    recomputing one block costs), ``disk_bytes`` (optimizer state on disk: read and written once each),
    ``network_bytes`` (what this rank sends to the others in a step: data parallel's gradient reduction and
    weight broadcast, or FSDP2's all-gathers and reduce-scatter; ring collectives, (N-1)/N of each tensor)."""

    vram: dict[str, int]
    host: dict[str, int]
    pinned: dict[str, int]
    saved_bytes: int
    paged_bytes: int
    block_weight_bytes: int
    trained_params: int
    h2d_bytes: int
    d2h_bytes: int
    flops: float
    host_optimizer_params: int
    block_forward_flops: float
    disk_bytes: int = 0
    network_bytes: int = 0

    @property
    def allocator_bytes(self) -> int:
        """Predicted peak of the caching allocator (``torch.cuda.max_memory_allocated``)."""
        return sum(v for k, v in self.vram.items() if k != "cuda_context")

    @property
    def device_bytes(self) -> int:
        return sum(self.vram.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def pinned_bytes(self) -> int:
        return sum(self.pinned.values())


def _block_weights(shape: ModelShape, o: Options) -> tuple[int, int, int, int]:
    """One block: (trained values, trained bytes, frozen bytes on the device, matmul values)."""
    a, ad = DTYPE_BYTES[o.dtype], DTYPE_BYTES[o.adapter_dtype]
    matmul = sum(i * j for i, j, _ in shape.linears().values())  # per token: the experts it takes
    if o.train == "full":
        return shape.block_params, shape.block_params * a, 0, matmul
    stored = shape.weight_linears()  # every expert's weights, trained or not
    adapters = sum(n * o.lora_rank * (i + j) for name, i, j, _, n in stored if name in o.lora_targets)
    frozen = sum(n * (weight_bytes(j, i, o.quantize, a) + (j * a if bias else 0)) for _, i, j, bias, n in stored)
    return adapters, adapters * ad, frozen + 2 * shape.hidden_size * a, matmul


def state_share(shape: ModelShape, options: Options) -> float:
    """The fraction of the trained values whose host optimizer state the busiest of ``state_shared_by`` ranks
    holds: trainstream's data parallel splits the trained values evenly by element (a tensor larger than a
    rank's share is split between ranks), so the busiest holds ceil(values / ranks) of them. Under FSDP2
    (``fsdp_shards``) every rank holds 1/N by element too (its shards)."""
    if options.fsdp_shards > 1:
        return 1.0 / options.fsdp_shards  # FSDP2 shards by element: an even split
    ranks = options.state_shared_by
    if ranks == 1:
        return 1.0
    o, layers = options, shape.num_hidden_layers
    if o.train == "full":
        trained = layers * shape.block_params + shape.embedding_params + shape.head_params
    else:
        targets = [(i, j, n) for name, i, j, _, n in shape.weight_linears() if name in o.lora_targets]
        trained = layers * sum(n * o.lora_rank * (i + j) for i, j, n in targets)
    return 1.0 if trained == 0 else -(-trained // ranks) / trained


def _network_bytes(o: Options, trained: int, trained_dtype: int, weight_bytes_all: int) -> int:
    """Bytes one rank sends in a step over ring collectives ((N-1)/N of each tensor). trainstream's data parallel
    (``state_shared_by``): the gradients reduced to their owners and the new weights broadcast back, each once.
    FSDP2 (``fsdp_shards``): every weight all-gathered twice (forward, and backward or recomputation) and the
    trained gradients reduce-scattered once at fp32 (the ZeRO-3 volume, arXiv 1910.02054 section 7)."""
    if o.fsdp_shards > 1:
        n = o.fsdp_shards
        return round((2 * weight_bytes_all + trained * 4) * (n - 1) / n)
    if o.state_shared_by > 1:
        n = o.state_shared_by
        return round(2 * trained * trained_dtype * (n - 1) / n)
    return 0


def estimate_memory(shape: ModelShape, options: Options, cuda_context_bytes: int = 512 * MiB,
                    runtime_host_bytes: int = 2 * GiB) -> MemoryEstimate:
    """The bytes one training step of `shape` needs with `options`, by category (see MemoryEstimate).
    ``cuda_context_bytes``: the CUDA context and libraries' workspaces (outside the allocator);
    ``runtime_host_bytes``: host RAM the Python process and CUDA runtime take besides the training state."""
    o, layers = options, shape.num_hidden_layers
    keep, page, recompute = o.activation_counts(layers)
    if o.streamed_blocks > layers:
        raise ValueError(f"streamed_blocks={o.streamed_blocks} exceeds the model's {layers} blocks")
    a, m = DTYPE_BYTES[o.dtype], DTYPE_BYTES[o.moment_dtype]
    trained_dtype = a if o.train == "full" else DTYPE_BYTES[o.adapter_dtype]
    tokens, h, v = o.batch * o.seq, shape.hidden_size, shape.vocab_size
    block_trained, block_trained_bytes, block_frozen_bytes, matmul = _block_weights(shape, o)
    block_bytes = block_trained_bytes + block_frozen_bytes
    outer = shape.embedding_params + shape.head_params  # embedding, final norm, untied output layer
    outer_trained = outer if o.train == "full" else 0
    trained = layers * block_trained + outer_trained
    resident = layers - o.streamed_blocks
    if o.embedding_on_host and shape.tie_word_embeddings:
        raise ValueError("embedding_on_host needs an untied embedding: a tied one is the output layer's weight too")
    host_embedding = shape.hidden_size * shape.vocab_size * a if o.embedding_on_host else 0

    # Activations of one block: unique storage held in VRAM, every saved tensor for paging.
    saved = block_saved_tensors(shape, o.batch, o.seq, train=o.train, lora_rank=o.lora_rank,
                                lora_targets=o.lora_targets, adapter_dtype=o.adapter_dtype, dtype=o.dtype,
                                compact_lora_inputs=o.compact_lora_inputs)
    unique, packed = sum(dict(saved).values()), sum(n for _, n in saved)
    if o.loss_chunk is None:  # HF: fp32 logits; backward holds log_softmax's output, its gradient and the input's
        loss = tokens * v * 12
    else:
        loss = min(o.loss_chunk, tokens) * v * 12 + tokens * 8
    loss += tokens * h * (a + 4) + tokens * 4  # the final norm's fp32 input and the head's input

    # Gradients on the device: all of them until step() when the optimizer is there; else the ones in
    # flight to the host. An untied output layer's gradient leaves during the loss's backward, two blocks'
    # worth at a time during the blocks', the embedding's after the last block: one of the three at a time
    # (the full7b plan added them and over-predicted its peak by 15 %). A tied weight's gradient sums its
    # output-layer and embedding parts, so autograd holds it through the whole backward.
    if o.optimizer == "gpu":
        shards = o.fsdp_shards  # FSDP2: each rank's gradients and state are its shards (plus a block in flight)
        grads = math.ceil(trained * trained_dtype / shards) + (2 * block_trained * trained_dtype if shards > 1 else 0)
        if o.state_shared_by > 1:  # trainstream's data parallel: the buckets reduced during backward hold copies
            grads += trained * trained_dtype
        state = math.ceil(trained * (2 * m + (4 if trained_dtype != 4 and o.master_weights else 0)) / shards)
        host_state, host_params, disk_bytes = 0, 0, 0
    else:
        in_flight = 2 * block_trained * trained_dtype
        if o.state_shared_by > 1:  # trainstream's data parallel: reduced at step(), their bucket copies beside them
            grads = 2 * trained * trained_dtype
        elif o.train != "full":
            grads = in_flight
        elif shape.tie_word_embeddings:
            grads = in_flight + outer_trained * a
        else:
            grads = max(in_flight, shape.head_params * a, shape.embedding_params * a)
        state = 0
        upload = trained_dtype if trained_dtype != 4 else 0  # the updated weights' staging copy
        owned = math.ceil(trained * state_share(shape, o))  # data parallel: this rank's part (all of it alone)
        host_state, host_params = owned * (4 + 2 * m + trained_dtype + upload), owned
        # The disk tier keeps master and moments of some values on disk; in RAM each keeps its gradient
        # buffer and an upload buffer (which an fp32 weight's master no longer doubles as).
        on_disk = round(owned * o.disk_state_share)
        host_state -= on_disk * (4 + 2 * m + upload - trained_dtype)
        disk_bytes = on_disk * (4 + 2 * m)
    vram = {
        "cuda_context": cuda_context_bytes,
        "trained_weights": resident * block_trained_bytes + outer_trained * a
                           + (o.streamed_blocks * block_trained_bytes if o.train == "lora" else 0),
        "frozen_weights": resident * block_frozen_bytes + (outer * a if o.train == "lora" else 0) - host_embedding,
        "stream_buffers": min(o.streamed_blocks, 2) * block_bytes  # the block computing, the next arriving
                          + (round(o.stream_packing * block_frozen_bytes)  # the packed bytes' staging buffer
                             if o.streamed_blocks and o.stream_packing < 1 else 0),
        "gradients": grads,
        "optimizer_state": state,
        "activations_kept": keep * unique,
        "activations_paged": min(page, 2) * unique,  # the pages being written out / read back
        "activations_recompute": recompute * checkpoint_bytes(shape, o.batch, o.seq, o.dtype)
                                 + (unique if recompute else 0),  # the block recomputed for its backward
        "hidden_states": 2 * tokens * h * a,  # the residual stream into and out of the running block
        "output_and_loss": loss,
        "backward_working_set": max(0, block_backward_bytes(shape, o.batch, o.seq, o.dtype) - loss),
    }
    packed_copy = round(o.streamed_blocks * block_frozen_bytes * o.stream_packing) if o.stream_packing < 1 else 0
    if o.train == "lora":  # adapters stay resident even when their block streams
        streamed_host = -(-o.streamed_blocks * block_frozen_bytes // o.streamed_shared_by) + packed_copy
    else:  # a streamed full-FT block's bf16 copy is the host optimizer's upload buffer, already counted
        streamed_host = o.streamed_blocks * (block_frozen_bytes + (0 if o.optimizer == "host" else block_trained_bytes))
    pinned = {"optimizer_state": host_state, "streamed_weights": streamed_host, "activation_pages": page * packed,
              "embedding": host_embedding}
    host = {**pinned, "runtime": runtime_host_bytes}

    # In for forward, again for backward (and recompute); packed frozen bytes cross as packed.
    streamed_link = round(o.streamed_blocks * (block_frozen_bytes * o.stream_packing + block_trained_bytes) * 2)
    h2d = (streamed_link + page * packed + (trained * trained_dtype if o.optimizer == "host" else 0)
           + (tokens * h * a if o.embedding_on_host else 0))  # the rows looked up
    d2h = page * packed + (trained * trained_dtype if o.optimizer == "host" else 0)
    block_fwd = 2 * tokens * matmul + 2 * o.batch * o.seq * o.seq * shape.q_dim  # causal attention: half of 4BT^2
    head_fwd = 2 * tokens * h * v
    passes = 3 if o.train == "full" else 2  # a frozen base needs no weight gradients
    flops = layers * block_fwd * passes + head_fwd * passes + recompute * block_fwd
    network = _network_bytes(o, trained, trained_dtype, layers * block_bytes + outer * a)
    if o.fsdp_shards > 1:  # each rank keeps 1/N of the weights, and gathers the running block and the next
        n = o.fsdp_shards
        vram["trained_weights"] = math.ceil(vram["trained_weights"] / n) + 2 * block_trained_bytes
        vram["frozen_weights"] = math.ceil(vram["frozen_weights"] / n) + 2 * block_frozen_bytes
    return MemoryEstimate(vram, host, pinned, unique, packed, block_bytes, trained, h2d, d2h, float(flops),
                          host_params, float(block_fwd), disk_bytes, network)
