"""`tess-compile run`: train the sharded model beside the unsharded one and compare the losses.

It starts q*q*d local gloo processes (or the ranks of `--spec`'s parallel spec:
`dp x pp x [q, q, d]`, each running what `tess_compile.parallelize` gives it),
or, with `--simulate`, runs every rank in this process, and trains both models
with AdamW on the example inputs,
printing both losses at every step and a progress bar; it exits with 1 if the
losses differ by more than TOLERANCE (relative), or if a process fails or
runs past `--timeout`.
"""

from __future__ import annotations

import copy
import sys
import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

import tess_compile
from tess_compile.cli.common import (
    CliError,
    add_model_arguments,
    build,
    load_cluster_file,
    parse_target,
    positive,
    spec_of,
    type_names,
)
from tess_compile.core.parallel_spec import ParallelSpec
from tess_compile.core.program import split_example_inputs
from tess_compile.runtime.launch import run_local
from tess_compile.scale_out.rank_run import RankRun

__all__ = [
    "BAR_WIDTH",
    "TOLERANCE",
    "Table",
    "add_command",
    "cmd_run",
    "compile_pair",
    "launch",
    "loss_of",
    "rank_main",
    "summarize",
    "train",
    "train_step",
]

TOLERANCE = 1e-4  # the largest relative loss difference `run` accepts
BAR_WIDTH = 20


def cmd_run(args) -> int:
    """Train the sharded model beside the oracle; exit 1 if their losses differ."""
    path, name = parse_target(args.target)
    spec = spec_of(args)
    if args.cluster is not None:
        load_cluster_file(args.cluster)  # a bad file fails here, before any process starts
    start = time.perf_counter()
    if args.simulate:
        print(f"simulating {spec.world_size} ranks in this process ({spec.describe()})", file=sys.stderr, flush=True)
        sim, oracle, inputs = compile_pair(tess_compile.simulate, path, name, spec=spec, cluster=args.cluster)
        rows = train(sim, oracle, inputs, args.steps, args.lr, show=True)
        mode = "simulated"
    else:
        build(path, name)  # errors of the file show here, before any process starts
        print(f"launching {spec.world_size} local gloo processes ({spec.describe()})", file=sys.stderr, flush=True)
        rows = launch(path, name, args, spec)
        mode = f"{spec.world_size} processes"
    return summarize(rows, time.perf_counter() - start, mode)


def compile_pair(compile_fn, path: str, name: str, *args, **keywords):
    """(compiled model, unsharded copy, example inputs); compile_fn is shard, simulate or parallelize."""
    model, inputs = build(path, name)
    oracle = copy.deepcopy(model)
    try:
        return compile_fn(model, *args, example_inputs=inputs, **keywords), oracle, inputs
    except ValueError as exc:
        raise CliError(str(exc)) from None


def launch(path: str, name: str, args, spec: ParallelSpec) -> list[tuple]:
    """Run rank_main on the spec's local gloo processes; return rank 0's rows."""
    job = (path, name, spec, args.cluster, args.steps, args.lr, args.timeout)
    try:
        rows, error = run_local(rank_main, spec.world_size, args=job, timeout_s=args.timeout,
                                collective_timeout_s=args.timeout)[0]
    except TimeoutError as exc:
        raise CliError(f"{exc}; pass a larger --timeout", code=1) from None
    except RuntimeError as exc:
        raise CliError(str(exc), code=1) from None
    if error is not None:
        raise CliError(error)
    return rows


def rank_main(rank: int, world_size: int, path, name, spec, cluster, steps, lr, timeout) -> tuple:
    """One process of `run`: (rows, None), or (None, message) for a user error."""
    try:
        run, oracle, inputs = compile_pair(tess_compile.parallelize, path, name, spec, cluster=cluster,
                                           timeout=timeout, loss_fn=_loss_of_output)
    except CliError as exc:  # the same on every rank: compiling needs no peer
        return None, str(exc)
    return train(run, oracle, inputs, steps, lr, show=rank == 0), None


def _loss_of_output(output, target) -> torch.Tensor:
    """`loss_of` as a `RankRun`'s loss function (the example inputs are the whole step: no target)."""
    return loss_of(output)


def train(sharded: nn.Module, oracle: nn.Module, inputs, steps: int, lr: float, *, show: bool) -> list[tuple]:
    """`steps` AdamW steps of both models; rows (step, sharded loss, unsharded loss, relative difference)."""
    args, kwargs = split_example_inputs(inputs)
    models = [(model, torch.optim.AdamW(model.parameters(), lr=lr)) for model in (sharded, oracle)]
    table = Table(steps) if show else None
    rows = []
    for step in range(1, steps + 1):
        loss, loss_oracle = (train_step(model, opt, args, kwargs) for model, opt in models)
        rows.append((step, loss, loss_oracle, abs(loss - loss_oracle) / max(abs(loss_oracle), 1e-12)))
        if table:
            table.add(rows[-1])
    if table:
        table.erase()
    return rows


def train_step(model: nn.Module | RankRun, opt, args: tuple, kwargs: dict) -> float:
    """One forward, backward and optimizer step (a `RankRun`'s own step: its pipeline's or its replica's part);
    the loss."""
    opt.zero_grad(set_to_none=True)
    if isinstance(model, RankRun):
        loss = model.step(*args, *([kwargs] if kwargs else []))
    else:
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
    opt.step()
    return loss.item()


def loss_of(output) -> torch.Tensor:
    """The first tensor of `output` if it is a scalar, else the mean of its squares."""
    first = next((leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)), None)
    if first is None:
        raise CliError(f"the model returned {type_names(output)} without a tensor: return a loss or a tensor")
    if isinstance(first, DTensor):
        first = first.full_tensor()
    return first if first.dim() == 0 else first.pow(2).mean()


def summarize(rows: list[tuple], wall: float, mode: str) -> int:
    """Print the summary line; 0 if every relative difference is within TOLERANCE, else 1."""
    worst = max(rows, key=lambda row: row[3])
    print(f"max rel diff {worst[3]:.3e} over {len(rows)} steps; wall time {wall:.1f} s ({mode})", flush=True)
    if worst[3] <= TOLERANCE:
        return 0
    print(f"tess-compile: error: the sharded loss differs from the unsharded loss by {worst[3]:.3e} "
          f"(relative) at step {worst[0]}, more than {TOLERANCE:g}", file=sys.stderr)
    return 1


class Table:
    """The loss table on stdout and a progress bar on stderr: one line redrawn with
    '\\r' when stderr is a terminal, else one line per step."""

    def __init__(self, steps: int):
        self.steps = steps
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.bar = ""
        print(f"{'step':>5}  {'sharded loss':>14}  {'unsharded loss':>14}  {'rel diff':>10}", flush=True)

    def add(self, row: tuple) -> None:
        step, loss, loss_oracle, diff = row
        self.erase()
        print(f"{step:>5d}  {loss:>14.6f}  {loss_oracle:>14.6f}  {diff:>10.3e}", flush=True)
        done = BAR_WIDTH * step // self.steps
        self.bar = (f"[{'#' * done}{'.' * (BAR_WIDTH - done)}] step {step}/{self.steps}, "
                    f"{time.perf_counter() - self.start:.1f} s")
        sys.stderr.write(f"\r{self.bar}" if self.tty else f"{self.bar}\n")
        sys.stderr.flush()

    def erase(self) -> None:
        """Erase the bar from the terminal (nothing to do off a terminal)."""
        if self.tty and self.bar:
            sys.stderr.write("\r" + " " * len(self.bar) + "\r")
            sys.stderr.flush()


def add_command(commands) -> None:
    parser = commands.add_parser(
        "run", help="train the sharded model beside the unsharded one",
        description="Train the model of FACTORY sharded and unsharded with AdamW on its example inputs "
                    "and compare the losses at every step. Loss: the output if it is a scalar, else the "
                    "mean of the squares of the first tensor output (DTensors via .full_tensor()). "
                    f"Exit code 1 if a relative difference exceeds {TOLERANCE:g}.")
    add_model_arguments(parser, spec=True)
    parser.add_argument("--steps", type=positive(int), default=5, help="training steps (default 5)")
    parser.add_argument("--lr", type=positive(float), default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--simulate", action="store_true",
                        help="run every rank in this process (tess_compile.simulate) instead of q*q*d processes "
                             "(or the spec's)")
    parser.add_argument("--timeout", type=positive(float), default=600.0,
                        help="seconds the processes may take (default 600)")
    parser.set_defaults(func=cmd_run)
