"""Placement rules of reductions and of ops along dims (softmax, cumsum, tril,
pad, diff).

A sum or mean over a split dim leaves partial sums (the consumer reduces
them); the other ops need the dims they work along whole on every rank.
"""

from __future__ import annotations

from torch.fx import Node

from passes.rules.common import P, Decision, aten, dim_arg, dims_local, get_arg, layout_of, normalize_dim, shape_of
from tess_compile.layout import Layout, Shard

__all__ = ["REDUCTION_RULES"]


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


REDUCTION_RULES = {
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
