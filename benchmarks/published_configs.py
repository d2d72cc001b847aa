"""The planner against published figures: torchtitan's Llama 3 runs on H100s, priced on an H100 cluster.

Each row is a published training configuration, compiled for its tensor-parallel mesh on the meta
device (`benchmarks/llama_sizes.py`, bf16, block reuse, priced only) in the mode that matches it
(1-D tensor parallelism inside a node, FSDP2 over the data-parallel ranks: `zero=True`, full
activation checkpointing: `recompute="blocks"`; the loss of the logits as TP leaves them split, as
torchtitan's loss_parallel computes it: `TITAN_STEP`) and priced by `tess_compile.plan` on `H100_CLUSTER`.
The table gives the published figure, the predicted one and the error, and what the cost model
leaves out that explains it:

- torchtitan's Llama 3.1 70B on 256 H100s (FSDP 32 x TP 8, bf16, torch.compile, full activation
  checkpointing, local batch 16 of 8,192 tokens; vanilla TP): 597 tokens/s/GPU
  (torchtitan `benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`);
- torchtitan's Llama 3.1 405B on 128 H100s (FSDP 16 x TP 8, bf16, torch.compile, full activation
  checkpointing, local batch 2 of 8,192 tokens, no float8): 109 tokens/s/GPU, 29.0% MFU
  (torchtitan `docs/performance.md`, its 2024 version).

MFU is torchtitan's: tokens/s/GPU times `6 * (parameters - embedding) + 12 * layers * hidden * seq`
FLOPs a token, over the bf16 dense peak (989 TFLOP/s).

Beside the step: its compute and communication seconds, and the seconds the cost model charges the
fused attention kernels (`analysis.kernels` prices them as matrix products whose smallest dimension
is the head dim, 128: 5.6% of peak on this cluster; forward, recomputed forward and backward, as it
counts them), and what the figure would be with attention at the rate of a product of the sequence
length (8,192) instead: FlashAttention runs near that rate, not at the head dim's.

    python3 benchmarks/published_configs.py [--configs 70b,405b]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.llama_sizes import make
from tess_compile.analysis.planner import pick, plan
from tess_compile.analysis.step_tail import StepTail
from tess_compile.core.cluster import Cluster

BF16_PEAK = 989e12  # H100 SXM, dense bf16

# An H100 cluster as torchtitan's runs describe it: 8 GPUs a node on NVLink (450 GB/s each way per GPU),
# 400 Gb/s (50 GB/s) of InfiniBand per GPU between nodes, 96 GB of HBM2e at 2.4 TB/s. A matrix product
# of smallest dimension m runs at 989 TFLOP/s * m / (m + 2170): 782 TFLOP/s at m = 8192, the rate
# benchmarks/gpu_check.py measured on an H100 (benchmarks/results/gpu_check_h100.json). Latencies are
# NCCL's usual 2 us (NVLink) and 5 us (InfiniBand) a step; 5 us a kernel launch.
H100_CLUSTER = Cluster(
    gpus_per_node=8,
    intra_bandwidth=450e9,
    intra_latency=2e-6,
    inter_bandwidth=50e9,
    inter_latency=5e-6,
    flops=BF16_PEAK,
    memory=96e9,
    matmul_half_size=2170.0,
    memory_bandwidth=2.4e12,
    kernel_overhead=5e-6,
)

# torchtitan's step: the loss of the logits as TP leaves them split (loss_parallel), no gather
TITAN_STEP = StepTail(gather=False)

LEFT_OUT = "attention's rate; TP collectives not overlapped; 500 W cap (priced at 700 W's rate); causal half"


@dataclass(frozen=True)
class Published:
    """One published run: the model (`llama_sizes.make(size, layers)`), GPUs, FSDP and TP degrees,
    local batch (sequences per FSDP rank) and sequence length, and its figure: `tokens` (tokens/s/GPU)
    and/or `mfu` (a fraction)."""

    name: str
    size: str
    gpus: int
    tp: int
    local_batch: int
    seq: int
    tokens: float | None = None
    mfu: float | None = None
    layers: int | None = None
    source: str = ""

    @property
    def dp(self) -> int:
        return self.gpus // self.tp


PUBLISHED = {
    "70b": Published("Llama 3.1 70B, 256 H100, FSDP 32 x TP 8", "70b", 256, 8, 16, 8192, tokens=597.0,
                     source="torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"),
    "405b": Published("Llama 3.1 405B, 128 H100, FSDP 16 x TP 8", "405b", 128, 8, 2, 8192, tokens=109.0, mfu=0.29,
                      source="torchtitan docs/performance.md (2024)"),
}


def flops_per_token(model: torch.nn.Module, seq: int) -> float:
    """torchtitan's training FLOPs a token: 6 per non-embedding parameter, and attention's
    12 * layers * hidden * seq."""
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embedding
    return 6 * params + 12 * config.num_hidden_layers * config.hidden_size * seq


def attention_flops(model: torch.nn.Module, config: Published) -> float:
    """FLOPs of one rank's fused attention kernels in a step, as `analysis.kernels` counts them: the two
    products of the whole score matrix, forward twice (recomputed) and backward at twice forward's."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    forward = 4 * config.local_batch * (c.num_attention_heads // config.tp) * config.seq ** 2 * head_dim
    return forward * (1 + 1 + 2) * c.num_hidden_layers


def price(config: Published, cluster: Cluster = H100_CLUSTER) -> dict:
    """The predicted step of `config` on `cluster` (1-D TP over `config.tp` ranks, FSDP2 over the rest,
    every block recomputed): step, compute and communication seconds, tokens/s/GPU, MFU, GB per GPU, the
    seconds charged to attention, the tokens/s/GPU with attention at the sequence's rate, and the CPU
    seconds it took."""
    start = time.process_time()
    model, inputs = make(config.size, layers=config.layers, batch=config.local_batch * config.dp, seq=config.seq)
    model = model.to(torch.bfloat16)
    rows = plan(model, config.gpus, example_inputs=inputs, cluster=cluster, modes=("1d",), dp=config.dp, pp=1,
                zero=True, recompute="blocks", summa="broadcast", keep_blocks=False,
                memory_budget=float("inf"), tail=TITAN_STEP)
    row = pick(rows)
    if row is None:
        raise ValueError(f"{config.name}: no row priced: {rows[0].note}")
    time_ = row.time
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    flops = attention_flops(model, config)
    attention_s = flops / (cluster.flops * cluster.matmul_efficiency(head_dim))
    at_seq_s = flops / (cluster.flops * cluster.matmul_efficiency(config.seq))
    per_gpu = config.local_batch * config.dp * config.seq / config.gpus  # tokens a GPU's step adds
    tokens = per_gpu / time_.step_s
    return {"step_s": time_.step_s, "compute_s": time_.forward_compute_s + time_.backward_compute_s + time_.optimizer_s,
            "comm_s": time_.forward_comm_s + time_.backward_comm_s, "attention_s": attention_s,
            "tokens": tokens, "mfu": tokens * flops_per_token(model, config.seq) / BF16_PEAK,
            "tokens_at_seq": per_gpu / (time_.step_s - attention_s + at_seq_s),
            "memory_gb": row.memory.total / 1e9, "seconds": time.process_time() - start}


def error(predicted: float, published: float) -> str:
    return f"{100 * (predicted - published) / published:+.0f}%"


def table(configs: list[Published], cluster: Cluster = H100_CLUSTER) -> list[tuple[str, ...]]:
    """The rows to print (`HEADER`), one per published figure of each config."""
    lines = []
    for config in configs:
        r = price(config, cluster)
        times = tuple(f"{r[key]:.3g}" for key in ("step_s", "compute_s", "comm_s", "attention_s"))
        scale = r["tokens_at_seq"] / r["tokens"]  # the figure with attention at the sequence's rate
        figures = [("tokens/s/GPU", config.tokens, r["tokens"], f"{config.tokens:g}", "{:.0f}".format),
                   ("MFU", config.mfu, r["mfu"], f"{100 * (config.mfu or 0):.1f}%", lambda v: f"{100 * v:.1f}%")]
        for figure, published, predicted, shown, fmt in figures:
            if published is not None:
                lines.append((config.name, figure, shown, fmt(predicted), error(predicted, published), *times,
                              f"{fmt(predicted * scale)} ({error(predicted * scale, published)})",
                              f"{r['memory_gb']:.3g}", f"{r['seconds']:.0f}", LEFT_OUT))
    return lines


HEADER = ("config", "figure", "published", "predicted", "error", "step s", "compute s", "comm s", "attention s",
          "attention at seq rate", "GB/GPU", "CPU s", "left out")


def format_rows(lines: list[tuple[str, ...]]) -> str:
    cells = [HEADER] + lines
    widths = [max(len(line[col]) for line in cells) for col in range(len(HEADER) - 1)]
    return "\n".join("  ".join([line[0].ljust(widths[0])] + [text.rjust(width) for text, width in
                                                             zip(line[1:-1], widths[1:])] + [line[-1]])
                     for line in cells) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="70b,405b", help="comma-separated keys of PUBLISHED")
    args = parser.parse_args()
    configs = [PUBLISHED[key] for key in args.configs.split(",")]
    print(f"# H100 cluster: {H100_CLUSTER.gpus_per_node} GPUs a node, NVLink {H100_CLUSTER.intra_bandwidth / 1e9:g} GB/s, "
          f"InfiniBand {H100_CLUSTER.inter_bandwidth / 1e9:g} GB/s per GPU, {BF16_PEAK / 1e12:g} TFLOP/s bf16, "
          f"matmul half size {H100_CLUSTER.matmul_half_size:g}")
    print(format_rows(table(configs)), end="")


if __name__ == "__main__":
    main()
