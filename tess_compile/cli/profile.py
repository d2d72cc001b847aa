"""`tess-compile profile`: measure this machine over local processes and write the cluster.

It starts `--processes` local processes (gloo on CPUs; `--backend nccl` for one
process per GPU), runs `tess_compile.profile_cluster` on all of them at once
and writes the `Cluster` as JSON to `-o` (`plan --cluster FILE`, `shard(...,
cluster=...)` and `Cluster.load` read it), printing its figures. When stderr is
a terminal, rank 0 draws a progress bar of the measurements with the time left.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch

from tess_compile.analysis.profiling import profile_cluster
from tess_compile.cli.common import CliError, ProgressBar, add_progress_flag, positive, show_progress
from tess_compile.runtime.launch import run_local

__all__ = ["add_command", "cmd_profile", "describe_cluster"]

log = logging.getLogger("tess_compile")


def _profile_rank(rank: int, world: int, gpus_per_node: int | None, repeats: int, progress: bool):
    """One process of `profile`; rank 0 draws the progress bar if `progress`."""
    if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    bar = ProgressBar("profile", "measurements") if progress and rank == 0 else None
    with bar or contextlib.nullcontext():
        return profile_cluster(gpus_per_node=gpus_per_node, repeats=repeats, progress=bar)


def describe_cluster(cluster) -> str:
    """The profiled figures, one per line, in the units a reader expects."""
    lines = [
        f"{cluster.gpus_per_node} ranks per node",
        f"matrix products: {cluster.flops / 1e9:.3g} GFLOP/s, half rate at smallest dimension "
        f"{cluster.matmul_half_size:.3g}",
        f"memory-bound kernels: {cluster.memory_bandwidth / 1e9:.3g} GB/s, {cluster.kernel_overhead * 1e6:.3g} us "
        "a kernel",
        f"AdamW: {cluster.optimizer_overhead * 1e6:.3g} us a parameter tensor, "
        f"{cluster.optimizer_bandwidth / 1e9:.3g} GB/s of parameters",
    ]
    for op, size, link, *curve in cluster.collectives:
        lines.append(f"{op} over {size} ({link}-node): {_describe_curve(curve)}")
    return "\n".join(lines)


def _describe_curve(curve: list) -> str:
    """A profiled collective's points ("1.75 ms at 4 KiB, ...") or a line's latency and rate."""
    if len(curve) == 1:
        return ", ".join(f"{seconds * 1e3:.3g} ms at {num_bytes / 1024:.4g} KiB" for num_bytes, seconds in curve[0])
    latency, per_byte = curve
    rate = f"{1 / per_byte / 1e9:.3g} GB/s" if per_byte > 0 else "bandwidth not resolved"
    return f"{latency * 1e6:.4g} us + bytes at {rate}"


def cmd_profile(args) -> int:
    """Profile over --processes local processes and write the cluster to -o."""
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info("profiling over %d %s processes", args.processes, args.backend)
    progress = show_progress(args)
    if progress:
        print(f"tess-compile profile: starting {args.processes} {args.backend} processes", file=sys.stderr, flush=True)
    try:
        clusters = run_local(_profile_rank, args.processes, args=(args.gpus_per_node, args.repeats, progress),
                             backend=args.backend, timeout_s=args.timeout)
    except (RuntimeError, TimeoutError) as exc:
        raise CliError(f"profiling failed: {exc}", code=1) from None
    cluster = clusters[0]
    cluster.save(args.output)
    print(describe_cluster(cluster))
    print(f"wrote {args.output}")
    return 0


def add_command(commands) -> None:
    parser = commands.add_parser("profile", help="measure this machine and write the cluster as JSON",
                                 description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="cluster.json", help="the JSON file to write (cluster.json)")
    parser.add_argument("--processes", type=positive(int), default=8, help="local processes (ranks) to profile (8)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="process group backend (gloo)")
    parser.add_argument("--gpus-per-node", type=positive(int), default=None,
                        help="ranks per node (default: the ranks on one host, here all of them)")
    parser.add_argument("--repeats", type=positive(int), default=5, help="timed runs of each measurement (5)")
    parser.add_argument("--timeout", type=positive(float), default=300, help="seconds before the run is stopped (300)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what it does")
    add_progress_flag(parser)
    parser.set_defaults(func=cmd_profile)
