"""Placement rules of mixture-of-experts layers with token-choice routing and
static shapes: the router's `topk`, the tokens repeated once per chosen expert
(`repeat_interleave`), each token's expert weights gathered from the stacked
`[E, out, in]` table (`index`); the fused gate/up projection's halves are
`chunk`s, placed as splits (views). The expert products themselves are batched matmuls (`bmm`) of the
gathered weights and the tokens, placed by the product rules.

Tokens stay split as they come (over depth and row in 2.5-D; whole in 1-D).
A free expert table is split over col on the dim that its product contracts
(its in features) and replicated over depth and row: each rank gathers the
weights of its own tokens, its products are partial sums over col, and no
rank repeats another's work. The experts dim stays whole, since any token
may choose any expert.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from tess_compile.passes.rules.common import (
    R,
    aten,
    get_arg,
    layout_of,
    normalize_dim,
    place_replicated,
    shape_of,
    users_past_casts,
    without_partial,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import AXES

__all__ = ["FAMILY", "PLACEMENT", "place_index", "place_repeat_interleave"]

_PRODUCTS = (aten.bmm.default, aten.matmul.default)


def _whole_on(layout: Layout, dim: int) -> Layout:
    """`layout` with `dim` whole and no partial sums."""
    return Layout(*(R if isinstance(p, Shard) and p.dim == dim else p for p in without_partial(layout).placements))


def _along_dim(dim_of):
    """Rule for an op that works along one dim and returns several tensors of the
    input's rank (`topk`): that dim whole, the other splits kept."""

    def rule(node: Node, ctx) -> Decision:
        x = node.args[0]
        needed = _whole_on(layout_of(ctx, x), normalize_dim(dim_of(node), len(shape_of(x))))
        return Decision({x: needed}, tuple(needed for _ in node.meta["val"]))

    return rule


def place_repeat_interleave(node: Node, ctx) -> Decision:
    """Each row repeated `repeats` times along `dim`: a split of `dim` keeps its blocks
    (block b of the output repeats block b of the input). With per-row counts or a
    global `output_size` the dim is whole."""
    x = node.args[0]
    dim = get_arg(node, 2, "dim")
    if dim is None:  # the flattened tensor
        return Decision({x: Layout.replicated()}, Layout.replicated())
    dim = normalize_dim(dim, len(shape_of(x)))
    layout = without_partial(layout_of(ctx, x))
    if get_arg(node, 3, "output_size") is not None:
        layout = _whole_on(layout, dim)
    return Decision({x: layout}, layout)


def _contracted_dim(node: Node) -> int | None:
    """The dim of `node`'s value that its first matmul-like user (past autocast's casts) sums over."""
    ndim = len(shape_of(node))
    for user, taken in users_past_casts(node):
        if user.target in _PRODUCTS and ndim >= 2:
            return ndim - 1 if user.args[0] is taken else ndim - 2
    return None


def _free_table_layout(node: Node, ctx, table: Node, num_ids_dims: int) -> Layout:
    """A free expert table: split over col on the in features its gathered rows are
    multiplied by, if they divide; whole otherwise."""
    contracted = _contracted_dim(node)
    if contracted is None:
        return Layout.replicated()
    dim = contracted - num_ids_dims + 1
    if dim < 1 or shape_of(table)[dim] % ctx.mesh.size("col"):
        return Layout.replicated()
    return Layout(R, R, Shard(dim))


def place_index(node: Node, ctx) -> Decision:
    """`table[ids]` on dim 0: the output `[*ids.shape, *table.shape[1:]]` takes the ids'
    splits and the table's splits of its other dims (the table's dim 0 whole). An
    axis that splits both keeps the ids' split. Other index forms run whole."""
    table, indices = node.args[0], node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], Node) or indices[0].meta["val"].dtype == torch.bool:
        return place_replicated(node, ctx)
    ids = indices[0]
    num_ids_dims = len(shape_of(ids))
    ids_layout = without_partial(layout_of(ctx, ids))
    table_layout = ctx.layout(table)
    if table_layout is None:
        table_layout = _free_table_layout(node, ctx, table, num_ids_dims)
    table_layout = _whole_on(table_layout, 0)
    table_needed, out = [], []
    for axis in AXES:
        p_ids, p_table = ids_layout.on(axis), table_layout.on(axis)
        if isinstance(p_ids, Shard):
            table_needed.append(R)
            out.append(p_ids)
        elif isinstance(p_table, Shard):
            table_needed.append(p_table)
            out.append(Shard(p_table.dim + num_ids_dims - 1, p_table.groups))
        else:
            table_needed.append(R)
            out.append(R)
    return Decision({table: Layout(*table_needed), ids: ids_layout}, Layout(*out))


PLACEMENT = {
    aten.topk.default: _along_dim(lambda node: get_arg(node, 2, "dim", -1)),
    aten.repeat_interleave.self_int: place_repeat_interleave,
    aten.index.Tensor: place_index,
}

FAMILY = Family("experts", PLACEMENT)
