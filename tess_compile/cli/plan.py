"""`tess-compile plan`: the meshes of a GPU count, by predicted step time on a cluster.

It builds the model on the meta device, compiles it for every mesh of --gpus
ranks in --modes and prints the meshes by predicted step time on the cluster
the options describe: `--cluster`'s file or the Tesseract paper's (4 A100 per
node, with the constants fitted to its Table 1), with the cluster flags given
in place of its values; see docs/planner.md. A progress bar on stderr (a
terminal's only) counts the configurations; `--json` writes the rows as JSON
(`plan_json`, each with its parallel spec), `--pick` the fastest row that fits as
a parallel spec (`ParallelSpec.save`: what `tess-compile run --spec` and
`tess_compile.parallelize` take), `--plot` a chart of step time against memory
per rank as SVG (`tess_compile.analysis.plan_plot`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys

import torch
from torch import nn
from torch.utils import _pytree as pytree
from tqdm.contrib.logging import logging_redirect_tqdm

from tess_compile.analysis.decode_plan import format_decode_table, plan_decode
from tess_compile.analysis.parallel_plan import batch_size, num_blocks
from tess_compile.analysis.plan_plot import plan_svg
from tess_compile.analysis.plan_table import format_table
from tess_compile.analysis.planner import PlanRow, candidate_meshes, pick, plan
from tess_compile.analysis.step_tail import MODULE_LOSS, StepTail
from tess_compile.cli.common import (
    KEEP_BLOCKS,
    CliError,
    ProgressBar,
    add_progress_flag,
    call_factory,
    count_or_auto,
    load_cluster_file,
    load_factory,
    non_negative,
    package_version,
    parse_target,
    positive,
    show_progress,
)
from tess_compile.core.cluster import CALIBRATED_CLUSTER as paper
from tess_compile.core.cluster import Cluster
from tess_compile.core.options import RECOMPUTE, SCHEDULES

__all__ = ["CLUSTER_FLAGS", "JSON_SCHEMA", "add_command", "cluster_of", "cmd_plan", "model_summary", "plan_json"]

# Cluster field -> (the flag's dest, the field's units in one of the flag's; None: the same).
CLUSTER_FLAGS = {
    "gpus_per_node": ("gpus_per_node", None),
    "intra_bandwidth": ("intra_bandwidth", 1e9),
    "intra_latency": ("intra_latency", 1e-6),
    "inter_bandwidth": ("inter_bandwidth", 1e9),
    "inter_latency": ("inter_latency", 1e-6),
    "flops": ("tflops", 1e12),
    "memory": ("memory_gb", 1e9),
    "algorithm": ("algorithm", None),
    "matmul_half_size": ("matmul_half_size", None),
    "memory_bandwidth": ("memory_bandwidth", 1e9),
    "kernel_overhead": ("kernel_overhead", 1e-6),
}

JSON_SCHEMA = 1  # the "schema" of `--json`'s document: raised when a key changes meaning or goes away


def cmd_plan(args) -> int:
    """Print the meshes of --gpus ranks by predicted step time; exit 1 if none fits in memory."""
    path, name = parse_target(args.target)
    cluster = cluster_of(args)
    modes = _modes(args)
    try:  # bad --gpus or --modes fail before the model is built
        candidate_meshes(args.gpus if (args.dp, args.pp) == (1, 1) else 1, modes)
    except ValueError as exc:
        raise CliError(f"{exc} (--gpus, --modes)") from None
    for flag, output in (("--json", args.json), ("--plot", args.plot), ("--pick", args.pick)):
        _check_folder(output, flag)
    factory = load_factory(path, name)
    with torch.device("meta"):  # no weight is allocated
        model, inputs = call_factory(factory, path, name)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.decode:
        return _decode(args, model, inputs, cluster, modes)
    rows = _plan_rows(args, model, inputs, cluster, modes)
    if "-" not in (args.json, args.plot, args.pick):  # stdout holds the table, or what was sent there instead
        print(_cluster_line(args, cluster))
        sys.stdout.write(format_table(rows))
    if args.json is not None:
        _write(args.json, json.dumps(plan_json(rows, args, cluster, model, inputs), indent=2) + "\n", "--json")
    if args.plot is not None:
        _write(args.plot, _plot(rows, args, cluster, model), "--plot")
    chosen = pick(rows)
    if args.pick is not None and chosen is not None:
        _write(args.pick, json.dumps(chosen.spec.to_dict(), indent=2) + "\n", "--pick")
    if chosen is None:
        print(f"tess-compile: error: no mesh of {args.gpus} GPUs fits (see the notes): raise --memory-gb, "
              "use more GPUs, or change the model", file=sys.stderr)
        return 1
    return 0


def _decode(args, model: nn.Module, inputs, cluster: Cluster, modes: tuple[str, ...]) -> int:
    """`--decode`: the decode step's table (`plan_decode`), or its rows as JSON with `--json`."""
    bar = ProgressBar("plan --decode", "meshes") if show_progress(args) else None
    with bar or contextlib.nullcontext():
        try:
            rows = plan_decode(model, args.gpus, example_inputs=inputs, modes=modes, cluster=cluster,
                               summa=args.summa, progress=bar)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if args.json != "-":
        print(_cluster_line(args, cluster))
        print(format_decode_table(rows))
    if args.json is not None:
        document = {"schema": JSON_SCHEMA, "decode": [row.to_dict() for row in rows]}
        _write(args.json, json.dumps(document, indent=2) + "\n", "--json")
    return 0


def _modes(args) -> tuple[str, ...]:
    """The modes of --modes, in its order."""
    return tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())


def _plan_rows(args, model: nn.Module, inputs, cluster: Cluster, modes: tuple[str, ...]) -> list[PlanRow]:
    """`plan`'s rows for the options, with a progress bar on a terminal (log lines of -v above it)."""
    bar = ProgressBar("plan", "configurations") if show_progress(args) else None
    quiet_logs = logging_redirect_tqdm() if bar is not None and args.verbose else contextlib.nullcontext()
    with bar or contextlib.nullcontext(), quiet_logs:
        try:
            return plan(model, args.gpus, cluster=cluster, modes=modes, example_inputs=inputs, overlap=args.overlap,
                        summa=args.summa, keep_blocks=KEEP_BLOCKS[args.keep_blocks], recompute=args.recompute,
                        dp=args.dp, pp=args.pp, microbatches=args.microbatches, zero=KEEP_BLOCKS[args.zero],
                        progress=bar, tail=step_tail(args))
        except ValueError as exc:
            raise CliError(str(exc)) from None


# --step: the step around the model's call that each row prices (`tess_compile.analysis.step_tail`)
STEPS = {"readme": StepTail(), "local": StepTail(gather=False), "module": MODULE_LOSS}


def step_tail(args) -> StepTail:
    """The `StepTail` of --step and --zero-grad."""
    return dataclasses.replace(STEPS[args.step], set_to_none=args.zero_grad == "none")


def _cluster_line(args, cluster: Cluster) -> str:
    """The table's first line: the cluster it was priced on."""
    return (f"# {args.gpus} GPUs, {cluster.gpus_per_node} per node; intra-node {cluster.intra_bandwidth / 1e9:g} GB/s, "
            f"{cluster.intra_latency * 1e6:g} us; inter-node {cluster.inter_bandwidth / 1e9:g} GB/s, "
            f"{cluster.inter_latency * 1e6:g} us; {cluster.flops / 1e12:g} TFLOP/s and {cluster.memory / 1e9:g} GB "
            f"per GPU; matmul half size {cluster.matmul_half_size:g}, memory {cluster.memory_bandwidth / 1e9:g} "
            f"GB/s, {cluster.kernel_overhead * 1e6:g} us a kernel; {cluster.algorithm} collectives"
            f"{'; compute and communication overlapped' if args.overlap else ''}")


def plan_json(rows: list[PlanRow], args, cluster: Cluster, model: nn.Module, inputs) -> dict:
    """`--json`'s document: the options, the model, the cluster, the pick and every row in the
    table's order (`PlanRow.to_dict`); the keys are listed in docs/planner.md."""
    chosen = next((number for number, row in enumerate(rows) if row.fits), None)  # `planner.pick`'s
    return {
        "schema": JSON_SCHEMA,
        "tess_compile": package_version(),
        "target": args.target,
        "gpus": args.gpus,
        "options": {"modes": list(_modes(args)), "summa": args.summa, "keep_blocks": args.keep_blocks,
                    "recompute": args.recompute, "dp": args.dp, "pp": args.pp, "microbatches": args.microbatches,
                    "zero": args.zero, "overlap": args.overlap, "step": args.step, "zero_grad": args.zero_grad},
        "model": model_summary(model, inputs),
        "cluster": cluster.to_dict(),
        "memory_budget_bytes": cluster.memory,
        "pick": chosen,
        "rows": [dict(row.to_dict(), pick=number == chosen) for number, row in enumerate(rows)],
    }


def model_summary(model: nn.Module, inputs) -> dict:
    """The model's class, parameters (count and bytes), repeated blocks, batch and input tensors."""
    params = list(model.parameters())
    tensors = [leaf for leaf in pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor)]
    return {
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in params),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "repeated_blocks": num_blocks(model),
        "batch": batch_size(inputs),
        "inputs": [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in tensors],
    }


def _plot(rows: list[PlanRow], args, cluster: Cluster, model: nn.Module) -> str:
    """`--plot`'s SVG (`plan_plot.plan_svg`); a CliError if no configuration compiled."""
    title = f"tess-compile plan: {type(model).__name__} ({args.target}) on {args.gpus} GPUs"
    try:
        return plan_svg(rows, budget=cluster.memory, title=title)
    except ValueError as exc:
        raise CliError(f"{exc} (--plot)") from None


def _check_folder(path: str | None, flag: str) -> None:
    """A CliError before the model is planned if `path`'s folder does not exist."""
    if path is None or path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"folder {folder!r} of {path!r} not found ({flag}): create it, or write elsewhere")


def _write(path: str, text: str, flag: str) -> None:
    """`text` to the file at `path`, or to stdout for "-"; a CliError if it cannot be written."""
    if path == "-":
        sys.stdout.write(text)
        return
    try:
        with open(path, "w", encoding="utf-8") as file:
            file.write(text)
    except OSError as exc:
        raise CliError(f"cannot write {path!r} ({exc.strerror}) ({flag}): pass a path in a folder you can "
                       "write to") from None


def cluster_of(args) -> Cluster:
    """The Cluster the plan options describe: `--cluster`'s file (default the calibrated
    cluster) with the values of the cluster flags given (`CLUSTER_FLAGS`) in place of its own."""
    base = paper if args.cluster is None else load_cluster_file(args.cluster)
    given = {}
    for name, (dest, unit) in CLUSTER_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            given[name] = value if unit is None else value * unit
    try:
        return dataclasses.replace(base, **given)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def add_command(commands) -> None:
    """The `plan` command; the cluster flags default to `--cluster`'s values, else the calibrated
    cluster's (the Tesseract paper's, with constants fitted to its Table 1)."""
    parser = commands.add_parser(
        "plan", help="rank the meshes of a GPU count by predicted step time",
        description="Build the model of FACTORY on the meta device, compile it for every mesh of --gpus "
                    "ranks in --modes, and print the meshes by predicted step time (the calibrated cost model; "
                    "see docs/planner.md). Cluster defaults: --cluster's file, else the Tesseract paper's (4 A100 "
                    "40 GB per node) with link, matmul-efficiency and kernel constants fitted to its Table 1. "
                    "Exit code 1 if no mesh fits in memory.")
    parser.add_argument("target", metavar="FILE.py:FACTORY",
                        help="a function in FILE.py that takes no arguments and returns (model, example_inputs)")
    parser.add_argument("--gpus", type=positive(int), required=True, help="number of GPUs (ranks)")
    parser.add_argument("--cluster", metavar="FILE.json",
                        help="the cluster to price on: a JSON file of Cluster fields (Cluster.save, tess-compile "
                             "profile -o) instead of the calibrated cluster; cluster flags given replace its values")
    parser.add_argument("--gpus-per-node", type=positive(int),
                        help=f"GPUs per node; ranks fill nodes in order (default {paper.gpus_per_node})")
    parser.add_argument("--modes", default="1d,2d,2.5d",
                        help="comma-separated modes among 1d, 2d, 2.5d, 3d (default 1d,2d,2.5d)")
    parser.add_argument("--intra-bandwidth", type=positive(float), metavar="GB_PER_S",
                        help=f"GB/s within a node (default {paper.intra_bandwidth / 1e9:g})")
    parser.add_argument("--intra-latency", type=non_negative, metavar="US",
                        help=f"microseconds per step within a node (default {paper.intra_latency * 1e6:g})")
    parser.add_argument("--inter-bandwidth", type=positive(float), metavar="GB_PER_S",
                        help=f"GB/s between nodes (default {paper.inter_bandwidth / 1e9:g}: 200 Gb/s InfiniBand)")
    parser.add_argument("--inter-latency", type=non_negative, metavar="US",
                        help=f"microseconds per step between nodes (default {paper.inter_latency * 1e6:g})")
    parser.add_argument("--tflops", type=positive(float),
                        help=f"sustained matmul TFLOP/s of one GPU (default {paper.flops / 1e12:g})")
    parser.add_argument("--matmul-half-size", type=non_negative, metavar="M",
                        help="a product whose smallest dimension is m runs at tflops * m / (m + M); 0: always at "
                           f"--tflops (default {paper.matmul_half_size:g})")
    parser.add_argument("--memory-bandwidth", type=positive(float), metavar="GB_PER_S",
                        help=f"GB/s of one GPU's memory, for kernels other than products (default "
                           f"{paper.memory_bandwidth / 1e9:g})")
    parser.add_argument("--kernel-overhead", type=non_negative, metavar="US",
                        help=f"microseconds per kernel launch (default {paper.kernel_overhead * 1e6:g})")
    parser.add_argument("--memory-gb", type=positive(float),
                        help=f"memory of one GPU in GB, the budget a mesh must fit (default {paper.memory / 1e9:g})")
    parser.add_argument("--algorithm", choices=("ring", "tree"),
                        help=f"collective algorithm (default {paper.algorithm})")
    parser.add_argument("--summa", choices=("auto", *SCHEDULES), default="auto",
                        help="schedule of the matrix products to price; auto (default) prices each, keeps the fastest")
    parser.add_argument("--dp", type=count_or_auto, default="auto",
                        help="data-parallel replicas around each mesh, or auto: every count that divides the GPUs "
                           "and the batch (default auto)")
    parser.add_argument("--pp", type=count_or_auto, default="auto",
                        help="pipeline stages, or auto: every count that divides the GPUs and the model's repeated "
                           "blocks (default auto)")
    parser.add_argument("--microbatches", type=positive(int), default=None,
                        help="microbatches per step with pipeline stages (default: the most up to 4 per stage that "
                           "divide the batch)")
    parser.add_argument("--zero", choices=tuple(KEEP_BLOCKS), nargs="?", const="on", default="auto",
                        help="shard parameters, gradients and AdamW state over the data-parallel replicas (ZeRO, "
                           "FSDP2): auto (each configuration with dp > 1 with and without), on (--zero alone) or "
                           "off (default auto)")
    parser.add_argument("--keep-blocks", choices=tuple(KEEP_BLOCKS), default="auto",
                        help="keep the fetched blocks of the matrix products for backward: auto (where memory "
                           "allows and it is faster), on or off (default auto)")
    parser.add_argument("--recompute", "--checkpoint", dest="recompute", choices=RECOMPUTE, default="none",
                        help="recompute in backward: none, blocks (each repeated block) or selective (default none)")
    parser.add_argument("--step", choices=tuple(STEPS), default="readme",
                        help="the step each row prices around the model's call: readme (README's loop, the default: "
                             "the output gathered with full_tensor on every rank, a loss of it outside), local (a "
                             "loss of each rank's output block, no gather) or module (the output is the loss)")
    parser.add_argument("--zero-grad", choices=("none", "zeros"), default="none",
                        help="zero_grad's mode after the optimizer's step: none (set_to_none=True, the default) or "
                             "zeros (set_to_none=False: the gradients stay allocated)")
    parser.add_argument("--decode", action="store_true",
                        help="price an inference decode step instead of a training step (the example inputs: one "
                             "new token per sequence): tokens/s and bytes per token on each mesh, in its fastest "
                             "batch split (docs/planner.md)")
    parser.add_argument("--overlap", action="store_true",
                        help="assume compute and communication overlap (max instead of sum per phase)")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the plan as JSON to FILE (its keys: docs/planner.md); '-': to stdout, in "
                             "place of the table")
    parser.add_argument("--pick", metavar="FILE.json",
                        help="also write the fastest configuration that fits as a parallel spec (JSON), for "
                             "`tess-compile run --spec FILE.json` and tess_compile.parallelize ('-': stdout, in place "
                             "of the table); nothing is written if none fits")
    parser.add_argument("--plot", metavar="FILE.svg",
                        help="also draw predicted step time against memory per rank as SVG to FILE.svg, one point "
                             "per configuration, the pick ringed and the memory budget dashed ('-': stdout)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each mesh as it compiles")
    add_progress_flag(parser)
    parser.set_defaults(func=cmd_plan)
