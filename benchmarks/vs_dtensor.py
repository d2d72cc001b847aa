"""Training step time against PyTorch's DTensor tensor parallelism at its best, over 8 gloo processes.

The model is PyTorch's own test Transformer
(`torch.testing._internal.distributed._tensor.common_dtensor`, which needs
the `expecttest` package: `pip install -e '.[bench]'`): dim 128 (`--dims`),
2 layers, 8 heads, vocabulary 512, tied embedding and output weights, no
dropout; batch 16, sequences 32, 64 and 128 (`--seqs`, one launch each, with
`max_seq_len` the sequence), fp32. `WithLoss` adds the loss, the
cross-entropy of the logits against random targets, so every row runs the
same module and the loss is part of what each one shards. Each step:
zero_grad, forward, backward, AdamW in torchtitan's default implementation,
`fused=True` (`--optimizer`; torch's CPU default is the for-loop one), on
every row. A fused or foreach step refuses plain tensors beside DTensors
in one call, and the plans that leave some parameters plain (the norms of
a plan without sequence parallelism) are such; so every row's AdamW holds
two parameter groups, its DTensors and its plain tensors, and each group
takes one fused step (`make_adamw`).

Configurations (`CONFIGS`), each on all 8 ranks of one launch:

- "DTensor eager", "DTensor compiled": PyTorch's own plan
  `Transformer.parallelize` on a 1-D DeviceMesh of 8
  (`local_output_for_attn=True`, the plan's CPU path: DTensor has no
  sharding rule for the CPU flash attention kernel; attention then runs on
  local tensors in every DTensor row), the logits gathered (its output
  layout is Replicate) for the loss; eager, and the whole module under
  `torch.compile`. Kept for reference.
- DTensor at its best, torchtitan's recipe (`torchtitan.models.llama3` and
  `torchtitan.distributed.compile.apply_compile`) on the same module
  (`titan_plan`): the same Megatron plan, but the output projection leaves
  the logits vocabulary-sharded (`ColwiseParallel(output_layouts=Shard(-1),
  use_local_output=False)`) and the cross-entropy runs under
  `torch.distributed.tensor.parallel.loss_parallel()` (forward and
  backward), so the logits are never gathered; then each transformer block
  compiled on its own (`block.compile(fullgraph=True)`, as `apply_compile`).
  The tied weights stay tied: the embedding's `RowwiseParallel` and the
  output's `ColwiseParallel` both shard the one weight on the vocabulary
  (`Shard(0)`), which is what `loss_parallel` needs. Rows: "DTensor lp
  eager" (the plan and loss_parallel, nothing compiled), "DTensor lp
  blocks" (each block compiled) and "DTensor lp+sp blocks" (with sequence
  parallelism as well, torchtitan's default `enable_sequence_parallel`:
  norms and residuals sharded on the sequence, all-gathers and
  reduce-scatters in place of the all-reduces). Async TP (torchtitan's
  `enable_async_tensor_parallel`: inductor's `_micro_pipeline_tp` pass over
  symmetric memory, `torch.distributed._symmetric_memory`) needs CUDA and
  NCCL: it does not apply on gloo and CPU tensors, and no row pretends to
  run it.
- tess-compile: `tess_compile.shard(model, 2, 2, mode="1d")` (Megatron-LM
  over p=8, the loss over the vocab-split logits) and mode "2.5d" (the
  `[2,2,2]` mesh), eager and with `compile=True` (each rank's program
  through inductor, every collective lowered to torch's functional
  collectives: docs/compiled.md), each with its default options
  (`summa="auto"`). `--schedules` adds 2.5d eagerly in each fixed schedule
  of its products: the papers' (q broadcasts of each operand), "overlap"
  (the next step's broadcasts in flight) and "gather" (one all-gather of
  each operand).

"DTensor at its best" is, per sequence, the fastest DTensor row of that
launch; the table names it, and gives every row's time over it.

Every configuration is built and runs `--warmup` steps (compilation
included), then two measured steps, then `--rounds` rounds: round r runs
`--steps` steps of each configuration in turn, between barriers. Per-step
time of a round is the slowest rank's; the table gives the median over
rounds. Alternating rounds spread the machine's drift over all rows.

Columns: ms/step; its ratio to DTensor at its best and to DTensor eager;
the loss of the first step and of the last (every row starts from the same
weights and batch and takes the same steps: a row whose losses differ from
the others' beyond float rounding is a bug); bytes saved for backward per
rank in one forward (`tess_compile.analysis.accounting.saved_bytes`:
storages autograd keeps, each once, parameters' left out, a DTensor by its
local tensor); bytes moved per rank per step: the payload a rank hands each
collective (its input tensor's bytes, the convention of
`tess_compile.analysis.accounting`). For eager tess these are the runtime's
`comm.records`; for compiled tess, the collectives its compiled graphs hold
(`CompiledRank.graphs`); for DTensor, the collectives that `CommDebugMode`
counts (`CommBytes` adds their input bytes). Under a dispatch mode such as
CommDebugMode dynamo cannot trace, so the compiled DTensor rows' bytes are
counted on an eager step (`torch.compiler.set_stance("force_eager")`); the
CPU time a rank spends per step (`time.process_time`, all of its threads:
the program, gloo's workers, inductor's kernels; a blocked wait spends
none), the mean over ranks, and the CPU-bound step, every rank's CPU over
the cores: the least step time the machine allows for that work. What a
step takes beyond it is waiting: a rank blocked on a peer that is not
running. CPU cores are shared by all 8 processes: the times rank
configurations on this machine, they are not GPU predictions.

    python3 benchmarks/vs_dtensor.py [--dims 128,256] [--seqs 32,64,128] [--rounds 7] [--steps 5]
        [--warmup 3] [--optimizer fused|foreach|for-loop] [--configs NAME,...] [--schedules] [--quick]
        [--out benchmarks/results/vs_dtensor.json]

`--quick` runs tiny sizes (one sequence, 8) on 4 ranks (`[2,2,1]`), eager
rows only (compiling costs minutes), for the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils import _pytree as pytree

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile
from tess_compile.analysis.accounting import saved_bytes
from tess_compile.core.options import SCHEDULES
from tess_compile.runtime.launch import run_local

__all__ = ["CONFIGS", "Config", "WithLoss", "main", "make_model", "titan_plan"]

SIZES = {"dim": 128, "layers": 2, "heads": 8, "vocab": 512, "batch": 16, "seq": 32}
QUICK_SIZES = {"dim": 32, "layers": 1, "heads": 8, "vocab": 64, "batch": 8, "seq": 8}
DEFAULT_SEQS = "32,64,128"


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
    """PyTorch's own tensor-parallel plan of the Transformer on a 1-D mesh of all q*q*d ranks,
    the logits gathered; `compiled`: the whole module under torch.compile."""
    from torch.testing._internal.distributed._tensor.common_dtensor import Transformer

    mesh = init_device_mesh("cpu", (q * q * d,))
    Transformer.parallelize(model.model, mesh, use_seq_parallel=False, local_output_for_attn=True)
    return torch.compile(model) if compiled else model


def titan_plan(transformer: nn.Module, mesh, *, sequence_parallel: bool) -> nn.Module:
    """torchtitan's tensor-parallel plan of PyTorch's test Transformer on the 1-D `mesh`:
    `Transformer.parallelize`'s Megatron plan (attention on local tensors, its CPU path) with the
    logits left vocabulary-sharded, a `Shard(-1)` DTensor, for `loss_parallel`;
    `sequence_parallel`: norms and residuals sharded on the sequence (torchtitan's default)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    residual = Shard(1) if sequence_parallel else Replicate()  # layout of the activations between blocks
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        # positions are [seq, dim]: the sequence is their dim 0
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=Shard(0) if sequence_parallel else Replicate()),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(transformer, mesh, root_plan)
    for block in transformer.layers:
        block_plan = {
            "attention.wq": ColwiseParallel(use_local_output=True),
            "attention.wk": ColwiseParallel(use_local_output=True),
            "attention.wv": ColwiseParallel(use_local_output=True),
            "attention.wo": RowwiseParallel(output_layouts=residual),
            "feed_forward.w1": ColwiseParallel(input_layouts=residual),
            "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        }
        if sequence_parallel:
            block_plan["attention"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
            block_plan["attention_norm"] = SequenceParallel()
            block_plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, mesh, block_plan)
        block.attention.n_heads //= mesh.size()  # each rank's heads, on local tensors
    if transformer.model_args.weight_tying:
        # both plans shard the one weight on the vocabulary (Shard(0)): tie the two DTensors again
        transformer.output.weight = transformer.tok_embeddings.weight
    return transformer


def dtensor_titan(model: WithLoss, batch, q: int, d: int, *, sequence_parallel: bool, compiled: str) -> nn.Module:
    """torchtitan's recipe on a 1-D mesh of all q*q*d ranks: `titan_plan`, then `compiled`:
    "blocks", each transformer block compiled on its own (`apply_compile`), "model", the whole
    Transformer (the loss stays outside), or "" nothing; the step runs the loss under `loss_parallel`."""
    mesh = init_device_mesh("cpu", (q * q * d,))
    titan_plan(model.model, mesh, sequence_parallel=sequence_parallel)
    if compiled == "blocks":
        for block in model.model.layers:
            block.compile(fullgraph=True)
    elif compiled == "model":
        model.model.compile()
    return model


def tess(model: WithLoss, batch, q: int, d: int, *, mode: str, compiled: bool, **options) -> nn.Module:
    """tess-compile's module of `model` on the q*q*d ranks in `mode` (1d: all ranks on one
    axis) with its default options but `options` (e.g. `summa`); `compiled`: its per-rank
    program through inductor (`compile=True`)."""
    return tess_compile.shard(model, q, d, example_inputs=batch, mode=mode, timeout=300, compile=compiled, **options)


@dataclasses.dataclass(frozen=True)
class Config:
    """A row: `build(model, batch, q, d) -> module`; `compiled`: it compiles (left out by
    `--quick`); `dtensor`: a candidate for DTensor at its best; `loss_parallel`: the step
    runs forward and backward under `loss_parallel()`; `extra`: only with `--schedules`."""

    build: Callable
    compiled: bool = False
    dtensor: bool = False
    loss_parallel: bool = False
    extra: bool = False


CONFIGS = {
    "DTensor eager": Config(functools.partial(dtensor, compiled=False), dtensor=True),
    "DTensor compiled": Config(functools.partial(dtensor, compiled=True), compiled=True, dtensor=True),
    "DTensor lp eager": Config(functools.partial(dtensor_titan, sequence_parallel=False, compiled=""),
                               dtensor=True, loss_parallel=True),
    "DTensor lp blocks": Config(functools.partial(dtensor_titan, sequence_parallel=False, compiled="blocks"),
                                compiled=True, dtensor=True, loss_parallel=True),
    "DTensor lp+sp blocks": Config(functools.partial(dtensor_titan, sequence_parallel=True, compiled="blocks"),
                                   compiled=True, dtensor=True, loss_parallel=True),
    "DTensor lp model": Config(functools.partial(dtensor_titan, sequence_parallel=False, compiled="model"),
                               compiled=True, dtensor=True, loss_parallel=True),
    "tess 1d": Config(functools.partial(tess, mode="1d", compiled=False)),
    "tess 2.5d": Config(functools.partial(tess, mode="2.5d", compiled=False)),
    **{f"tess 2.5d {summa}": Config(functools.partial(tess, mode="2.5d", compiled=False, summa=summa), extra=True)
       for summa in SCHEDULES},
    "tess 1d compiled": Config(functools.partial(tess, mode="1d", compiled=True), compiled=True),
    "tess 2.5d compiled": Config(functools.partial(tess, mode="2.5d", compiled=True), compiled=True),
}
# the ratios of the summary: tess's rows over DTensor at its best
SUMMARY_ROWS = ["tess 1d", "tess 1d compiled", "tess 2.5d", "tess 2.5d compiled"]


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


def _loss_value(loss: torch.Tensor) -> float:
    """The loss as a float on this rank (a replicated DTensor's full value)."""
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return float(loss)


OPTIMIZERS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def make_adamw(module: nn.Module, implementation: str) -> torch.optim.AdamW:
    """AdamW over `module`'s parameters in `implementation` (a key of `OPTIMIZERS`), the DTensors
    and the plain tensors each a parameter group of their own: a fused or foreach step runs per
    group, and refuses the two kinds in one call."""
    params = list(module.parameters())
    kinds = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return torch.optim.AdamW([{"params": group} for group in kinds if group], lr=1e-4,
                             **OPTIMIZERS[implementation])


class Trainer:
    """One configuration on this rank: its module, AdamW (`make_adamw`), and the global batch."""

    def __init__(self, name: str, sizes: dict, q: int, d: int, optimizer: str):
        self.config = CONFIGS[name]
        self.batch = make_batch(sizes)
        self.module = self.config.build(make_model(sizes), self.batch, q, d)
        self.optimizer = make_adamw(self.module, optimizer)
        self.last_loss = None

    def context(self):
        """Where forward and backward run: under `loss_parallel()` for the rows that use it."""
        if self.config.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def forward(self) -> torch.Tensor:
        return self.module(*self.batch)

    def step(self, forward=None) -> None:
        self.optimizer.zero_grad()
        with self.context():
            loss = (forward or self.forward)()
            loss.backward()
        self.optimizer.step()
        self.last_loss = loss.detach()

    def saved_bytes(self) -> int:
        """One step; the bytes its forward saves for backward."""
        parameters = [p.to_local() if isinstance(p, DTensor) else p for p in self.module.parameters()]
        losses = []
        with self.context():  # entered once around forward, once around backward in `step`: never nested
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
        # dynamo cannot trace under CommDebugMode (and fullgraph=True refuses to fall back): an eager step
        with warnings.catch_warnings(), torch.compiler.set_stance("force_eager"), CommBytes() as counter:
            warnings.simplefilter("ignore")  # CommDebugMode's module hooks warn about inputs without grad
            self.step()
        return counter.num_bytes

    def timed_round(self, steps: int) -> tuple[float, float]:
        """Seconds per step of `steps` steps between barriers, and this process's CPU seconds per step
        in them (every thread: the program's, gloo's, inductor's kernels'; waits not counted)."""
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
        cpu = time.process_time() - cpu
        dist.barrier()
        return (time.perf_counter() - start) / steps, cpu / steps


def _worker(rank: int, world_size: int, names: list, sizes: dict, q: int, d: int,
            rounds: int, steps: int, warmup: int, optimizer: str) -> list:
    trainers = [Trainer(name, sizes, q, d, optimizer) for name in names]
    first_losses = []
    for trainer in trainers:
        for index in range(warmup):
            trainer.step()
            if index == 0:
                first_losses.append(_loss_value(trainer.last_loss))
    rows = [{"saved": trainer.saved_bytes(), "moved": trainer.moved_bytes(), "times": [], "cpu": [],
             "loss_first": loss} for trainer, loss in zip(trainers, first_losses)]
    for _ in range(rounds):
        for trainer, row in zip(trainers, rows):
            wall, cpu = trainer.timed_round(steps)
            row["times"].append(wall)
            row["cpu"].append(cpu)
    for trainer, row in zip(trainers, rows):
        row["loss_last"] = _loss_value(trainer.last_loss)
    return rows


def _parse_ints(parser, flag: str, text: str) -> list[int]:
    try:
        values = [int(value) for value in text.split(",")]
    except ValueError:
        parser.error(f"{flag} {text!r}: give whole numbers separated by commas, e.g. {flag} 32,64,128")
    if any(value <= 0 for value in values):
        parser.error(f"{flag} {text!r}: every value must be positive")
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default=str(SIZES["dim"]), help="model dims, e.g. 128,256")
    parser.add_argument("--seqs", default=DEFAULT_SEQS, help="sequence lengths, one launch each per dim")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="fused",
                        help="AdamW's implementation on every row (default: fused, torchtitan's default)")
    parser.add_argument("--configs", help="only these rows, by name, separated by commas (default: all)")
    parser.add_argument("--schedules", action="store_true", help="also tess 2.5d in each fixed schedule")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (sequence 8) on 4 ranks ([2,2,1]), eager rows only, 2 rounds of 1 step")
    parser.add_argument("--out", help="also write the results as JSON here (e.g. benchmarks/results/vs_dtensor.json)")
    args = parser.parse_args(argv)
    dims = _parse_ints(parser, "--dims", args.dims)
    seqs = _parse_ints(parser, "--seqs", args.seqs)
    if min(args.rounds, args.steps, args.warmup) < 1:
        parser.error("--rounds, --steps and --warmup must each be at least 1")
    if args.configs:
        names = [name.strip() for name in args.configs.split(",")]
        unknown = [name for name in names if name not in CONFIGS]
        if unknown:
            parser.error(f"--configs: unknown {unknown}; the configurations are {list(CONFIGS)}")
    else:
        names = [name for name, config in CONFIGS.items() if args.schedules or not config.extra]
    if args.quick:
        runs, (q, d), (rounds, steps, warmup) = [QUICK_SIZES], (2, 1), (2, 1, 1)
        names = [name for name in names if not CONFIGS[name].compiled]
    else:
        runs = [dict(SIZES, dim=dim, seq=seq) for dim in dims for seq in seqs]
        (q, d), (rounds, steps, warmup) = (2, 2), (args.rounds, args.steps, args.warmup)
    start = time.perf_counter()
    tables = []
    for sizes in runs:
        results = run_local(_worker, q * q * d, args=(names, sizes, q, d, rounds, steps, warmup, args.optimizer),
                            timeout_s=3600, collective_timeout_s=600)
        print(f"\nPyTorch's test Transformer: dim {sizes['dim']}, {sizes['layers']} layers, {sizes['heads']} heads, "
              f"vocabulary {sizes['vocab']} (tied), batch {sizes['batch']}, sequence {sizes['seq']}, fp32, "
              f"cross-entropy, AdamW ({args.optimizer}); {q * q * d} gloo processes on {_cores()} CPU cores (DTensor and "
              f"tess 1d over all, tess 2.5d on [{q},{q},{d}]); median over {rounds} rounds of {steps} steps, after "
              f"{warmup} warm-up")
        table = make_table(names, results)
        print_table(table)
        tables.append({"sizes": sizes, **table})
    wall_s = time.perf_counter() - start
    if len(tables) > 1:
        print_summary(tables)
    print(f"(ms/step: the slowest rank's; wall time of the whole run {wall_s:.0f} s)")
    if args.out:
        record = {"command": "python3 benchmarks/vs_dtensor.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "torch": torch.__version__, "cpu_count": os.cpu_count(), "world_size": q * q * d,
                  "mesh_2_5d": [q, q, d], "optimizer": args.optimizer, "rounds": rounds, "steps": steps, "warmup": warmup,
                  "wall_s": round(wall_s, 1), "runs": tables}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


def _cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def make_table(names: list, results: list) -> dict:
    """The rows of one launch: median ms/step over rounds (slowest rank per round), the ratios to
    DTensor at its best (the fastest DTensor row) and to DTensor eager, rank 0's losses and bytes; the
    CPU a rank spends per step (median over rounds of the mean over ranks), and the least step time
    the cores allow for that work (every rank's CPU over the cores): the rest of a step is waiting."""
    medians = {name: statistics.median(max(times) for times in zip(*(rank[index]["times"] for rank in results)))
               for index, name in enumerate(names)}
    cpus = {name: statistics.median(statistics.fmean(cpu) for cpu in zip(*(rank[index]["cpu"] for rank in results)))
            for index, name in enumerate(names)}
    candidates = [name for name in names if CONFIGS[name].dtensor]
    best = min(candidates, key=medians.get) if candidates else None
    eager = medians.get("DTensor eager")
    rows = []
    for index, name in enumerate(names):
        row = results[0][index]
        rows.append({
            "configuration": name,
            "ms_per_step": round(medians[name] * 1e3, 2),
            "vs_best": round(medians[name] / medians[best], 3) if best else None,
            "vs_dtensor_eager": round(medians[name] / eager, 3) if eager else None,
            "loss_first": row["loss_first"],
            "loss_last": row["loss_last"],
            "saved_bytes": row["saved"],
            "moved_bytes": row["moved"],
            "cpu_ms_per_rank": round(cpus[name] * 1e3, 2),
            "cpu_bound_ms": round(cpus[name] * len(results) / _cores() * 1e3, 2),
            "round_ms": [round(max(times) * 1e3, 2) for times in zip(*(rank[index]["times"] for rank in results))],
        })
    return {"best": best, "rows": rows}


def _ratio(value) -> str:
    return f"{value:.2f}" if value is not None else "-"


def print_table(table: dict) -> None:
    """One row per configuration, DTensor at its best named above."""
    best = table["best"]
    if best is not None:
        ms = next(row["ms_per_step"] for row in table["rows"] if row["configuration"] == best)
        print(f"DTensor at its best: {best} ({ms:.1f} ms/step)")
    print(f"{'configuration':<22} {'ms/step':>8} {'vs best':>8} {'vs DT eager':>11} {'loss first':>11} "
          f"{'loss last':>10} {'saved B/rank':>13} {'moved B/rank/step':>18} {'CPU ms/rank':>12} {'CPU-bound ms':>13}")
    for row in table["rows"]:
        print(f"{row['configuration']:<22} {row['ms_per_step']:8.1f} {_ratio(row['vs_best']):>8} "
              f"{_ratio(row['vs_dtensor_eager']):>11} {row['loss_first']:11.6f} {row['loss_last']:10.6f} "
              f"{row['saved_bytes']:>13,} {row['moved_bytes']:>18,} {row['cpu_ms_per_rank']:12.1f} "
              f"{row['cpu_bound_ms']:13.1f}")
    losses = [row["loss_first"] for row in table["rows"]]
    print(f"(first-step losses agree to {max(losses) - min(losses):.1e})")


def print_summary(tables: list) -> None:
    """Per launch: DTensor at its best, and tess's rows over it."""
    present = [name for name in SUMMARY_ROWS if any(row["configuration"] == name for row in tables[0]["rows"])]
    print("\nSummary: ms/step of DTensor at its best, and tess's over it (goal for compiled tess: <= 0.80)")
    print(f"{'dim':>4} {'seq':>4} {'DTensor at its best':<22} {'ms/step':>8} "
          + " ".join(f"{name:>18}" for name in present))
    for table in tables:
        by_name = {row["configuration"]: row for row in table["rows"]}
        best = table["best"]
        ms = by_name[best]["ms_per_step"] if best else float("nan")
        print(f"{table['sizes']['dim']:>4} {table['sizes']['seq']:>4} {best or '-':<22} {ms:8.1f} "
              + " ".join(f"{_ratio(by_name[name]['vs_best']):>18}" for name in present))


if __name__ == "__main__":
    raise SystemExit(main())
