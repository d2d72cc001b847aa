"""The `tess-compile` command: dump a model's compiled graph, or train it sharded.

    tess-compile dump model.py:make --q 2 --d 2 [--rank R] [--stage S] [--format F] [-o OUT] [--strict]
    tess-compile run model.py:make --q 2 --d 2 [--steps N] [--lr LR] [--simulate] [--timeout S]

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

User errors (the FILE.py:FACTORY argument, the file, the factory, the mesh,
shapes the mesh cannot split) print a message and exit with 2.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
import time
import traceback

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

import tess_compile
from tess_compile.compiler import split_example_inputs
from tess_compile.launch import run_local

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
    factory = load_factory(path, name)
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


def check_mesh(q: int, d: int) -> None:
    """CliError with tess_compile's message unless [q, q, d] is a valid mesh."""
    try:
        tess_compile.Mesh(q, d)
    except ValueError as exc:
        raise CliError(str(exc)) from None


# --------------------------------------------------------------------------- dump


def cmd_dump(args) -> int:
    """Print (or write to args.output) one stage of the compiled model."""
    from tess_compile.graph_dump import dump  # only this command needs it

    model, inputs = build(*parse_target(args.target))
    check_mesh(args.q, args.d)
    try:
        text = dump(model, args.q, args.d, example_inputs=inputs, rank=args.rank,
                    stage=args.stage, format=args.format, strict=args.strict)
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
    check_mesh(args.q, args.d)
    world = args.q * args.q * args.d
    start = time.perf_counter()
    if args.simulate:
        print(f"simulating {world} ranks in this process", file=sys.stderr, flush=True)
        sim, oracle, inputs = compile_pair(tess_compile.simulate, path, name, args.q, args.d)
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
    job = (path, name, args.q, args.d, args.steps, args.lr, args.timeout)
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


def rank_main(rank: int, world_size: int, path, name, q, d, steps, lr, timeout) -> tuple:
    """One process of `run`: (rows, None), or (None, message) for a user error."""
    try:
        sharded, oracle, inputs = compile_pair(tess_compile.shard, path, name, q, d, timeout=timeout)
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


# --------------------------------------------------------------------------- command line


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
    """The parser of `tess-compile` and its commands `dump` and `run`."""
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
    return parser


def add_common(parser: argparse.ArgumentParser) -> None:
    """The arguments of both commands: the factory and the mesh."""
    parser.add_argument("target", metavar="FILE.py:FACTORY",
                        help="a function in FILE.py that takes no arguments and returns (model, example_inputs)")
    parser.add_argument("--q", type=int, required=True, help="mesh side: q*q*d ranks")
    parser.add_argument("--d", type=int, required=True, help="mesh depth, 1 <= d <= q")


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
