"""Matrix products of fetched blocks, with the papers' memory-lean backward.

A SUMMA step multiplies blocks fetched from other ranks (a broadcast, or
an all-gather in the gather schedule). Plain autograd would keep those
fetched blocks for backward, q of them per operand. `fetched_product`
keeps this rank's own blocks only and fetches again in backward: for
`C = A @ B`, `dA = dC @ B^T` re-broadcasts B along row and `dB = A^T @ dC`
re-broadcasts A along col (Tesseract Alg. 3 backward; Optimus Alg. 2 and
3); the reduces are the adjoints of the forward's broadcasts.

One autograd function serves both runtimes: it works on lists of per-rank
tensors, one per rank the communicator speaks for (one on a distributed
rank, p in the simulator).

The own block of the weight may come in pieces (a tuple): the weights of
products merged into one (`tess_compile.passes.merge_products`), which backward
concatenates along the out dim before fetching again. So a merged product
keeps the parameters themselves for backward, not a copy of them.
"""

from __future__ import annotations

import torch

from tess_compile.ops.collectives import Comm, active_comm, current_comm, use_comm

__all__ = ["PRODUCTS", "fetched_product", "lockstep_product"]

# Local kernels a fetched product may run: y = product(a, w), w 2-D.
PRODUCTS = ("linear", "matmul")


def _forward(product: str, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(a, w) if product == "linear" else torch.matmul(a, w)


def _grad_a(product: str, grad: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(grad, w) if product == "linear" else torch.matmul(grad, w.t())


def _joined(product: str, pieces) -> torch.Tensor:
    """A weight's own block from its pieces, joined along the out dim (dim 0 of `linear`'s [out, in])."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0 if product == "linear" else 1)


def _grad_w(product: str, grad: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    rows_a = a.reshape(-1, a.shape[-1])
    rows_g = grad.reshape(-1, grad.shape[-1])
    return rows_g.t() @ rows_a if product == "linear" else rows_a.t() @ rows_g


class _FetchedProduct(torch.autograd.Function):
    """`product(a_used[r], w_used[r])` for each rank r; saves the own blocks `a`, `w`.

    `a_fetch` / `w_fetch` say how an operand was fetched from its own block,
    `(op, axis, *args)` for `Comm.run_all`, or None when the own block was
    used as it is. Inputs are flat: a_used, w_used, a, each n tensors, then
    w as `parts` pieces a rank, rank by rank.
    """

    @staticmethod
    def forward(ctx, comm, product, a_fetch, w_fetch, n, parts, *tensors):
        a_used, w_used, a_own = (tensors[i * n:(i + 1) * n] for i in range(3))
        ctx.comm, ctx.product, ctx.fetch, ctx.n, ctx.parts = comm, product, (a_fetch, w_fetch), n, parts
        ctx.save_for_backward(*a_own, *tensors[3 * n:])
        return tuple(_forward(product, a, w) for a, w in zip(a_used, w_used))

    @staticmethod
    def backward(ctx, *grads):
        n, parts, product = ctx.n, ctx.parts, ctx.product
        saved = ctx.saved_tensors
        a_own = list(saved[:n])
        w_own = [_joined(product, saved[n + r * parts:n + (r + 1) * parts]) for r in range(n)]
        need_a, need_w = any(ctx.needs_input_grad[6:6 + n]), any(ctx.needs_input_grad[6 + n:6 + 2 * n])
        comm = ctx.comm or current_comm()
        # The same order on every rank: w's fetch, then a's.
        w_used = _refetch(comm, w_own, ctx.fetch[1]) if need_a else None
        a_used = _refetch(comm, a_own, ctx.fetch[0]) if need_w else None
        grad_a = [_grad_a(product, g, w.to(g.dtype)).to(a.dtype) for g, w, a in zip(grads, w_used, a_own)] if need_a else [None] * n
        grad_w = [_grad_w(product, g, a.to(g.dtype)).to(w.dtype) for g, a, w in zip(grads, a_used, w_own)] if need_w else [None] * n
        return (None,) * 6 + (*grad_a, *grad_w) + (None,) * (n + n * parts)


def _refetch(comm: Comm, own: list[torch.Tensor], fetch: tuple | None) -> list[torch.Tensor]:
    if fetch is None:
        return own
    op, axis, *args = fetch
    with use_comm(comm, phase="backward"):
        return comm.run_all(op, [x.contiguous() for x in own], axis, *args)


def lockstep_product(comm: Comm, a_used, w_used, a_own, w_own, product: str, a_fetch, w_fetch) -> list[torch.Tensor]:
    """`fetched_product` over lists of per-rank tensors (the simulator's lockstep); `w_own` is
    such a list, or a tuple of them: the pieces of the weight's own block."""
    n = len(a_used)
    parts = w_own if isinstance(w_own, tuple) else (w_own,)
    pieces = [part[r] for r in range(n) for part in parts]
    return list(_FetchedProduct.apply(comm, product, a_fetch, w_fetch, n, len(parts), *a_used, *w_used, *a_own,
                                      *pieces))


def fetched_product(a_used, w_used, a_own, w_own, product: str, a_fetch, w_fetch) -> torch.Tensor:
    """`product(a_used, w_used)` on this rank (a graph target); backward keeps `a_own` and
    `w_own` (a tensor, or a tuple of pieces it joins along the out dim) and fetches the used
    blocks again as `a_fetch` / `w_fetch` say."""
    own = tuple([piece] for piece in w_own) if isinstance(w_own, (tuple, list)) else [w_own]
    return lockstep_product(active_comm(), [a_used], [w_used], [a_own], own, product, a_fetch, w_fetch)[0]


fetched_product._opname = "fetched_product"
