"""The machine a cost is for: a `Cluster` of nodes, two links, one GPU's figures.

Layer: core. A collective of `n` bytes over a group of `g` ranks on a link
of latency `alpha` (seconds) and bandwidth `B` (bytes/s) takes `steps(g) *
alpha + factor(g) * n / B`, with `steps` and `factor` from the collective's
`price` for the cluster's algorithm (`tess_compile.core.collective_table`).
A group is on the intra-node link if all its ranks share a node (ranks
packed onto nodes in order: `node = rank // gpus_per_node`), else on the
inter-node link. The compute constants: a matrix product whose smallest
dimension is `m` runs at `flops * m / (m + matmul_half_size)`; other kernels
move their bytes at `memory_bandwidth`; each launch costs `kernel_overhead`.
`Cluster.compute_seconds` prices kernels so, from their `COMPUTE_TERMS`
(a product's from `product_terms`): the one price of a matrix product that
the cost model and the schedule choice share.

`Cluster`'s defaults for the three compute constants (every matmul at
`flops`, memory-bound kernels and launches free) give the plain alpha-beta
model; `CALIBRATED_CLUSTER` holds the constants fitted to the Tesseract
paper's measurements (`tess_compile.analysis.calibration`, docs/planner.md),
and `PAPER_CLUSTER` the paper's cluster as specified, uncalibrated.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from dataclasses import dataclass

from tess_compile.core.collective_table import COLLECTIVES, PriceRule
from tess_compile.core.mesh import Mesh

__all__ = [
    "ALGORITHMS",
    "CALIBRATED_CLUSTER",
    "COLLECTIVE_RULES",
    "COMPUTE_TERMS",
    "PAPER_CLUSTER",
    "Cluster",
    "Link",
    "collective_rule",
    "collective_time",
    "product_terms",
    "seconds_at",
]

ALGORITHMS = ("ring", "tree")


# (algorithm, op) -> g -> (latency steps, bandwidth factor): a view of the collectives' `price`
# (`tess_compile.core.collective_table`, which gives the formulas; docs/planner.md their table).
COLLECTIVE_RULES: dict[tuple[str, str], PriceRule] = {
    (algorithm, name): rule for name, record in COLLECTIVES.items() for algorithm, rule in record.price.items()}


# The terms a kernel's time is priced by, each times one constant of the cluster
# (`Cluster.compute_coefficients`).
COMPUTE_TERMS = ("matmul_flops", "matmul_flops_per_size", "memory_bytes", "kernels", "ops")


def product_terms(flops: float, size: int) -> dict[str, float]:
    """The matmul terms of one matrix product of `flops` FLOPs whose smallest dimension is `size`
    (its launch, a `kernels` term, aside): at `flops * m / (m + matmul_half_size)` it takes
    `f / flops + (f / m) * matmul_half_size / flops`."""
    return {"matmul_flops": flops, "matmul_flops_per_size": flops / max(size, 1)}


@dataclass(frozen=True)
class Link:
    """A link's bandwidth (bytes/s) and latency (seconds per message step)."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Cluster:
    """The machine a plan is for: nodes of `gpus_per_node` GPUs, two links, one GPU's figures.

    Bandwidths are bytes/s one rank sends or receives on the link, latencies
    seconds per message step, `flops` the matmul FLOP/s of one GPU (its peak
    when `matmul_half_size` is set, else a sustained rate), `memory` its
    bytes, `algorithm` the collectives' family ("ring" or "tree").

    The compute constants (see the module docstring): a matrix product whose
    smallest dimension is `m` runs at `flops * m / (m + matmul_half_size)`;
    other kernels move their bytes at `memory_bandwidth` (bytes/s); each
    kernel launch costs `kernel_overhead` seconds. The defaults (0, inf, 0)
    give the uncalibrated alpha-beta model. `op_overhead`: the host seconds a
    program's runtime spends per op beyond a launch (its graph code, autograd
    nodes, DTensor and custom-op dispatch), on every kernel and every op of
    the runtime's own (views and allocations are not counted: a 1-D program,
    many views and few kernels, shows no such time); a profile measures it on
    a sharded reference program; 0 by default.
    `call_overhead`: the host seconds of one call of a program, forward and
    backward together, beyond its ops (inputs and outputs as DTensors, the
    autograd engine's start; a profile measures it with `op_overhead`).

    `bias_copy`: a matrix product with a bias term (`addmm`) first copies the
    bias into its output, whose bytes it then reads back, as CPU BLAS kernels
    do (GPU kernels add it in the product's epilogue).

    A profiled cluster (`tess_compile.analysis.profiling.profile_cluster`) also
    holds the optimizer step, `optimizer_overhead` seconds per parameter tensor
    plus its parameter bytes at `optimizer_bandwidth` (AdamW; the defaults, 0
    and inf, leave it out), and `collectives`, which price those collectives in
    place of `COLLECTIVE_RULES`: a line `(op, group size, "intra" or "inter",
    seconds, seconds per byte)`, or measured points `(op, group size, link,
    ((bytes, seconds), ...))`, bytes ascending, joined by straight segments
    (below the first point its seconds, beyond the last the last segment's
    slope): a profile's, since on a CPU a collective's time per byte grows once
    its buffers leave the caches. These are timed with the program's other
    group layouts of the same size in turn (a mesh's axes of equal size
    alternate); `lone_collectives`, in the same form, price a group layout
    that no other of its size alternates with (1-D, a data-parallel axis),
    which runs faster.

    `time_error`: the relative error of predicted step times measured on this
    machine (a profile's self-check, or `benchmarks/plan_accuracy.py`), None
    if unmeasured; the planner marks rows closer than it as ties.
    """

    gpus_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    flops: float
    memory: float
    algorithm: str = "ring"
    matmul_half_size: float = 0.0
    memory_bandwidth: float = math.inf
    kernel_overhead: float = 0.0
    optimizer_overhead: float = 0.0
    optimizer_bandwidth: float = math.inf
    collectives: tuple[tuple, ...] = ()
    bias_copy: bool = False
    op_overhead: float = 0.0
    call_overhead: float = 0.0
    lone_collectives: tuple[tuple, ...] = ()
    time_error: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node!r}: use a positive integer, e.g. 4 or 8")
        for name in ("intra_bandwidth", "inter_bandwidth", "flops", "memory", "memory_bandwidth",
                     "optimizer_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Cluster {name}={getattr(self, name)!r}: use a number > 0")
        for name in ("intra_latency", "inter_latency", "matmul_half_size", "kernel_overhead", "optimizer_overhead",
                     "op_overhead", "call_overhead"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Cluster {name}={getattr(self, name)!r}: use a number >= 0")
        object.__setattr__(self, "collectives", tuple(map(_entry, self.collectives)))
        object.__setattr__(self, "lone_collectives", tuple(map(_entry, self.lone_collectives)))
        priced = list(dict.fromkeys(op for _, op in COLLECTIVE_RULES))
        for entry in self.collectives + self.lone_collectives:
            if not (entry[0] in priced and isinstance(entry[1], int) and entry[1] > 1
                    and entry[2] in ("intra", "inter") and _valid_curve(entry)):
                raise ValueError(f"Cluster collectives entry {entry!r}: use (op, group size > 1, 'intra' or "
                                 f"'inter', latency s >= 0, s per byte >= 0) or (op, group size, link, "
                                 f"((bytes, seconds >= 0), ...) with bytes ascending), op one of {', '.join(priced)}")
        if self.time_error is not None and not (isinstance(self.time_error, (int, float)) and self.time_error >= 0):
            raise ValueError(f"Cluster time_error={self.time_error!r}: use a relative error >= 0 (0.1 for 10%) "
                             "or None")
        if not isinstance(self.bias_copy, bool):
            raise ValueError(f"Cluster bias_copy={self.bias_copy!r}: use True (products copy their bias term into "
                             "their output first, as CPU BLAS does) or False")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"collective algorithm {self.algorithm!r} is not one of "
                             f"{', '.join(map(repr, ALGORITHMS))}: use 'ring' (NCCL's default) or 'tree'")

    def is_intra_node(self, mesh: Mesh, axis: str) -> bool:
        """Whether every group along `axis` lies within one node."""
        return all(len({rank // self.gpus_per_node for rank in group}) == 1 for group in mesh.groups(axis))

    def measured(self, op: str, group_size: int, intra: bool,
                 alone: bool = False) -> tuple[tuple[float, float], ...] | None:
        """The (bytes, seconds) points of `op` over `group_size` ranks as profiled (a line's:
        its seconds at 0 and 1 byte), or None; `alone`: of a group layout that no other of
        its size alternates with (`lone_collectives`, where the cluster has them)."""
        link = "intra" if intra else "inter"
        for entry in (self.lone_collectives if alone else ()) + self.collectives:
            if entry[:3] == (op, group_size, link):
                return _points(entry)
        return None

    def collective_seconds(self, op: str, group_size: int, num_bytes: int, intra: bool, alone: bool = False) -> float:
        """Seconds of `op` on `num_bytes` (as `accounting` counts them) over `group_size`
        ranks: the profiled line (`collectives`, or with `alone` `lone_collectives`) where there
        is one, else `COLLECTIVE_RULES` on the link."""
        if group_size <= 1 or num_bytes == 0:
            return 0.0
        points = self.measured(op, group_size, intra, alone)
        if points is not None:
            return seconds_at(points, num_bytes)
        return collective_time(op, group_size, num_bytes, self._link(intra), self.algorithm)

    def link(self, mesh: Mesh, axis: str) -> Link:
        """The link the collectives along `axis` run on."""
        return self._link(self.is_intra_node(mesh, axis))

    def _link(self, intra: bool) -> Link:
        if intra:
            return Link(self.intra_bandwidth, self.intra_latency)
        return Link(self.inter_bandwidth, self.inter_latency)

    def matmul_efficiency(self, size: float) -> float:
        """The fraction of `flops` a matrix product whose smallest dimension is `size` reaches."""
        return size / (size + self.matmul_half_size)

    def compute_coefficients(self) -> dict[str, float]:
        """Seconds per unit of each of `COMPUTE_TERMS`."""
        return {
            "matmul_flops": 1 / self.flops,
            "matmul_flops_per_size": self.matmul_half_size / self.flops,
            "memory_bytes": 1 / self.memory_bandwidth,
            "kernels": self.kernel_overhead,
            "ops": self.op_overhead,
        }

    def compute_seconds(self, terms: dict[str, float]) -> float:
        """Seconds of kernels of `terms` (amounts of `COMPUTE_TERMS`; a missing one is 0): the
        products' FLOPs at their rate, the other kernels' bytes, the launches, the host time per op."""
        price = self.compute_coefficients()
        return sum(price[name] * terms.get(name, 0) for name in COMPUTE_TERMS)

    def to_dict(self) -> dict:
        """The fields as a dict of JSON values (an infinite bandwidth as the string "inf")."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("collectives", "lone_collectives"):
            values[name] = [list(entry) for entry in values[name]]
        return {key: "inf" if value == math.inf else value for key, value in values.items()}

    @classmethod
    def from_dict(cls, values: dict, where: str = "the cluster") -> Cluster:
        """The cluster of `to_dict`'s dict; a ValueError names an unknown or missing field."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"{where}: unknown Cluster field {unknown[0]!r}; the fields are {', '.join(names)}")
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"{where}: Cluster field {missing[0]!r} is missing; give every one of "
                             f"{', '.join(required)}")
        return cls(**{key: math.inf if value == "inf" else value for key, value in values.items()})

    def save(self, path: str | os.PathLike) -> None:
        """Write the cluster to `path` as JSON (`Cluster.load` reads it back)."""
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_dict(), file, indent=2)
            file.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Cluster:
        """The cluster `save` (or `tess-compile profile`) wrote to `path`."""
        try:
            with open(path, encoding="utf-8") as file:
                values = json.load(file)
        except FileNotFoundError:
            raise ValueError(f"cluster file {os.fspath(path)!r} not found: write one with "
                             "`tess-compile profile -o FILE` or Cluster.save") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"cluster file {os.fspath(path)!r} is not JSON ({exc}): write it with "
                             "`tess-compile profile -o FILE` or Cluster.save") from None
        if not isinstance(values, dict):
            raise ValueError(f"cluster file {os.fspath(path)!r} holds a {type(values).__name__}, not an object "
                             "of Cluster fields")
        return cls.from_dict(values, where=f"cluster file {os.fspath(path)!r}")


def _entry(entry) -> tuple:
    """A collectives entry as tuples (JSON gives lists)."""
    entry = tuple(entry)
    if len(entry) == 4 and isinstance(entry[3], (list, tuple)):
        return (*entry[:3], tuple(tuple(point) for point in entry[3]))
    return entry


def _valid_curve(entry: tuple) -> bool:
    if len(entry) == 5:
        return entry[3] >= 0 and entry[4] >= 0
    points = entry[3] if len(entry) == 4 else ()
    return (len(points) >= 2 and all(len(p) == 2 and p[0] >= 0 and p[1] >= 0 for p in points)
            and all(a[0] < b[0] for a, b in itertools.pairwise(points)))


def _points(entry: tuple) -> tuple[tuple[float, float], ...]:
    """An entry's (bytes, seconds) points: a line's at 0 and 1 byte, measured ones as they are."""
    if len(entry) == 5:
        return ((0.0, entry[3]), (1.0, entry[3] + entry[4]))
    return entry[3]


def seconds_at(points: tuple[tuple[float, float], ...], num_bytes: float) -> float:
    """The seconds of `num_bytes` on the straight segments through `points` (bytes ascending):
    the first point's seconds below it, the last segment's slope (if it rises) beyond the last."""
    if num_bytes <= points[0][0]:
        return points[0][1]
    for (b0, s0), (b1, s1) in itertools.pairwise(points):
        if num_bytes <= b1:
            return s0 + (s1 - s0) * (num_bytes - b0) / (b1 - b0)
    (b0, s0), (b1, s1) = points[-2:]
    return s1 + max(s1 - s0, 0.0) / (b1 - b0) * (num_bytes - b1)


# The paper's cluster (Tesseract, section 4: MeluXina): 4 A100 per node, NVLink
# 200 GB/s inside a node, InfiniBand 200 Gb/s (25 GB/s) between nodes. The A100s
# of MeluXina's GPU nodes are the 40 GB SXM4 model. Throughput: half the 312
# TFLOP/s bf16/fp16 dense tensor-core peak (TF32's dense peak is 156 TFLOP/s),
# the sustained rate large-model training reaches on A100s (Megatron-LM reports
# 138-163 TFLOP/s per GPU, 44-52 % of peak). Latencies, which the paper does not
# give: 2 us per step over NVLink and 5 us over InfiniBand, typical of NCCL.
PAPER_CLUSTER = Cluster(
    gpus_per_node=4,
    intra_bandwidth=200e9,
    intra_latency=2e-6,
    inter_bandwidth=25e9,
    inter_latency=5e-6,
    flops=156e12,
    memory=40e9,
    algorithm="ring",
)


# The paper's cluster with the constants fitted to its Table 1 (strong scaling) by
# `tess_compile.analysis.calibration.fit_cluster`, as `benchmarks/paper_times.py` runs it
# (one layer per row, fp16, checkpointed; docs/planner.md): `flops` fixed at the
# A100's 312 TFLOP/s fp16 dense peak, the rest fitted within `calibration.BOUNDS`.
# matmul_half_size and inter_bandwidth ended at an end of their range; the two
# latencies came out equal (the fit keeps intra <= inter). tests/test_calibration.py checks that
# the fit still gives these values.
CALIBRATED_CLUSTER = dataclasses.replace(
    PAPER_CLUSTER,
    intra_bandwidth=98.083e9,
    intra_latency=2.3065e-6,
    inter_latency=2.3065e-6,
    flops=312e12,
    matmul_half_size=1024.0,
    memory_bandwidth=727.25e9,
    kernel_overhead=15.114e-6,
)


def collective_rule(algorithm: str, op: str) -> PriceRule:
    """The `PriceRule` of `op` with `algorithm` (its record's `price`); a ValueError if it has none."""
    rule = COLLECTIVE_RULES.get((algorithm, op))
    if rule is None:
        known = list(dict.fromkeys(name for _, name in COLLECTIVE_RULES))
        raise ValueError(f"no cost rule for {op!r} with algorithm {algorithm!r}: ops are {', '.join(known)}, "
                         f"algorithms {', '.join(ALGORITHMS)}")
    return rule


def collective_time(op: str, group_size: int, num_bytes: int, link: Link, algorithm: str = "ring") -> float:
    """Seconds of `op` on `num_bytes` (as `accounting` counts them) over `group_size` ranks."""
    rule = collective_rule(algorithm, op)
    if group_size <= 1 or num_bytes == 0:
        return 0.0
    steps, factor = rule(group_size)
    return steps * link.latency + factor * num_bytes / link.bandwidth
