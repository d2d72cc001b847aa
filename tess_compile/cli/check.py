"""`tess-compile check`: compare the sharded model with the unsharded one before a long launch.

It builds the model of FILE.py:FACTORY, runs `tess_compile.check` on it (every
rank simulated in this process, on float64 copies) and prints the table:
outputs, loss, gradients, weights after one SGD step, redundant work and the
ops that run replicated (docs/check.md). Exit code 0 if everything matches
within the tolerance, 1 on a mismatch, 2 on a user error.
"""

from __future__ import annotations

import sys

from tess_compile.cli.common import (
    CliError,
    add_model_arguments,
    add_progress_flag,
    build,
    compile_options,
    parse_target,
    positive,
)
from tess_compile.validation import CheckMismatch, check

__all__ = ["add_command", "cmd_check"]


def add_command(commands) -> None:
    parser = commands.add_parser(
        "check", help="compare the sharded model with the unsharded one (outputs, gradients, a step)",
        description="Simulate every rank of the model of FACTORY on float64 copies and compare its outputs, "
                    "loss, gradients and weights after one SGD step with the unsharded model's; print the "
                    "table. Exit code 1 on a mismatch.")
    add_model_arguments(parser)
    parser.add_argument("--tolerance", type=positive(float), default=None,
                        help="the largest relative error accepted (default 1e-12, or 1e-5 for a model whose "
                             "own code casts float64 down to float32)")
    add_progress_flag(parser)
    parser.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    """Check the model of args.target; print the table; 0 if it matches, else 1."""
    model, inputs = build(*parse_target(args.target))
    options = compile_options(args)
    try:
        report = check(model, args.q, args.d, example_inputs=inputs, options=options, cluster=args.cluster,
                       tolerance=args.tolerance, progress=not args.no_progress)
    except CheckMismatch as exc:  # --strict
        report = exc.report
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(report.table(), flush=True)
    if report.ok:
        return 0
    print(f"tess-compile: error: {report.mismatch}", file=sys.stderr)
    return 1
