"""Rules of mode "1d" (Megatron-LM): the other modes' tables with the ops that
multiply by a weight and the embedding replaced.

All `p` ranks lie on the col axis (depth and row have size 1). Activations
are whole on every rank. A linear whose input is whole is column-parallel:
its weight's out features are split over col and so is its output, with no
communication. A linear whose input has its features split is row-parallel:
its weight's in features are split, and each rank's product is a partial
sum over col; the consumer that needs the whole value (the residual add)
all-reduces it. One that widens (a vocabulary head after a split
LayerNorm) is column-parallel instead: gathering its input is cheaper than
all-reducing its output, and the loss takes the logits split. Attention
between the two runs on the heads of each rank.
A free embedding table is split by vocab over col; each rank looks up the
ids inside its block, and the partial sums are all-reduced by the consumer
(ids outside the table raise IndexError first, as in torch).

Backward needs no rule of its own: the adjoint of the all-reduce is the
all-reduce of the gradient (Megatron's "f" and "g" operators,
docs/gradients.md).
"""

from __future__ import annotations

import warnings

from torch.fx import Node

from passes.builder import Builder, aten
from passes.lowering_rules import LOWERING_RULES, check_lookup_ids, lower_default, masked_lookup
from passes.placement_rules import PLACEMENT_RULES
from passes.rules.common import Decision, check_divisible, display_name, get_arg, layout_of, shape_of, without_partial
from passes.rules.products import is_narrow_projection, weight_product_rules
from tess_compile import collectives as c
from tess_compile.layout import Layout, Partial, Replicate, Shard

__all__ = ["LOWERING_RULES_1D", "PLACEMENT_RULES_1D"]

R, P = Replicate(), Partial()
WHOLE = Layout(R, R, R)


def _split_last(layout: Layout, ndim: int) -> Shard | None:
    """The split of the last dim over col, if any."""
    col = layout.col
    return col if isinstance(col, Shard) and col.dim == ndim - 1 else None


def _widens(node: Node, ctx, w: Node, w_in: int, w_out: int) -> bool:
    """Whether a product has more out features than in features, split evenly over col."""
    num_in, num_out = shape_of(w)[w_in], shape_of(w)[w_out]
    return num_out > num_in and num_out % (ctx.mesh.size("col") * ctx.hints.get(node, 1)) == 0


def _place_parallel_linear(node: Node, ctx, x: Node, w: Node, bias: Node | None, w_in: int, w_out: int) -> Decision:
    """x @ W row-parallel if W's in features are split over col, or if W is free, x's
    features are split and the product does not widen; else column-parallel (a
    widening product, such as a vocabulary head after a split LayerNorm, gathers
    x rather than all-reducing its wider output); see the module docstring."""
    ndim = len(shape_of(x))
    x_split = _split_last(without_partial(layout_of(ctx, x)), ndim)
    w_layout = ctx.layout(w)
    parts = ctx.mesh.size("col")
    fix = f"use sizes that are multiples of p={parts} (hidden size, heads, MLP width), or another p"
    if w_layout is not None:
        row_parallel = isinstance(w_layout.col, Shard) and w_layout.col.dim == w_in
    else:
        row_parallel = x_split is not None and not _widens(node, ctx, w, w_in, w_out)
    if row_parallel:
        groups = w_layout.col.groups if w_layout is not None else x_split.groups
        check_divisible("in features", w, shape_of(w)[w_in], parts * groups, ctx, fix)
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
    whole_weight = w_layout == WHOLE or (w_layout is None and out_features % (parts * groups) and is_narrow_projection(node))
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
    check_divisible("out features", w, out_features, parts * groups, ctx, fix)
    args = {x: WHOLE, w: Layout(R, R, Shard(w_out, groups))}
    if bias is not None:
        args[bias] = Layout(R, R, Shard(0, groups))
    return Decision(args, Layout(R, R, Shard(ndim - 1, groups)))


def _vocab_split(layout: Layout | None) -> bool:
    return layout == Layout(R, R, Shard(0))


def place_embedding_1d(node: Node, ctx) -> Decision:
    """A free table (or one tied to a column-parallel head) split by vocab over col:
    the lookup gives partial sums. Otherwise the table is whole.

    `padding_idx` changes backward only (that row gets no gradient; see
    `masked_lookup`), so it splits too. `scale_grad_by_freq` stays whole: a
    masked lookup sends other blocks' ids to local row 0, which would count
    them. (`max_norm` renorms the table before, replicated, leaving it whole.)"""
    weight, ids = node.args[:2]
    w_layout = ctx.layout(weight)
    vocab = shape_of(weight)[0]
    free = w_layout is None and vocab % ctx.mesh.size("col") == 0
    if not get_arg(node, 3, "scale_grad_by_freq", False) and (free or _vocab_split(w_layout)):
        return Decision({weight: Layout(R, R, Shard(0)), ids: WHOLE}, Layout(R, R, P))
    return Decision({weight: WHOLE, ids: WHOLE}, WHOLE)


PLACEMENT_RULES_1D = {
    **PLACEMENT_RULES,
    **weight_product_rules(_place_parallel_linear),
    aten.embedding.default: place_embedding_1d,
}


# ----------------------------------------------------------------- lowering


def _bias_once(index: int):
    """Lowering of a product whose bias is argument `index`: a row-parallel product
    (partial output) adds the bias on the rank at col 0 only."""

    def lower(b: Builder, node: Node, args, kwargs):
        if not isinstance(node.meta["layout"].col, Partial) or len(args) <= index or args[index] is None:
            return lower_default(b, node, args, kwargs)
        args = list(args)
        args[index] = b.collective(c.keep_first, args[index], "col")
        return b.call(node.target, *args, **kwargs)

    return lower


def lower_embedding_1d(b: Builder, node: Node, args, kwargs):
    check_lookup_ids(b, node, args[1])
    if not _vocab_split(node.meta["arg_layouts"][node.args[0]]) or b.mesh.size("col") == 1:
        return lower_default(b, node, args, kwargs)
    vocab = node.args[0].meta["val"].shape[0]
    return masked_lookup(b, args[0], args[1], vocab, "col", get_arg(node, 2, "padding_idx", -1))


LOWERING_RULES_1D = {
    **LOWERING_RULES,
    aten.linear.default: _bias_once(2),
    aten.addmm.default: _bias_once(0),
    aten.matmul.default: lower_default,
    aten.mm.default: lower_default,
    aten.bmm.default: lower_default,
    aten.embedding.default: lower_embedding_1d,
}
