"""The `tess-compile` command: dump a model's compiled graph, train it sharded, or plan a mesh.

    tess-compile dump model.py:make --q 2 --d 2 [--mode M] [--rank R] [--stage S] [--format F] [-o OUT] [--strict]
    tess-compile run model.py:make --q 2 --d 2 [--mode M] [--steps N] [--lr LR] [--simulate] [--timeout S]
    tess-compile plan model.py:make --gpus 64 [--gpus-per-node 4] [--modes 1d,2d,2.5d] [--memory-gb 40] ...

`make` is a function in model.py that takes no arguments and returns
`(model, example_inputs)`: an `nn.Module` and a tensor, a tuple of positional
inputs or a dict of keyword inputs. torch is seeded before each call, so
every process builds the same model and inputs.

`run` starts q*q*d local gloo processes (or, with `--simulate`, runs every
rank in this process), and trains the sharded model with AdamW on the example
inputs beside an unsharded copy (the oracle), printing both losses at every
step. The loss is the model's output if that is a scalar tensor; otherwise
the mean of the squares of its first tensor output (a DTensor is gathered
with `.full_tensor()` first). It exits with 1 if the losses differ by more
than TOLERANCE (relative), or if a process fails or runs past `--timeout`.

`--mode` picks the parallel mode of dump and run: 2.5d (Tesseract, the
default), 2d (Optimus, d=1), 3d (d=q) or 1d (Megatron-LM over q*q*d ranks,
e.g. --q 1 --d 8). `plan` builds the model on the meta device, compiles it
for every mesh of --gpus ranks in --modes and prints the meshes by predicted
step time on the cluster the options describe (default: the Tesseract
paper's, 4 A100 per node); see docs/planner.md.

User errors (the FILE.py:FACTORY argument, the file, the factory, the mesh,
shapes the mesh cannot split) print a message and exit with 2.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import os
import sys
import time
import traceback

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

import tess_compile
from passes.recompute import CHECKPOINTS
from passes.summa import SCHEDULES
from tess_compile.compiler import split_example_inputs
from tess_compile.launch import run_local
from tess_compile.mesh import MODES

__all__ = ["main"]

SEED = 0  # torch's seed before every call of the factory
TOLERANCE = 1e-4  # the largest relative loss difference `run` accepts
MODULE_NAME = "_tess_compile_factory"  # the name the factory's file is imported under
BAR_WIDTH = 20


class CliError(Exception):
    """A failure reported as one message on stderr, without a traceback; `code` is the exit code."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- the factory


def parse_target(target: str) -> tuple[str, str]:
    """Split FILE.py:FACTORY and check that FILE is an existing .py file."""
    path, _, name = target.rpartition(":")
    if not path or not name:
        example = f"{target}:make_model" if target.endswith(".py") else "model.py:make_model"
        raise CliError(f"expected FILE.py:FACTORY, got {target!r}: name the factory function "
                       f"after a colon, e.g. {example}")
    if not path.endswith(".py"):
        raise CliError(f"{path!r} is not a .py file: pass a Python file, e.g. model.py:{name}")
    if not os.path.isfile(path):
        raise CliError(f"file {path!r} not found (from {os.getcwd()}): check the path")
    return path, name


def load_factory(path: str, name: str):
    """Import the file at `path` and return its callable `name`."""
    full = os.path.abspath(path)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    sys.path.insert(0, os.path.dirname(full))  # so that the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # any error of the user's file
        raise CliError(f"importing {path} failed: {describe(exc, path)}; fix the error in the file") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(key for key, value in vars(module).items()
                       if callable(value) and getattr(value, "__module__", None) == MODULE_NAME)
        raise CliError(f"{path} has no function {name!r}; its callables are: {', '.join(found) or '(none)'}; "
                       f"pass one of them as FILE.py:FACTORY")
    return factory


def describe(exc: Exception, path: str) -> str:
    """The exception's last line, with the line of the file at `path` that raised it when known."""
    text = traceback.format_exception_only(type(exc), exc)[-1].strip()
    if isinstance(exc, SyntaxError):
        line = exc.lineno
    else:
        full = os.path.abspath(path)
        line = next((frame.lineno for frame in reversed(traceback.extract_tb(exc.__traceback__))
                     if frame.filename == full), None)
    return f"{text} (line {line})" if line else text


def build(path: str, name: str) -> tuple[nn.Module, object]:
    """Seed torch, call the factory and check that it returned (model, example_inputs)."""
    return call_factory(load_factory(path, name), path, name)


def call_factory(factory, path: str, name: str) -> tuple[nn.Module, object]:
    """Seed torch, call `factory` (`name` in `path`) and check that it returned (model, example_inputs)."""
    torch.manual_seed(SEED)
    try:
        result = factory()
    except Exception as exc:  # any error of the user's factory
        raise CliError(f"{name}() in {path} failed: {describe(exc, path)}; the factory must take "
                       "no arguments and return (model, example_inputs)") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)
            and isinstance(result[1], (torch.Tensor, tuple, dict))):
        raise CliError(f"{name}() in {path} returned {type_names(result)}, not a pair (model, example_inputs): "
                       "return an nn.Module and a tensor, a tuple of positional inputs or a dict of "
                       "keyword inputs, e.g. `return model, torch.randn(4, 3, 8)`")
    return result


def type_names(value) -> str:
    """`value`'s type for a message; a tuple's element types too."""
    if isinstance(value, tuple):
        return f"tuple ({', '.join(type(item).__name__ for item in value)})"
    return type(value).__name__


def check_mesh(q: int, d: int, mode: str = "2.5d") -> None:
    """CliError with tess_compile's message unless [q, q, d] is a valid mesh in `mode`."""
    try:
        tess_compile.Mesh(q, d, mode)
    except ValueError as exc:
        raise CliError(str(exc)) from None


# --------------------------------------------------------------------------- dump


def cmd_dump(args) -> int:
    """Print (or write to args.output) one stage of the compiled model."""
    from tess_compile.graph_dump import dump  # only this command needs it

    model, inputs = build(*parse_target(args.target))
    check_mesh(args.q, args.d, args.mode)
    try:
        text = dump(model, args.q, args.d, example_inputs=inputs, mode=args.mode, rank=args.rank,
                    stage=args.stage, format=args.format, strict=args.strict, **memory_options(args))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not text.endswith("\n"):
        text += "\n"
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(text)
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror}; pick a writable path for -o") from None
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- run


def cmd_run(args) -> int:
    """Train the sharded model beside the oracle; exit 1 if their losses differ."""
    path, name = parse_target(args.target)
    check_mesh(args.q, args.d, args.mode)
    world = args.q * args.q * args.d
    start = time.perf_counter()
    if args.simulate:
        print(f"simulating {world} ranks in this process", file=sys.stderr, flush=True)
        sim, oracle, inputs = compile_pair(tess_compile.simulate, path, name, args.q, args.d, mode=args.mode,
                                           **memory_options(args))
        rows = train(sim, oracle, inputs, args.steps, args.lr, show=True)
        mode = "simulated"
    else:
        build(path, name)  # errors of the file show here, before any process starts
        print(f"launching {world} local gloo processes", file=sys.stderr, flush=True)
        rows = launch(path, name, args)
        mode = f"{world} processes"
    return summarize(rows, time.perf_counter() - start, mode)


def compile_pair(compile_fn, path: str, name: str, q: int, d: int, **options):
    """(compiled model, unsharded copy, example inputs); compile_fn is shard or simulate."""
    model, inputs = build(path, name)
    oracle = copy.deepcopy(model)
    try:
        return compile_fn(model, q, d, example_inputs=inputs, **options), oracle, inputs
    except ValueError as exc:
        raise CliError(str(exc)) from None


def launch(path: str, name: str, args) -> list[tuple]:
    """Run rank_main on q*q*d local gloo processes; return rank 0's rows."""
    world = args.q * args.q * args.d
    job = (path, name, args.q, args.d, args.mode, args.steps, args.lr, args.timeout, memory_options(args))
    try:
        rows, error = run_local(rank_main, world, args=job, timeout_s=args.timeout,
                                collective_timeout_s=args.timeout)[0]
    except TimeoutError as exc:
        raise CliError(f"{exc}; pass a larger --timeout", code=1) from None
    except RuntimeError as exc:
        raise CliError(str(exc), code=1) from None
    if error is not None:
        raise CliError(error)
    return rows


def rank_main(rank: int, world_size: int, path, name, q, d, mode, steps, lr, timeout, options) -> tuple:
    """One process of `run`: (rows, None), or (None, message) for a user error."""
    try:
        sharded, oracle, inputs = compile_pair(tess_compile.shard, path, name, q, d, mode=mode, timeout=timeout,
                                               **options)
    except CliError as exc:  # the same on every rank: compiling needs no peer
        return None, str(exc)
    return train(sharded, oracle, inputs, steps, lr, show=rank == 0), None


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


def train_step(model: nn.Module, opt, args: tuple, kwargs: dict) -> float:
    """One forward, backward and optimizer step; the loss."""
    opt.zero_grad(set_to_none=True)
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


# --------------------------------------------------------------------------- plan


def cmd_plan(args) -> int:
    """Print the meshes of --gpus ranks by predicted step time; exit 1 if none fits in memory."""
    from tess_compile.planner import candidate_meshes, format_table, plan  # only this command needs them

    path, name = parse_target(args.target)
    cluster = cluster_of(args)
    modes = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
    try:  # bad --gpus or --modes fail before the model is built
        candidate_meshes(args.gpus if (args.dp, args.pp) == (1, 1) else 1, modes)
    except ValueError as exc:
        raise CliError(f"{exc} (--gpus, --modes)") from None
    factory = load_factory(path, name)
    with torch.device("meta"):  # no weight is allocated
        model, inputs = call_factory(factory, path, name)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        rows = plan(model, args.gpus, cluster=cluster, modes=modes, example_inputs=inputs, overlap=args.overlap,
                    summa=args.summa, keep_blocks=KEEP_BLOCKS[args.keep_blocks], checkpoint=args.checkpoint,
                    dp=args.dp, pp=args.pp, microbatches=args.microbatches, zero=args.zero)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(f"# {args.gpus} GPUs, {cluster.gpus_per_node} per node; intra-node {args.intra_bandwidth:g} GB/s, "
          f"{args.intra_latency:g} us; inter-node {args.inter_bandwidth:g} GB/s, {args.inter_latency:g} us; "
          f"{args.tflops:g} TFLOP/s and {args.memory_gb:g} GB per GPU; matmul half size {args.matmul_half_size:g}, "
          f"memory {args.memory_bandwidth:g} GB/s, {args.kernel_overhead:g} us a kernel; {cluster.algorithm} collectives"
          f"{'; compute and communication overlapped' if args.overlap else ''}")
    sys.stdout.write(format_table(rows))
    if not any(row.fits for row in rows):
        print(f"tess-compile: error: no mesh of {args.gpus} GPUs fits (see the notes): raise --memory-gb, "
              "use more GPUs, or change the model", file=sys.stderr)
        return 1
    return 0


def cluster_of(args):
    """The Cluster the plan options describe."""
    from tess_compile.cost_model import Cluster

    try:
        return Cluster(gpus_per_node=args.gpus_per_node,
                       intra_bandwidth=args.intra_bandwidth * 1e9, intra_latency=args.intra_latency / 1e6,
                       inter_bandwidth=args.inter_bandwidth * 1e9, inter_latency=args.inter_latency / 1e6,
                       flops=args.tflops * 1e12, memory=args.memory_gb * 1e9, algorithm=args.algorithm,
                       matmul_half_size=args.matmul_half_size, memory_bandwidth=args.memory_bandwidth * 1e9,
                       kernel_overhead=args.kernel_overhead / 1e6)
    except ValueError as exc:
        raise CliError(str(exc)) from None


# --------------------------------------------------------------------------- command line


def non_negative(text: str) -> float:
    """An argparse type: a float >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def positive(kind):
    """An argparse type: `kind` (int or float) that must be > 0."""
    def convert(text: str):
        problem = f"expected a number > 0 ({kind.__name__}), got {text!r}"
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(problem) from None
        if not value > 0:  # NaN too
            raise argparse.ArgumentTypeError(problem)
        return value
    return convert


def make_parser() -> argparse.ArgumentParser:
    """The parser of `tess-compile` and its commands `dump`, `run` and `plan`."""
    parser = argparse.ArgumentParser(
        prog="tess-compile",
        description="Shard a PyTorch model with Tesseract (2.5-D) tensor parallelism on a [q, q, d] mesh.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    dump = commands.add_parser(
        "dump", help="print a stage of the compiled model",
        description="Compile the model of FACTORY and print one stage of it.")
    add_common(dump)
    dump.add_argument("--rank", type=int, default=0, help="the rank whose graph to show (default 0)")
    dump.add_argument("--stage", choices=("captured", "placed", "rewritten"), default="rewritten",
                      help="the graph after capture, placement or rewriting (default rewritten)")
    dump.add_argument("--format", choices=("text", "dot", "svg"), default="text", help="(default text)")
    dump.add_argument("-o", "--output", metavar="OUT", help="write to OUT instead of stdout")
    dump.add_argument("--strict", action="store_true", help="fail on ops that would run replicated")
    dump.set_defaults(func=cmd_dump)

    run = commands.add_parser(
        "run", help="train the sharded model beside the unsharded one",
        description="Train the model of FACTORY sharded and unsharded with AdamW on its example inputs "
                    "and compare the losses at every step. Loss: the output if it is a scalar, else the "
                    "mean of the squares of the first tensor output (DTensors via .full_tensor()). "
                    f"Exit code 1 if a relative difference exceeds {TOLERANCE:g}.")
    add_common(run)
    run.add_argument("--steps", type=positive(int), default=5, help="training steps (default 5)")
    run.add_argument("--lr", type=positive(float), default=1e-3, help="AdamW learning rate (default 1e-3)")
    run.add_argument("--simulate", action="store_true",
                     help="run every rank in this process (tess_compile.simulate) instead of q*q*d processes")
    run.add_argument("--timeout", type=positive(float), default=600.0,
                     help="seconds the q*q*d processes may take (default 600)")
    run.set_defaults(func=cmd_run)
    add_plan(commands)
    return parser


def add_plan(commands) -> None:
    """The `plan` command; the cluster options default to the calibrated cluster
    (the Tesseract paper's, with constants fitted to its Table 1)."""
    from tess_compile.cost_model import CALIBRATED_CLUSTER as paper

    plan = commands.add_parser(
        "plan", help="rank the meshes of a GPU count by predicted step time",
        description="Build the model of FACTORY on the meta device, compile it for every mesh of --gpus "
                    "ranks in --modes, and print the meshes by predicted step time (the calibrated cost model; "
                    "see docs/planner.md). Cluster defaults: the Tesseract paper's (4 A100 40 GB per node), "
                    "with link, matmul-efficiency and kernel constants fitted to its Table 1. "
                    "Exit code 1 if no mesh fits in memory.")
    plan.add_argument("target", metavar="FILE.py:FACTORY",
                      help="a function in FILE.py that takes no arguments and returns (model, example_inputs)")
    plan.add_argument("--gpus", type=positive(int), required=True, help="number of GPUs (ranks)")
    plan.add_argument("--gpus-per-node", type=positive(int), default=paper.gpus_per_node,
                      help=f"GPUs per node; ranks fill nodes in order (default {paper.gpus_per_node})")
    plan.add_argument("--modes", default="1d,2d,2.5d",
                      help="comma-separated modes among 1d, 2d, 2.5d, 3d (default 1d,2d,2.5d)")
    plan.add_argument("--intra-bandwidth", type=positive(float), default=paper.intra_bandwidth / 1e9,
                      metavar="GB_PER_S", help=f"GB/s within a node (default {paper.intra_bandwidth / 1e9:g})")
    plan.add_argument("--intra-latency", type=non_negative, default=paper.intra_latency * 1e6, metavar="US",
                      help=f"microseconds per step within a node (default {paper.intra_latency * 1e6:g})")
    plan.add_argument("--inter-bandwidth", type=positive(float), default=paper.inter_bandwidth / 1e9,
                      metavar="GB_PER_S",
                      help=f"GB/s between nodes (default {paper.inter_bandwidth / 1e9:g}: 200 Gb/s InfiniBand)")
    plan.add_argument("--inter-latency", type=non_negative, default=paper.inter_latency * 1e6, metavar="US",
                      help=f"microseconds per step between nodes (default {paper.inter_latency * 1e6:g})")
    plan.add_argument("--tflops", type=positive(float), default=paper.flops / 1e12,
                      help=f"sustained matmul TFLOP/s of one GPU (default {paper.flops / 1e12:g})")
    plan.add_argument("--matmul-half-size", type=non_negative, default=paper.matmul_half_size, metavar="M",
                      help="a product whose smallest dimension is m runs at tflops * m / (m + M); 0: always at "
                           f"--tflops (default {paper.matmul_half_size:g})")
    plan.add_argument("--memory-bandwidth", type=positive(float), default=paper.memory_bandwidth / 1e9,
                      metavar="GB_PER_S",
                      help=f"GB/s of one GPU's memory, for kernels other than products (default "
                           f"{paper.memory_bandwidth / 1e9:g})")
    plan.add_argument("--kernel-overhead", type=non_negative, default=paper.kernel_overhead * 1e6, metavar="US",
                      help=f"microseconds per kernel launch (default {paper.kernel_overhead * 1e6:g})")
    plan.add_argument("--memory-gb", type=positive(float), default=paper.memory / 1e9,
                      help=f"memory of one GPU in GB, the budget a mesh must fit (default {paper.memory / 1e9:g})")
    plan.add_argument("--algorithm", choices=("ring", "tree"), default=paper.algorithm,
                      help=f"collective algorithm (default {paper.algorithm})")
    plan.add_argument("--summa", choices=("auto", *SCHEDULES), default="auto",
                      help="schedule of the matrix products to price; auto (default) prices each, keeps the fastest")
    plan.add_argument("--dp", type=count_or_auto, default="auto",
                      help="data-parallel replicas around each mesh, or auto: every count that divides the GPUs "
                           "and the batch (default auto)")
    plan.add_argument("--pp", type=count_or_auto, default="auto",
                      help="pipeline stages, or auto: every count that divides the GPUs and the model's repeated "
                           "blocks (default auto)")
    plan.add_argument("--microbatches", type=positive(int), default=None,
                      help="microbatches per step with pipeline stages (default: the most up to 4 per stage that "
                           "divide the batch)")
    plan.add_argument("--zero", action="store_true",
                      help="shard gradients and AdamW state over the data-parallel replicas (ZeRO)")
    plan.add_argument("--keep-blocks", choices=tuple(KEEP_BLOCKS), default="auto",
                      help="keep the fetched blocks of the matrix products for backward: auto (where memory "
                           "allows and it is faster), on or off (default auto)")
    plan.add_argument("--checkpoint", choices=CHECKPOINTS, default="none",
                      help="recompute in backward: none, blocks (each repeated block) or selective (default none)")
    plan.add_argument("--overlap", action="store_true",
                      help="assume compute and communication overlap (max instead of sum per phase)")
    plan.add_argument("-v", "--verbose", action="store_true", help="log each mesh as it compiles")
    plan.set_defaults(func=cmd_plan)


def add_common(parser: argparse.ArgumentParser) -> None:
    """The arguments of dump and run: the factory, the mesh and the mode."""
    parser.add_argument("target", metavar="FILE.py:FACTORY",
                        help="a function in FILE.py that takes no arguments and returns (model, example_inputs)")
    parser.add_argument("--q", type=int, required=True, help="mesh side: q*q*d ranks")
    parser.add_argument("--d", type=int, required=True, help="mesh depth, 1 <= d <= q (1d: any d)")
    parser.add_argument("--mode", choices=MODES, default="2.5d",
                        help="2.5d (Tesseract, default), 2d (Optimus, d=1), 3d (d=q), "
                             "1d (Megatron-LM over q*q*d ranks, e.g. --q 1 --d 8)")
    parser.add_argument("--keep-blocks", action="store_true",
                        help="keep the fetched blocks of the matrix products for backward (less communication, "
                             "q times the saved bytes) instead of fetching them again")
    parser.add_argument("--checkpoint", choices=CHECKPOINTS, default="none",
                        help="recompute in backward: none, blocks (each repeated block) or selective (default none)")


def count_or_auto(text: str):
    """A positive whole number, or "auto"."""
    if text == "auto":
        return text
    return positive(int)(text)


# --keep-blocks of plan -> the planner's keep_blocks.
KEEP_BLOCKS = {"auto": "auto", "on": True, "off": False}


def memory_options(args) -> dict:
    """The compile options of dump and run that trade memory for work."""
    return {"keep_blocks": args.keep_blocks, "checkpoint": args.checkpoint}


def main(argv=None) -> int:
    """Run the command line `argv` (default sys.argv[1:]); return the exit code."""
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        print(f"tess-compile: error: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
