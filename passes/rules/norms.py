"""Rules of normalisations: layer_norm and rms_norm keep their input's layout,
and the affine parameters are split like the normalised dims. Over a split
normalised dim the lowering computes the statistics with one collective an
axis (LayerNorm: each rank's mean and centred sum of squares, all-gathered
and merged by Chan et al.'s formula; RMSNorm: an all-reduce of the sum of
squares) and normalises with `tess_compile.ops.split_norm`, which keeps only
x and the statistics for backward.

batch_norm keeps its input's splits too (partial sums are resolved by
channels): its affine parameters and running statistics are split like
the channels (dim 1), and in training the per-channel statistics over the
other dims are all-reduced along the axes that split those (the lowering).
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from passes.builder import Builder
from passes.rules.common import R, aten, layout_of, lower_default, shape_of, split_axes, without_partial
from passes.rules.convolutions import channels_layout
from passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Shard
from tess_compile.ops import collectives as c
from tess_compile.ops.split_norm import split_norm

__all__ = [
    "FAMILY",
    "HALF_TYPES",
    "LOWERING",
    "PLACEMENT",
    "lower_batch_norm",
    "lower_layer_norm",
    "lower_rms_norm",
    "place_batch_norm",
    "place_norm",
]


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


def _sum_over(b: Builder, x: Node, dims, axes) -> Node:
    total = b.call(aten.sum.dim_IntList, x, dims, True)
    for axis in axes:
        total = b.collective(c.all_reduce, total, axis)
    return total


def _mean_and_variance(b: Builder, xs: Node, dims: list[int], axes: list[str], count: int) -> tuple[Node, Node]:
    """Mean and (biased) variance over `dims` of `count` elements, split over `axes`, with one
    collective an axis: each rank's own mean and centred sum of squares side by side,
    all-gathered, then merged by Chan et al.'s pairwise formula (every rank holds
    `count / parts` of them): `M2 = sum M2_r + n_r * sum (mean_r - mean)^2`. As stable as
    a two-pass variance; a sum of squares minus a squared sum would cancel."""
    parts = math.prod(b.mesh.size(axis) for axis in axes)
    assert count % parts == 0, "placement splits norm dims evenly"
    own = count // parts
    at = dims[-1]  # the statistics lie side by side along one reduced dim (kept, size 1)
    own_mean = b.call(aten.div.Tensor, b.call(aten.sum.dim_IntList, xs, dims, True), own)
    centred = b.call(aten.sub.Tensor, xs, own_mean)
    own_m2 = b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, centred, centred), dims, True)
    stats = b.call(aten.cat.default, [own_mean, own_m2], at)
    for axis in axes:
        stats = b.split_op(c.all_gather, stats, axis, at, 1)
    means = b.call(aten.slice.Tensor, stats, at, 0, None, 2)
    m2s = b.call(aten.slice.Tensor, stats, at, 1, None, 2)
    mean = b.call(aten.mean.dim, means, [at], True)
    spread = b.call(aten.sub.Tensor, means, mean)
    between = b.call(aten.mul.Tensor, b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, spread, spread), [at], True), own)
    m2 = b.call(aten.add.Tensor, b.call(aten.sum.dim_IntList, m2s, [at], True), between)
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
    axes = split_axes(b, node.meta["arg_layouts"][node.args[0]], dims)
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
    axes = split_axes(b, node.meta["arg_layouts"][node.args[0]], dims)
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
    axes = split_axes(b, node.meta["arg_layouts"][node.args[0]], dims)
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


PLACEMENT = {
    aten.batch_norm.default: place_batch_norm,
    aten.layer_norm.default: place_norm,
    aten.rms_norm.default: place_norm,
}


LOWERING = {
    aten.layer_norm.default: lower_layer_norm,
    aten.rms_norm.default: lower_rms_norm,
    aten.batch_norm.default: lower_batch_norm,
}

FAMILY = Family("norms", PLACEMENT, lowering=LOWERING)
