"""Placement rules of normalisations: layer_norm and rms_norm keep their
input's layout; a split normalised dim is reduced by all-reduce in the
lowering, and the affine parameters are split like the normalised dims.
"""

from __future__ import annotations

from torch.fx import Node

from passes.rules.common import R, Decision, aten, layout_of, shape_of, without_partial
from tess_compile.layout import Layout, Shard

__all__ = ["NORM_RULES"]


def place_norm(node: Node, ctx) -> Decision:
    """layer_norm / rms_norm over the last dims; a split normalised dim is reduced by all-reduce."""
    x = node.args[0]
    layout = without_partial(layout_of(ctx, x))
    ndim = len(shape_of(x))
    first = ndim - len(node.args[1])
    affine = Layout(*(Shard(p.dim - first, p.groups) if isinstance(p, Shard) and p.dim >= first else R for p in layout.placements))
    args = {x: layout}
    params = node.args[2:4] if node.target is aten.layer_norm.default else node.args[2:3]
    for param in params:
        if isinstance(param, Node):
            args[param] = affine
    return Decision(args, layout)


NORM_RULES = {
    aten.layer_norm.default: place_norm,
    aten.rms_norm.default: place_norm,
}
