"""Tesseract's matrix products on the [q, q, d] mesh (DESIGN.md section 3).

Each depth slab runs the 2-D algorithm on its own rows at once. `A` is split
rows over (depth, row) and columns over col; `B` rows over row and columns
over col, replicated over depth. The loops emit q steps of broadcasts and
local products; autograd through them gives the backward (a broadcast's
adjoint is a reduce), so the backward of `C = A @ B` is made of the reduces
of `dA = dC @ B^T` and `dB = A^T @ dC`.

A weight laid out the other way round (out features over row, in features
over col, as when an earlier consumer fixed it) is used as it is by
`C = A @ B^T` (Optimus Alg. 2) instead of being moved.
"""

from __future__ import annotations

from torch.fx import Node

from passes.builder import Builder, aten
from tess_compile import collectives as c
from tess_compile.layout import Layout, Shard

__all__ = ["matmul", "matmul_ab", "matmul_abt"]


def matmul_ab(b: Builder, a: Node, w: Node, product=aten.matmul.default) -> Node:
    """C = A @ B (Tesseract Alg. 3): for t, broadcast A along col from j=t and
    B along row from i=t, and accumulate `product(A_t, B_t)`."""
    acc = None
    for t in range(b.mesh.q):
        a_t = b.collective(c.broadcast, a, "col", t)
        w_t = b.collective(c.broadcast, w, "row", t)
        y = b.call(product, a_t, w_t)
        acc = y if acc is None else b.call(aten.add.Tensor, acc, y)
    return acc


def matmul_abt(b: Builder, a: Node, w: Node, product=aten.linear.default) -> Node:
    """C = A @ B^T (Optimus Alg. 2): for t, broadcast B along row from i=t and
    reduce `product(A, B_t)` along col to j=t; rank j keeps step j's sum."""
    acc = None
    for t in range(b.mesh.q):
        w_t = b.collective(c.broadcast, w, "row", t)
        part = b.collective(c.reduce, b.call(product, a, w_t), "col", t)
        acc = part if acc is None else b.call(aten.add.Tensor, acc, part)
    return acc


def matmul(b: Builder, a: Node, w: Node, w_layout: Layout, out_dim: int, product) -> Node:
    """x @ W by the algorithm that `w_layout` calls for (out dim over row: A @ B^T)."""
    row = w_layout.row
    if isinstance(row, Shard) and row.dim == out_dim:
        return matmul_abt(b, a, w, product)
    return matmul_ab(b, a, w, product)
