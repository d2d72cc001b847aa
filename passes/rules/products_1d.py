"""Mode "1d" (Megatron-LM) placement of a product by a weight, for the products
family (`passes/rules/products.py`, which holds its tables and lowering).

All `p` ranks lie on the col axis. A linear whose input is whole is
column-parallel: its weight's out features are split over col and so is its
output, with no communication. A linear whose input has its features split is
row-parallel: its weight's in features are split, and each rank's product is a
partial sum over col that the consumer needing the whole value (the residual
add) all-reduces; the bias is added on the rank at col 0 only. One that widens
(a vocabulary head after a split LayerNorm) is column-parallel instead:
gathering its input is cheaper than all-reducing its output, and the loss
takes the logits split. Backward needs no rule of its own: the adjoint of the
all-reduce is the all-reduce of the gradient (Megatron's "f" and "g"
operators, docs/gradients.md).
"""

from __future__ import annotations

import warnings

from torch.fx import Node

from tess_compile.core.layout import Layout, Shard
from tess_compile.passes.rules.common import (
    WHOLE,
    P,
    R,
    check_divisible,
    display_name,
    is_narrow_projection,
    layout_of,
    shape_of,
    without_partial,
)
from tess_compile.passes.rules.family import Decision

__all__ = ["place_parallel_linear"]


def _split_last(layout: Layout, ndim: int) -> Shard | None:
    """The split of the last dim over col, if any."""
    col = layout.col
    return col if isinstance(col, Shard) and col.dim == ndim - 1 else None


def _widens(node: Node, ctx, w: Node, w_in: int, w_out: int) -> bool:
    """Whether a product has more out features than in features, split over col (in groups, evenly)."""
    num_in, num_out = shape_of(w)[w_in], shape_of(w)[w_out]
    groups = ctx.hints.get(node, 1)
    return num_out > num_in and (groups == 1 or num_out % (ctx.mesh.size("col") * groups) == 0)


def place_parallel_linear(node: Node, ctx, x: Node, w: Node, bias: Node | None, w_in: int, w_out: int) -> Decision:
    """x @ W row-parallel if W's in features are split over col, or if W is free, x's
    features are split and the product does not widen; else column-parallel (a
    widening product, such as a vocabulary head after a split LayerNorm, gathers
    x rather than all-reducing its wider output); see the module docstring."""
    ndim = len(shape_of(x))
    x_split = _split_last(without_partial(layout_of(ctx, x)), ndim)
    w_layout = ctx.layout(w)
    parts = ctx.mesh.size("col")
    fix = f"make each group a multiple of p={parts} in size (a fused projection's parts), or use another p"
    if w_layout is not None:
        row_parallel = isinstance(w_layout.col, Shard) and w_layout.col.dim == w_in
    else:
        row_parallel = x_split is not None and not _widens(node, ctx, w, w_in, w_out)
    if row_parallel:
        groups = w_layout.col.groups if w_layout is not None else x_split.groups
        check_divisible(node, "in features", w, shape_of(w)[w_in], parts, groups, ctx, fix)
        args = {x: Layout(R, R, Shard(ndim - 1, groups)), w: w_layout or Layout(R, R, Shard(w_in, groups))}
        if bias is not None:
            args[bias] = WHOLE
        return Decision(args, Layout(R, R, P))
    return _place_column_parallel(node, ctx, x, w, bias, w_out, w_layout, fix)


def _place_column_parallel(node: Node, ctx, x: Node, w: Node, bias, w_out: int, w_layout, fix: str) -> Decision:
    ndim = len(shape_of(x))
    parts = ctx.mesh.size("col")
    groups = w_layout.col.groups if w_layout is not None and isinstance(w_layout.col, Shard) else ctx.hints.get(node, 1)
    out_features = shape_of(w)[w_out]
    narrow = w_layout is None and out_features % (parts * groups) and is_narrow_projection(node)
    whole_weight = w_layout == WHOLE or narrow
    if whole_weight:
        if w_layout is None:
            warnings.warn(
                f"{node.target} with weight {display_name(w)!r} of shape {list(shape_of(w))}: out features "
                f"{out_features} do not divide by p={parts} on mesh {ctx.mesh}, so it runs whole on every rank",
                stacklevel=2,
            )
        args = {x: WHOLE, w: WHOLE}
        if bias is not None:
            args[bias] = WHOLE
        return Decision(args, WHOLE)
    check_divisible(node, "out features", w, out_features, parts, groups, ctx, fix)
    args = {x: WHOLE, w: Layout(R, R, Shard(w_out, groups))}
    if bias is not None:
        args[bias] = Layout(R, R, Shard(0, groups))
    return Decision(args, Layout(R, R, Shard(ndim - 1, groups)))
