"""Rules of normalisations: layer_norm and rms_norm keep their input's layout,
and the affine parameters are split like the normalised dims. Over a split
normalised dim the lowering computes the statistics with one collective an
axis (LayerNorm: each rank's mean and centred sum of squares, all-gathered
and merged by Chan et al.'s formula, `_chan_merge`; RMSNorm: an all-reduce of the sum of
squares) and normalises with `tess_compile.ops.split_norm`, which keeps only
x and the statistics for backward.

batch_norm keeps its input's splits too (partial sums are resolved by
channels): its affine parameters and running statistics are split like
the channels (dim 1), and in training the per-channel statistics over the
other dims are all-reduced along the axes that split those (the lowering).

group_norm normalises each sample's groups of channels over the spatial
dims: the batch is split over depth and row (each sample's statistics are
its own), the spatial dims are whole and the channels are split over col.
Where each rank holds whole groups it runs its own groups, locally, as a
grouped conv does; otherwise the per-channel statistics are all-gathered
along col (a few numbers a channel) and merged into the groups' on every rank.

_weight_norm (`torch.nn.utils.weight_norm` and its parametrization: the weight
`v * g / |v|`, recomputed from the parameters v and g each forward) takes the
layout its consumer (a conv or a product) asks of a free weight, so that v is
split as the weight would be (that family's rule, asked through the table:
`PlacementContext.rule`); the norm over split dims is one all-reduce of the
sums of squares per axis.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import (
    R,
    arg_layout,
    aten,
    batch_placements,
    channels_layout,
    get_arg,
    lower_default,
    resolve_partials,
    shape_of,
    split_axes,
    users_past_casts,
    without_partial,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import AXES
from tess_compile.core.meta_keys import LAYOUT
from tess_compile.ops import collectives as c
from tess_compile.ops.split_norm import split_norm

__all__ = [
    "FAMILY",
    "HALF_TYPES",
    "LOWERING",
    "PLACEMENT",
    "lower_batch_norm",
    "lower_group_norm",
    "lower_layer_norm",
    "lower_rms_norm",
    "lower_weight_norm",
    "place_batch_norm",
    "place_group_norm",
    "place_norm",
    "place_weight_norm",
]


def place_norm(node: Node, ctx) -> Decision:
    """layer_norm / rms_norm over the last dims; a split normalised dim is reduced by all-reduce, and
    partial sums are reduce-scattered over the tokens where they can be (`resolve_partials`)."""
    x = node.args[0]
    ndim = len(shape_of(x))
    first = ndim - len(node.args[1])
    layout = resolve_partials(ctx, x, frozen=range(first, ndim))
    affine = Layout(*(Shard(p.dim - first, p.groups) if isinstance(p, Shard) and p.dim >= first else R
                      for p in layout.placements))
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


def _sum_over(b: Builder, x: Node, dims, axes) -> Node:
    total = b.call(aten.sum.dim_IntList, x, dims, True)
    for axis in axes:
        total = b.collective(c.all_reduce, total, axis)
    return total


def _own_statistics(b: Builder, xs: Node, own_mean: Node, dims: list[int], at: int) -> Node:
    """This rank's mean of `xs` over `dims` (`own_mean`) and centred sum of squares M2 over
    them, side by side along dim `at` (a reduced dim, kept)."""
    centred = b.call(aten.sub.Tensor, xs, own_mean)
    own_m2 = b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, centred, centred), dims, True)
    return b.call(aten.cat.default, [own_mean, own_m2], at)


def _chan_merge(b: Builder, means: Node, m2s: Node, at: int, own: int) -> tuple[Node, Node]:
    """The mean and M2 of the parts whose means and M2s (of `own` elements each) lie along dim
    `at`, by Chan et al.'s pairwise formula: `M2 = sum M2_r + own * sum (mean_r - mean)^2`. As
    stable as a two-pass variance; a sum of squares minus a squared sum would cancel."""
    mean = b.call(aten.mean.dim, means, [at], True)
    spread = b.call(aten.sub.Tensor, means, mean)
    between = b.call(aten.mul.Tensor, b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, spread, spread), [at], True),
                     own)
    return mean, b.call(aten.add.Tensor, b.call(aten.sum.dim_IntList, m2s, [at], True), between)


def _mean_and_variance(b: Builder, xs: Node, dims: list[int], axes: list[str], count: int) -> tuple[Node, Node]:
    """Mean and (biased) variance over `dims` of `count` elements, split over `axes`, with one
    collective an axis: each rank's own mean and M2 side by side, all-gathered, then merged
    (`_chan_merge`; every rank holds `count / parts` of them)."""
    parts = math.prod(b.mesh.size(axis) for axis in axes)
    assert count % parts == 0, "placement splits norm dims evenly"
    own = count // parts
    at = dims[-1]  # the statistics lie side by side along one reduced dim (kept, size 1)
    stats = _own_statistics(b, xs, b.call(aten.div.Tensor, b.call(aten.sum.dim_IntList, xs, dims, True), own), dims, at)
    for axis in axes:
        stats = b.split_op(c.all_gather, stats, axis, at, 1)
    means = b.call(aten.slice.Tensor, stats, at, 0, None, 2)
    m2s = b.call(aten.slice.Tensor, stats, at, 1, None, 2)
    mean, m2 = _chan_merge(b, means, m2s, at, own)
    return mean, b.call(aten.div.Tensor, m2, count)


HALF_TYPES = (torch.float16, torch.bfloat16)


def _statistics_input(b: Builder, x: Node, dtype: torch.dtype) -> Node:
    """`x` in the dtype that norm statistics are computed in: half types go up to
    float32, as in torch's kernels; float32 and float64 stay as they are."""
    return b.call(aten.to.dtype, x, torch.float32) if dtype in HALF_TYPES else x


def lower_layer_norm(b: Builder, node: Node, args, kwargs):
    """LayerNorm over a split hidden dim: mean and variance by `_mean_and_variance` (in
    fp32 for half inputs, in the input's dtype otherwise, as torch's own kernel), on the
    detached input; `split_norm` normalises and keeps only x and the statistics."""
    x, shape = args[0], args[1]
    weight, bias = (list(args[2:4]) + [None, None])[:2]
    eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
    ndim = node.args[0].meta["val"].dim()
    dims = list(range(ndim - len(shape), ndim))
    axes = split_axes(b, arg_layout(node, node.args[0]), dims)
    if not axes:
        return lower_default(b, node, args, kwargs)
    count = math.prod(shape)
    xs = _statistics_input(b, b.call(aten.detach.default, x), node.args[0].meta["val"].dtype)
    mean, var = _mean_and_variance(b, xs, dims, axes, count)
    rstd = b.call(aten.rsqrt.default, b.call(aten.add.Tensor, var, eps))
    return b.call(split_norm, x, mean, rstd, weight, bias, tuple(axes), dims, count)


def lower_rms_norm(b: Builder, node: Node, args, kwargs):
    """RMSNorm over a split hidden dim: the sum of squares is all-reduced (in fp32 for
    half inputs, in the input's dtype otherwise) on the detached input; `split_norm`
    normalises and keeps only x and the statistic."""
    x, shape = args[0], args[1]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    eps = args[3] if len(args) > 3 else kwargs.get("eps")
    val = node.args[0].meta["val"]
    dims = list(range(val.dim() - len(shape), val.dim()))
    axes = split_axes(b, arg_layout(node, node.args[0]), dims)
    if not axes:
        return lower_default(b, node, args, kwargs)
    eps = torch.finfo(val.dtype).eps if eps is None else eps
    count = math.prod(shape)
    xs = _statistics_input(b, b.call(aten.detach.default, x), val.dtype)
    squares = b.call(aten.mul.Tensor, xs, xs)
    mean_square = b.call(aten.div.Tensor, _sum_over(b, squares, dims, axes), count)
    rstd = b.call(aten.rsqrt.default, b.call(aten.add.Tensor, mean_square, eps))
    return b.call(split_norm, x, None, rstd, weight, None, tuple(axes), dims, count)


def lower_batch_norm(b: Builder, node: Node, args, kwargs):
    """Training batch norm over dims split on some axes: per-channel mean and variance by
    `_mean_and_variance` (as `lower_layer_norm`'s), `split_norm`
    to normalise, and the running statistics updated in place with the global ones.
    Evaluation, and training with the batch and space whole, run as they are."""
    x, weight, bias, running_mean, running_var, training, momentum, eps = args[:8]
    val = node.args[0].meta["val"]
    dims = [0, *range(2, val.dim())]
    axes = split_axes(b, arg_layout(node, node.args[0]), dims)
    if not training or not axes:
        return lower_default(b, node, args, kwargs)
    count = math.prod(val.shape[d] for d in dims)
    xs = _statistics_input(b, b.call(aten.detach.default, x), val.dtype)
    mean, var = _mean_and_variance(b, xs, dims, axes, count)
    rstd = b.call(aten.rsqrt.default, b.call(aten.add.Tensor, var, eps))
    if running_mean is not None:
        buffer_dtype = node.args[3].meta["val"].dtype
        unbiased = b.call(aten.mul.Tensor, var, count / max(count - 1, 1))
        for running, value in ((running_mean, mean), (running_var, unbiased)):
            value = b.call(aten.to.dtype, b.call(aten.reshape.default, value, [-1]), buffer_dtype)
            b.call(aten.lerp_.Scalar, running, value, momentum)  # (1 - m) * running + m * value
    shape = [-1] + [1] * (val.dim() - 2)  # per-channel vectors broadcast over space
    weight, bias = (v if v is None else b.call(aten.reshape.default, v, shape) for v in (weight, bias))
    return b.call(split_norm, x, mean, rstd, weight, bias, tuple(axes), dims, count)


def place_group_norm(node: Node, ctx) -> Decision:
    """group_norm(x, groups, weight, bias, ...): batch split over depth and row, spatial dims
    whole, channels split over col as they come (partial sums resolved by channels), or
    split there if they are whole and each rank would hold whole groups; the affine
    parameters are split like the channels."""
    x, num_groups = node.args[:2]
    layout = channels_layout(ctx, x, 1)
    col, parts, channels = layout.col, ctx.mesh.size("col"), shape_of(x)[1]
    if not (isinstance(col, Shard) and col.dim == 1 and channels % (col.groups * parts) == 0):
        col = Shard(1) if parts > 1 and channels % parts == 0 and num_groups % parts == 0 else R
    needed = Layout(*batch_placements(ctx, layout, shape_of(x)[0]), col)
    per_channel = Layout(R, R, Shard(0, col.groups) if isinstance(col, Shard) else R)
    args = {x: needed}
    for vector in node.args[2:4]:
        if isinstance(vector, Node):
            args[vector] = per_channel
    return Decision(args, needed)


def _whole_groups(num_groups: int, placement, parts: int) -> bool:
    """Whether each rank's channel blocks under `placement` (on an axis of `parts`) hold whole groups."""
    return not isinstance(placement, Shard) or parts == 1 or num_groups % (placement.groups * parts) == 0


def lower_group_norm(b: Builder, node: Node, args, kwargs):
    """group_norm with channels split over col: each rank's own `groups / parts` groups
    where it holds whole groups; otherwise `_spread_group_norm`."""
    x, num_groups = args[:2]
    weight, bias = (list(args[2:4]) + [None, None])[:2]
    eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
    placement, parts = arg_layout(node, node.args[0]).col, b.mesh.size("col")
    if not (isinstance(placement, Shard) and placement.dim == 1) or parts == 1:
        return lower_default(b, node, args, kwargs)
    if _whole_groups(num_groups, placement, parts):
        return b.call(node.target, x, num_groups // parts, *args[2:], **kwargs)
    return _spread_group_norm(b, node, x, weight, bias, eps, placement)


def _spread_group_norm(b: Builder, node: Node, x: Node, weight, bias, eps, placement) -> Node:
    """group_norm whose groups spread over ranks of col: every rank's per-channel mean and
    centred sum of squares over the spatial dims, all-gathered along col, merged into each
    group's (`_chan_merge`), expanded back to channels and cut to this rank's; differentiated
    through as it is."""
    val = node.args[0].meta["val"]
    batch, channels, num_groups = *arg_layout(node, node.args[0]).local_shape(val.shape, b.mesh)[:2], node.args[1]
    spatial = math.prod(val.shape[2:])
    per_group = val.shape[1] // num_groups
    xs = b.call(aten.reshape.default, _statistics_input(b, x, val.dtype), [batch, channels, spatial])
    stats = _own_statistics(b, xs, b.call(aten.mean.dim, xs, [2], True), [2], 2)
    stats = b.split_op(c.all_gather, stats, "col", 1, placement.groups)
    stats = b.call(aten.reshape.default, stats, [batch, num_groups, per_group, 2])
    means, m2s = (b.call(aten.select.int, stats, 3, i) for i in (0, 1))
    mean, m2 = _chan_merge(b, means, m2s, 2, spatial)
    rstd = b.call(aten.rsqrt.default, b.call(aten.add.Tensor, b.call(aten.div.Tensor, m2, per_group * spatial), eps))
    mean, rstd = (_own_channels(b, v, batch, per_group, placement) for v in (mean, rstd))
    y = b.call(aten.mul.Tensor, b.call(aten.sub.Tensor, xs, mean), rstd)
    y = b.call(aten.reshape.default, y, list(LAYOUT.of(node).local_shape(val.shape, b.mesh)))
    shape = [-1] + [1] * (val.dim() - 2)  # per-channel vectors broadcast over space
    if weight is not None:
        y = b.call(aten.mul.Tensor, y, b.call(aten.reshape.default, weight, shape))
    if bias is not None:
        y = b.call(aten.add.Tensor, y, b.call(aten.reshape.default, bias, shape))
    return b.call(aten.to.dtype, y, val.dtype)


def _own_channels(b: Builder, per_group: Node, batch: int, group_size: int, placement) -> Node:
    """A per-group value `[batch, groups, 1]` as one per channel of this rank, `[batch, c, 1]`."""
    expanded = b.call(aten.expand.default, per_group, [-1, -1, group_size])
    channels = b.call(aten.reshape.default, expanded, [batch, -1, 1])
    return b.split_op(c.shard_slice, channels, "col", 1, placement.groups)


def place_weight_norm(node: Node, ctx) -> Decision:
    """_weight_norm(v, g, dim): the weight takes the layout its consumer asks of a free
    weight (`_consumer_wish`), and v that layout; g (size 1 but along `dim`) is split
    where `dim` is. A weight no rule asks for is whole."""
    v, g = node.args[:2]
    dim = get_arg(node, 2, "dim", 0)
    layout = without_partial(_consumer_wish(node, ctx) or Layout.replicated())
    if not _divides(layout, shape_of(v), ctx.mesh):  # padded rows would have norm 0
        layout = Layout.replicated()
    g_shape, v_shape = shape_of(g), shape_of(v)
    g_layout = Layout(*(p if isinstance(p, Shard) and p.dim == dim and len(g_shape) == len(v_shape)
                        and g_shape[dim] == v_shape[dim] else R for p in layout.placements))
    return Decision({v: layout, g: g_layout}, layout)


def _divides(layout: Layout, shape, mesh) -> bool:
    """Whether every split of `layout` divides its dim of `shape` evenly."""
    local = list(shape)
    for axis, p in zip(AXES, layout.placements):
        if isinstance(p, Shard):
            if local[p.dim] % (mesh.size(axis) * p.groups):
                return False
            local[p.dim] //= mesh.size(axis)
    return True


# The families whose rules lay out a weight: a free weight's first consumer among them gives
# `_weight_norm` its layout.
_WEIGHT_CONSUMERS = ("convolutions", "products")


def _consumer_wish(node: Node, ctx) -> Layout | None:
    """The layout that the first conv or product using `node` (past autocast's casts) would give it
    as a free weight (its rule, of the mesh's mode, asked in advance; its warnings are its own call's
    to give)."""
    for user, taken in users_past_casts(node):
        rule = ctx.rule(user.target, _WEIGHT_CONSUMERS)
        if rule is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                wish = rule(user, ctx).args.get(taken)
            if wish is not None:
                return wish
    return None


def lower_weight_norm(b: Builder, node: Node, args, kwargs):
    """`v * g / |v|` with the norm over every dim but `dim` (all dims for dim -1): where v's
    layout splits one of those, the sum of squares is all-reduced along the splitting axes."""
    v, g = args[:2]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    ndim = node.args[0].meta["val"].dim()
    normed = list(range(ndim)) if dim == -1 else [d for d in range(ndim) if d != dim]
    axes = split_axes(b, arg_layout(node, node.args[0]), normed)
    if not axes:
        return lower_default(b, node, args, kwargs)
    squares = b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, v, v), normed, True)
    for axis in axes:
        squares = b.collective(c.all_reduce, squares, axis)
    return b.call(aten.mul.Tensor, v, b.call(aten.div.Tensor, g, b.call(aten.sqrt.default, squares)))


PLACEMENT = {
    aten.batch_norm.default: place_batch_norm,
    aten.group_norm.default: place_group_norm,
    aten._weight_norm.default: place_weight_norm,
    aten.layer_norm.default: place_norm,
    aten.rms_norm.default: place_norm,
}


LOWERING = {
    aten.group_norm.default: lower_group_norm,
    aten._weight_norm.default: lower_weight_norm,
    aten.layer_norm.default: lower_layer_norm,
    aten.rms_norm.default: lower_rms_norm,
    aten.batch_norm.default: lower_batch_norm,
}

FAMILY = Family("norms", PLACEMENT, lowering=LOWERING)
