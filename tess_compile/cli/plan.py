"""`tess-compile plan`: the meshes of a GPU count, by predicted step time on a cluster.

It builds the model on the meta device, compiles it for every mesh of --gpus
ranks in --modes and prints the meshes by predicted step time on the cluster
the options describe: `--cluster`'s file or the Tesseract paper's (4 A100 per
node, with the constants fitted to its Table 1), with the cluster flags given
in place of its values; see docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import torch

from tess_compile.analysis.planner import candidate_meshes, format_table, plan
from tess_compile.cli.common import (
    KEEP_BLOCKS,
    CliError,
    call_factory,
    count_or_auto,
    load_cluster_file,
    load_factory,
    non_negative,
    parse_target,
    positive,
)
from tess_compile.core.cluster import CALIBRATED_CLUSTER as paper
from tess_compile.core.cluster import Cluster
from tess_compile.core.options import RECOMPUTE, SCHEDULES

__all__ = ["CLUSTER_FLAGS", "add_command", "cluster_of", "cmd_plan"]

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


def cmd_plan(args) -> int:
    """Print the meshes of --gpus ranks by predicted step time; exit 1 if none fits in memory."""
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
                    summa=args.summa, keep_blocks=KEEP_BLOCKS[args.keep_blocks], recompute=args.recompute,
                    dp=args.dp, pp=args.pp, microbatches=args.microbatches, zero=args.zero)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(f"# {args.gpus} GPUs, {cluster.gpus_per_node} per node; intra-node {cluster.intra_bandwidth / 1e9:g} GB/s, "
          f"{cluster.intra_latency * 1e6:g} us; inter-node {cluster.inter_bandwidth / 1e9:g} GB/s, "
          f"{cluster.inter_latency * 1e6:g} us; {cluster.flops / 1e12:g} TFLOP/s and {cluster.memory / 1e9:g} GB "
          f"per GPU; matmul half size {cluster.matmul_half_size:g}, memory {cluster.memory_bandwidth / 1e9:g} GB/s, "
          f"{cluster.kernel_overhead * 1e6:g} us a kernel; {cluster.algorithm} collectives"
          f"{'; compute and communication overlapped' if args.overlap else ''}")
    sys.stdout.write(format_table(rows))
    if not any(row.fits for row in rows):
        print(f"tess-compile: error: no mesh of {args.gpus} GPUs fits (see the notes): raise --memory-gb, "
              "use more GPUs, or change the model", file=sys.stderr)
        return 1
    return 0


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
    parser.add_argument("--zero", action="store_true",
                        help="shard gradients and AdamW state over the data-parallel replicas (ZeRO)")
    parser.add_argument("--keep-blocks", choices=tuple(KEEP_BLOCKS), default="auto",
                        help="keep the fetched blocks of the matrix products for backward: auto (where memory "
                           "allows and it is faster), on or off (default auto)")
    parser.add_argument("--recompute", "--checkpoint", dest="recompute", choices=RECOMPUTE, default="none",
                        help="recompute in backward: none, blocks (each repeated block) or selective (default none)")
    parser.add_argument("--overlap", action="store_true",
                        help="assume compute and communication overlap (max instead of sum per phase)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each mesh as it compiles")
    parser.set_defaults(func=cmd_plan)
