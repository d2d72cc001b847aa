"""Matrix products of fetched blocks, with the papers' memory-lean backward.

A SUMMA step multiplies blocks fetched from other ranks (a broadcast, or
an all-gather in the gather schedule). Plain autograd would keep those
fetched blocks for backward, q of them per operand. `fetched_product`
keeps this rank's own blocks only and fetches again in backward: for
`C = A @ B`, `dA = dC @ B^T` re-broadcasts B along row and `dB = A^T @ dC`
re-broadcasts A along col (Tesseract Alg. 3 backward; Optimus Alg. 2 and
3); the reduces are the adjoints of the forward's broadcasts.

The product is a kernel of `tess_compile.core.product_table` named by the
caller (a record whose `summa` is set: its `forward`, `grad_input` and
`grad_weight`). One autograd function serves both runtimes: it works on lists
of per-rank tensors, one per rank the communicator speaks for (one on a
distributed rank, p in the simulator).

The own block of the weight may come in pieces (a tuple): the weights of
products merged into one (`tess_compile.passes.merge_products`), which backward
concatenates along the out dim before fetching again. So a merged product
keeps the parameters themselves for backward, not a copy of them.
"""

from __future__ import annotations

import torch

from tess_compile.core.product_table import PRODUCT_KERNELS
from tess_compile.ops.collectives import Comm, active_comm, current_comm, use_comm

__all__ = ["fetched_product", "lockstep_product"]


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
        kernel = PRODUCT_KERNELS[product]
        ctx.comm, ctx.kernel, ctx.fetch, ctx.n, ctx.parts = comm, kernel, (a_fetch, w_fetch), n, parts
        ctx.save_for_backward(*map(_compact, a_own), *map(_compact, tensors[3 * n:]))
        return tuple(kernel.forward(a, w) for a, w in zip(a_used, w_used))

    @staticmethod
    def backward(ctx, *grads):
        n, parts, kernel = ctx.n, ctx.parts, ctx.kernel
        saved = ctx.saved_tensors
        a_own = list(saved[:n])
        w_own = [kernel.join(saved[n + r * parts:n + (r + 1) * parts]) for r in range(n)]
        need_a, need_w = any(ctx.needs_input_grad[6:6 + n]), any(ctx.needs_input_grad[6 + n:6 + 2 * n])
        comm = ctx.comm or current_comm()
        # The same order on every rank: w's fetch, then a's.
        w_used = _refetch(comm, w_own, ctx.fetch[1]) if need_a else None
        a_used = _refetch(comm, a_own, ctx.fetch[0]) if need_w else None
        grad_a = ([kernel.grad_input(g, w.to(g.dtype)).to(a.dtype) for g, w, a in zip(grads, w_used, a_own)]
                  if need_a else [None] * n)
        grad_w = ([kernel.grad_weight(g, a.to(g.dtype)).to(w.dtype) for g, a, w in zip(grads, a_used, w_own)]
                  if need_w else [None] * n)
        return (None,) * 6 + (*grad_a, *grad_w) + (None,) * (n + n * parts)


def _compact(own: torch.Tensor) -> torch.Tensor:
    """`own`, or a copy of it where it is a block cut out of a larger computed tensor (a weight
    gathered into another layout and sliced: a tied embedding's weight in its head's layout): saved
    as a view, it would keep the whole larger tensor for backward. A block of a parameter (a leaf
    under its views) stays a view: the parameter is kept anyway."""
    base = own._base
    if base is None or base.is_leaf or base.untyped_storage().nbytes() <= own.numel() * own.element_size():
        return own
    return own.clone()


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
