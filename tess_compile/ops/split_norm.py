"""LayerNorm and RMSNorm over a split hidden dim, saving what torch's own kernels save.

The statistics are computed by graph nodes on a detached input (their
all-reduces are the forward's collectives); `split_norm` then normalises
and keeps only the input, the statistics and the affine weight for
backward. Its backward is paper eq. 13/14: with `g = dy * weight` and
`x_hat` the normalised input, `dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))`
(RMSNorm: no `mean(g)` term), the two sums over the split dim all-reduced
together along its axes, one collective an axis. Works on lists of per-rank tensors, as `tess_compile.ops.fetched_product`.
"""

from __future__ import annotations

import torch

from tess_compile.ops.collectives import Comm, active_comm, current_comm, use_comm

__all__ = ["lockstep_norm", "split_norm"]


def _normalised(x: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor) -> torch.Tensor:
    x = x.to(rstd.dtype)
    return (x if mean is None else x - mean) * rstd


class _SplitNorm(torch.autograd.Function):
    """Per rank r: `x_hat[r] * weight[r] + bias[r]`, in x's dtype. Flat inputs: x, mean,
    rstd, weight, bias, each n entries (None where absent)."""

    @staticmethod
    def forward(ctx, comm, axes, dims, count, n, *tensors):
        xs, means, rstds, weights, biases = (tensors[i * n:(i + 1) * n] for i in range(5))
        ctx.comm, ctx.axes, ctx.dims, ctx.count, ctx.n = comm, axes, dims, count, n
        ctx.has_mean, ctx.has_weight, ctx.has_bias = means[0] is not None, weights[0] is not None, biases[0] is not None
        ctx.save_for_backward(*xs, *rstds, *(means if ctx.has_mean else ()), *(weights if ctx.has_weight else ()))
        outs = []
        for x, mean, rstd, weight, bias in zip(xs, means, rstds, weights, biases):
            y = _normalised(x, mean, rstd)
            y = y if weight is None else y * weight
            y = y if bias is None else y + bias
            outs.append(y.to(x.dtype))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        saved = iter(ctx.saved_tensors)
        xs, rstds, means, weights = ([next(saved) for _ in range(n)] if present else [None] * n
                                     for present in (True, True, ctx.has_mean, ctx.has_weight))
        x_hats = [_normalised(x, mean, rstd) for x, mean, rstd in zip(xs, means, rstds)]
        dys = [g.to(r.dtype) for g, r in zip(grads, rstds)]
        gs = [dy if w is None else dy * w for dy, w in zip(dys, weights)]
        grad_x = [None] * n
        if any(ctx.needs_input_grad[5:5 + n]):
            grad_x = _grad_x(ctx, xs, x_hats, rstds, gs)
        grad_w = [_sum_to(dy * x_hat, w) for dy, x_hat, w in zip(dys, x_hats, weights)] if ctx.has_weight else [None] * n
        grad_b = [_sum_to(dy, w) for dy, w in zip(dys, weights)] if ctx.has_bias else [None] * n
        return (None,) * 5 + (*grad_x, *[None] * (2 * n), *grad_w, *grad_b)


def _grad_x(ctx, xs, x_hats, rstds, gs) -> list[torch.Tensor]:
    """Eq. 13/14: the sums over the split dim of `g * x_hat` (and, with a mean, of `g`), side
    by side along one reduced dim, all-reduced along the norm's axes: one collective an axis."""
    n, dims = ctx.n, ctx.dims
    sums = [(g * x_hat).sum(dims, keepdim=True) for g, x_hat in zip(gs, x_hats)]
    if ctx.has_mean:
        sums = [torch.cat([s, g.sum(dims, keepdim=True)], dims[-1]) for s, g in zip(sums, gs)]
    sums = _all_reduced(ctx, sums)
    grad_x = []
    for r in range(n):
        inner = gs[r] - x_hats[r] * (sums[r].narrow(dims[-1], 0, 1) / ctx.count)
        if ctx.has_mean:
            inner = inner - sums[r].narrow(dims[-1], 1, 1) / ctx.count
        grad_x.append((rstds[r] * inner).to(xs[r].dtype))
    return grad_x


def _sum_to(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return value.sum_to_size(like.shape).to(like.dtype)


def _all_reduced(ctx, values: list[torch.Tensor]) -> list[torch.Tensor]:
    comm = ctx.comm or current_comm()
    with use_comm(comm, phase="backward"):
        for axis in ctx.axes:
            values = comm.run_all("all_reduce", [v.contiguous() for v in values], axis)
    return values


def lockstep_norm(comm: Comm, xs, means, rstds, weights, biases, axes, dims, count) -> list[torch.Tensor]:
    """`split_norm` over lists of per-rank tensors (the simulator's lockstep); `means`,
    `weights` and `biases` may be None."""
    n = len(xs)
    means, weights, biases = ([None] * n if v is None else v for v in (means, weights, biases))
    return list(_SplitNorm.apply(comm, tuple(axes), list(dims), count, n, *xs, *means, *rstds, *weights, *biases))


def split_norm(x, mean, rstd, weight, bias, axes, dims, count) -> torch.Tensor:
    """This rank's normalised `x` (a graph target); see the module docstring. `mean` is
    None for RMSNorm; the statistics were all-reduced along `axes` over `count` elements."""
    wrap = (lambda v: None if v is None else [v])
    return lockstep_norm(active_comm(), [x], wrap(mean), [rstd], wrap(weight), wrap(bias), axes, dims, count)[0]


split_norm._opname = "split_norm"
