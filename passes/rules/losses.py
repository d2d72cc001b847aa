"""Placement rules of losses: cross-entropy over logits split by rows and
classes, never gathered whole (Optimus 3.2).
"""

from __future__ import annotations

from torch.fx import Node

from passes.rules.common import R, Decision, aten, get_arg, layout_of, place_replicated, shape_of, without_partial
from tess_compile.layout import Layout, Shard

__all__ = ["LOSS_RULES", "cross_entropy_is_split"]


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


LOSS_RULES = {
    aten.cross_entropy_loss.default: place_cross_entropy,
}
