"""The price of one matrix product in each schedule, for summa="auto".

Part of stage 3 (rewrite): each record of `tess_compile.passes.summa.SCHEDULE_TABLE`
names its price function here, and `summa.cheapest_schedule` gives every product
that takes SUMMA steps the schedule of least price. A product's schedules differ
only in that product's own kernels and collectives, so pricing them alone and
keeping the cheapest gives the cheapest program under an additive cost, one
product at a time (q, k and v of one layer may so take another schedule than
its MLP). The prices follow `tess_compile.passes.summa`'s lowering and
`tess_compile.ops.fetched_product`'s backward, forward and backward of one step
on one rank:

- each kernel by `Cluster.compute_seconds`, the price the cost model uses too:
  a product of smallest dimension `m` (`product_terms`) at `flops * m / (m +
  matmul_half_size)`, an accumulation's bytes at `memory_bandwidth`,
  `kernel_overhead` per kernel;
- each collective by `Cluster.collective_seconds` (a profiled line where the
  cluster has one) on the link of its axis;
- "overlap": each step's broadcasts in flight behind the previous step's
  product (forward only; backward runs as "broadcast").

The prices read only the local shapes, the mesh and the cluster, so every rank
makes the same choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tess_compile.core.cluster import Cluster, product_terms
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.product_table import PRODUCT_KERNELS

__all__ = ["ProductCase", "ProductPrices", "broadcast_seconds", "gather_seconds", "overlap_seconds"]


@dataclass(frozen=True)
class ProductCase:
    """One product as this rank runs it: `A @ B` (Tesseract Alg. 3) or, with `transposed`,
    `A @ B^T` (Optimus Alg. 2, the weight's out features over row)."""

    transposed: bool
    a_shape: tuple[int, ...]  # this rank's block of A
    w_shape: tuple[int, int]  # this rank's block of the weight as stored
    product: str  # its kernel's name in `PRODUCT_KERNELS`: "linear" (weight [out, in]) or "matmul" ([in, out])
    itemsize: int
    a_shared: bool = False  # A's gather is an earlier product's (the gather schedule shares it)
    keep_blocks: bool = False  # fetched blocks kept for backward (no refetch)

    @property
    def rows(self) -> int:
        return math.prod(self.a_shape[:-1])

    @property
    def w_in_out(self) -> tuple[int, int]:
        out_dim = PRODUCT_KERNELS[self.product].out_dim
        return (self.w_shape[1 - out_dim], self.w_shape[out_dim])

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """`(m, k, n, itemsize)`: A's rows and in features (this rank's block), the weight block's out features."""
        return self.rows, self.a_shape[-1], self.w_in_out[1], self.itemsize


class ProductPrices:
    """Seconds of one kernel or collective of a product on `cluster`, on one rank of `mesh`."""

    def __init__(self, mesh: Mesh, cluster: Cluster):
        self.mesh, self.cluster = mesh, cluster
        self.intra = {axis: cluster.is_intra_node(mesh, axis) for axis in AXES}

    def product(self, m: int, k: int, n: int) -> float:
        return self.cluster.compute_seconds({**product_terms(2 * m * k * n, min(m, k, n)), "kernels": 1})

    def add(self, elements: int, itemsize: int) -> float:
        return self.cluster.compute_seconds({"memory_bytes": 3 * elements * itemsize, "kernels": 1})

    def comm(self, op: str, axis: str, num_bytes: int) -> float:
        return self.cluster.collective_seconds(op, self.mesh.size(axis), num_bytes, self.intra[axis])


def broadcast_seconds(case: ProductCase, price: ProductPrices, q: int) -> float:
    """The broadcast schedule: q steps, each fetching its blocks after the step before."""
    return (_stepped_abt if case.transposed else _stepped_ab)(case, price, q, _in_turn)


def overlap_seconds(case: ProductCase, price: ProductPrices, q: int) -> float:
    """The overlap schedule: q steps, step t+1's broadcasts behind step t's work (forward only)."""
    return (_stepped_abt if case.transposed else _stepped_ab)(case, price, q, _overlapped)


def gather_seconds(case: ProductCase, price: ProductPrices, q: int) -> float:
    """The gather schedule: one all-gather of each operand, one product."""
    return (_gathered_abt if case.transposed else _gathered_ab)(case, price, q)


def _in_turn(fetch: float, work: float, q: int) -> float:
    """q steps, each fetch after the step before."""
    return q * (fetch + work)


def _overlapped(fetch: float, work: float, q: int) -> float:
    """q steps whose fetch t+1 runs behind step t's `work`: the first fetch, then per step the
    longer of the work and the next fetch, the last step's work alone."""
    return fetch + (q - 1) * max(work, fetch) + work


def _stepped_ab(case: ProductCase, price: ProductPrices, q: int, forward_of) -> float:
    """`C = A @ B` in q steps: A's in features over col, B's in features over row, out features over
    col; `forward_of(fetch, work, q)` the forward of the steps."""
    m, k, n, size = case.dims
    a_bytes, w_bytes = m * k * size, k * n * size
    fetch = price.comm("broadcast", "col", a_bytes) + price.comm("broadcast", "row", w_bytes)
    work = price.product(m, k, n) + price.add(m * n, size)
    refetch = 0.0 if case.keep_blocks else fetch
    reduces = price.comm("reduce", "col", a_bytes) + price.comm("reduce", "row", w_bytes)
    grads = price.product(m, n, k) + price.product(k, m, n) + price.add(m * k, size) + price.add(k * n, size)
    return forward_of(fetch, work, q) + q * (refetch + reduces + grads)


def _stepped_abt(case: ProductCase, price: ProductPrices, q: int, forward_of) -> float:
    """`C = A @ B^T` in q steps: A's in features over col, B's out features over row, in features
    over col; each step's partial product reduced along col."""
    m, k, n, size = case.dims
    out_bytes, w_bytes = m * n * size, k * n * size
    fetch = price.comm("broadcast", "row", w_bytes)
    work = price.product(m, k, n) + price.comm("reduce", "col", out_bytes) + price.add(m * n, size)
    refetch = 0.0 if case.keep_blocks else fetch
    backward = price.comm("broadcast", "col", out_bytes) + refetch + price.comm("reduce", "row", w_bytes)
    backward += price.product(m, n, k) + price.product(n, m, k) + price.add(m * k, size) + price.add(n * k, size)
    return forward_of(fetch, work, q) + q * backward


def _gathered_ab(case: ProductCase, price: ProductPrices, q: int) -> float:
    """`C = A @ B` gathered: A along col (unless an earlier product's gather is shared), B along row."""
    m, k, n, size = case.dims
    a_bytes, w_bytes = m * k * size, k * n * size
    forward = (0.0 if case.a_shared else price.comm("all_gather", "col", a_bytes))
    forward += price.comm("all_gather", "row", w_bytes) + price.product(m, q * k, n)
    refetch = 0.0 if case.keep_blocks else (price.comm("all_gather", "row", w_bytes)
                                            + price.comm("all_gather", "col", a_bytes))
    grad_a = price.add(m * q * k, size) if case.a_shared else price.comm("reduce_scatter", "col", q * a_bytes)
    backward = refetch + price.product(m, n, q * k) + price.product(q * k, m, n) + grad_a
    return forward + backward + price.comm("reduce_scatter", "row", q * w_bytes)


def _gathered_abt(case: ProductCase, price: ProductPrices, q: int) -> float:
    """`C = A @ B^T` gathered: B along row, the partial products reduce-scattered along col."""
    m, k, n, size = case.dims
    out_bytes, w_bytes = m * n * size, k * n * size
    refetch = 0.0 if case.keep_blocks else price.comm("all_gather", "row", w_bytes)
    forward = price.comm("all_gather", "row", w_bytes) + price.product(m, k, q * n)
    forward += price.comm("reduce_scatter", "col", q * out_bytes)
    backward = price.comm("all_gather", "col", out_bytes) + refetch + price.product(m, q * n, k)
    return forward + backward + price.product(q * n, m, k) + price.comm("reduce_scatter", "row", q * w_bytes)
