"""`tess-compile profile`: measure this machine over local processes and write the cluster.

It starts `--processes` local processes (gloo on CPUs; `--backend nccl` for one
process per GPU), runs `tess_compile.profile_cluster` on all of them at once,
then the self-check (`tess_compile.analysis.profile_check.self_check`: a small
model trained on two meshes, its step times against the profile's predictions;
`--no-check` skips it), and writes the `Cluster` as JSON to `-o` (`plan
--cluster FILE`, `shard(..., cluster=...)` and `Cluster.load` read it), its
`time_error` the self-check's error, printing its figures. When stderr is a
terminal, rank 0 draws a progress bar of the measurements, then one of the
self-check, with the time left.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch

from tess_compile.analysis.plan_table import percent
from tess_compile.analysis.profile_check import check_meshes, with_time_error
from tess_compile.analysis.profiling import profile_cluster
from tess_compile.cli.common import CliError, ProgressBar, add_progress_flag, positive, show_progress
from tess_compile.runtime.launch import run_local

__all__ = ["add_command", "cmd_profile", "describe_cluster"]

log = logging.getLogger("tess_compile")


def _profile_rank(rank: int, world: int, gpus_per_node: int | None, repeats: int, check: bool, progress: bool):
    """One process of `profile`: the profile, then the self-check if `check`; rank 0 draws the
    progress bars if `progress`."""
    if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    with _bar(progress and rank == 0, "profile", "measurements") as bar:
        cluster = profile_cluster(gpus_per_node=gpus_per_node, repeats=repeats, progress=bar)
    if not check:
        return cluster
    with _bar(progress and rank == 0, "profile self-check", "configurations") as bar:
        return with_time_error(cluster, progress=bar)


def _bar(show: bool, command: str, unit: str):
    """A `ProgressBar` if `show`, else a context that gives None."""
    return ProgressBar(command, unit) if show else contextlib.nullcontext()


def describe_cluster(cluster) -> str:
    """The profiled figures, one per line, in the units a reader expects."""
    lines = [
        f"{cluster.gpus_per_node} ranks per node",
        f"matrix products: {cluster.flops / 1e9:.3g} GFLOP/s, half rate at smallest dimension "
        f"{cluster.matmul_half_size:.3g}",
        f"memory-bound kernels: {cluster.memory_bandwidth / 1e9:.3g} GB/s, {cluster.kernel_overhead * 1e6:.3g} us "
        f"a kernel; a program's host time {cluster.op_overhead * 1e6:.3g} us an op, "
        f"{cluster.call_overhead * 1e3:.3g} ms a call",
        f"AdamW: {cluster.optimizer_overhead * 1e6:.3g} us a parameter tensor, "
        f"{cluster.optimizer_bandwidth / 1e9:.3g} GB/s of parameters",
    ]
    for entries, alone in ((cluster.collectives, ""), (cluster.lone_collectives, ", one group layout alone")):
        for op, size, link, *curve in entries:
            lines.append(f"{op} over {size} ({link}-node{alone}): {_describe_curve(curve)}")
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
        clusters = run_local(_profile_rank, args.processes,
                             args=(args.gpus_per_node, args.repeats, args.check, progress),
                             backend=args.backend, timeout_s=args.timeout)
    except (RuntimeError, TimeoutError) as exc:
        raise CliError(f"profiling failed: {exc}", code=1) from None
    cluster = clusters[0]
    cluster.save(args.output)
    print(describe_cluster(cluster))
    if cluster.time_error is not None:
        print(_check_line(cluster.time_error, len(check_meshes(args.processes))))
    print(f"wrote {args.output}")
    return 0


def _check_line(error: float, num_meshes: int) -> str:
    """"self-check: predicted step times 8.3% off on this machine (2 configurations)"."""
    plural = "s" if num_meshes > 1 else ""
    return f"self-check: predicted step times {percent(error)} off on this machine ({num_meshes} configuration{plural})"


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
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the self-check (a small model trained on 1-D and a 2-D/2.5-D mesh, its step times "
                             "against the profile's predictions; a few seconds): time_error stays null, and plan marks "
                             "no ties")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what it does")
    add_progress_flag(parser)
    parser.set_defaults(func=cmd_profile)
