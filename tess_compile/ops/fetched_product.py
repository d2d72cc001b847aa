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


def _grad_w(product: str, grad: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    rows_a = a.reshape(-1, a.shape[-1])
    rows_g = grad.reshape(-1, grad.shape[-1])
    return rows_g.t() @ rows_a if product == "linear" else rows_a.t() @ rows_g


class _FetchedProduct(torch.autograd.Function):
    """`product(a_used[r], w_used[r])` for each rank r; saves the own blocks `a`, `w`.

    `a_fetch` / `w_fetch` say how an operand was fetched from its own block,
    `(op, axis, *args)` for `Comm.run_all`, or None when the own block was
    used as it is. Inputs are flat: a_used, w_used, a, w, each n tensors.
    """

    @staticmethod
    def forward(ctx, comm, product, a_fetch, w_fetch, n, *tensors):
        a_used, w_used, a_own, w_own = (tensors[i * n:(i + 1) * n] for i in range(4))
        ctx.comm, ctx.product, ctx.fetch, ctx.n = comm, product, (a_fetch, w_fetch), n
        ctx.save_for_backward(*a_own, *w_own)
        return tuple(_forward(product, a, w) for a, w in zip(a_used, w_used))

    @staticmethod
    def backward(ctx, *grads):
        n, product = ctx.n, ctx.product
        saved = ctx.saved_tensors
        a_own, w_own = list(saved[:n]), list(saved[n:])
        need_a, need_w = any(ctx.needs_input_grad[5:5 + n]), any(ctx.needs_input_grad[5 + n:5 + 2 * n])
        comm = ctx.comm or current_comm()
        # The same order on every rank: w's fetch, then a's.
        w_used = _refetch(comm, w_own, ctx.fetch[1]) if need_a else None
        a_used = _refetch(comm, a_own, ctx.fetch[0]) if need_w else None
        grad_a = [_grad_a(product, g, w.to(g.dtype)).to(a.dtype) for g, w, a in zip(grads, w_used, a_own)] if need_a else [None] * n
        grad_w = [_grad_w(product, g, a.to(g.dtype)).to(w.dtype) for g, a, w in zip(grads, a_used, w_own)] if need_w else [None] * n
        return (None,) * 5 + (*grad_a, *grad_w) + (None,) * (2 * n)


def _refetch(comm: Comm, own: list[torch.Tensor], fetch: tuple | None) -> list[torch.Tensor]:
    if fetch is None:
        return own
    op, axis, *args = fetch
    with use_comm(comm, phase="backward"):
        return comm.run_all(op, [x.contiguous() for x in own], axis, *args)


def lockstep_product(comm: Comm, a_used, w_used, a_own, w_own, product: str, a_fetch, w_fetch) -> list[torch.Tensor]:
    """`fetched_product` over lists of per-rank tensors (the simulator's lockstep)."""
    n = len(a_used)
    return list(_FetchedProduct.apply(comm, product, a_fetch, w_fetch, n, *a_used, *w_used, *a_own, *w_own))


def fetched_product(a_used, w_used, a_own, w_own, product: str, a_fetch, w_fetch) -> torch.Tensor:
    """`product(a_used, w_used)` on this rank (a graph target); backward keeps `a_own` and
    `w_own` and fetches the used blocks again as `a_fetch` / `w_fetch` say."""
    return lockstep_product(active_comm(), [a_used], [w_used], [a_own], [w_own], product, a_fetch, w_fetch)[0]


fetched_product._opname = "fetched_product"
