"""Training step time against PyTorch's DTensor tensor parallelism, over 8 gloo processes.

The model is PyTorch's own test Transformer
(`torch.testing._internal.distributed._tensor.common_dtensor`, which needs
the `expecttest` package: `pip install -e '.[bench]'`): dim 128 (and 256 with
`--dims 128,256`), 2 layers, 8 heads, vocabulary 512, tied embedding and
output weights, no dropout; batch 16, sequence 32, fp32. `WithLoss` adds the
loss, the cross-entropy of the logits against random targets, so both sides
run the same module and the loss is part of what each one shards: DTensor
gathers the logits (its plan's output layout is Replicate), tess-compile
computes it over the vocab-split logits. Each step: zero_grad, forward,
backward, AdamW (torch's CPU default, its for-loop implementation: the
foreach and fused ones refuse DTensor's plan, which leaves some parameters
plain tensors beside DTensors).

Configurations (`CONFIGS`), each on all 8 ranks of one launch:

- DTensor: PyTorch's own plan `Transformer.parallelize` on a 1-D DeviceMesh
  of 8 (`local_output_for_attn=True`, the plan's CPU path: DTensor has no
  sharding rule for the CPU flash attention kernel), eager and under
  `torch.compile`;
- tess-compile: `tess_compile.shard(model, 2, 2, mode="1d")` (Megatron-LM
  over p=8) and mode "2.5d" (the `[2,2,2]` mesh), eager and with
  `compile=True` (the per-rank programs through inductor), each with its
  default options (`summa="auto"`: each product's cheapest schedule on the
  default cluster). 2.5d runs eagerly in each fixed schedule of its products
  as well: the papers' (q broadcasts of each operand), "overlap" (the next
  step's broadcasts in flight) and "gather" (one all-gather of each operand:
  fewer, larger messages; the same bytes saved for backward).

Every configuration is built and runs `--warmup` steps (compilation
included), then two measured steps, then `--rounds` rounds: round r runs
`--steps` steps of each configuration in turn, between barriers. Per-step
time of a round is the slowest rank's; the table gives the median over
rounds. Alternating rounds spread the machine's drift over all rows.

Columns: ms/step, its ratio to DTensor eager and to DTensor compiled, bytes
saved for backward per rank in one forward (`tess_compile.analysis.accounting.saved_bytes`: storages
autograd keeps, each once, parameters' left out, a DTensor by its local
tensor), and bytes moved per rank per step: the
payload a rank hands each collective (its input tensor's bytes, the
convention of `tess_compile.analysis.accounting`). For tess-compile these are the
runtime's `comm.records`; for DTensor, the collectives that `CommDebugMode`
counts (`CommBytes` adds their input bytes). Under a dispatch mode such as
CommDebugMode dynamo runs the module eagerly, so the compiled row's are
counted on an eager step; torch.profiler shows the compiled step running the
same collectives on the same shapes (checked at the `--quick` sizes: 9
all-reduces and one all-gather of the logits; 15 and one at full size).
CPU cores are shared by all 8 processes: the times rank configurations on
this machine, they are not GPU predictions.

    python3 benchmarks/vs_dtensor.py [--dims 128,256] [--rounds 7] [--steps 5] [--warmup 3] [--quick]

`--quick` runs tiny sizes on 4 ranks (`[2,2,1]`), eager rows only
(compiling costs minutes), for the tests.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils import _pytree as pytree

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile  # noqa: E402
from tess_compile.analysis.accounting import saved_bytes
from tess_compile.core.options import SCHEDULES
from tess_compile.runtime.launch import run_local

SIZES = {"dim": 128, "layers": 2, "heads": 8, "vocab": 512, "batch": 16, "seq": 32}
QUICK_SIZES = {"dim": 32, "layers": 1, "heads": 8, "vocab": 64, "batch": 8, "seq": 8}


class WithLoss(nn.Module):
    """The model's logits and the cross-entropy against `targets`, as one module."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets):
        logits = self.model(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(sizes: dict) -> WithLoss:
    """PyTorch's test Transformer of `sizes` with its loss, the same weights every call."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    args = ModelArgs(dim=sizes["dim"], n_layers=sizes["layers"], n_heads=sizes["heads"],
                     vocab_size=sizes["vocab"], max_seq_len=sizes["seq"], dropout_p=0.0)
    return WithLoss(Transformer(args))


def make_batch(sizes: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and targets, the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    shape = (sizes["batch"], sizes["seq"])
    return (torch.randint(0, sizes["vocab"], shape, generator=generator),
            torch.randint(0, sizes["vocab"], shape, generator=generator))


def dtensor(model: WithLoss, batch, q: int, d: int, *, compiled: bool) -> nn.Module:
    """PyTorch's own tensor-parallel plan of the Transformer on a 1-D mesh of all q*q*d ranks."""
    from torch.testing._internal.distributed._tensor.common_dtensor import Transformer

    mesh = init_device_mesh("cpu", (q * q * d,))
    Transformer.parallelize(model.model, mesh, use_seq_parallel=False, local_output_for_attn=True)
    return torch.compile(model) if compiled else model


def tess(model: WithLoss, batch, q: int, d: int, *, mode: str, compiled: bool, **options) -> nn.Module:
    """tess-compile's module of `model` on the q*q*d ranks in `mode` (1d: all ranks on one
    axis) with its default options but `options` (e.g. `summa`); `compiled`: its per-rank
    program through inductor (`compile=True`)."""
    return tess_compile.shard(model, q, d, example_inputs=batch, mode=mode, timeout=300, compile=compiled, **options)


# name: (build(model, batch, q, d) -> module, compiled)
CONFIGS = {
    "DTensor eager": (functools.partial(dtensor, compiled=False), False),
    "DTensor compiled": (functools.partial(dtensor, compiled=True), True),
    "tess 1d": (functools.partial(tess, mode="1d", compiled=False), False),
    "tess 2.5d": (functools.partial(tess, mode="2.5d", compiled=False), False),
    **{f"tess 2.5d {summa}": (functools.partial(tess, mode="2.5d", compiled=False, summa=summa), False)
       for summa in SCHEDULES},
    "tess 1d compiled": (functools.partial(tess, mode="1d", compiled=True), True),
    "tess 2.5d compiled": (functools.partial(tess, mode="2.5d", compiled=True), True),
}


class CommBytes(CommDebugMode):
    """CommDebugMode that also sums the bytes of the input tensor of each collective it counts."""

    def __init__(self):
        super().__init__()
        self.num_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:
            first = next(t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))
            self.num_bytes += first.numel() * first.element_size()
        return out


class Trainer:
    """One configuration on this rank: its module, AdamW, and the global batch."""

    def __init__(self, name: str, sizes: dict, q: int, d: int):
        build, _ = CONFIGS[name]
        self.batch = make_batch(sizes)
        self.module = build(make_model(sizes), self.batch, q, d)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-4)

    def forward(self) -> torch.Tensor:
        return self.module(*self.batch)

    def step(self, forward=None) -> None:
        self.optimizer.zero_grad()
        (forward or self.forward)().backward()
        self.optimizer.step()

    def saved_bytes(self) -> int:
        """One step; the bytes its forward saves for backward."""
        parameters = [p.to_local() if isinstance(p, DTensor) else p for p in self.module.parameters()]
        losses = []
        saved = saved_bytes(lambda: losses.append(self.forward()), parameters)
        self.step(lambda: losses[0])
        return saved

    def moved_bytes(self) -> int:
        """One step; the bytes its collectives send."""
        comm = getattr(self.module, "comm", None)  # tess-compile's runtime records its collectives
        if comm is not None:
            comm.records.clear()
            self.step()
            if self.module.compile:  # collectives lowered into the compiled graphs: as the graphs hold them
                graphs = self.module.compiled_program(None).graphs
                return sum(record.num_bytes for graph in graphs for record in graph.collectives)
            return sum(record.num_bytes for record in comm.records)
        with warnings.catch_warnings(), CommBytes() as counter:
            warnings.simplefilter("ignore")  # CommDebugMode's module hooks warn about inputs without grad
            self.step()
        return counter.num_bytes

    def timed_round(self, steps: int) -> float:
        """Seconds per step of `steps` steps between barriers."""
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        dist.barrier()
        return (time.perf_counter() - start) / steps


def _worker(rank: int, world_size: int, names: list, sizes: dict, q: int, d: int,
            rounds: int, steps: int, warmup: int) -> list:
    trainers = [Trainer(name, sizes, q, d) for name in names]
    for trainer in trainers:
        for _ in range(warmup):
            trainer.step()
    rows = [{"saved": trainer.saved_bytes(), "moved": trainer.moved_bytes(), "times": []} for trainer in trainers]
    for _ in range(rounds):
        for trainer, row in zip(trainers, rows):
            row["times"].append(trainer.timed_round(steps))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default=str(SIZES["dim"]), help="model dims, one launch each, e.g. 128,256")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes on 4 ranks ([2,2,1]), eager rows only, 2 rounds of 1 step")
    args = parser.parse_args(argv)
    try:
        dims = [int(dim) for dim in args.dims.split(",")]
    except ValueError:
        parser.error(f"--dims {args.dims!r}: give model dims separated by commas, e.g. 128,256")
    if args.quick:
        runs, (q, d), (rounds, steps, warmup) = [QUICK_SIZES], (2, 1), (2, 1, 1)
    else:
        runs, (q, d), (rounds, steps, warmup) = [dict(SIZES, dim=dim) for dim in dims], (2, 2), (
            args.rounds, args.steps, args.warmup)
    names = [name for name, (_, compiled) in CONFIGS.items() if not (args.quick and compiled)]
    start = time.perf_counter()
    for sizes in runs:
        results = run_local(_worker, q * q * d, args=(names, sizes, q, d, rounds, steps, warmup),
                            timeout_s=3600, collective_timeout_s=600)
        print(f"\nPyTorch's test Transformer: dim {sizes['dim']}, {sizes['layers']} layers, {sizes['heads']} heads, "
              f"vocabulary {sizes['vocab']}, batch {sizes['batch']}, sequence {sizes['seq']}, fp32, cross-entropy, "
              f"AdamW; {q * q * d} gloo processes on {os.cpu_count()} CPU cores (DTensor and "
              f"tess 1d over all, tess 2.5d on [{q},{q},{d}]); median over {rounds} rounds of {steps} steps, after "
              f"{warmup} warm-up")
        print_table(names, results)
    print(f"(ms/step: the slowest rank's; wall time of the whole run {time.perf_counter() - start:.0f} s)")
    return 0


def print_table(names: list, results: list) -> None:
    """One row per configuration: median ms/step over rounds (slowest rank per round), its ratio to
    DTensor eager and (where it ran) DTensor compiled, bytes of rank 0."""
    print(f"{'configuration':<26} {'ms/step':>9} {'vs eager':>9} {'vs compiled':>11} {'saved B/rank':>13} "
          f"{'moved B/rank/step':>18}")
    medians = [statistics.median(max(times) for times in zip(*(rank[index]["times"] for rank in results)))
               for index in range(len(names))]
    eager = medians[names.index("DTensor eager")]
    compiled = medians[names.index("DTensor compiled")] if "DTensor compiled" in names else None
    for index, name in enumerate(names):
        row = results[0][index]
        versus = f"{medians[index] / compiled:11.2f}" if compiled else f"{'-':>11}"
        print(f"{name:<26} {medians[index] * 1e3:9.1f} {medians[index] / eager:9.2f} {versus} "
              f"{row['saved']:>13,} {row['moved']:>18,}")


if __name__ == "__main__":
    raise SystemExit(main())
