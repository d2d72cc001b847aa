"""Rules of losses: cross-entropy over logits split by rows and classes, never
gathered whole (Optimus 3.2): each rank's log-sum-exp and its part of the
target logit (a one-hot sum) are gathered together, two numbers a row and
rank, in one all-gather per class axis, and combined alike by every rank
(so that `passes/alike_regions.py` can make the gather's backward local where
the loss is the output); rows split over other axes are summed by
all-reduce. Targets are range-checked as torch checks them
(`tess_compile.passes.rules.index_checks`).
"""

from __future__ import annotations

from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import (
    R,
    arg_layout,
    aten,
    block_indices,
    get_arg,
    layout_of,
    lower_default,
    masked_padding,
    place_replicated,
    shape_of,
    without_partial,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.passes.rules.index_checks import check_targets
from tess_compile.core.layout import Layout, Shard
from tess_compile.ops import collectives as c

__all__ = ["FAMILY", "LOWERING", "PLACEMENT", "cross_entropy_is_split", "lower_cross_entropy", "place_cross_entropy"]


def cross_entropy_is_split(node: Node) -> bool:
    """Whether cross_entropy_loss takes the vocab-parallel path: [N, C] logits,
    no class weights, no label smoothing."""
    plain = get_arg(node, 2, "weight") is None and get_arg(node, 5, "label_smoothing", 0.0) == 0.0
    return plain and len(shape_of(node.args[0])) == 2


def place_cross_entropy(node: Node, ctx) -> Decision:
    """Cross-entropy over [N, C] logits split over rows and classes: log-sum-exp and the
    target logit by collectives (Optimus 3.2), never the whole logits on a rank."""
    if not cross_entropy_is_split(node):
        return place_replicated(node, ctx)
    logits, target = node.args[:2]
    layout = without_partial(layout_of(ctx, logits))
    target_layout = Layout(*(p if isinstance(p, Shard) and p.dim == 0 else R for p in layout.placements))
    reduction = get_arg(node, 3, "reduction", 1)
    out = target_layout if reduction == 0 else Layout.replicated()
    return Decision({logits: layout, target: target_layout}, out)


def lower_cross_entropy(b: Builder, node: Node, args, kwargs):
    """-log softmax(x)[target] with the class dim split: each rank's log-sum-exp and
    one-hot sum of its target logits, gathered in one collective per class axis, then
    combined (a log-sum-exp and a sum). Rows split over other axes are summed by
    all-reduce. An uneven class split's padding is -inf in the log-sum-exp, and no
    target picks it."""
    reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
    ignore_index = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    check_targets(b, node, args[1], ignore_index)
    if not cross_entropy_is_split(node):
        return lower_default(b, node, args, kwargs)
    x, target, shape = args[0], args[1], node.args[0].meta["val"].shape
    layout = arg_layout(node, node.args[0])
    x = masked_padding(b, x, shape, layout, 1, float("-inf"))
    class_axes = [a for a in layout.axes_where(Shard, b.mesh) if layout.on(a).dim == 1]
    row_axes = [a for a in layout.axes_where(Shard, b.mesh) if layout.on(a).dim == 0]
    lse = b.call(aten.logsumexp.default, x, [1], True)
    ids = block_indices(b, x, shape[1], layout, 1)  # the class each of this rank's columns stands for
    onehot = b.call(aten.eq.Tensor, b.call(aten.unsqueeze.default, target, 1), ids)
    picked = b.call(aten.sum.dim_IntList, b.call(aten.where.ScalarOther, onehot, x, 0.0), [1], True)
    if class_axes:  # [N, 1, 2]: this rank's log-sum-exp and target logit, gathered together: [N, parts, 2]
        both = b.call(aten.stack.default, [lse, picked], 2)
        for axis in class_axes:
            both = b.split_op(c.all_gather, both, axis, 1, 1)
        lse, picked = b.call(aten.select.int, both, 2, 0), b.call(aten.select.int, both, 2, 1)
    lse = b.call(aten.logsumexp.default, lse, [1])
    picked = b.call(aten.sum.dim_IntList, picked, [1])  # one rank's target logit, the others' zeros
    keep = b.call(aten.ne.Scalar, target, ignore_index)
    per_row = b.call(aten.where.ScalarOther, keep, b.call(aten.sub.Tensor, lse, picked), 0.0)
    if reduction == 0:
        return per_row
    total = _sum_all(b, per_row, row_axes)
    if reduction == 2:
        return total
    count = _sum_all(b, b.call(aten._to_copy.default, keep, dtype=node.meta["val"].dtype), row_axes)
    return b.call(aten.div.Tensor, total, count)


def _sum_all(b: Builder, x: Node, axes) -> Node:
    total = b.call(aten.sum.default, x)
    for axis in axes:
        total = b.collective(c.all_reduce, total, axis)
    return total


PLACEMENT = {
    aten.cross_entropy_loss.default: place_cross_entropy,
}


LOWERING = {aten.cross_entropy_loss.default: lower_cross_entropy}

FAMILY = Family("losses", PLACEMENT, lowering=LOWERING)
