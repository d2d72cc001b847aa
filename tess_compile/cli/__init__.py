"""The `tess-compile` command: dump a model's compiled graph, check it, train it sharded, plan a mesh, or profile.

    tess-compile dump model.py:make --q 2 --d 2 [compile options] [--rank R] [--stage S] [--format F] [-o OUT]
    tess-compile check model.py:make --q 2 --d 2 [compile options] [--tolerance T]
    tess-compile run model.py:make --q 2 --d 2 [compile options] [--steps N] [--lr LR] [--simulate] [--timeout S]
    tess-compile run model.py:make --spec spec.json [--steps N] [--lr LR] [--simulate] [--timeout S]
    tess-compile plan model.py:make --gpus 64 [--gpus-per-node 4] [--modes 1d,2d,2.5d] [--memory-gb 40] ...
        [--json [FILE|-]] [--pick FILE.json] [--plot FILE.svg] [--no-progress]
    tess-compile profile [-o cluster.json] [--processes 8] [--backend gloo] [--no-check] [--no-progress]
    tess-compile --version

`make` is a function in model.py that takes no arguments and returns
`(model, example_inputs)`: an `nn.Module` and a tensor, a tuple of positional
inputs or a dict of keyword inputs. torch is seeded before each call, so
every process builds the same model and inputs.

`check` simulates every rank in this process on float64 copies of the model
and its inputs and compares outputs, loss, gradients and the weights after
one SGD step with the unsharded model's (`tess_compile.check`), printing a
table with the redundant work and the ops that run replicated; it exits with
1 if anything differs by more than the tolerance (docs/check.md).

`run` starts q*q*d local gloo processes (or those of `--spec`'s parallel spec,
`dp x pp x [q, q, d]`, each running what `tess_compile.parallelize` gives it;
or, with `--simulate`, runs every rank in this process), and trains the sharded model with AdamW on the example
inputs beside an unsharded copy (the oracle), printing both losses at every
step. The loss is the model's output if that is a scalar tensor; otherwise
the mean of the squares of its first tensor output (a DTensor is gathered
with `.full_tensor()` first). It exits with 1 if the losses differ by more
than TOLERANCE (relative), or if a process fails or runs past `--timeout`.

The compile options of dump, check and run are `tess_compile.CompileOptions`'
fields as flags (`--mode`, `--summa`, `--keep-blocks`, `--recompute`,
`--strict`, `--verify`): `--mode` picks the parallel mode, 2.5d (Tesseract,
the default), 2d (Optimus, d=1), 3d (d=q) or 1d (Megatron-LM over q*q*d
ranks, e.g. --q 1 --d 8). `plan` builds the model on the meta device, compiles it
for every mesh of --gpus ranks in --modes and prints the meshes by predicted
step time on the cluster the options describe (default: the Tesseract
paper's, 4 A100 per node); see docs/planner.md. `profile` measures this machine
over local processes (`tess_compile.profile_cluster`), checks its predicted step
times on a small model (`--no-check` skips it) and writes the cluster as JSON
for `plan --cluster`, which marks rows within that error of the pick as ties.
`plan --json` writes the rows (each with its parallel spec), the pick, the
cluster and the model as JSON (to stdout with `-`, in place of the table);
`plan --pick FILE` writes the pick's parallel spec, which `run --spec` takes;
`plan --plot` draws step time against memory per rank as SVG.

`plan` and `profile` draw a progress bar with the time left on stderr when
stderr is a terminal (never into a pipe or a file; `--no-progress` turns it
off), `check` one of its stages; their results go to stdout. `--version`
prints the installed version and torch's.

User errors (the FILE.py:FACTORY argument, the file, the factory, the mesh,
shapes the mesh cannot split) print a message and exit with 2.

One module a command (`dump`, `check`, `run`, `plan`, `profile`); what they
share (loading the factory, the compile options as flags, progress bars,
user errors) is `common`.
"""

from __future__ import annotations

import argparse
import sys

from tess_compile.cli import check, dump, plan, profile, run
from tess_compile.cli.common import CliError, version_text

__all__ = ["main", "make_parser"]


def make_parser() -> argparse.ArgumentParser:
    """The parser of `tess-compile` (and `--version`) and its commands `dump`, `check`, `run`, `plan`
    and `profile`."""
    parser = argparse.ArgumentParser(
        prog="tess-compile",
        description="Shard a PyTorch model with Tesseract (2.5-D) tensor parallelism on a [q, q, d] mesh.")
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the version of tess-compile and of torch, and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (dump, check, run, plan, profile):
        command.add_command(commands)
    return parser


def main(argv=None) -> int:
    """Run the command line `argv` (default sys.argv[1:]); return the exit code."""
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        print(f"tess-compile: error: {exc}", file=sys.stderr)
        return exc.code
