"""Placement rules of convolutions: column-parallel over output channels,
batch kept split over depth and row.
"""

from __future__ import annotations

from torch.fx import Node

from passes.rules.common import R, Decision, aten, get_arg, layout_of, shape_of
from tess_compile.layout import Layout, Shard

__all__ = ["CONVOLUTION_RULES"]


def place_conv(node: Node, ctx) -> Decision:
    """convNd(x, W, b): batch kept split over depth and row; out channels over col
    (a column-parallel conv, no communication); x's channels and space whole."""
    x, weight = node.args[:2]
    bias = get_arg(node, 2, "bias")
    x_layout = layout_of(ctx, x)
    batch = [p if isinstance(p, Shard) and p.dim == 0 else R for p in x_layout.placements[:2]]
    split_out = shape_of(weight)[0] % ctx.mesh.size("col") == 0
    col = Shard(0) if split_out else R
    args = {x: Layout(*batch, R), weight: Layout(R, R, col)}
    if isinstance(bias, Node):
        args[bias] = Layout(R, R, col)
    return Decision(args, Layout(*batch, Shard(1) if split_out else R))


CONVOLUTION_RULES = {
    aten.conv1d.default: place_conv,
    aten.conv2d.default: place_conv,
    aten.conv3d.default: place_conv,
}
