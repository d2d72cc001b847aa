"""The schedule of one matrix product under summa="auto": each schedule priced on a cluster.

Part of stage 3 (rewrite): `tess_compile.passes.summa` asks `cheapest_schedule` for every product
that takes SUMMA steps. A product's schedules differ only in that product's own
kernels and collectives, so pricing them alone and keeping the cheapest gives the
cheapest program under an additive cost, one product at a time (q, k and v of
one layer may so take another schedule than its MLP). The prices follow
`tess_compile.passes.summa`'s lowering and `tess_compile.ops.fetched_product`'s backward,
forward and backward of one step on one rank:

- a product of smallest dimension `m` at `flops * m / (m + matmul_half_size)`,
  an accumulation's bytes at `memory_bandwidth`, `kernel_overhead` per kernel;
- each collective by `Cluster.collective_seconds` (a profiled line where the
  cluster has one) on the link of its axis;
- "overlap": each step's broadcasts in flight behind the previous step's
  product (forward only; backward runs as "broadcast").

The choice reads only the local shapes, the mesh and the cluster, so every rank
makes the same one. Ties go to the earlier of `SCHEDULES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.options import SCHEDULES

__all__ = ["ProductCase", "cheapest_schedule", "schedule_prices"]


@dataclass(frozen=True)
class ProductCase:
    """One product as this rank runs it: `A @ B` (Tesseract Alg. 3) or, with `transposed`,
    `A @ B^T` (Optimus Alg. 2, the weight's out features over row)."""

    transposed: bool
    a_shape: tuple[int, ...]  # this rank's block of A
    w_shape: tuple[int, int]  # this rank's block of the weight as stored
    product: str  # "linear" (weight [out, in]) or "matmul" (weight [in, out])
    itemsize: int
    a_shared: bool = False  # A's gather is an earlier product's (the gather schedule shares it)
    keep_blocks: bool = False  # fetched blocks kept for backward (no refetch)

    @property
    def rows(self) -> int:
        return math.prod(self.a_shape[:-1])

    @property
    def w_in_out(self) -> tuple[int, int]:
        return (self.w_shape[1], self.w_shape[0]) if self.product == "linear" else self.w_shape


class _Prices:
    """Seconds of one kernel or collective of a product on `cluster`, on one rank of `mesh`."""

    def __init__(self, mesh: Mesh, cluster: Cluster):
        self.mesh, self.cluster = mesh, cluster
        self.intra = {axis: cluster.is_intra_node(mesh, axis) for axis in AXES}

    def product(self, m: int, k: int, n: int) -> float:
        flops = 2 * m * k * n
        rate = self.cluster.flops * self.cluster.matmul_efficiency(max(min(m, k, n), 1))
        return flops / rate + self.cluster.kernel_overhead

    def add(self, elements: int, itemsize: int) -> float:
        return 3 * elements * itemsize / self.cluster.memory_bandwidth + self.cluster.kernel_overhead

    def comm(self, op: str, axis: str, num_bytes: int) -> float:
        return self.cluster.collective_seconds(op, self.mesh.size(axis), num_bytes, self.intra[axis])


def schedule_prices(case: ProductCase, mesh: Mesh, cluster: Cluster) -> dict[str, float]:
    """Seconds of the product's forward and backward on one rank, per schedule of `SCHEDULES`."""
    price = _Prices(mesh, cluster)
    step = _transposed_steps if case.transposed else _steps
    return {schedule: step(case, price, mesh.q, schedule) for schedule in SCHEDULES}


def cheapest_schedule(case: ProductCase, mesh: Mesh, cluster: Cluster) -> str:
    """The schedule of least `schedule_prices` (the earlier of `SCHEDULES` on a tie)."""
    prices = schedule_prices(case, mesh, cluster)
    return min(SCHEDULES, key=lambda schedule: prices[schedule])


def _overlapped(fetch: float, work: float, q: int) -> float:
    """q steps whose fetch t+1 runs behind step t's `work`: the first fetch, then per step the
    longer of the work and the next fetch, the last step's work alone."""
    return fetch + (q - 1) * max(work, fetch) + work


def _steps(case: ProductCase, price: _Prices, q: int, schedule: str) -> float:
    """`C = A @ B`: A's in features over col, B's in features over row, out features over col."""
    size = case.itemsize
    m, k = case.rows, case.a_shape[-1]
    n = case.w_in_out[1]
    a_bytes, w_bytes = m * k * size, k * n * size
    if schedule == "gather":
        forward = (0.0 if case.a_shared else price.comm("all_gather", "col", a_bytes))
        forward += price.comm("all_gather", "row", w_bytes) + price.product(m, q * k, n)
        refetch = 0.0 if case.keep_blocks else (price.comm("all_gather", "row", w_bytes)
                                                + price.comm("all_gather", "col", a_bytes))
        grad_a = price.add(m * q * k, size) if case.a_shared else price.comm("reduce_scatter", "col", q * a_bytes)
        backward = refetch + price.product(m, n, q * k) + price.product(q * k, m, n) + grad_a
        return forward + backward + price.comm("reduce_scatter", "row", q * w_bytes)
    fetch = price.comm("broadcast", "col", a_bytes) + price.comm("broadcast", "row", w_bytes)
    work = price.product(m, k, n) + price.add(m * n, size)
    forward = _overlapped(fetch, work, q) if schedule == "overlap" else q * (fetch + work)
    refetch = 0.0 if case.keep_blocks else fetch
    reduces = price.comm("reduce", "col", a_bytes) + price.comm("reduce", "row", w_bytes)
    grads = price.product(m, n, k) + price.product(k, m, n) + price.add(m * k, size) + price.add(k * n, size)
    return forward + q * (refetch + reduces + grads)


def _transposed_steps(case: ProductCase, price: _Prices, q: int, schedule: str) -> float:
    """`C = A @ B^T`: A's in features over col, B's out features over row, in features over col;
    the partial products are reduced along col."""
    size = case.itemsize
    m, k = case.rows, case.a_shape[-1]
    n = case.w_in_out[1]
    out_bytes, w_bytes = m * n * size, k * n * size
    refetch = 0.0 if case.keep_blocks else price.comm("all_gather" if schedule == "gather" else "broadcast", "row",
                                                      w_bytes)
    if schedule == "gather":
        forward = price.comm("all_gather", "row", w_bytes) + price.product(m, k, q * n)
        forward += price.comm("reduce_scatter", "col", q * out_bytes)
        backward = price.comm("all_gather", "col", out_bytes) + refetch + price.product(m, q * n, k)
        return forward + backward + price.product(q * n, m, k) + price.comm("reduce_scatter", "row", q * w_bytes)
    fetch = price.comm("broadcast", "row", w_bytes)
    work = price.product(m, k, n) + price.comm("reduce", "col", out_bytes) + price.add(m * n, size)
    forward = _overlapped(fetch, work, q) if schedule == "overlap" else q * (fetch + work)
    backward = price.comm("broadcast", "col", out_bytes) + refetch + price.comm("reduce", "row", w_bytes)
    backward += price.product(m, n, k) + price.product(n, m, k) + price.add(m * k, size) + price.add(n * k, size)
    return forward + q * backward
