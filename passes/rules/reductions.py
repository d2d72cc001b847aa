"""Rules of reductions and of ops along dims (softmax, tril, diff, argmax and argmin, vector norms;
cumsum, roll and pad are `passes/rules/scans.py`'s).

A sum or mean over a split dim leaves partial sums (the consumer reduces
them); the other ops need the dims they work along whole on every rank. A mean
over a split dim lowers to the local sum over the global count. argmax and
argmin over a split dim keep it split: each rank finds its own best value and
that value's global index, and one all-gather of both per axis picks the
first best (NaN counts as the best, as in torch), so the values are never
gathered whole.
"""

from __future__ import annotations

import math

from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import (
    WHOLE,
    P,
    R,
    arg_layout,
    aten,
    dim_arg,
    dims_local,
    get_arg,
    layout_of,
    lower_default,
    masked_padding,
    normalize_dim,
    shape_of,
    split_axes,
    without_partial,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import AXES
from tess_compile.ops import collectives as c
from tess_compile.ops.local import arange_like

__all__ = [
    "FAMILY", "LOWERING", "PLACEMENT", "lower_arg_reduction", "lower_mean", "place_arg_reduction", "place_reduction",
    "place_vector_norm",
]


def _reduced_dims(node: Node, ndim: int) -> list[int]:
    dims = get_arg(node, 1, "dim") if node.target in (aten.sum.dim_IntList, aten.mean.dim) else None
    if not dims:
        return list(range(ndim))
    return sorted(normalize_dim(d, ndim) for d in dims)


def place_reduction(node: Node, ctx) -> Decision:
    x = node.args[0]
    layout = layout_of(ctx, x)
    ndim = len(shape_of(x))
    dims = _reduced_dims(node, ndim)
    keepdim = node.target in (aten.sum.dim_IntList, aten.mean.dim) and get_arg(node, 2, "keepdim", False)
    out = []
    for p in layout.placements:
        if isinstance(p, Shard) and p.dim in dims:
            out.append(P)
        elif isinstance(p, Shard):
            shift = 0 if keepdim else sum(d < p.dim for d in dims)
            out.append(Shard(p.dim - shift, p.groups))
        else:
            out.append(p)
    return Decision({x: layout}, Layout(*out))


def _last_two(node: Node) -> list[int]:
    return [-2, -1]


def _unpadded(b: Builder, node: Node, x: Node, dims: list[int]) -> Node:
    """`x` with the padding of the reduced dims that are split unevenly set to 0 (it must not count)."""
    val, layout = node.args[0].meta["val"], arg_layout(node, node.args[0])
    for dim in dims:
        x = masked_padding(b, x, val.shape, layout, dim, 0.0)
    return x


def lower_sum(b: Builder, node: Node, args, kwargs):
    """A sum over a split dim gives partial sums as it is, but for an uneven split's padding."""
    dims = _reduced_dims(node, node.args[0].meta["val"].dim())
    return b.call(node.target, _unpadded(b, node, args[0], dims), *args[1:], **kwargs)


def place_arg_reduction(node: Node, ctx) -> Decision:
    """argmax / argmin along `dim`: every split kept, the reduced dim's too where it is even
    (the lowering merges the ranks' candidates; padding could win); the index has the reduced
    dim removed unless keepdim. Without a dim (the flattened tensor) the input is whole."""
    x, dim = node.args[0], get_arg(node, 1, "dim")
    if dim is None:
        return Decision({x: WHOLE}, WHOLE)
    dim = normalize_dim(dim, len(shape_of(x)))
    keepdim = get_arg(node, 2, "keepdim", False)
    layout = without_partial(layout_of(ctx, x))
    if not _evenly_split(layout, dim, shape_of(x)[dim], ctx.mesh):
        layout = Layout(*(R if isinstance(p, Shard) and p.dim == dim else p for p in layout.placements))
    out = [p if not isinstance(p, Shard) else R if p.dim == dim
           else Shard(p.dim - (not keepdim and p.dim > dim), p.groups) for p in layout.placements]
    return Decision({x: layout}, Layout(*out))


def _evenly_split(layout: Layout, dim: int, size: int, mesh) -> bool:
    """Whether every axis that splits `dim` (of `size`) divides its blocks evenly (no padding
    that could win the comparison)."""
    for axis in AXES:
        p = layout.on(axis)
        if isinstance(p, Shard) and p.dim == dim:
            if size % mesh.size(axis):
                return False
            size //= mesh.size(axis)
    return True


def lower_arg_reduction(b: Builder, node: Node, args, kwargs):
    """argmax / argmin over a split dim: the rank's own best value and its global index
    (`_global_positions`), then per splitting axis one all-gather of each and the first
    best of the gathered candidates (`_first_best`)."""
    x_node, dim = node.args[0], get_arg(node, 1, "dim")
    layout = arg_layout(node, x_node)
    ndim = x_node.meta["val"].dim()
    axes = [] if dim is None else split_axes(b, layout, [normalize_dim(dim, ndim)])
    if not axes:
        return lower_default(b, node, args, kwargs)
    dim = normalize_dim(dim, ndim)
    x = b.call(aten.detach.default, args[0])
    local_index = b.call(node.target, x, dim, True)
    value = b.call(aten.gather.default, x, dim, local_index)
    index = b.call(aten.take.default, _global_positions(b, x, layout, dim, x_node.meta["val"].shape[dim]), local_index)
    for axis in axes:
        values = b.split_op(c.all_gather, value, axis, dim, 1)
        indices = b.split_op(c.all_gather, index, axis, dim, 1)
        value, index = _first_best(b, node.target, values, indices, dim, x_node.meta["val"].shape[dim])
    return index if get_arg(node, 2, "keepdim", False) else b.call(aten.squeeze.dim, index, dim)


def _global_positions(b: Builder, x: Node, layout: Layout, dim: int, size: int) -> Node:
    """The global index of each of this rank's entries along `dim`: 0..size-1 split as
    `layout` splits `dim` (axis by axis, left to right, groups included)."""
    positions = b.call(arange_like, x, size)
    for axis in AXES:
        p = layout.on(axis)
        if isinstance(p, Shard) and p.dim == dim:
            positions = b.split_op(c.shard_slice, positions, axis, 0, p.groups)
    return positions


def _first_best(b: Builder, target, values: Node, indices: Node, dim: int, size: int) -> tuple[Node, Node]:
    """The best of the candidates along `dim` (NaN first, as torch's argmax and argmin)
    and, among the candidates that hold it, the smallest global index."""
    best = b.call(aten.amax.default if target is aten.argmax.default else aten.amin.default, values, [dim], True)
    nan_best = b.call(aten.logical_and.default, b.call(aten.isnan.default, values), b.call(aten.isnan.default, best))
    holds = b.call(aten.logical_or.default, b.call(aten.eq.Tensor, values, best), nan_best)
    candidates = b.call(aten.where.ScalarOther, holds, indices, size)
    return best, b.call(aten.amin.default, candidates, [dim], True)


def lower_mean(b: Builder, node: Node, args, kwargs):
    """Mean over a split dim: local sum over the global count gives partial sums."""
    x = node.args[0]
    ndim = x.meta["val"].dim()
    dims = list(range(ndim)) if node.target is aten.mean.default or not args[1] else [d % ndim for d in args[1]]
    if not split_axes(b, arg_layout(node, x), dims):
        return lower_default(b, node, args, kwargs)
    keepdim = node.target is aten.mean.dim and (args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    count = math.prod(x.meta["val"].shape[d] for d in dims)
    total = b.call(aten.sum.dim_IntList, _unpadded(b, node, args[0], dims), dims, keepdim)
    return b.call(aten.div.Tensor, total, count)


def _norm_dims(node: Node) -> list[int]:
    """The dims `linalg_vector_norm(x, ord, dim, keepdim)` reduces (None: all)."""
    dims = get_arg(node, 2, "dim")
    return list(range(len(shape_of(node.args[0])))) if dims is None else [dims] if isinstance(dims, int) else dims


def place_vector_norm(node: Node, ctx) -> Decision:
    """A vector norm (`F.normalize`'s) over dims whole on every rank, other splits kept (shifted past
    the reduced dims unless `keepdim`)."""
    decision = dims_local(_norm_dims)(node, ctx)
    if get_arg(node, 3, "keepdim", False):
        return decision
    x = node.args[0]
    dims = [normalize_dim(d, len(shape_of(x))) for d in _norm_dims(node)]
    out = Layout(*(Shard(p.dim - sum(d < p.dim for d in dims), p.groups) if isinstance(p, Shard) else p
                   for p in decision.out.placements))
    return Decision(decision.args, out)


PLACEMENT = {
    aten.sum.dim_IntList: place_reduction,
    aten.mean.dim: place_reduction,
    aten.sum.default: place_reduction,
    aten.mean.default: place_reduction,
    aten.softmax.int: dims_local(dim_arg),
    aten._softmax.default: dims_local(dim_arg),
    aten.log_softmax.int: dims_local(dim_arg),
    aten._log_softmax.default: dims_local(dim_arg),
    aten.tril.default: dims_local(_last_two),
    aten.triu.default: dims_local(_last_two),
    aten.diff.default: dims_local(lambda node: [get_arg(node, 2, "dim", -1)]),
    aten.argmax.default: place_arg_reduction,
    aten.argmin.default: place_arg_reduction,
    aten.linalg_vector_norm.default: place_vector_norm,
}


LOWERING = {
    aten.mean.dim: lower_mean,
    aten.mean.default: lower_mean,
    aten.sum.dim_IntList: lower_sum,
    aten.sum.default: lower_sum,
    aten.argmax.default: lower_arg_reduction,
    aten.argmin.default: lower_arg_reduction,
}

FAMILY = Family("reductions", PLACEMENT, lowering=LOWERING)
