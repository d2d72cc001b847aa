"""Gradient buckets: the gradient all-reduces of replicated parameters, many per collective.

A parameter replicated over a mesh axis gets on each rank the gradient of
that rank's share of the work; the sum over the axis is its gradient. One
all-reduce per parameter and axis pays one collective's latency per
parameter. `grad_bucket` (a graph target, placed by `tess_compile.passes.grad_buckets`)
is the identity on a list of parameters; its backward, which autograd runs
once the gradients of all of them are known, concatenates them and runs one
all-reduce per axis and dtype (the members replicated over that axis), as
DistributedDataParallel's buckets do. A member that does not require grad
is left out at run time; one that backward does not reach (a parameter of
an output the loss does not use) is reduced as zeros, so that every rank
runs the same collectives, and keeps no gradient (None), as in PyTorch. Works on lists of per-rank tensors, as
`tess_compile.ops.split_norm`. The copies that pack and unpack a bucket are the
collective's own work, as a communicator's internal copies are: `packing()`
tells the cost model not to price them as kernels.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from tess_compile.core.mesh import AXES
from tess_compile.ops.collectives import Comm, active_comm, current_comm, use_comm

__all__ = ["bucket_groups", "grad_bucket", "lockstep_bucket", "packing"]

_PACKING: contextvars.ContextVar[bool] = contextvars.ContextVar("tess_bucket_packing", default=False)


def packing() -> bool:
    """Whether a bucket is packing, reducing or unpacking gradients now."""
    return _PACKING.get()


@contextlib.contextmanager
def _packing():
    token = _PACKING.set(True)
    try:
        yield
    finally:
        _PACKING.reset(token)


def bucket_groups(axes: tuple, dtypes: list, needed: list) -> list[tuple[str, list[int]]]:
    """`(axis, members)` for each all-reduce of a bucket, in the order it runs them: per mesh
    axis, the members replicated over it that need a gradient, one group per dtype.
    `axes[m]` are member m's replica axes; `dtypes[m]` its dtype; `needed[m]` whether it
    requires grad."""
    groups = []
    for axis in AXES:
        members = [m for m, member_axes in enumerate(axes) if axis in member_axes and needed[m]]
        for dtype in dict.fromkeys(dtypes[m] for m in members):
            groups.append((axis, [m for m in members if dtypes[m] == dtype]))
    return groups


class _GradBucket(torch.autograd.Function):
    """Identity on every member of every rank (flat, member-major: `m * num_ranks + r`);
    backward all-reduces the members' gradients in the groups of `bucket_groups`."""

    @staticmethod
    def forward(ctx, comm, axes, num_ranks, *tensors):
        ctx.comm, ctx.axes, ctx.num_ranks = comm, axes, num_ranks
        ctx.dtypes = [tensors[m * num_ranks].dtype for m in range(len(axes))]
        ctx.like = [(t.shape, t.dtype, t.device) for t in tensors]  # for the zeros of unreached members
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.num_ranks
        needed = [ctx.needs_input_grad[3 + m * n] for m in range(len(ctx.axes))]
        reached = [g is not None for g in grads]
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                 for g, (shape, dtype, device) in zip(grads, ctx.like)]
        comm = ctx.comm or current_comm()
        with use_comm(comm, phase="backward"), _packing():
            for axis, members in bucket_groups(ctx.axes, ctx.dtypes, needed):
                flats = [torch.cat([grads[m * n + r].reshape(-1) for m in members]) for r in range(n)]
                flats = comm.run_all("all_reduce", flats, axis)
                for r, flat in enumerate(flats):
                    pieces = flat.split([grads[m * n + r].numel() for m in members])
                    for m, piece in zip(members, pieces):
                        grads[m * n + r] = piece.view_as(grads[m * n + r])
        kept = (g if needed[index // n] and reached[index] else None for index, g in enumerate(grads))
        return (None, None, None, *kept)


def lockstep_bucket(comm: Comm, xs: list[list[torch.Tensor]], axes: tuple) -> list[tuple[torch.Tensor, ...]]:
    """`grad_bucket` over lists of per-rank tensors (the simulator's lockstep): `xs[m][r]`
    is member m on rank r; returns each rank's tuple of members."""
    num_ranks = len(xs[0])
    out = _GradBucket.apply(comm, axes, num_ranks, *(x for member in xs for x in member))
    return [tuple(out[m * num_ranks + r] for m in range(len(xs))) for r in range(num_ranks)]


def grad_bucket(xs: list[torch.Tensor], axes: tuple) -> tuple[torch.Tensor, ...]:
    """This rank's parameters `xs` as they are (a graph target); in backward their gradients
    are all-reduced over `axes[m]` (member m's replica axes), a few members per collective."""
    return lockstep_bucket(active_comm(), [[x] for x in xs], axes)[0]


grad_bucket._opname = "grad_bucket"
