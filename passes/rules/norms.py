"""Placement rules of normalisations: layer_norm and rms_norm keep their
input's layout; a split normalised dim is reduced by all-reduce in the
lowering, and the affine parameters are split like the normalised dims.

batch_norm keeps its input's splits too (partial sums are resolved by
channels): its affine parameters and running statistics are split like
the channels (dim 1), and in training the per-channel statistics over the
other dims are all-reduced along the axes that split those (the lowering).
"""

from __future__ import annotations

from torch.fx import Node

from passes.rules.common import R, Decision, aten, layout_of, shape_of, without_partial
from passes.rules.convolutions import channels_layout
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


def place_batch_norm(node: Node, ctx) -> Decision:
    """batch_norm(x, weight, bias, running_mean, running_var, ...): per channel (dim 1).
    Running statistics that already have a layout keep it (they are updated in place)."""
    x, running = node.args[0], node.args[3]
    layout = channels_layout(ctx, x, 1)
    fixed = ctx.layout(running) if isinstance(running, Node) else None
    if fixed is not None:
        layout = Layout(*(_channel_split(p, f) for p, f in zip(layout.placements, fixed.placements)))
    per_channel = Layout(*(Shard(0, p.groups) if isinstance(p, Shard) and p.dim == 1 else R for p in layout.placements))
    args = {x: layout}
    for vector in node.args[1:5]:
        if isinstance(vector, Node):
            args[vector] = per_channel
    return Decision(args, layout)


def _channel_split(x_placement, vector_placement):
    """x's placement on an axis where a per-channel vector has `vector_placement`."""
    if isinstance(vector_placement, Shard):
        return Shard(1, vector_placement.groups)
    return R if isinstance(x_placement, Shard) and x_placement.dim == 1 else x_placement


NORM_RULES = {
    aten.batch_norm.default: place_batch_norm,
    aten.layer_norm.default: place_norm,
    aten.rms_norm.default: place_norm,
}
