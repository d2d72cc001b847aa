"""`tess-compile dump`: print one stage of the compiled model (text, dot or svg)."""

from __future__ import annotations

import sys

from tess_compile.analysis.graph_dump import FORMATS, STAGES, dump
from tess_compile.cli.common import (
    CliError,
    add_model_arguments,
    build,
    compile_options,
    parse_target,
)

__all__ = ["add_command", "cmd_dump"]


def add_command(commands) -> None:
    parser = commands.add_parser(
        "dump", help="print a stage of the compiled model",
        description="Compile the model of FACTORY and print one stage of it.")
    add_model_arguments(parser)
    parser.add_argument("--rank", type=int, default=0, help="the rank whose graph to show (default 0)")
    parser.add_argument("--stage", choices=STAGES, default="rewritten",
                        help="the graph after capture, placement or rewriting (default rewritten)")
    parser.add_argument("--format", choices=FORMATS, default="text", help="(default text)")
    parser.add_argument("-o", "--output", metavar="OUT", help="write to OUT instead of stdout")
    parser.set_defaults(func=cmd_dump)


def cmd_dump(args) -> int:
    """Print (or write to args.output) one stage of the compiled model."""
    model, inputs = build(*parse_target(args.target))
    options = compile_options(args)
    try:
        text = dump(model, args.q, args.d, example_inputs=inputs, rank=args.rank, stage=args.stage,
                    format=args.format, options=options, cluster=args.cluster)
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
