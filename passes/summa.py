"""Tesseract's matrix products on the [q, q, d] mesh (DESIGN.md section 3).

Each depth slab runs the 2-D algorithm on its own rows at once. `A` is split
rows over (depth, row) and columns over col; `B` rows over row and columns
over col, replicated over depth. The loops emit q steps of broadcasts and
local products; autograd through them gives the backward (a broadcast's
adjoint is a reduce), so the backward of `C = A @ B` is made of the reduces
of `dA = dC @ B^T` and `dB = A^T @ dC`.

No fetched block outlives its product: each product is a
`tess_compile.ops.fetched_product.fetched_product` that keeps this rank's own blocks
for backward and fetches again there (the papers' backward: 2q broadcasts
and 2q reduces for `C = A @ B`). With `keep_blocks` the products are plain
kernels that keep the fetched blocks instead: 2q fewer backward
collectives, q times the saved bytes.

A weight laid out the other way round (out features over row, in features
over col, as when an earlier consumer fixed it) is used as it is by
`C = A @ B^T` (Optimus Alg. 2) instead of being moved.

A schedule is one record of `SCHEDULE_TABLE`: how it lowers a product and
how `tess_compile.passes.product_schedule` prices it. With summa="auto" each
product takes the schedule priced cheapest on the builder's cluster
(`cheapest_schedule`); `Builder.schedules` counts the choices. Adding a
schedule is adding a record (its lowering here, its price there) and its name
to `tess_compile.core.options.SCHEDULES`, which must list the table's names.

A product's step runs its kernel (`tess_compile.core.product_table`: a record whose
`summa` is set), by name in a `fetched_product`.

Writes `SUMMA_STEP` (`tess_compile.core.meta_keys`) = t on the collectives of step t of a loop, so
that an analysis can count one step q times (`tess_compile.analysis.symbolic`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.product_schedule import (
    ProductCase,
    ProductPrices,
    broadcast_seconds,
    gather_seconds,
    overlap_seconds,
)
from tess_compile.core.cluster import Cluster
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import SUMMA_STEP
from tess_compile.core.options import AUTO, SCHEDULES
from tess_compile.core.product_table import product_kernel
from tess_compile.ops import collectives as c
from tess_compile.ops.fetched_product import fetched_product

__all__ = [
    "SCHEDULE_TABLE",
    "Schedule",
    "cheapest_schedule",
    "matmul",
    "matmul_ab",
    "matmul_abt",
    "matmul_gathered",
    "matmul_in_steps",
    "matmul_overlapped",
    "schedule_prices",
]

aten = torch.ops.aten


def _kernel_name(product) -> str:
    """The name `fetched_product` knows the kernel of the product op `product` by."""
    kernel = product_kernel(product)
    assert kernel is not None and kernel.summa, f"{product} is no kernel of SUMMA's steps"
    return kernel.name


def _broadcast_spec(b: Builder, axis: str, t: int) -> tuple | None:
    """How step t's block along `axis` was fetched (None: the own block was used)."""
    return ("broadcast", axis, t) if b.mesh.size(axis) > 1 else None


def _gather_spec(b: Builder, axis: str, dim: int, groups: int) -> tuple | None:
    parts = b.mesh.size(axis)
    return ("all_gather", axis, parts, dim, groups) if parts > 1 else None


def _product(b: Builder, product, a_used: Node, w_used: Node, a: Node, w: Node, a_fetch, w_fetch) -> Node:
    """`product(a_used, w_used)`; unless the builder keeps fetched blocks, a
    `fetched_product` that keeps the own blocks `a`, `w` and fetches again in backward."""
    if b.keep_blocks or (a_fetch is None and w_fetch is None):
        return b.call(product, a_used, w_used)
    return b.call(fetched_product, a_used, w_used, a, w, _kernel_name(product), a_fetch, w_fetch)


def _fetch(b: Builder, x: Node, axis: str, t: int, ahead: bool) -> Node:
    """Step t's block of `x` along `axis`: a broadcast, started asynchronously when fetched `ahead`."""
    op = c.broadcast_start if ahead else c.broadcast
    return _mark_step(b.collective(op, x, axis, t), x, t)


def _mark_step(node: Node, x: Node, t: int) -> Node:
    """Write `SUMMA_STEP` = t on a collective or product of step t of a q-step
    loop (the steps move equal bytes; `tess_compile.analysis.symbolic` counts step 0 q times).
    `node` is `x` itself when the axis has size 1: nothing was emitted, nothing is marked."""
    if node is not x:
        SUMMA_STEP.set(node, t)
    return node


def _arrived(b: Builder, x: Node) -> Node:
    return b.call(c.wait, x) if x.target is c.broadcast_start else x


def _accumulate_steps(b: Builder, fetch, use, ahead: bool) -> Node:
    """The sum over the q steps of `use(t, blocks)`, where `fetch(t)` emits step t's
    broadcasts. Step t+1's broadcasts follow step t's product; fetched `ahead`, they
    start as soon as step t's blocks arrive, in flight during the product."""
    acc, pending = None, fetch(0)
    for t in range(b.mesh.q):
        blocks = tuple(_arrived(b, x) for x in pending)
        more = t + 1 < b.mesh.q
        if more and ahead:
            pending = fetch(t + 1)
        y = use(t, blocks)
        acc = y if acc is None else _mark_step(b.call(aten.add.Tensor, acc, y), y, t)
        if more and not ahead:
            pending = fetch(t + 1)
    return acc


def matmul_ab(b: Builder, a: Node, w: Node, product=aten.matmul.default, ahead: bool = False) -> Node:
    """C = A @ B (Tesseract Alg. 3): for t, broadcast A along col from j=t and
    B along row from i=t, and accumulate `product(A_t, B_t)`."""

    def fetch(t: int) -> tuple[Node, Node]:
        return _fetch(b, a, "col", t, ahead), _fetch(b, w, "row", t, ahead)

    def use(t: int, blocks) -> Node:
        y = _product(b, product, *blocks, a, w, _broadcast_spec(b, "col", t), _broadcast_spec(b, "row", t))
        return _mark_step(y, blocks[0], t)

    return _accumulate_steps(b, fetch, use, ahead)


def matmul_abt(b: Builder, a: Node, w: Node, product=aten.linear.default, ahead: bool = False) -> Node:
    """C = A @ B^T (Optimus Alg. 2): for t, broadcast B along row from i=t and
    reduce `product(A, B_t)` along col to j=t; rank j keeps step j's sum."""

    def reduce_step(t: int, blocks) -> Node:
        partial = _mark_step(_product(b, product, a, blocks[0], a, w, None, _broadcast_spec(b, "row", t)), a, t)
        return _mark_step(b.collective(c.reduce, partial, "col", t), partial, t)

    return _accumulate_steps(b, lambda t: (_fetch(b, w, "row", t, ahead),), reduce_step, ahead)


def matmul_in_steps(b: Builder, a: Node, w: Node, w_layout: Layout, a_dim: int, transposed: bool, product) -> Node:
    """The broadcast schedule: q steps, each fetching its blocks after the step before."""
    return (matmul_abt if transposed else matmul_ab)(b, a, w, product)


def matmul_overlapped(b: Builder, a: Node, w: Node, w_layout: Layout, a_dim: int, transposed: bool,
                      product) -> Node:
    """The overlap schedule: q steps, step t+1's broadcasts started while step t multiplies."""
    return (matmul_abt if transposed else matmul_ab)(b, a, w, product, ahead=True)


def matmul_gathered(b: Builder, a: Node, w: Node, w_layout: Layout, a_dim: int, transposed: bool, product) -> Node:
    """The gather schedule: all-gather W along row (and, for A @ B, A along col), one
    product; for A @ B^T the product's partial sums are reduce-scattered along col.
    Products of the same A read one all-gather of it (its gradient is then reduce-
    scattered once); each still gathers A again in its own backward."""
    row = w_layout.row
    w_full = b.split_op(c.all_gather, w, "row", row.dim, row.groups)
    w_fetch = _gather_spec(b, "row", row.dim, row.groups)
    if transposed:
        y = _product(b, product, a, w_full, a, w, None, w_fetch)
        return b.split_op(c.reduce_scatter, y, "col", a_dim, row.groups)
    key = _gather_key(a, a_dim, row.groups)
    if key not in b.shared:  # products of one input (q, k and v) share its gathered rows
        b.shared[key] = b.split_op(c.all_gather, a, "col", a_dim, row.groups)
    return _product(b, product, b.shared[key], w_full, a, w, _gather_spec(b, "col", a_dim, row.groups), w_fetch)


def _gather_key(a: Node, a_dim: int, groups: int) -> tuple:
    """The key of A's all-gather along col in `Builder.shared`."""
    return ("all_gather", a, "col", a_dim, groups)


@dataclass(frozen=True)
class Schedule:
    """How the q steps of a matrix product run: its lowering and its price.

    `lower(b, a, w, w_layout, a_dim, transposed, product)` emits `x @ W` (`matmul`'s
    arguments); `price(case, prices, q)` gives the seconds of the product's forward and
    backward on one rank (`tess_compile.passes.product_schedule`).
    """

    name: str
    lower: Callable[..., Node]
    price: Callable[[ProductCase, ProductPrices, int], float]


# schedule name -> its record; ties in price go to the earlier.
SCHEDULE_TABLE = {schedule.name: schedule for schedule in (
    Schedule("broadcast", matmul_in_steps, broadcast_seconds),
    Schedule("overlap", matmul_overlapped, overlap_seconds),
    Schedule("gather", matmul_gathered, gather_seconds),
)}
assert tuple(SCHEDULE_TABLE) == SCHEDULES, "tess_compile.core.options.SCHEDULES lists SCHEDULE_TABLE's names, in order"


def schedule_prices(case: ProductCase, mesh: Mesh, cluster: Cluster) -> dict[str, float]:
    """Seconds of the product's forward and backward on one rank, per schedule of `SCHEDULE_TABLE`."""
    prices = ProductPrices(mesh, cluster)
    return {name: schedule.price(case, prices, mesh.q) for name, schedule in SCHEDULE_TABLE.items()}


def cheapest_schedule(case: ProductCase, mesh: Mesh, cluster: Cluster) -> str:
    """The schedule of least `schedule_prices` (the earlier of `SCHEDULE_TABLE` on a tie)."""
    prices = schedule_prices(case, mesh, cluster)
    return min(SCHEDULE_TABLE, key=lambda name: prices[name])


def _schedule_for(b: Builder, case: ProductCase) -> Schedule:
    """The schedule of one product: the builder's, or with "auto" the cheapest for `case`;
    with q == 1 there are no steps to schedule (none is counted)."""
    if b.mesh.q == 1:
        return SCHEDULE_TABLE["broadcast" if b.summa == AUTO else b.summa]
    name = cheapest_schedule(case, b.mesh, b.cluster) if b.summa == AUTO else b.summa
    b.schedules[name] += 1
    return SCHEDULE_TABLE[name]


def matmul(b: Builder, a: Node, w: Node, w_layout: Layout, out_dim: int, product, a_dim: int,
           shapes: tuple[tuple[int, ...], tuple[int, int], int]) -> Node:
    """x @ W by the algorithm that `w_layout` calls for (out dim over row: A @ B^T), in the
    builder's schedule (with "auto", the cheapest for this product); `a_dim` is x's last dim,
    `shapes` this rank's blocks of x and W and their item size, which "auto" prices."""
    row = w_layout.row
    if not isinstance(row, Shard):  # a product placed whole (replicated): no steps to take
        return b.call(product, a, w)
    transposed = row.dim == out_dim
    a_shape, w_shape, itemsize = shapes
    shared = not transposed and _gather_key(a, a_dim, row.groups) in b.shared
    schedule = _schedule_for(b, ProductCase(transposed, a_shape, w_shape, _kernel_name(product), itemsize,
                                            a_shared=shared, keep_blocks=b.keep_blocks))
    return schedule.lower(b, a, w, w_layout, a_dim, transposed, product)
