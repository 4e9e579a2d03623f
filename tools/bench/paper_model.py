r"""A paper model of a 14B full fine-tune on 128 ranks: per rank and step, the bytes over the network and over
PCIe, the host RAM and VRAM held, and an estimated step time, for five ways to run it. PAPER ESTIMATE, NOT A
MEASUREMENT: nothing here ran on 128 GPUs; every rate is a named assumption (``ASSUMPTIONS``), printed beside
the figures it produces.

The run: the Qwen2.5-14B shape (``ts_planner.ModelShape``: hidden 5120, intermediate 13824, 48 layers, 40 heads,
8 key/value heads, vocabulary 152064, q/k/v biases, untied output layer), every parameter trained, bf16 weights
and gradients on the GPU, AdamW with fp32 master weights and fp32 moments, 16 nodes of 8 GPUs (N = 128 ranks).

Notation: P = trained parameters (``ModelShape.total_params``), b = 2 bytes (bf16), N = ranks, R = the values
of the root unit (embedding, final norm and output layer: what ``fully_shard(model)`` on the root holds once
each block was ``fully_shard``-ed), s = the share of P whose optimizer state trainstream's busiest rank owns
(``ts_planner.state_share``: the values split evenly by element, so 1/N to one value).

Network, bytes each rank sends per step. Ring collectives: an all-gather or a reduce-scatter of B bytes sends
(N-1)/N x B from every rank, a reduce or a broadcast (a pipelined chain) about B. The ZeRO paper (Rajbhandari
et al., arXiv 1910.02054, section 7, "Communication Analysis of ZeRO-DP") counts the same way: data parallel's
all-reduce moves 2 x the parameters per step (a reduce-scatter then an all-gather), ZeRO stage 2 (optimizer state
and gradients partitioned) the same 2x, stage 3 (parameters partitioned too) 3x: an all-gather in forward, one in
backward and a reduce-scatter, 1.5x data parallel.

    trainstream replicated DP (today)  reduce of every gradient to its owner + broadcast of every new weight:
                                       2 x P x b (docs/distributed.md, "What each rank keeps and does")
    FSDP2 + trainstream                all-gather in forward and again in backward, except the root unit, which
                                       FSDP2 keeps gathered from forward to backward (torch's fully_shard:
                                       reshard_after_forward=None is False for the root), + reduce-scatter:
                                       (2P - R + P) x b x (N-1)/N
    DeepSpeed ZeRO-2 offload           reduce-scatter of the gradients + all-gather of the new bf16 weights:
                                       2 x P x b x (N-1)/N
    DeepSpeed ZeRO-3 offload           2 all-gathers + reduce-scatter: 3 x P x b x (N-1)/N
    FSDP2 with CPUOffloadPolicy        as FSDP2 + trainstream (the all-gathers run in param_dtype, bf16)

Gradients are reduced in bf16 everywhere. Under FSDP2 + trainstream the model is in bf16 (its shards 2 bytes a
value; trainstream keeps the fp32 master in host RAM); under FSDP2 with CPUOffloadPolicy the shards are the fp32
master weights, all-gathered in bf16 (``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.bfloat16)``) and updated by torch's AdamW on the CPU.
A ring's per-rank volume V crosses each node's link once (every node has one link in the ring, carrying V), so
the network term is V / the node's network rate: the 8 ranks of a node share it, NVLink inside the node is
assumed not to be the bound.

PCIe, bytes each way per rank (H2D up, D2H down); its term is the larger way / the link's rate (full duplex, as
``ts_planner.check_plan`` prices the link):

    trainstream replicated DP          down: the owned gradients s x P x b; up: the owned new weights s x P x b
    FSDP2 + trainstream                down: the gradient shard P x b / N; up: the new weight shard P x b / N
    ZeRO-2 offload                     down: the gradient partition P x b / N; up: the new bf16 partition P x b / N
                                       (a 16-bit H2D copy: DeepSpeed PR 7309)
    ZeRO-3 offload (params offloaded)  up: the bf16 parameter partition for each of the 2 all-gathers 2 x P x b / N;
                                       down: the gradient partition P x b / N (tools/bench/deepspeed_zero3.json
                                       offloads the optimizer and the parameters)
    FSDP2 CPUOffloadPolicy             the sharded parameters are the fp32 masters in host RAM and cross as fp32
                                       before the cast to bf16 (FSDPParam.all_gather_inputs), for each all-gather:
                                       up (2P - R) x 4 / N; the reduced gradient shard is cast back to fp32 before
                                       its D2H copy (foreach_reduce): down P x 4 / N

Host RAM, training state per rank: trainstream keeps 16 bytes per owned value (fp32 master, two fp32 moments, a
bf16 gradient buffer, a bf16 upload buffer: ``ts_planner.estimate_memory``), s x P values replicated, P / N
values under FSDP2; ZeRO-2 offload 16 x P / N (fp32 master, moments and fp32 gradient partition); ZeRO-3 offload
18 x P / N (the same and the bf16 parameter partition); FSDP2 CPUOffloadPolicy 16 x P / N (fp32 sharded
parameters, fp32 gradient shards, two moments).

VRAM, model state per rank: replicated DP 3 x P x b (weights; gradients, kept in ``param.grad`` until ``step()``;
the bucket copies the overlap makes: docs/distributed.md, "The cost"); FSDP2 + trainstream P x b / N of shards +
the working set; ZeRO-2 offload P x b + two gradient buckets of DeepSpeed's ``reduce_bucket_size``; ZeRO-3
offload and FSDP2 CPUOffloadPolicy the working set. Working set: the root unit and two blocks (one computing,
one prefetched) gathered, and their unsharded gradients: 2 x (R + 2 x block) x b. Activations are the same in
every configuration (``ts_planner.estimate_memory``, every block recomputed) and shown apart.

Step time. Compute: ``ts_planner.estimate_memory``'s FLOPs of one step (forward, backward, the recompute) at
the assumed matmul rate. Host AdamW: the values this rank updates at the assumed rate. The estimate asked for is
max(compute, network, PCIe, host AdamW): every transfer hidden behind the others, a lower bound. The second
estimate adds what each engine runs after backward returns (with clipping, the updates wait for the global
norm): every configuration its host AdamW; replicated DP then the broadcast of the new weights; ZeRO-2 the
upload and all-gather of the new partition. ZeRO-3 and FSDP2 gather the new weights at the next forward.

Sources. The ZeRO paper (arXiv 1910.02054), section 7: 2x the parameters per step for data parallel and for
ZeRO stages 1-2, 3x (1.5x) with the parameters partitioned; its abstract's "a maximum of 1.5x communication" is
quoted in PaddlePaddle issue 25863 and DeepSpeed's blog post "ZeRO stage 1 with reduced communication"
(deepspeed.ai, 2020-03-17) gives the 1.5x -> 1x, both found with the search tool; the paper itself was not in
its corpus. ZeRO-Offload (Ren et al., arXiv 2101.06840): fp32 master weights, moments and gradients on the CPU,
16-bit weights on the GPU, gradients down and weights up once per step. DeepSpeed PR 7309 ("Fix the GPU memory
usage of ZeRO-Offload"): the H2D copy of stages 1-2 goes through a 16-bit pinned buffer. FSDP2: torch 2.13's
``torch/distributed/fsdp/_fully_shard/``: ``_fully_shard.py`` (reshard_after_forward), ``_fsdp_state.py`` (the
root is not resharded after forward), ``_fsdp_param.py`` (``all_gather_inputs``: an offloaded shard is copied to
the GPU, then cast to param_dtype), ``_fsdp_collectives.py`` (``foreach_reduce``: the reduced shard cast to the
parameter's dtype, then copied to the CPU). trainstream's own: docs/distributed.md and
``packages/trainstream/src/trainstream/distributed/``.

    python tools/bench/paper_model.py                    # print the tables
    python tools/bench/paper_model.py --out model.json   # and write the JSON record
    python tools/bench/paper_model.py --write            # render them into docs/multi-node.md
    python tools/bench/paper_model.py --check            # exit 1 when docs/multi-node.md differs (tested)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import ts_planner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "multi-node.md")
BEGIN = "<!-- generated by tools/bench/paper_model.py -->"
END = "<!-- end generated: paper model -->"

SHAPE = ts_planner.ModelShape(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                              num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, qkv_bias=True)
NODES, GPUS_PER_NODE = 16, 8
BF16 = 2  # bytes of a bf16 weight or gradient
FP32 = 4


@dataclasses.dataclass(frozen=True)
class Assumption:
    value: float
    unit: str
    why: str


ASSUMPTIONS = {
    "matmul_tflops": Assumption(400.0, "TFLOP/s per GPU", "bf16 achieved in training, about 40 % of the H100 SXM's "
                                "989 TFLOP/s dense peak"),
    "network_gbps_per_node": Assumption(50.0, "GB/s per node, each way", "400 Gb/s per node at line rate, shared by "
                                        "its 8 ranks"),
    "pcie_gbps": Assumption(55.0, "GB/s per GPU, each way", "PCIe 5 x16; 55.2 GB/s measured for one H100 of the lent "
                            "host (docs/results/compare-full1.5b-h100-2026-12-05.json, rates); 8 at once share "
                            "the host's memory, not modelled"),
    "host_adamw_params_per_s": Assumption(1.5e9, "values/s per rank", "5.5 G/s measured with 16 cores for one "
                                          "process on the lent H100 host (same record); a node's cores and memory "
                                          "shared by 8 ranks; the same rate for every engine (torch's CPU AdamW "
                                          "makes several passes over memory: slower)"),
    "gpu_memory_gb": Assumption(80.0, "GB per GPU", "H100 80 GB"),
    "tokens_per_rank": Assumption(4096, "tokens per rank and step", "1 sequence of 4096; 524,288 tokens per step "
                                  "over the 128 ranks"),
    "ds_reduce_bucket_values": Assumption(5e8, "values", "DeepSpeed's default reduce_bucket_size; two buckets in "
                                          "VRAM with overlap_comm"),
}


def rate(name: str) -> float:
    return ASSUMPTIONS[name].value


def _shape_counts() -> dict:
    P = SHAPE.total_params
    root = SHAPE.embedding_params + SHAPE.head_params
    return {"P": P, "R": root, "block": SHAPE.block_params}


def _activations() -> tuple[float, dict]:
    """(FLOPs of one step, VRAM bytes of activations and the CUDA context): ts-planner's model, every block
    recomputed, the same in every configuration."""
    options = ts_planner.Options(batch=1, seq=int(rate("tokens_per_rank")), recompute=SHAPE.num_hidden_layers)
    e = ts_planner.estimate_memory(SHAPE, options)
    parts = ("activations_recompute", "hidden_states", "output_and_loss", "backward_working_set", "cuda_context")
    return e.flops, {k: e.vram[k] for k in parts}


def _trainstream_state_bytes_per_value() -> float:
    """Host bytes trainstream keeps per owned value (ts-planner's model of one process, all values owned)."""
    e = ts_planner.estimate_memory(SHAPE, ts_planner.Options(batch=1, seq=16))
    return e.pinned["optimizer_state"] / SHAPE.total_params


def configurations(world: int = NODES * GPUS_PER_NODE) -> dict[str, dict]:
    """Per configuration: network bytes sent per rank (during backward / after it), PCIe bytes each way (up,
    down), host RAM and VRAM of the training state, the values host AdamW updates (module docstring)."""
    c = _shape_counts()
    P, R, block, N, b = c["P"], c["R"], c["block"], world, BF16
    ring = (N - 1) / N
    share = ts_planner.state_share(SHAPE, ts_planner.Options(state_shared_by=N))
    owned = share * P
    ts_bytes = _trainstream_state_bytes_per_value()
    working_set = 2 * (R + 2 * block) * b
    fsdp_gathers = 2 * P - R  # the root unit stays gathered from forward to backward
    return {
        "trainstream replicated DP (today)": {
            "moves": "reduce of every gradient to its owner, broadcast of every new weight",
            "network_in_backward": P * b, "network_after": P * b,
            "pcie_up": owned * b, "pcie_down": owned * b, "pcie_after": True,
            "host_bytes": owned * ts_bytes, "vram_state": 3 * P * b, "adamw_values": owned,
            "holds": f"whole bf16 model and gradients; the state split by element: the busiest rank owns "
                     f"{share:.2%} of the values (1/{N})"},
        "FSDP2 + trainstream": {
            "moves": "all-gather in forward and backward (root unit once), reduce-scatter",
            "network_in_backward": (fsdp_gathers + P) * b * ring, "network_after": 0.0,
            "pcie_up": P * b / N, "pcie_down": P * b / N, "pcie_after": False,
            "host_bytes": P * ts_bytes / N, "vram_state": P * b / N + working_set, "adamw_values": P / N,
            "holds": f"1/{N} of every bf16 parameter (dim-0 shards), their state in host RAM"},
        "DeepSpeed ZeRO-2 offload": {
            "moves": "reduce-scatter of the gradients, all-gather of the new weights",
            "network_in_backward": P * b * ring, "network_after": P * b * ring,
            "pcie_up": P * b / N, "pcie_down": P * b / N, "pcie_after": True,
            "host_bytes": 16 * P / N, "vram_state": P * b + 2 * rate("ds_reduce_bucket_values") * b,
            "adamw_values": P / N, "holds": f"whole bf16 model; a 1/{N} partition of gradients and state on the host"},
        "DeepSpeed ZeRO-3 offload": {
            "moves": "all-gather in forward and backward, reduce-scatter",
            "network_in_backward": 3 * P * b * ring, "network_after": 0.0,
            "pcie_up": 2 * P * b / N, "pcie_down": P * b / N, "pcie_after": False,
            "host_bytes": 18 * P / N, "vram_state": working_set, "adamw_values": P / N,
            "holds": f"a 1/{N} partition of parameters, gradients and state, all on the host"},
        "FSDP2 CPUOffloadPolicy": {
            "moves": "all-gather in forward and backward (root unit once), reduce-scatter",
            "network_in_backward": (fsdp_gathers + P) * b * ring, "network_after": 0.0,
            "pcie_up": fsdp_gathers * FP32 / N, "pcie_down": P * FP32 / N, "pcie_after": False,
            "host_bytes": 16 * P / N, "vram_state": working_set, "adamw_values": P / N,
            "holds": f"1/{N} fp32 shards of parameters, gradients and moments, all on the host"},
    }


def estimate(world: int = NODES * GPUS_PER_NODE) -> dict:
    """The record: the shape, the assumptions and, per configuration, the bytes and the step's terms."""
    flops, activations = _activations()
    compute = flops / (rate("matmul_tflops") * 1e12)
    out = {}
    for name, c in configurations(world).items():
        network_bytes = c["network_in_backward"] + c["network_after"]
        terms = {"compute_s": compute,
                 "network_s": network_bytes / (rate("network_gbps_per_node") * 1e9),
                 "pcie_s": max(c["pcie_up"], c["pcie_down"]) / (rate("pcie_gbps") * 1e9),
                 "host_adamw_s": c["adamw_values"] / rate("host_adamw_params_per_s")}
        step = max(terms.values())
        bound_by = max(terms, key=terms.get).removesuffix("_s")
        during = max(compute, c["network_in_backward"] / (rate("network_gbps_per_node") * 1e9),
                     0.0 if c["pcie_after"] else terms["pcie_s"])
        after = (terms["host_adamw_s"] + c["network_after"] / (rate("network_gbps_per_node") * 1e9)
                 + (terms["pcie_s"] if c["pcie_after"] else 0.0))
        vram = c["vram_state"] + sum(activations.values())
        out[name] = {**{k: v for k, v in c.items() if k != "pcie_after"}, "network_bytes": network_bytes,
                     "pcie_after_backward": c["pcie_after"], "vram_total": vram,
                     "fits_vram": vram <= rate("gpu_memory_gb") * 1e9, "terms": terms, "step_s": step,
                     "bound_by": bound_by, "step_with_after_backward_s": during + after}
    counts = _shape_counts()
    return {"kind": "paper-model", "measured": False,
            "note": "paper estimate, not a measurement: tools/bench/paper_model.py's formulas and assumptions",
            "shape": dataclasses.asdict(SHAPE), "params": counts["P"], "root_unit_params": counts["R"],
            "block_params": counts["block"], "nodes": NODES, "gpus_per_node": GPUS_PER_NODE, "world": world,
            "step_flops": flops, "activations_bytes": activations,
            "assumptions": {k: dataclasses.asdict(a) for k, a in ASSUMPTIONS.items()}, "configurations": out}


def _value(v: float) -> str:
    return f"{v / 1e9:g} G" if v >= 1e9 else f"{v / 1e6:g} M" if v >= 1e6 else f"{v:g}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n < 10e9 else f"{n / 1e9:.1f} GB"


def render(record: dict) -> str:
    """The Markdown between the page's markers."""
    a, configs = record["assumptions"], record["configurations"]
    act = sum(record["activations_bytes"].values())
    lines = [
        BEGIN,
        f"**Paper estimate, not a measurement.** {record['params'] / 1e9:.2f} B parameters (the Qwen2.5-14B shape, "
        f"full fine-tune), {record['nodes']} nodes x {record['gpus_per_node']} GPUs = {record['world']} ranks, bf16 "
        f"weights and gradients, fp32 master weights and moments, "
        f"{int(a['tokens_per_rank']['value'])} tokens per rank and step, every block recomputed, the loss over the whole "
        f"logits. Figures are per rank and step; "
        f"the formulas and their sources are the docstring of `tools/bench/paper_model.py`.",
        "",
        "| Assumption | Value | Why |",
        "|---|---|---|",
        *[f"| `{k}` | {_value(v['value'])} {v['unit']} | {v['why']} |" for k, v in a.items()],
        "",
        "| Configuration | What each rank holds | Network, sent per rank | PCIe up / down | Host RAM (state) | "
        f"VRAM (state) | VRAM with activations | Fits {a['gpu_memory_gb']['value']:g} GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in configs.items():
        lines.append(f"| {name} | {c['holds']} | {_gb(c['network_bytes'])}: {c['moves']} | {_gb(c['pcie_up'])} / "
                     f"{_gb(c['pcie_down'])} | {_gb(c['host_bytes'])} | {_gb(c['vram_state'])} | "
                     f"{_gb(c['vram_total'])} | {'yes' if c['fits_vram'] else 'no'} |")
    lines += [
        "",
        f"Activations and the CUDA context, the same in every row: {_gb(act)}.",
        "",
        "| Configuration | Compute | Network | PCIe | Host AdamW | Estimated step = max | Bound by | "
        "With the work after backward |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in configs.items():
        t = c["terms"]
        lines.append(f"| {name} | {t['compute_s']:.2f} s | {t['network_s']:.2f} s | {t['pcie_s']:.3f} s | "
                     f"{t['host_adamw_s']:.3f} s | {c['step_s']:.2f} s | {c['bound_by'].replace('_', ' ')} | "
                     f"{c['step_with_after_backward_s']:.2f} s |")
    dp, fsdp = configs["trainstream replicated DP (today)"], configs["FSDP2 + trainstream"]
    zero3 = configs["DeepSpeed ZeRO-3 offload"]
    n, gpu = record["world"], a["gpu_memory_gb"]["value"]
    lines += [
        "",
        f"Read from the tables: replicated data parallel holds {_gb(dp['vram_state'])} of model state on every GPU "
        f"({_gb(dp['vram_total'])} with the activations: {'within' if dp['fits_vram'] else 'beyond'} {gpu:g} GB), "
        f"and its busiest rank updates {dp['adamw_values'] / fsdp['adamw_values']:.2f}x the values of a 1/{n} "
        f"share (the values are split by element); FSDP2 + trainstream sends "
        f"{fsdp['network_bytes'] / dp['network_bytes']:.2f}x the network bytes "
        f"of replicated data parallel, ZeRO-3 {zero3['network_bytes'] / dp['network_bytes']:.2f}x.",
    ]
    lines.append(END)
    return "\n".join(lines)


def page_with(text: str, section: str) -> str:
    """`text` with the generated section replaced (ValueError without the markers)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{PAGE} lacks the markers {BEGIN!r} ... {END!r}")
    return text[:start] + section + text[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON record to this file")
    parser.add_argument("--write", action="store_true", help=f"render the tables into {PAGE}")
    parser.add_argument("--check", action="store_true", help=f"exit 1 when {PAGE} differs from what --write writes")
    parser.add_argument("--page", default=PAGE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    record = estimate()
    section = render(record)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    if not (args.write or args.check):
        print(section)
        return 0
    with open(args.page) as f:
        text = f.read()
    wanted = page_with(text, section)
    if args.check:
        if wanted != text:
            print(f"{args.page} differs from the paper model: run python tools/bench/paper_model.py --write",
                  file=sys.stderr)
            return 1
        return 0
    with open(args.page, "w") as f:
        f.write(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
