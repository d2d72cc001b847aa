"""Rules of reductions and of ops along dims (softmax, cumsum, tril,
pad, diff).

A sum or mean over a split dim leaves partial sums (the consumer reduces
them); the other ops need the dims they work along whole on every rank. A mean
over a split dim lowers to the local sum over the global count.
"""

from __future__ import annotations

import math

from torch.fx import Node

from passes.builder import Builder
from passes.rules.common import (
    P,
    aten,
    dim_arg,
    dims_local,
    get_arg,
    layout_of,
    lower_default,
    normalize_dim,
    shape_of,
    split_axes,
)
from passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Shard

__all__ = ["FAMILY", "LOWERING", "PLACEMENT", "lower_mean", "place_reduction"]


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


def _padded_dims(node: Node) -> list[int]:
    """aten.pad's `pad` lists (before, after) pairs from the last dim backwards."""
    return [-1 - k for k in range(len(node.args[1]) // 2)]


def lower_mean(b: Builder, node: Node, args, kwargs):
    """Mean over a split dim: local sum over the global count gives partial sums."""
    x = node.args[0]
    ndim = x.meta["val"].dim()
    dims = list(range(ndim)) if node.target is aten.mean.default or not args[1] else [d % ndim for d in args[1]]
    if not split_axes(b, node.meta["arg_layouts"][x], dims):
        return lower_default(b, node, args, kwargs)
    keepdim = node.target is aten.mean.dim and (args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    count = math.prod(x.meta["val"].shape[d] for d in dims)
    total = b.call(aten.sum.dim_IntList, args[0], dims, keepdim)
    return b.call(aten.div.Tensor, total, count)


PLACEMENT = {
    aten.sum.dim_IntList: place_reduction,
    aten.mean.dim: place_reduction,
    aten.sum.default: place_reduction,
    aten.mean.default: place_reduction,
    aten.softmax.int: dims_local(dim_arg),
    aten._softmax.default: dims_local(dim_arg),
    aten.log_softmax.int: dims_local(dim_arg),
    aten._log_softmax.default: dims_local(dim_arg),
    aten.cumsum.default: dims_local(dim_arg),
    aten.tril.default: dims_local(_last_two),
    aten.triu.default: dims_local(_last_two),
    aten.pad.default: dims_local(_padded_dims),
    aten.diff.default: dims_local(lambda node: [get_arg(node, 2, "dim", -1)]),
}


LOWERING = {aten.mean.dim: lower_mean, aten.mean.default: lower_mean}

FAMILY = Family("reductions", PLACEMENT, lowering=LOWERING)
