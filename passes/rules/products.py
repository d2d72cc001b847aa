"""Placement rules of matrix products: `x @ W` by a weight (Tesseract's SUMMA,
or each mode's own scheme through `weight_product_rules`) and batched
products of two activations.

x's rows are split over depth and row, its features over col; W's in
features over row and out features over col, replicated over depth. A weight
already laid out the other way round runs as `A @ B^T`. A narrow projection
whose out features do not divide by q (grouped-query key/value heads) keeps
its output whole over col.
"""

from __future__ import annotations

import warnings

from torch.fx import Node

from passes.rules.common import (
    P,
    R,
    Decision,
    aten,
    check_divisible,
    display_name,
    get_arg,
    is_param,
    layout_of,
    place_replicated,
    shape_of,
    without_partial,
)
from passes.rules.pointwise import align, aligned
from tess_compile.layout import Layout, Placement, Shard
from tess_compile.mesh import AXES

__all__ = ["PRODUCT_RULES", "is_narrow_projection", "uses_summa", "weight_product_rules"]


def is_narrow_projection(x: Node) -> bool:
    """A projection to fewer features than it takes: grouped-query attention's key and
    value heads, whose count need not divide q (they then run replicated)."""
    if x.target is not aten.linear.default:
        return False
    out_features, in_features = shape_of(x.args[1])[:2]
    return out_features < in_features


def _row_block_dim(ctx, x: Node, layout: Layout, axis: str) -> Placement:
    """x's split along depth or row: kept on its leading dim, else dim 0."""
    p = layout.on(axis)
    ndim = len(shape_of(x))
    if isinstance(p, Shard) and p.dim < ndim - 1:
        return p
    if ndim < 2:
        raise ValueError(
            f"{display_name(x)!r} of shape {list(shape_of(x))} feeds a matmul without a batch dim; "
            "Tesseract splits rows over depth and row: give the input a batch dim"
        )
    return Shard(0)


def _place_summa(node: Node, ctx, x: Node, w: Node, bias: Node | None, w_in: int, w_out: int) -> Decision:
    """C = x @ W by Tesseract's algorithms: x rows over depth and row, features over col.

    W takes in features over row and out features over col (`C = A @ B`),
    unless an earlier consumer already laid it out the other way round
    (out over row, in over col): then `C = A @ B^T` uses it as it is.
    """
    mesh = ctx.mesh
    x_layout = without_partial(layout_of(ctx, x))
    ndim = len(shape_of(x))
    col = x_layout.col
    groups_in = col.groups if isinstance(col, Shard) and col.dim == ndim - 1 else 1
    groups_out = ctx.hints.get(node, 1)
    w_layout = ctx.layout(w)
    transposed = (
        w_layout is not None
        and w_layout.depth == R
        and w_layout.col == Shard(w_in, groups_in)
        and isinstance(w_layout.row, Shard)
        and w_layout.row.dim == w_out
    )
    if transposed:
        groups_out = w_layout.row.groups
    in_features, out_features = shape_of(w)[w_in], shape_of(w)[w_out]
    fix = f"use sizes that are multiples of q={mesh.q} (hidden size, heads, MLP width), or another q"
    check_divisible("in features", w, in_features, mesh.q * groups_in, ctx, fix)
    split_out = transposed or out_features % (mesh.q * groups_out) == 0 or not is_narrow_projection(node)
    if not split_out:
        warnings.warn(
            f"{node.target} with weight {display_name(w)!r} of shape {list(shape_of(w))}: out features "
            f"{out_features} do not divide by q={mesh.q} on mesh {mesh}, so its output (e.g. grouped-query "
            "key/value heads) runs replicated over col",
            stacklevel=2,
        )
        return _place_narrow_summa(node, ctx, x, w, bias, w_in, w_out, groups_in)
    check_divisible("out features", w, out_features, mesh.q * groups_out, ctx, fix)
    depth = _row_block_dim(ctx, x, x_layout, "depth")
    row = _row_block_dim(ctx, x, x_layout, "row")
    x_needed = Layout(depth, row, Shard(ndim - 1, groups_in))
    _check_rows(node, x, x_needed, ctx)
    w_needed = w_layout if transposed else Layout(R, Shard(w_in, groups_in), Shard(w_out, groups_out))
    args = {x: x_needed, w: w_needed}
    if bias is not None:
        args[bias] = Layout(R, R, Shard(0, groups_out))
    return Decision(args, Layout(depth, row, Shard(ndim - 1, groups_out)))


def _place_narrow_summa(node: Node, ctx, x: Node, w: Node, bias, w_in: int, w_out: int, groups_in: int) -> Decision:
    """x @ W with W's out features whole on every column: each column computes the
    whole output of its rows (the same SUMMA steps; the output is replicated over col)."""
    x_layout = without_partial(layout_of(ctx, x))
    ndim = len(shape_of(x))
    depth = _row_block_dim(ctx, x, x_layout, "depth")
    row = _row_block_dim(ctx, x, x_layout, "row")
    x_needed = Layout(depth, row, Shard(ndim - 1, groups_in))
    _check_rows(node, x, x_needed, ctx)
    args = {x: x_needed, w: Layout(R, Shard(w_in, groups_in), R)}
    if bias is not None:
        args[bias] = Layout.replicated()
    return Decision(args, Layout(depth, row, R))


def _check_rows(node: Node, x: Node, layout: Layout, ctx) -> None:
    local = list(shape_of(x))
    for axis in ("depth", "row"):
        p = layout.on(axis)
        parts = ctx.mesh.size(axis)
        if local[p.dim] % parts:
            raise ValueError(
                f"{node.target} input {display_name(x)!r} of shape {list(shape_of(x))}: dim {p.dim} "
                f"is not divisible by d*q = {ctx.mesh.d * ctx.mesh.q} on mesh {ctx.mesh}; "
                f"use a batch that is a multiple of {ctx.mesh.d * ctx.mesh.q}"
            )
        local[p.dim] //= parts


def uses_summa(node: Node) -> bool:
    """Whether a matmul-like node multiplies by a 2-D parameter (Tesseract's SUMMA)."""
    if node.target is aten.linear.default:
        return True
    if node.target is aten.addmm.default:
        plain = get_arg(node, 3, "beta", 1) == 1 and get_arg(node, 4, "alpha", 1) == 1
        return plain and is_param(node.args[2])
    weight = node.args[1]
    return _is_weight(weight) and len(shape_of(weight)) == 2


def _is_weight(node: Node) -> bool:
    """A parameter, or a transpose of one (`x @ W.T`)."""
    while node.op == "call_function" and node.target in (aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default):
        node = node.args[0]
    return is_param(node)


def weight_product_rules(place_product) -> dict:
    """The rules of the ops that may multiply by a weight, given how a mode places
    `x @ W`: `place_product(node, ctx, x, w, bias, w_in, w_out)`. Products of two
    activations are batched matmuls; addmm by a non-parameter runs replicated."""

    def place_linear(node: Node, ctx) -> Decision:
        return place_product(node, ctx, node.args[0], node.args[1], get_arg(node, 2, "bias"), w_in=1, w_out=0)

    def place_addmm(node: Node, ctx) -> Decision:
        if not uses_summa(node):
            return place_replicated(node, ctx)
        bias, x, w = node.args[:3]
        return place_product(node, ctx, x, w, bias, w_in=0, w_out=1)

    def place_matmul(node: Node, ctx) -> Decision:
        a, b = node.args[:2]
        if uses_summa(node):
            return place_product(node, ctx, a, b, None, w_in=0, w_out=1)
        if len(shape_of(a)) < 2 or len(shape_of(b)) < 2:
            return place_replicated(node, ctx)
        return _place_batched_matmul(node, ctx, a, b)

    return {
        aten.linear.default: place_linear,
        aten.addmm.default: place_addmm,
        aten.matmul.default: place_matmul,
        aten.mm.default: place_matmul,
        aten.bmm.default: place_matmul,
    }


def _place_batched_matmul(node: Node, ctx, a: Node, b: Node, partial: bool = True) -> Decision:
    """Activation @ activation: batch dims aligned, m or n kept split, k split -> partial
    (with `partial=False`, k is gathered instead)."""
    out_shape = shape_of(node)
    n_out = len(out_shape)
    batch = tuple(range(n_out - 2))
    required, out = align(ctx, node, [a, b], out_shape, frozen=(n_out - 2, n_out - 1))
    la, lb = without_partial(layout_of(ctx, a)), without_partial(layout_of(ctx, b))
    nda, ndb = len(shape_of(a)), len(shape_of(b))
    for index, axis in enumerate(AXES):
        if out[index] != R and isinstance(out[index], Shard) and out[index].dim in batch:
            continue
        pa, pb = la.on(axis), lb.on(axis)
        if isinstance(pa, Shard) and pa.dim == nda - 2:
            pair, out[index] = (pa, R), Shard(n_out - 2, pa.groups)
        elif isinstance(pb, Shard) and pb.dim == ndb - 1:
            pair, out[index] = (R, pb), Shard(n_out - 1, pb.groups)
        elif partial and isinstance(pa, Shard) and pa.dim == nda - 1 and pb in (Shard(ndb - 2, pa.groups), R):
            pair, out[index] = (pa, Shard(ndb - 2, pa.groups)), P  # a whole b is sliced for free
        elif partial and isinstance(pb, Shard) and pb.dim == ndb - 2 and pa == R:
            pair, out[index] = (Shard(nda - 1, pb.groups), pb), P
        else:
            pair, out[index] = (R, R), R
        required[a] = required[a].with_axis(axis, pair[0])
        required[b] = required[b].with_axis(axis, pair[1])
    return Decision(required, Layout(*out))


def place_baddbmm(node: Node, ctx) -> Decision:
    """beta * input + alpha * (batch1 @ batch2): the batched matmul without partial sums
    (input is added once), input split as the output (an ALiBi bias over heads)."""
    bias, a, b = node.args[:3]
    decision = _place_batched_matmul(node, ctx, a, b, partial=False)
    placements = [aligned(p, shape_of(bias), shape_of(node)) for p in decision.out.placements]
    decision.args[bias] = Layout(*placements)
    return decision


PRODUCT_RULES = {
    **weight_product_rules(_place_summa),
    aten.baddbmm.default: place_baddbmm,
}
