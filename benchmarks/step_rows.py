"""The rows of a training-step benchmark over gloo processes, shared by `vs_dtensor.py` and
`vs_torchtitan.py`.

A row is a `Config`: how to build the module from the unsharded model, where its step's
forward and backward run, what it does between backward and the optimizer. On each rank a
`Trainer` holds a row's module, its AdamW and the global batch; `measure` runs the warm-up,
counts the bytes a step saves and moves, and times alternating rounds of every row; `make_table`
gathers the ranks' rounds into the table that `print_table` prints (ms/step, the ratio to the
fastest peer row and to a reference row, first and last losses, bytes, CPU time). The columns are
described in `vs_dtensor.py`'s docstring.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils import _pytree as pytree

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile
from tess_compile.analysis.accounting import saved_bytes
from tess_compile.runtime.launch import run_local

__all__ = ["Config", "Trainer", "add_row_arguments", "make_table", "measure", "print_summary", "print_table",
           "run_launches", "select_rows", "shape_of_launches", "tess", "timed_steps"]


def tess(model: nn.Module, batch, q: int, d: int, *, mode: str, compiled: bool, **options) -> nn.Module:
    """tess-compile's module of `model` on the q*q*d ranks in `mode` (1d: all ranks on one
    axis) with its default options but `options` (e.g. `summa`); `compiled`: its per-rank
    program through inductor (`compile=True`)."""
    return tess_compile.shard(model, q, d, example_inputs=batch, mode=mode, timeout=300, compile=compiled, **options)


@dataclasses.dataclass(frozen=True)
class Config:
    """A row: `build(model, batch, q, d) -> module`; `compiled`: it compiles (left out by
    `--quick`); `peer`: a candidate for the fastest peer row (here DTensor at its best);
    `context(module)`: where the step's forward and backward run (e.g. under `loss_parallel()`);
    `after_backward(module)`: what the step does between backward and the optimizer;
    `extra`: only with `--schedules`."""

    build: Callable
    compiled: bool = False
    peer: bool = False
    context: Callable | None = None
    after_backward: Callable | None = None
    extra: bool = False


# the ratios of the summary: tess's rows over the fastest peer row
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
    """One configuration on this rank: its module built from `model`, AdamW (`make_adamw`), and
    the global `batch`."""

    def __init__(self, config: Config, model: nn.Module, batch: tuple, q: int, d: int, optimizer: str):
        self.config = config
        self.batch = batch
        self.module = config.build(model, batch, q, d)
        self.optimizer = make_adamw(self.module, optimizer)
        self.last_loss = None

    def context(self):
        """Where forward and backward run: the configuration's context, if it has one."""
        if self.config.context is not None:
            return self.config.context(self.module)
        return contextlib.nullcontext()

    def forward(self) -> torch.Tensor:
        return self.module(*self.batch)

    def step(self, forward=None) -> None:
        self.optimizer.zero_grad()
        with self.context():
            loss = (forward or self.forward)()
            loss.backward()
        if self.config.after_backward is not None:
            self.config.after_backward(self.module)
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
        return timed_steps(self.step, steps)


def timed_steps(step: Callable[[], object], steps: int) -> tuple[float, float]:
    """Seconds per step of `steps` calls of `step` between barriers, and this process's CPU seconds per
    step in them (every thread: the program's, gloo's, inductor's kernels'; waits not counted)."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    cpu = time.process_time() - cpu
    dist.barrier()
    return (time.perf_counter() - start) / steps, cpu / steps


def measure(trainers: list, rounds: int, steps: int, warmup: int) -> list:
    """This rank's row of each trainer: `warmup` steps (the first step's loss kept), the bytes
    saved and moved by a step, then `rounds` timed rounds of `steps` steps of each in turn."""
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


def parse_ints(parser, flag: str, text: str) -> list[int]:
    try:
        values = [int(value) for value in text.split(",")]
    except ValueError:
        parser.error(f"{flag} {text!r}: give whole numbers separated by commas, e.g. {flag} 32,64,128")
    if any(value <= 0 for value in values):
        parser.error(f"{flag} {text!r}: every value must be positive")
    return values


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def make_table(names: list, results: list, configs: dict, reference: str) -> dict:
    """The rows of one launch: median ms/step over rounds (slowest rank per round), the ratios to
    the fastest peer row (DTensor at its best) and to `reference`, rank 0's losses and bytes; the
    CPU a rank spends per step (median over rounds of the mean over ranks), and the least step time
    the cores allow for that work (every rank's CPU over the cores): the rest of a step is waiting."""
    medians = {name: statistics.median(max(times) for times in zip(*(rank[index]["times"] for rank in results)))
               for index, name in enumerate(names)}
    cpus = {name: statistics.median(statistics.fmean(cpu) for cpu in zip(*(rank[index]["cpu"] for rank in results)))
            for index, name in enumerate(names)}
    candidates = [name for name in names if configs[name].peer]
    best = min(candidates, key=medians.get) if candidates else None
    eager = medians.get(reference)
    rows = []
    for index, name in enumerate(names):
        row = results[0][index]
        rows.append({
            "configuration": name,
            "ms_per_step": round(medians[name] * 1e3, 2),
            "vs_best": round(medians[name] / medians[best], 3) if best else None,
            "vs_reference": round(medians[name] / eager, 3) if eager else None,
            "loss_first": row["loss_first"],
            "loss_last": row["loss_last"],
            "saved_bytes": row["saved"],
            "moved_bytes": row["moved"],
            "cpu_ms_per_rank": round(cpus[name] * 1e3, 2),
            "cpu_bound_ms": round(cpus[name] * len(results) / cores() * 1e3, 2),
            "round_ms": [round(max(times) * 1e3, 2) for times in zip(*(rank[index]["times"] for rank in results))],
        })
    return {"best": best, "rows": rows}


def _ratio(value) -> str:
    return f"{value:.2f}" if value is not None else "-"


def print_table(table: dict, peer: str, reference: str) -> None:
    """One row per configuration, the fastest `peer` row named above; `reference`: the column
    of ratios to the reference row."""
    best = table["best"]
    if best is not None:
        ms = next(row["ms_per_step"] for row in table["rows"] if row["configuration"] == best)
        print(f"{peer}: {best} ({ms:.1f} ms/step)")
    print(f"{'configuration':<22} {'ms/step':>8} {'vs best':>8} {'vs ' + reference:>11} {'loss first':>11} "
          f"{'loss last':>10} {'saved B/rank':>13} {'moved B/rank/step':>18} {'CPU ms/rank':>12} {'CPU-bound ms':>13}")
    for row in table["rows"]:
        print(f"{row['configuration']:<22} {row['ms_per_step']:8.1f} {_ratio(row['vs_best']):>8} "
              f"{_ratio(row['vs_reference']):>11} {row['loss_first']:11.6f} {row['loss_last']:10.6f} "
              f"{row['saved_bytes']:>13,} {row['moved_bytes']:>18,} {row['cpu_ms_per_rank']:12.1f} "
              f"{row['cpu_bound_ms']:13.1f}")
    losses = [row["loss_first"] for row in table["rows"]]
    print(f"(first-step losses agree to {max(losses) - min(losses):.1e})")


def print_summary(tables: list, peer: str) -> None:
    """Per launch: the fastest `peer` row, and tess's rows over it."""
    present = [name for name in SUMMARY_ROWS if any(row["configuration"] == name for row in tables[0]["rows"])]
    print(f"\nSummary: ms/step of {peer}, and tess's over it (goal for compiled tess: <= 0.80)")
    print(f"{'dim':>4} {'seq':>4} {peer:<22} {'ms/step':>8} "
          + " ".join(f"{name:>18}" for name in present))
    for table in tables:
        by_name = {row["configuration"]: row for row in table["rows"]}
        best = table["best"]
        ms = by_name[best]["ms_per_step"] if best else float("nan")
        print(f"{table['sizes']['dim']:>4} {table['sizes']['seq']:>4} {best or '-':<22} {ms:8.1f} "
              + " ".join(f"{_ratio(by_name[name]['vs_best']):>18}" for name in present))


def add_row_arguments(parser: argparse.ArgumentParser, default_seqs: str, out_example: str) -> None:
    """The options every step benchmark takes: sequences, rounds, steps, warm-up, AdamW's
    implementation, the rows, `--quick` and `--out`."""
    parser.add_argument("--seqs", default=default_seqs, help="sequence lengths, one launch each")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="fused",
                        help="AdamW's implementation on every row (default: fused, torchtitan's default)")
    parser.add_argument("--configs", help="only these rows, by name, separated by commas (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes on 4 ranks ([2,2,1]), eager rows only, 2 rounds of 1 step")
    parser.add_argument("--out", help=f"also write the results as JSON here (e.g. {out_example})")


def select_rows(parser: argparse.ArgumentParser, args, configs: dict, *, extra: bool = False) -> list[str]:
    """The rows `args` name (`--configs`), else every row (those marked `extra` only if `extra`);
    `--quick` leaves out the compiled ones. Checks `--rounds`, `--steps` and `--warmup`."""
    if min(args.rounds, args.steps, args.warmup) < 1:
        parser.error("--rounds, --steps and --warmup must each be at least 1")
    if args.configs:
        names = [name.strip() for name in args.configs.split(",")]
        unknown = [name for name in names if name not in configs]
        if unknown:
            parser.error(f"--configs: unknown {unknown}; the configurations are {list(configs)}")
    else:
        names = [name for name, config in configs.items() if extra or not config.extra]
    if args.quick:
        names = [name for name in names if not configs[name].compiled]
    return names


def shape_of_launches(args) -> tuple[int, int, tuple[int, int, int]]:
    """q and d of the launches' mesh, and their (rounds, steps, warm-up steps): `--quick`'s
    `[2,2,1]` and 2 rounds of 1 step after 1, else `[2,2,2]` and the options'."""
    if args.quick:
        return 2, 1, (2, 1, 1)
    return 2, 2, (args.rounds, args.steps, args.warmup)


def run_launches(worker: Callable, runs: list[dict], names: list[str], args, *, q: int, d: int, repeats: tuple,
                 configs: dict, describe: Callable, peer: str, reference: tuple[str, str], script: str, argv) -> None:
    """One launch of `worker(rank, world, names, sizes, q, d, rounds, steps, warmup, optimizer)` on the
    q*q*d ranks per sizes of `runs`, each printed (`describe(sizes)`, then its table, against the
    fastest `peer` row and the `reference` row, named and labelled); the summary; and the JSON
    record at `args.out`, if given."""
    rounds, steps, warmup = repeats
    start = time.perf_counter()
    tables = []
    for sizes in runs:
        results = run_local(worker, q * q * d, args=(names, sizes, q, d, rounds, steps, warmup, args.optimizer),
                            timeout_s=3600, collective_timeout_s=600)
        print("\n" + describe(sizes) + f"; median over {rounds} rounds of {steps} steps, after {warmup} warm-up")
        table = make_table(names, results, configs, reference[0])
        print_table(table, peer, reference[1])
        tables.append({"sizes": sizes, **table})
    wall_s = time.perf_counter() - start
    if len(tables) > 1:
        print_summary(tables, peer)
    print(f"(ms/step: the slowest rank's; wall time of the whole run {wall_s:.0f} s)")
    if args.out:
        command = f"python3 benchmarks/{script} " + " ".join(sys.argv[1:] if argv is None else argv)
        record = {"command": command, "torch": torch.__version__, "cpu_count": os.cpu_count(),
                  "world_size": q * q * d, "mesh_2_5d": [q, q, d], "optimizer": args.optimizer, "rounds": rounds,
                  "steps": steps, "warmup": warmup, "wall_s": round(wall_s, 1), "runs": tables}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
