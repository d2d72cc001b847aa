"""Measure the machine the programs run on: `profile_cluster` returns a `Cluster`.

Called on every rank of an initialised process group, it times, on every
rank at once (so that the ranks contend for cores, memory and links as they
do in training):

- the kernel overhead: a chain of tiny products, forward and backward;
- the matrix-product rate as a function of size: products whose smallest
  dimension runs from 8 to 512, fitted to `flops * m / (m + matmul_half_size)`;
- memory bandwidth: what a reference layer (an MLP half: norm, product,
  activation, product, residual on a 2 MB activation, forward and backward,
  each output newly allocated as in a program) takes beside its products and
  launches, over its bytes as the cost model counts them
  (`kernels.kernel_profile`): the kernels of a program in the working
  set of a program, not a streaming add (which runs 3 to 5 times faster);
- each collective the programs use (broadcast, reduce, all-reduce,
  all-gather, reduce-scatter) on every group size that divides the world,
  all groups of that size at once, at four message sizes from 4 KB to 4 MB,
  each call after a small product as in a program (the time of the product
  taken off), and each as a program's eager run calls it (the eager target of
  its custom op `tess::all_gather`, ...) on the runtime's communicator
  (`runtime.dist_comm.DistComm`), so the copies and the Python around
  torch.distributed count: the measured (bytes, seconds) points per
  (op, group size, link), joined by straight segments (no one line fits
  them: on this 2-core machine an all-reduce over 8 ranks takes 11.5 ms at
  4 KB and 512 KB alike, then 19 ms at 2 MB, once its buffers leave the
  caches), intra-node for groups within a node and inter-node for groups
  across nodes; each timed with every way of cutting the ranks into groups
  of its size in turn, as a mesh's axes of equal size alternate, and, where
  there are several, on one alone (`Cluster.lone_collectives`: a 1-D
  program's axis, a data-parallel one; about 1.4 ms faster here);
- the optimizer step: AdamW over DTensor parameters on a (depth, row, col)
  mesh, as a sharded module's parameters are, per tensor and per byte;
- the host time of a program: a tiny reference model (`_Reference`: pre-norm
  MLP blocks, 2, 4 and 8 of them) sharded on the world's own mesh
  (`reference_mesh`) and run by the runtime, forward and backward, with a
  communicator that moves nothing (collectives are priced by their own
  points); its time beyond what the cost model prices for its kernels, a line
  over its kernels and the runtime's own ops (views and allocations not counted):
  `Cluster.op_overhead` per op and `Cluster.call_overhead` per call;
- on the CPU, products with a bias term copy it into their output first
  (`Cluster.bias_copy`).

Each time is the median of repeated runs on a rank (a run repeats a short call
until it lasts 50 ms, so that the ranks overlap), averaged over the ranks
with an all-reduce; every rank returns rank 0's `Cluster`. `Cluster.save`
writes it as JSON; `tess-compile profile` runs this over local processes, with a
progress bar fed by `profile_cluster(progress=...)` on rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tess_compile.analysis.cost_model import profile_program, step_time
from tess_compile.analysis.kernels import kernel_profile
from tess_compile.analysis.rank_timing import Timer, process_group_device, world_mean
from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.options import CompileOptions
from tess_compile.ops.collectives import COMMUNICATING, EAGER_TARGETS, Comm, output_like, use_comm
from tess_compile.passes.driver import compile_model
from tess_compile.runtime.dist_comm import DistComm
from tess_compile.runtime.sharded_module import ShardedModule

__all__ = ["MESSAGE_BYTES", "profile_cluster", "reference_mesh"]

log = logging.getLogger("tess_compile")

# The payloads (bytes a rank passes to the collective) each line is fitted on.
MESSAGE_BYTES = (4 << 10, 64 << 10, 512 << 10, 4 << 20)

_MATMUL_SIZES = (8, 16, 32, 64, 128, 256, 512)  # the smallest dimension of the timed products
_MATMUL_OTHER = 512  # the two other dimensions
_ACTIVATION = (2048, 256)  # the float32 activation of the reference layer (2 MB)
_CHAIN = 64  # tiny products per chain of the kernel overhead
_BETWEEN = 128  # the side of the product run before each timed collective
_OPTIMIZER_SIZES = (16, 1 << 16)  # elements of each parameter tensor of the two timed AdamW steps
_OPTIMIZER_TENSORS = 8  # parameter tensors of a timed AdamW step
_REFERENCE_BLOCKS = (2, 4, 8)  # blocks of the reference programs of the host time
_HOST_ROUNDS = 3  # timings of each reference program, in turn with the others
_TIMEOUT = timedelta(minutes=10)  # of a profiled collective (a rank that stops fails the others)


def profile_cluster(*, gpus_per_node: int | None = None, memory: float | None = None, device=None,
                    repeats: int = 5, progress: Callable[[int, int, str], None] | None = None) -> Cluster:
    """Measure this machine on every rank of the default process group at once; call on every rank.

    `gpus_per_node`: ranks per node (default: the ranks on rank 0's host, read from the
    host names); `memory`: bytes per rank (default: the GPU's memory, or the host's
    memory divided among its ranks); `device`: where to run (default: the current CUDA
    device under NCCL, else the CPU); `repeats`: timed runs of each measurement;
    `progress(done, total, what)`: called on this rank before each measurement (`what`
    names it) and once at the end (`planner.Progress`; pass one on one rank only). Returns
    the same `Cluster` on every rank.
    """
    if not dist.is_initialized():
        raise ValueError("profile_cluster() needs an initialised process group: call it on every rank after "
                         "torch.distributed.init_process_group (or under tess_compile.run_local)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: use a positive integer, e.g. 5")
    device = torch.device(device) if device is not None else process_group_device()
    started = time.perf_counter()
    per_node = gpus_per_node or _ranks_on_first_host()
    timer = Timer(device, repeats, progress, _num_measurements(dist.get_world_size(), per_node))
    overhead = timer.mean(_kernel_chain(device), "kernel overhead") / (2 * _CHAIN)
    flops, half = _fit_matmul(timer, device, overhead)
    bandwidth = _memory_bandwidth(timer, device, overhead, flops, half)
    # every rank on col, as a 1-D program's; a communicator per partition gives col its group
    device_mesh = init_device_mesh(device.type, (1, 1, dist.get_world_size()), mesh_dim_names=AXES)
    collectives, lone_collectives = _collective_lines(timer, device, per_node, device_mesh)
    optimizer_overhead, optimizer_bandwidth = _optimizer_line(timer, device, device_mesh)
    intra = _link_figures(collectives, "intra") or (0.0, math.inf)  # a world of one: no link
    inter = _link_figures(collectives, "inter") or intra
    cluster = Cluster(
        gpus_per_node=per_node, intra_bandwidth=intra[1], intra_latency=intra[0], inter_bandwidth=inter[1],
        inter_latency=inter[0], flops=flops, memory=memory or _memory_per_rank(device, per_node),
        matmul_half_size=half, memory_bandwidth=bandwidth, kernel_overhead=overhead,
        optimizer_overhead=optimizer_overhead, optimizer_bandwidth=optimizer_bandwidth,
        collectives=tuple(collectives), lone_collectives=tuple(lone_collectives), bias_copy=device.type == "cpu")
    op_overhead, call_overhead = _host_overheads(timer, device, cluster)
    cluster = dataclasses.replace(cluster, op_overhead=op_overhead, call_overhead=call_overhead)
    timer.finish()
    shared = [cluster]  # rank 0's: the fits may differ in the last bit from rank to rank
    dist.broadcast_object_list(shared, src=0)
    cluster = shared[0]
    log.info("profile_cluster: %d ranks, %d per node, took %.1f s", dist.get_world_size(), per_node,
             time.perf_counter() - started)
    return cluster


def _num_measurements(world: int, per_node: int) -> int:
    """How many measurements (`Timer.median` calls) a profile takes: the kernel chain, the
    products, the reference layer, the product between collectives, every collective on
    every group layout at every message size (alternating, and alone where a size has several
    layouts), the AdamW steps and the reference programs."""
    layouts = sum(1 + (len(partitions) > 1) for _, _, partitions in _group_layouts(world, per_node))
    collectives = layouts * len(COMMUNICATING) * len(MESSAGE_BYTES)
    return 3 + len(_MATMUL_SIZES) + collectives + len(_OPTIMIZER_SIZES) + _HOST_ROUNDS * len(_REFERENCE_BLOCKS)


def _ranks_on_first_host() -> int:
    """How many ranks share rank 0's host (a ValueError if nodes do not hold equal, packed ranks)."""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    per_node = hosts.count(hosts[0])
    packed = all(hosts[rank] == hosts[rank - rank % per_node] for rank in range(len(hosts)))
    if len(hosts) % per_node or not packed:
        raise ValueError(f"ranks are not packed onto nodes in order ({per_node} on the first host of "
                         f"{len(hosts)}): pass gpus_per_node= to profile_cluster")
    return per_node


def _memory_per_rank(device: torch.device, per_node: int) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(pages) / per_node


def _kernel_chain(device: torch.device) -> Callable[[], None]:
    """`_CHAIN` tiny products forward and as many backward: `2 * _CHAIN` kernels."""
    x = torch.ones(1, device=device, requires_grad=True)

    def run():
        y = x
        for _ in range(_CHAIN):
            y = y * 1.0
        y.sum().backward()

    return run


def _layer(device: torch.device, rows: int, width: int) -> Callable[[], None]:
    """A transformer layer's MLP half on a [rows, width] float32 activation, forward and
    backward: norm, product, activation, product, residual, each output newly allocated."""
    x = torch.randn(rows, width, device=device, requires_grad=True)
    up = torch.randn(2 * width, width, device=device, requires_grad=True)
    down = torch.randn(width, 2 * width, device=device, requires_grad=True)

    def run():
        y = torch.nn.functional.layer_norm(x, (width,))
        y = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(y, up)), down)
        (x + y).sum().backward()

    return run


def _memory_bandwidth(timer: Timer, device: torch.device, overhead: float, flops: float, half: float) -> float:
    """Bytes per second of the memory-bound kernels of a reference layer (`_layer` on a 2 MB
    activation) as the cost model counts their bytes (`kernels.kernel_profile`): the layer's
    time less its products (at the fitted rate) and one `overhead` a kernel."""
    layer = _layer(device, *_ACTIVATION)
    counted = kernel_profile(layer)
    products = (counted.matmul_flops + counted.matmul_flops_per_size * half) / flops
    seconds = timer.mean(layer, "memory bandwidth (reference layer)") - products - counted.num_kernels * overhead
    return counted.memory_bytes / max(seconds, 1e-9)


def _fit_matmul(timer: Timer, device: torch.device, overhead: float) -> tuple[float, float]:
    """(flops, matmul_half_size): the least-squares fit of `t = f / flops + (f / m) * h / flops`
    over products of smallest dimension `m` (`f` their FLOPs, `t` their time less one launch)."""
    rows, times = [], []
    for m in _MATMUL_SIZES:
        a = torch.randn(_MATMUL_OTHER, _MATMUL_OTHER, device=device)
        b = torch.randn(_MATMUL_OTHER, m, device=device)
        flops = 2 * _MATMUL_OTHER * _MATMUL_OTHER * m
        rows.append([flops, flops / m])
        times.append(timer.median(lambda a=a, b=b: torch.mm(a, b), f"matrix product, smallest dimension {m}")
                     - overhead)
    times = world_mean(times)
    inverse, half_over = _nonnegative_fit(rows, times)
    inverse = max(inverse, 1e-18)
    return 1 / inverse, half_over / inverse


def _nonnegative_fit(rows: list[list[float]], times: list[float]) -> tuple[float, float]:
    """Least squares of `times ~ rows @ (x, y)` with x, y >= 0, relative errors weighted alike."""
    a = torch.tensor(rows, dtype=torch.float64)
    t = torch.tensor(times, dtype=torch.float64).clamp(min=1e-9)
    weighted = a / t[:, None]
    ones = torch.ones_like(t)
    x, y = torch.linalg.lstsq(weighted, ones[:, None]).solution.flatten().tolist()
    if x >= 0 and y >= 0:
        return x, y
    # one coefficient at zero: fit the other alone
    only = [max(float((weighted[:, k] @ ones) / (weighted[:, k] @ weighted[:, k])), 0.0) for k in (0, 1)]
    errors = [float(((weighted[:, k] * only[k] - ones) ** 2).sum()) for k in (0, 1)]
    return (only[0], 0.0) if errors[0] <= errors[1] else (0.0, only[1])


def _group_layouts(world: int, per_node: int) -> list[tuple[int, str, list[list[list[int]]]]]:
    """(group size, link, partitions): for each size `g` dividing the world, the ranks cut
    into groups of `g` ranks `t` apart for each stride `t` with `g * t` dividing the world,
    as the axes of a mesh cut them; grouped by link (intra-node: every group within a node,
    ranks packed onto nodes in order)."""
    layouts: dict[tuple[int, str], list] = {}
    for size in range(2, world + 1):
        for stride in range(1, world // size + 1):
            if world % (size * stride):
                continue
            span = size * stride
            groups = [[start + k * stride for k in range(size)]
                      for start in range(world) if start % span < stride]
            within = all(group[0] // per_node == group[-1] // per_node for group in groups)
            layouts.setdefault((size, "intra" if within else "inter"), []).append(groups)
    return [(size, link, partitions) for (size, link), partitions in layouts.items()]


def _collective_lines(timer: Timer, device: torch.device, per_node: int,
                      device_mesh) -> tuple[list[tuple], list[tuple]]:
    """`(collectives, lone collectives)`: the `(op, size, link, points)` of each collective on each
    group size and link, as `Cluster.collectives` and `Cluster.lone_collectives` hold them.

    A timed call runs the collective on every partition of that size in turn (as a program
    alternates its mesh axes of that size, which couples every rank to every other), each
    after a small product (`_between_kernels`), as a program's collectives follow its kernels;
    the products' time is taken off. Where the world has several partitions of a size, a
    lone call runs on the first alone (a 1-D program's axis, a data-parallel one)."""
    work = _between_kernels(device)
    work_s = timer.mean(work, "product between collectives")
    lines, lone = [], []
    world = dist.get_world_size()
    mesh = Mesh(1, world, "1d")
    for size, link, partitions in _group_layouts(world, per_node):
        groups = [dist.new_subgroups_by_enumeration(partition)[0] for partition in partitions]
        comms = [DistComm(mesh, device_mesh, _TIMEOUT, groups=dict.fromkeys(AXES, group)) for group in groups]
        for op in COMMUNICATING:
            where = f"{op} over {size} ranks ({link}-node)"
            lines.append((op, size, link, _points(timer, op, size, comms, work, work_s, where)))
            if len(comms) > 1:
                lone.append((op, size, link, _points(timer, op, size, comms[:1], work, work_s, f"{where}, alone")))
    return lines, lone


def _points(timer: Timer, op: str, size: int, comms: list[DistComm], work, work_s: float,
            where: str) -> tuple[tuple[int, float], ...]:
    """(bytes, seconds) of `op` at each of `MESSAGE_BYTES`: a call on each of `comms` in turn, each
    after `work()`, less its `work_s` seconds."""
    times = []
    payloads = [_payload_elements(num_bytes, size) * 4 for num_bytes in MESSAGE_BYTES]
    for num_bytes in payloads:
        calls = [_collective(op, num_bytes // 4, size, comm, timer.device) for comm in comms]

        def each_axis(calls=calls):
            for call in calls:
                work()
                call()

        times.append(timer.median(each_axis, f"{where}, {num_bytes / 1024:.4g} KiB", local=False) / len(calls)
                     - work_s)
    return tuple((n, max(t, 0.0)) for n, t in zip(payloads, world_mean(times)))


def _between_kernels(device: torch.device) -> Callable[[], torch.Tensor]:
    """The local work timed before each collective: one product of `_BETWEEN` square."""
    a = torch.randn(_BETWEEN, _BETWEEN, device=device)
    return lambda: torch.mm(a, a)


def _payload_elements(num_bytes: int, size: int) -> int:
    """float32 elements of a payload of about `num_bytes`, a multiple of `size` (a
    reduce-scatter over `size` ranks splits it evenly)."""
    return num_bytes // 4 // size * size


def _collective(op: str, elements: int, size: int, comm: DistComm, device) -> Callable[[], object]:
    """One call of `op` on `elements` float32 elements as a program's eager run makes it: the
    eager target of its custom op (`tess::<op>`, `EAGER_TARGETS`) on `comm`, whose axes all run
    on one group of `size` ranks."""
    x = torch.ones(elements, device=device)
    target = EAGER_TARGETS[getattr(torch.ops.tess, op).default]
    args = {"broadcast": (0,), "reduce": (0,), "all_reduce": (), "all_gather": (size, 0, 1),
            "reduce_scatter": (size, 0, 1)}[op]

    def call():
        with use_comm(comm):
            return target(x, "col", *args)

    return call


def _optimizer_line(timer: Timer, device: torch.device, mesh) -> tuple[float, float]:
    """(seconds per parameter tensor, parameter bytes per second) of an AdamW step over
    DTensor parameters on the (depth, row, col) DeviceMesh `mesh`, as a sharded module's
    (torch's default implementation), from steps over `_OPTIMIZER_TENSORS` tensors of each of
    `_OPTIMIZER_SIZES` float32 elements."""
    placements = [Replicate(), Replicate(), Shard(0)]
    times = []
    for numel in _OPTIMIZER_SIZES:
        params = [torch.nn.Parameter(DTensor.from_local(torch.randn(numel, device=device), mesh, placements,
                                                        run_check=False)) for _ in range(_OPTIMIZER_TENSORS)]
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-6)
        times.append(timer.median(optimizer.step, f"AdamW step, {_OPTIMIZER_TENSORS} tensors of {numel} elements"))
    times = world_mean(times)
    count = float(_OPTIMIZER_TENSORS)
    per_tensor, per_byte = _nonnegative_fit([[count, count * numel * 4] for numel in _OPTIMIZER_SIZES], times)
    return per_tensor, 1 / per_byte if per_byte > 0 else float("inf")


def _link_figures(lines: list[tuple], link: str) -> tuple[float, float] | None:
    """(latency per step, bandwidth) of `link` read from its largest group's all-reduce points,
    a line fitted through them taken as a ring's `2(g-1)` steps and `2(g-1)/g` bytes, for the
    collectives the points do not price."""
    found = [(size, points) for op, size, where, points in lines if op == "all_reduce" and where == link]
    if not found:
        return None
    size, points = max(found)
    latency, per_byte = _nonnegative_fit([[1.0, n] for n, _ in points], [t for _, t in points])
    steps, factor = 2 * (size - 1), 2 * (size - 1) / size
    return latency / steps, factor / per_byte if per_byte > 0 else float("inf")


class _Reference(torch.nn.Module):
    """The reference model of a program's host time: pre-norm MLP blocks (norm, product,
    activation, product, residual)."""

    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
            torch.nn.Linear(2 * width, width)) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


class _NoComm(Comm):
    """A communicator that moves nothing: each collective gives zeros of its output's shape."""

    def run(self, op: str, x: torch.Tensor, *args) -> torch.Tensor:
        return output_like(op, x, *args).zero_()


def reference_mesh(world: int) -> Mesh:
    """The mesh the reference program runs on: 2.5-D `[q, q, world / q**2]` for the largest `q`
    whose square divides the world, else 1-D over the world."""
    q = max(side for side in range(1, math.isqrt(world) + 1) if world % (side * side) == 0)
    return Mesh(q, world // (q * q), "2.5d") if q > 1 else Mesh(1, world, "1d")


def _host_overheads(timer: Timer, device: torch.device, cluster: Cluster) -> tuple[float, float]:
    """(seconds per op, seconds per call) of a program's host time beyond what `cluster` prices
    for its kernels: the reference programs (`_Reference` of `_REFERENCE_BLOCKS` blocks, width
    `16 q`, on `4 * world` rows, on `reference_mesh`), forward and backward through the runtime
    with collectives that move nothing, less their kernels' price; a line over their op counts.
    Each is timed `_HOST_ROUNDS` times, the programs in turn (the machine's drift spread over
    all), the median taken."""
    mesh = reference_mesh(dist.get_world_size())
    steps, rows, kernels_s = [], [], []
    for blocks in _REFERENCE_BLOCKS:
        torch.manual_seed(0)  # the same weights and input on every rank
        x = torch.randn(4 * mesh.num_ranks, 16 * mesh.q, device=device)
        program = compile_model(_Reference(16 * mesh.q, blocks).to(device), mesh, (x,),
                                options=CompileOptions(mode=mesh.mode))
        sharded = ShardedModule(program, device=device, timeout=_TIMEOUT)
        sharded.comm = _NoComm()
        steps.append(lambda sharded=sharded, x=x: sharded(x).to_local().sum().backward())
        profile = profile_program(program)
        priced = step_time(profile, cluster)
        kernels_s.append(priced.forward_compute_s + priced.backward_compute_s)
        rows.append([1.0, float(profile.forward.num_ops + profile.backward.num_ops)])
    times = [[] for _ in steps]
    for _ in range(_HOST_ROUNDS):
        for blocks, step, seconds in zip(_REFERENCE_BLOCKS, steps, times):
            seconds.append(timer.median(step, f"host time of a program ({blocks} reference blocks on {mesh.mode} "
                                              f"{list(mesh.shape)})"))
    host = [statistics.median(seconds) - kernels for seconds, kernels in zip(times, kernels_s)]
    per_call, per_op = _nonnegative_fit(rows, [max(t, 1e-9) for t in world_mean(host)])
    return per_op, per_call
