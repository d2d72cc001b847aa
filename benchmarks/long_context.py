"""Long sequences at a batch of one: step time and memory per rank, tokens split over the mesh.

The model is transformers' `LlamaForCausalLM` (RMSNorm, rotary positions,
SwiGLU, SDPA attention): hidden 256, 2 layers, 8 heads, 8 key/value heads
(`--kv-heads`), MLP 512, vocabulary 1024, fp32, no dropout; one sequence of
2,048, 4,096 and 8,192 tokens (`--seqs`, one launch each). `WithLoss` adds the
causal-LM loss as transformers computes it (the labels shifted by padding
them, not the logits by slicing them), so every row runs the same module and
shards its loss. Each step: zero_grad, forward, backward, AdamW (fused, one
group of DTensors and one of plain tensors, as `benchmarks/vs_dtensor.py`).

Rows, each on 8 gloo processes of one launch:

- "tess 2.5d [2,2,2]": `tess_compile.shard(model, 2, 2)`: at a batch of one
  the tokens split over depth and row (`token_split="auto"`), each rank's
  queries attend over every key (context parallelism, the keys and values
  all-gathered along the token axes: `tess_compile.ops.context_attention`).
- "tess 2.5d [2,2,2] contiguous": the same with `token_order="contiguous"`,
  one block of tokens a rank (the default stripes them: docs/modes.md), so
  every rank computes all its queries' causal scores.
- "tess 2.5d [2,2,2] whole tokens": the same with `token_split="none"`, the
  layout before the token split (the sequence whole over depth and row,
  every depth slab repeating the step): the reference the issue measured.
- "tess 1d p=8": Megatron-LM over 8 ranks with sequence parallelism
  (`token_split="auto"` gives "col"), attention on each rank's heads.
- "DTensor TP+SP": PyTorch's tensor parallelism on the same modules with
  torchtitan's Llama plan (`titan_llama_plan`: q/k/v and gate/up
  column-parallel, o and down row-parallel, the norms `SequenceParallel`, the
  embedding's output and the residual stream `Shard(1)`, the head
  column-parallel with `loss_parallel`), eager.

`--with-16` adds "tess 2.5d [4,4,1]" in its own launch of 16 processes (its
step time shares the cores among 16 processes: compare its memory, not its
time). torchtitan's own context parallelism
(`torch.distributed.tensor.experimental.context_parallel`, ring attention)
runs on CUDA's attention kernels only; its row is priced by accounting
(`priced_cp_row`): per rank a 1/8 block of every activation, the keys and
values of a layer all-gathered (8 ways) forward and reduce-scattered
backward, the weights whole on every rank (no tensor parallelism).

Columns: ms/step (the median over rounds of the slowest rank); CPU ms/step (the
median over rounds of the busiest rank's process CPU time: its work, steadier than
the wall time where other work shares the cores); the bytes
autograd saves in one forward on the rank that saves most
(`tess_compile.analysis.accounting.saved_bytes`); the peak bytes of tensors
alive over two training steps on rank 0 (torch's `MemTracker`,
`benchmarks/peak_memory.tracked_peak`: parameters, gradients, AdamW state,
activations, temporaries); the first loss (every row starts from the same
weights and batch).

    python3 benchmarks/long_context.py [--seqs 2048,4096,8192] [--rounds 3] [--steps 2] [--warmup 1]
        [--kv-heads 8] [--with-16] [--configs NAME,...] [--quick] [--out benchmarks/results/long_context.json]

`--quick` runs 64 tokens, hidden 64, one round of one step: the smoke test's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tess_compile
from peak_memory import tracked_peak
from step_rows import timed_steps
from tess_compile.analysis.accounting import saved_bytes
from tess_compile.runtime.launch import run_local

__all__ = ["CONFIGS", "WithLoss", "main", "make_model", "priced_cp_row", "titan_llama_plan"]

SIZES = {"hidden": 256, "layers": 2, "heads": 8, "kv_heads": 8, "mlp": 512, "vocab": 1024}
QUICK_SIZES = {"hidden": 64, "layers": 1, "heads": 8, "kv_heads": 8, "mlp": 128, "vocab": 128}
DEFAULT_SEQS = "2048,4096,8192"
IGNORE = -100


class WithLoss(nn.Module):
    """The causal LM's mean cross-entropy, its labels shifted by padding (as transformers does), one module."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        logits = self.model(input_ids=ids, use_cache=False).logits
        targets = F.pad(ids[:, 1:], (0, 1), value=IGNORE)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def make_model(sizes: dict, seq: int) -> WithLoss:
    """The Llama of `sizes` with its loss, the same weights every call."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["mlp"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"],
        num_key_value_heads=sizes["kv_heads"], max_position_embeddings=seq, attn_implementation="sdpa")
    return WithLoss(transformers.LlamaForCausalLM(config))


def make_batch(sizes: dict, seq: int) -> torch.Tensor:
    return torch.randint(0, sizes["vocab"], (1, seq), generator=torch.Generator().manual_seed(1))


def titan_llama_plan(model: WithLoss, mesh) -> WithLoss:
    """torchtitan's tensor-parallel plan of Llama (`torchtitan.models.llama3.parallelize`) with sequence
    parallelism on transformers' Llama modules over the 1-D `mesh`: attention and the MLP on local
    tensors (each rank's heads), the logits vocabulary-sharded for `loss_parallel`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    llama = model.model
    # the residual stream stays a DTensor (Shard(1)) between modules, so that transformers' model code
    # sees the sequence's global length (its positions, its mask); attention and the MLP's inside run
    # on local tensors, each rank's heads and MLP columns
    parallelize_module(llama, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in llama.model.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
    return model


def _tess(model, ids, q, d, **options):
    return tess_compile.shard(model, q, d, example_inputs=(ids,), timeout=600, **options)


def _dtensor(model, ids, q, d):
    from torch.distributed.device_mesh import init_device_mesh

    return titan_llama_plan(model, init_device_mesh("cpu", (q * q * d,)))


# name -> (build(model, ids, q, d), the mesh [q, q, d] it runs on, runs under loss_parallel)
CONFIGS = {
    "tess 2.5d [2,2,2]": (lambda m, ids, q, d: _tess(m, ids, q, d), (2, 2), False),
    "tess 2.5d [2,2,2] contiguous": (lambda m, ids, q, d: _tess(m, ids, q, d, token_order="contiguous"), (2, 2),
                                     False),
    "tess 2.5d [2,2,2] whole tokens": (lambda m, ids, q, d: _tess(m, ids, q, d, token_split="none"), (2, 2), False),
    "tess 1d p=8": (lambda m, ids, q, d: _tess(m, ids, q, d, mode="1d"), (2, 2), False),
    "DTensor TP+SP": (_dtensor, (2, 2), True),
    "tess 2.5d [4,4,1]": (lambda m, ids, q, d: _tess(m, ids, q, d), (4, 1), False),
}
SIXTEEN = ["tess 2.5d [4,4,1]"]


def make_adamw(module: nn.Module) -> torch.optim.AdamW:
    """Fused AdamW, its DTensors and plain tensors in two groups (a fused step refuses them in one)."""
    params = list(module.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return torch.optim.AdamW([{"params": group} for group in groups if group], lr=1e-4, fused=True)


class Trainer:
    """One row on this rank: its module, AdamW and the sequence."""

    def __init__(self, name: str, sizes: dict, seq: int):
        build, (q, d), self.loss_parallel = CONFIGS[name]
        self.ids = make_batch(sizes, seq)
        self.module = build(make_model(sizes, seq), self.ids, q, d)
        self.optimizer = make_adamw(self.module)

    def context(self):
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def step(self, forward=None) -> float:
        self.optimizer.zero_grad()
        with self.context():
            loss = (forward or (lambda: self.module(self.ids)))()
            loss.backward()
        self.optimizer.step()
        return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)

    def saved(self) -> int:
        parameters = [p.to_local() if isinstance(p, DTensor) else p for p in self.module.parameters()]
        losses = []
        with self.context():
            saved = saved_bytes(lambda: losses.append(self.module(self.ids)), parameters)
        self.step(lambda: losses[0])
        return saved

    def peak(self) -> int:
        return tracked_peak(self.step, self.module, self.optimizer, self.ids)

    def timed(self, steps: int) -> tuple[float, float]:
        return timed_steps(self.step, steps)


def _worker(rank: int, world: int, names: list, sizes: dict, seq: int, rounds: int, steps: int, warmup: int) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker's and DTensor's notes on every step
        trainers = [Trainer(name, sizes, seq) for name in names]
        first = [trainer.step() for trainer in trainers]
        for trainer in trainers:
            for _ in range(warmup - 1):
                trainer.step()
        rows = [{"loss_first": loss, "saved": trainer.saved(), "peak": trainer.peak(), "times": []}
                for trainer, loss in zip(trainers, first)]
        for _ in range(rounds):
            for trainer, row in zip(trainers, rows):
                row["times"].append(trainer.timed(steps))
    return rows


def priced_cp_row(sizes: dict, seq: int, ranks: int = 8, itemsize: int = 4) -> dict:
    """torchtitan's context parallelism over `ranks` (no tensor parallelism), by accounting: the bytes a
    rank sends per step (each layer all-gathers its keys and values forward, and reduce-scatters their
    gradients backward; the gradients of the whole weights all-reduced once) and the weights, gradients
    and AdamW state it holds (every weight whole on every rank)."""
    head_dim = sizes["hidden"] // sizes["heads"]
    kv = 2 * seq // ranks * sizes["kv_heads"] * head_dim * itemsize  # a rank's k and v of one layer
    moved = sizes["layers"] * 2 * kv  # all-gather forward, reduce-scatter backward (input bytes each)
    weights = sizes["layers"] * (4 * sizes["hidden"] ** 2 + 3 * sizes["hidden"] * sizes["mlp"]) \
        + 2 * sizes["vocab"] * sizes["hidden"]
    moved += weights * itemsize  # the weight gradients' all-reduce over the CP group
    return {"configuration": f"torchtitan CP={ranks} (priced)", "moved_bytes": moved,
            "state_bytes": 4 * weights * itemsize}


def make_rows(names: list, results: list) -> list[dict]:
    rows = []
    for index, name in enumerate(names):
        per_rank = [rank[index] for rank in results]
        rows.append({
            "configuration": name,
            "ranks": len(results),
            "ms_per_step": round(statistics.median(max(t[0] for t in ts) for ts in zip(*(r["times"] for r in per_rank)))
                                 * 1e3, 1),
            "cpu_ms_per_step": round(statistics.median(max(t[1] for t in ts)
                                                       for ts in zip(*(r["times"] for r in per_rank))) * 1e3, 1),
            "saved_bytes": max(r["saved"] for r in per_rank),
            "peak_bytes": per_rank[0]["peak"],
            "loss_first": per_rank[0]["loss_first"],
        })
    return rows


def print_rows(rows: list, priced: dict) -> None:
    print(f"{'configuration':<32} {'ranks':>5} {'ms/step':>9} {'CPU ms/step':>11} {'saved B/rank':>14} "
          f"{'peak B/rank':>14} {'loss first':>11}")
    for row in rows:
        print(f"{row['configuration']:<32} {row['ranks']:>5} {row['ms_per_step']:9.1f} {row['cpu_ms_per_step']:11.1f} "
              f"{row['saved_bytes']:>14,} {row['peak_bytes']:>14,} {row['loss_first']:11.6f}")
    print(f"{priced['configuration']:<32} {8:>5} {'-':>9} (moves {priced['moved_bytes']:,} B a rank a step; holds "
          f"{priced['state_bytes']:,} B of weights, gradients and AdamW state a rank, the activations a 1/8 block)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default=DEFAULT_SEQS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=SIZES["kv_heads"])
    parser.add_argument("--with-16", action="store_true", help="also tess 2.5d [4,4,1] on 16 processes")
    parser.add_argument("--configs", help="only these rows, by name, separated by commas")
    parser.add_argument("--quick", action="store_true", help="64 tokens, hidden 64, one round of one step")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    sizes = dict(QUICK_SIZES if args.quick else SIZES, kv_heads=args.kv_heads)
    seqs = [64] if args.quick else [int(s) for s in args.seqs.split(",")]
    rounds, steps, warmup = (1, 1, 1) if args.quick else (args.rounds, args.steps, args.warmup)
    names = [n.strip() for n in re.split(r",(?![^\[]*\])", args.configs)] if args.configs else \
        [n for n in CONFIGS if n not in SIXTEEN]  # commas inside a mesh's brackets belong to the name
    if args.with_16 and not args.configs:
        names += SIXTEEN
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; the configurations are {list(CONFIGS)}")
    start, tables = time.perf_counter(), []
    for seq in seqs:
        rows = []
        for group in ([n for n in names if n not in SIXTEEN], [n for n in names if n in SIXTEEN]):
            if group:
                world = 16 if group[0] in SIXTEEN else 8
                results = run_local(_worker, world, args=(group, sizes, seq, rounds, steps, warmup),
                                    timeout_s=7200, collective_timeout_s=1800)
                rows += make_rows(group, results)
        priced = priced_cp_row(sizes, seq)
        print(f"\nLlama (transformers): hidden {sizes['hidden']}, {sizes['layers']} layers, {sizes['heads']} heads, "
              f"{sizes['kv_heads']} key/value heads, MLP {sizes['mlp']}, vocabulary {sizes['vocab']}, fp32; batch 1 "
              f"of {seq} tokens, causal-LM loss, AdamW (fused); gloo processes on {os.cpu_count()} CPU cores; "
              f"median over {rounds} rounds of {steps} steps")
        print_rows(rows, priced)
        tables.append({"seq": seq, "rows": rows, "priced": priced})
    wall = time.perf_counter() - start
    print(f"(ms/step: the slowest rank's; saved: the rank that saves most; peak: rank 0; wall time {wall:.0f} s)")
    if args.out:
        record = {"command": "python3 benchmarks/long_context.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "torch": torch.__version__, "cpu_count": os.cpu_count(), "sizes": sizes, "wall_s": round(wall, 1),
                  "runs": tables}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
