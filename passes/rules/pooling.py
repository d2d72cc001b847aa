"""Placement rules of pooling (max, average, adaptive; 1-, 2- and 3-d) and
of upsampling (nearest, linear, bilinear, bicubic, trilinear): each channel
plane is pooled or resized on its own, so batch and channel splits stay and
the spatial dims are whole (their sizes and scales are global, and stay so). The batch is
split over depth and row as a convolution's is; partial sums (a row-parallel conv's output) are resolved
by channels.
"""

from __future__ import annotations

from torch.fx import Node

from tess_compile.passes.rules.common import R, aten, batch_placements, channels_layout, shape_of
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Shard

__all__ = ["FAMILY", "PLACEMENT", "pooling"]


def pooling(num_spatial: int, num_outputs: int = 1):
    """Rule of a pooling over the last `num_spatial` dims returning `num_outputs`
    tensors laid out alike (values, and indices within each plane)."""

    def rule(node: Node, ctx) -> Decision:
        x = node.args[0]
        ndim = len(shape_of(x))
        channel_dim = ndim - num_spatial - 1
        layout = channels_layout(ctx, x, channel_dim)
        placements = [R if isinstance(p, Shard) and p.dim > channel_dim else p for p in layout.placements]
        if channel_dim == 1:
            placements[:2] = batch_placements(ctx, Layout(*placements), shape_of(x)[0])
        needed = Layout(*placements)
        return Decision({x: needed}, needed if num_outputs == 1 else (needed,) * num_outputs)

    return rule


PLACEMENT = {
    aten.max_pool1d.default: pooling(1),
    aten.max_pool2d.default: pooling(2),
    aten.max_pool3d.default: pooling(3),
    aten.max_pool1d_with_indices.default: pooling(1, 2),
    aten.max_pool2d_with_indices.default: pooling(2, 2),
    aten.max_pool3d_with_indices.default: pooling(3, 2),
    aten.avg_pool1d.default: pooling(1),
    aten.avg_pool2d.default: pooling(2),
    aten.avg_pool3d.default: pooling(3),
    aten.adaptive_avg_pool1d.default: pooling(1),
    aten.adaptive_avg_pool2d.default: pooling(2),
    aten.adaptive_avg_pool3d.default: pooling(3),
    aten.adaptive_max_pool1d.default: pooling(1, 2),
    aten.adaptive_max_pool2d.default: pooling(2, 2),
    aten.adaptive_max_pool3d.default: pooling(3, 2),
}

# Upsampling ops by their number of spatial dims.
_UPSAMPLING = {
    1: ("upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_linear1d"),
    2: ("upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bilinear2d", "upsample_bicubic2d",
        "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"),
    3: ("upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_trilinear3d"),
}
PLACEMENT.update({
    getattr(getattr(aten, name), overload): pooling(num_spatial)
    for num_spatial, names in _UPSAMPLING.items() for name in names for overload in ("default", "vec")
})

FAMILY = Family("pooling", PLACEMENT)
