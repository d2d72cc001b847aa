"""Tesseract's matrix products on the [q, q, d] mesh (DESIGN.md section 3).

Each depth slab runs the 2-D algorithm on its own rows at once. `A` is split
rows over (depth, row) and columns over col; `B` rows over row and columns
over col, replicated over depth. The loops emit q steps of broadcasts and
local products; autograd through them gives the backward (a broadcast's
adjoint is a reduce), so the backward of `C = A @ B` is made of the reduces
of `dA = dC @ B^T` and `dB = A^T @ dC`.
"""

from __future__ import annotations

from torch.fx import Node

from passes.builder import Builder, aten
from tess_compile import collectives as c

__all__ = ["matmul_ab"]


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
