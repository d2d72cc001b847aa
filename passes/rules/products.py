"""Rules of matrix products: `x @ W` by a weight (Tesseract's SUMMA, or each
mode's own scheme through `weight_product_rules`) and batched products of two
activations.

x's rows are split over depth and row, its features over col; W's in
features over row and out features over col, replicated over depth. A weight
already laid out the other way round runs as `A @ B^T`. A narrow projection
whose out features do not divide by q (grouped-query key/value heads) keeps
its output whole over col. The lowering runs `x @ W` by the algorithm its
weight's layout calls for, in the builder's schedule (`tess_compile.passes.summa`).

Which rows of x each rank takes is `passes/rules/product_rows.py`'s. Mode "1d"
(Megatron-LM) places its products column- or row-parallel
(`passes/rules/products_1d.py`); a row-parallel product's partial output
adds its bias on the rank at col 0 only, as a weight-stationary one does.
"""

from __future__ import annotations

import warnings

from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from tess_compile.core.dynamic import concrete
from tess_compile.core.layout import Layout, Partial, Shard
from tess_compile.core.mesh import AXES
from tess_compile.core.meta_keys import ARG_LAYOUTS, LAYOUT
from tess_compile.ops import collectives as c
from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import (
    WHOLE,
    P,
    R,
    align,
    aligned,
    arg_layout,
    aten,
    check_divisible,
    display_name,
    get_arg,
    is_narrow_projection,
    is_param_or_transpose,
    layout_of,
    lower_default,
    place_replicated,
    shape_of,
    uses_summa,
    without_partial,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.passes.rules.product_rows import row_blocks, rows_whole, rows_whole_over_row
from tess_compile.passes.rules.products_1d import place_parallel_linear
from tess_compile.passes.summa import matmul
from tess_compile.ops.fetched_product import fetched_product

__all__ = [
    "FAMILY",
    "LOWERING",
    "LOWERING_1D",
    "PLACEMENT",
    "PLACEMENT_1D",
    "lower_addmm",
    "lower_linear",
    "lower_matmul",
    "place_baddbmm",
    "weight_product_rules",
]


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
    stationary = rows_whole_over_row(ctx, x, x_layout)
    if w_layout is None:  # free: rows whole over row take x's features over col as they come (A @ B^T)
        splits = shape_of(w)[w_out] % (mesh.q * groups_out) == 0
        transposed = stationary and splits and isinstance(col, Shard) and col.dim == ndim - 1
    else:
        transposed = (
            w_layout.depth == R
            and w_layout.col == Shard(w_in, groups_in)
            and isinstance(w_layout.row, Shard)
            and w_layout.row.dim == w_out
        )
    if transposed and w_layout is not None:
        groups_out = w_layout.row.groups
    in_features, out_features = shape_of(w)[w_in], shape_of(w)[w_out]
    fix = f"make each group a multiple of q={mesh.q} in size (a fused projection's parts), or use another q"
    check_divisible(node, "in features", w, in_features, mesh.q, groups_in, ctx, fix)
    split_out = transposed or out_features % (mesh.q * groups_out) == 0 or not is_narrow_projection(node)
    if not split_out:
        warnings.warn(
            f"{node.target} with weight {display_name(w)!r} of shape {list(shape_of(w))}: out features "
            f"{out_features} do not divide by q={mesh.q} on mesh {mesh}, so its output (e.g. grouped-query "
            "key/value heads) runs replicated over col",
            stacklevel=2,
        )
        return _place_narrow_summa(node, ctx, x, w, bias, w_in, w_out, groups_in)
    check_divisible(node, "out features", w, out_features, mesh.q, groups_out, ctx, fix)
    if stationary:
        return _place_stationary(x, w, bias, w_in, w_out, x_layout, (groups_in, groups_out), transposed)
    rows = row_blocks(node, ctx, x, x_layout)
    if rows is None:
        return rows_whole(node, ctx, x, w, bias, w_out)
    x_needed = Layout(*rows, Shard(ndim - 1, groups_in))
    w_needed = w_layout if transposed else Layout(R, Shard(w_in, groups_in), Shard(w_out, groups_out))
    args = {x: x_needed, w: w_needed}
    if bias is not None:
        args[bias] = Layout(R, R, Shard(0, groups_out))
    return Decision(args, Layout(*rows, Shard(ndim - 1, groups_out)))


def _place_stationary(x: Node, w: Node, bias, w_in: int, w_out: int, x_layout: Layout, groups: tuple[int, int],
                      transposed: bool) -> Decision:
    """x @ W with the weight block kept where it is and x moved (Pope et al.'s weight-stationary
    layout): for rows that stay whole over row, such as a decode step's few tokens.

    Each rank multiplies x's features of its weight block's in features by the block, a partial
    sum over the axis that splits the in features: over row for W laid out as Tesseract's B (the
    output's features over col), over col for W laid out the other way round (over row). The
    rows keep their split over depth. The consumer that needs the sum reduces it (the rewrite's
    all-reduce); the bias is added on one rank of that axis (`_bias_once`).
    """
    ndim = len(shape_of(x))
    groups_in, groups_out = groups
    row = x_layout.row
    if not transposed and isinstance(row, Shard) and row.dim == ndim - 1:
        groups_in = row.groups  # x's features over row, as an A @ B^T product leaves them
    depth = x_layout.depth if isinstance(x_layout.depth, Shard) and x_layout.depth.dim < ndim - 1 else R
    if transposed:
        w_layout = Layout(R, Shard(w_out, groups_out), Shard(w_in, groups_in))
        args = {x: Layout(depth, R, Shard(ndim - 1, groups_in)), w: w_layout}
        out = Layout(depth, Shard(ndim - 1, groups_out), P)
        bias_layout = Layout(R, Shard(0, groups_out), R)
    elif groups_out is None:  # a narrow projection: out features whole on every column
        args = {x: Layout(depth, Shard(ndim - 1, groups_in), R), w: Layout(R, Shard(w_in, groups_in), R)}
        out, bias_layout = Layout(depth, P, R), WHOLE
    else:
        args = {x: Layout(depth, Shard(ndim - 1, groups_in), R), w: Layout(R, Shard(w_in, groups_in), Shard(w_out, groups_out))}
        out, bias_layout = Layout(depth, P, Shard(ndim - 1, groups_out)), Layout(R, R, Shard(0, groups_out))
    if bias is not None:
        args[bias] = bias_layout
    return Decision(args, out)


def _place_narrow_summa(node: Node, ctx, x: Node, w: Node, bias, w_in: int, w_out: int, groups_in: int) -> Decision:
    """x @ W with W's out features whole on every column: each column computes the
    whole output of its rows (the same SUMMA steps; the output is replicated over col)."""
    x_layout = without_partial(layout_of(ctx, x))
    ndim = len(shape_of(x))
    if rows_whole_over_row(ctx, x, x_layout):
        return _place_stationary(x, w, bias, w_in, w_out, x_layout, (groups_in, None), transposed=False)
    rows = row_blocks(node, ctx, x, x_layout)
    if rows is None:
        return rows_whole(node, ctx, x, w, bias, w_out)
    x_needed = Layout(*rows, Shard(ndim - 1, groups_in))
    args = {x: x_needed, w: Layout(R, Shard(w_in, groups_in), R)}
    if bias is not None:
        args[bias] = Layout.replicated()
    return Decision(args, Layout(*rows, R))


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
    (with `partial=False`, k is gathered instead).

    A free stack of weights `b` (`[E, k, n]`, dense experts that every token passes
    through) is split where `a` leaves an axis free, as Megatron splits a weight:
    row-parallel (k split, partial output) if `a` comes with k split and the
    product does not widen, column-parallel (n split) otherwise. Its batch dims
    stay whole, so no rank repeats another's products. A free weight on the left
    (`W @ x`, Mamba's `dt_proj.weight @ dt`) has its rows, the output's features,
    split over an axis the batch leaves free; so has `a` where both inputs come
    whole over an axis (keys of fewer heads than ranks in a chunked linear
    attention): its rows are sliced for free, and no rank repeats the product."""
    out_shape = shape_of(node)
    n_out = len(out_shape)
    batch = tuple(range(n_out - 2))
    required, out = align(ctx, node, [a, b], out_shape, frozen=(n_out - 2, n_out - 1))
    la, lb = without_partial(layout_of(ctx, a)), without_partial(layout_of(ctx, b))
    nda, ndb = len(shape_of(a)), len(shape_of(b))
    weights = ndb >= 3 and ctx.layout(b) is None and is_param_or_transpose(b)
    widens = shape_of(b)[-1] > shape_of(b)[-2]
    weight_left = ctx.layout(a) is None and is_param_or_transpose(a)  # W @ x
    rows = shape_of(a)[-2]  # a's rows not split yet; None once an uneven split leaves no other to stack on it
    for index, axis in enumerate(AXES):
        if out[index] != R and isinstance(out[index], Shard) and out[index].dim in batch:
            continue
        pa, pb = la.on(axis), lb.on(axis)
        splits_k = isinstance(pa, Shard) and pa.dim == nda - 1
        parts = ctx.mesh.size(axis)
        whole = pa == R and pb == R and not weights
        if isinstance(pa, Shard) and pa.dim == nda - 2:
            pair, out[index] = (pa, R), Shard(n_out - 2, pa.groups)
            rows = rows // parts if rows is not None and statically_known_true(rows % parts == 0) else None
        elif isinstance(pb, Shard) and pb.dim == ndb - 1:
            pair, out[index] = (R, pb), Shard(n_out - 1, pb.groups)
        elif (parts > 1 and (weight_left or whole) and rows is not None
              and statically_known_true(rows % parts == 0)):  # free if whole
            pair, out[index] = (Shard(nda - 2), R), Shard(n_out - 2)
            rows //= parts
        elif weights and (widens or not splits_k or not partial):
            pair, out[index] = (R, Shard(ndb - 1)), Shard(n_out - 1)
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


def _last_dim(x: Node) -> int:
    return x.meta["val"].dim() - 1


def _weight_layout(node: Node, index: int) -> Layout:
    return arg_layout(node, node.args[index])


def _local_shapes(b: Builder, node: Node, x_index: int, w_index: int) -> tuple:
    """This rank's blocks of a product's input and weight (their example sizes where symbolic)
    and the input's item size, which summa="auto" prices (`tess_compile.passes.summa.matmul`)."""
    x, w = node.args[x_index], node.args[w_index]
    needed = ARG_LAYOUTS.of(node)
    x_val, w_val = x.meta["val"], w.meta["val"]
    return (concrete(needed[x].local_shape(x_val.shape, b.mesh)), concrete(needed[w].local_shape(w_val.shape, b.mesh)),
            x_val.dtype.itemsize)


def _local(node: Node, x_index: int) -> bool:
    """Whether a product takes its input's in features whole on every rank (a table by its weight's
    out features, `rows_whole`): no steps to take, one local kernel."""
    x = node.args[x_index]
    return not any(isinstance(p, Shard) and p.dim == _last_dim(x) for p in arg_layout(node, x).placements)


def lower_linear(b: Builder, node: Node, args, kwargs):
    """A linear (or another product kernel of a weight [out, in], its op's own: `product_table`) by its
    weight's algorithm; one without steps to take (a weight placed whole, an input whole, or any on a
    mesh with q = 1) runs with its bias block in one local linear, one kernel as the unsharded model's.
    (1-D linears lower by `LOWERING_1D`, which keeps the bias in the product too.)"""
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    w_layout = _weight_layout(node, 1)
    if _local(node, 0):
        return b.call(node.target, x, w, bias)
    if bias is not None and (b.mesh.q == 1 or not isinstance(w_layout.row, Shard)):
        return b.call(node.target, x, w, bias)
    y = matmul(b, x, w, w_layout, out_dim=0, product=node.target, a_dim=_last_dim(node.args[0]),
               shapes=_local_shapes(b, node, 0, 1))
    return y if bias is None else b.call(aten.add.Tensor, y, bias)


def lower_matmul(b: Builder, node: Node, args, kwargs):
    if not uses_summa(node) or _local(node, 0):
        return lower_default(b, node, args, kwargs)
    return matmul(b, args[0], args[1], _weight_layout(node, 1), out_dim=1, product=aten.matmul.default,
                  a_dim=_last_dim(node.args[0]), shapes=_local_shapes(b, node, 0, 1))


def lower_addmm(b: Builder, node: Node, args, kwargs):
    if not uses_summa(node) or _local(node, 1):
        return lower_default(b, node, args, kwargs)
    y = matmul(b, args[1], args[2], _weight_layout(node, 2), out_dim=1, product=aten.matmul.default,
               a_dim=_last_dim(node.args[1]), shapes=_local_shapes(b, node, 1, 2))
    return b.call(aten.add.Tensor, y, args[0])


def _partial_axis(node: Node) -> str | None:
    """The axis over which a product's output is a partial sum (row-parallel, or weight-stationary)."""
    return next((axis for axis in AXES if isinstance(LAYOUT.of(node).on(axis), Partial)), None)


def _bias_once(index: int, otherwise=lower_default):
    """Lowering of a product whose bias is argument `index`: a product with a partial output
    (row-parallel, or weight-stationary) runs locally and adds the bias on the rank at
    coordinate 0 of that axis only; any other by `otherwise`."""

    def lower(b: Builder, node: Node, args, kwargs):
        axis = _partial_axis(node)
        if axis is None:
            return otherwise(b, node, args, kwargs)
        if len(args) <= index or args[index] is None:
            return lower_default(b, node, args, kwargs)
        args = list(args)
        args[index] = b.collective(c.keep_first, args[index], axis)
        return b.call(node.target, *args, **kwargs)

    return lower


PLACEMENT = {
    **weight_product_rules(_place_summa),
    aten.baddbmm.default: place_baddbmm,
}


LOWERING = {  # a weight-stationary product (partial output) runs locally, as a row-parallel one does
    aten.linear.default: _bias_once(2, lower_linear),
    aten.matmul.default: _bias_once(2, lower_matmul),
    aten.mm.default: _bias_once(2, lower_matmul),
    aten.bmm.default: _bias_once(2, lower_matmul),
    aten.addmm.default: _bias_once(0, lower_addmm),
}


def _gathered_product(x_index: int, bias_index: int | None, product: str):
    """Lowering of a 1-D column-parallel product (`product` of its input, argument `x_index`, by a weight,
    the argument after it) whose input arrives all-gathered by tokens (sequence parallelism): a
    `fetched_product` that keeps the input's own block of tokens for backward and gathers it again there,
    as Megatron-LM's sequence-parallel linear does, its bias (argument `bias_index`) added after. Any
    other product runs as it is."""

    def lower(b: Builder, node: Node, args, kwargs):
        x, w = args[x_index], args[x_index + 1]
        bias = None if bias_index is None else args[bias_index] if len(args) > bias_index else kwargs.get("bias")
        if b.keep_blocks or not uses_summa(node) or not isinstance(x, Node) or x.target is not c.all_gather:
            return lower_default(b, node, args, kwargs)
        own, axis, *rest = x.args
        y = b.call(fetched_product, x, w, own, w, product, ("all_gather", axis, *rest), None)
        return y if bias is None else b.call(aten.add.Tensor, y, bias)

    return lower


PLACEMENT_1D = weight_product_rules(place_parallel_linear)


LOWERING_1D = {
    aten.linear.default: _bias_once(2, _gathered_product(0, 2, "linear")),
    aten.addmm.default: _bias_once(0, _gathered_product(1, 0, "matmul")),
    aten.matmul.default: _gathered_product(0, None, "matmul"),
    aten.mm.default: _gathered_product(0, None, "matmul"),
    aten.bmm.default: lower_default,
}

FAMILY = Family("products", PLACEMENT, lowering=LOWERING, placement_1d=PLACEMENT_1D, lowering_1d=LOWERING_1D)
