"""Rules of convolutions (conv1d/2d/3d and `convolution`, not transposed).

The batch is split over depth and row (a whole batch is sliced, for free);
channels are split over col in one of three ways:

- grouped (`groups > 1`, groups divisible by col's size): the input's
  channels and the output's are split by whole groups, and each rank runs
  its `groups / parts` groups with its block of the weight: local, no
  communication (a depthwise conv is the case of one channel a group, as
  the causal conv of Mamba's and linear attention's mixers; a weight that
  comes whole, a view of the parameter, is sliced);
- column-parallel (input channels whole): the weight's out channels and the
  output's channels are split, no communication;
- row-parallel (input channels split over col): the weight's in channels
  are split and each rank's output is a partial sum over col, reduced by
  its consumer (a batch norm or pooling takes it split by channels, see
  `common.channels_layout`). This keeps only the rank's channel block of the input
  for backward; gathering the channels for a column-parallel conv instead
  would move the input rather than the output, but keep it whole on every
  rank of col until backward.

A conv whose channels fit none of these runs with them whole on every rank
of col (a warning says so); its batch stays split. The lowering gives a
grouped conv its own number of groups, and a row-parallel conv adds its bias
on the rank at col 0 only.

A causal conv1d (`tess_compile.ops.causal_conv`: Mamba's, a conv padded by k-1 and its first L
outputs, fused by `passes/causal_convs.py` over a token split) is placed as a conv, and the tokens
(its last dim) keep each plain, even split they arrive in: each rank convolves its block, without
padding, with the k-1 tokens before it (the halo, zeros before the first token), which is its
block of the conv's output. A halo of at most a block is the previous block's last k-1 tokens, one
all-gather per token axis of each block's edge (`common.neighbour_edges`, as a token shift takes
its edge); a wider one (more ranks than tokens over k-1) is cut from the tokens gathered whole,
with no conv run twice. Where col splits the tokens (mode 1d's sequence parallelism) they keep col
and the channels are whole there. Stripes and uneven splits make the tokens whole first.
Everything is a graph op or a collective, so backward is autograd's through the collectives'
adjoints.
"""

from __future__ import annotations

import math
import warnings

from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import (
    P,
    R,
    arg_layout,
    aten,
    batch_placements,
    blocks_of,
    channels_layout,
    display_name,
    get_arg,
    keep_dim_split,
    layout_of,
    neighbour_edges,
    own_block,
    pad_of,
    place_replicated,
    plain_split_axes,
    shape_of,
    split_axes,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Partial, Shard
from tess_compile.core.meta_keys import LAYOUT
from tess_compile.ops import collectives as c
from tess_compile.ops.causal_conv import causal_conv1d

__all__ = ["FAMILY", "LOWERING", "PLACEMENT", "conv_groups", "groups_index", "lower_causal_conv", "lower_conv",
           "place_causal_conv", "place_conv"]


def groups_index(node: Node) -> int:
    """The position of a conv node's `groups` argument."""
    return {aten.convolution.default: 8, causal_conv1d: 3}.get(node.target, 6)


def conv_groups(node: Node) -> int:
    """The `groups` argument of a conv node."""
    return get_arg(node, groups_index(node), "groups", 1)


def _col_split(node: Node, ctx, x_col, weight: Node) -> str:
    """How col splits the channels: "grouped", "column", "row" or "whole"."""
    parts = ctx.mesh.size("col")
    c_out, c_in = shape_of(weight)[:2]
    groups = conv_groups(node)
    w_layout = ctx.layout(weight)
    w_col = w_layout.col if w_layout is not None else None
    if parts == 1:
        return "whole"
    if groups > 1:  # a whole weight (a view of one: `w.squeeze(1)`) is sliced by out channels, for free
        return "grouped" if groups % parts == 0 and w_col in (None, R, Shard(0)) else "whole"
    if w_col is not None:
        return {Shard(0): "column", Shard(1): "row"}.get(w_col, "whole")
    column = c_out % parts == 0
    row = c_in % parts == 0
    if row and (x_col == Shard(1) or (x_col == R and not column)):
        return "row"
    return "column" if column else "whole"


def _warn(node: Node, ctx, what: str) -> None:
    weight = node.args[1]
    warnings.warn(
        f"{node.target} with weight {display_name(weight)!r} of shape {list(shape_of(weight))} and groups "
        f"{conv_groups(node)} on mesh {ctx.mesh}: {what}",
        stacklevel=2,
    )


# (x's channels, weight, bias, output's channels) on col, per kind of split.
_COL = {
    "grouped": (Shard(1), Shard(0), Shard(0), Shard(1)),
    "column": (R, Shard(0), Shard(0), Shard(1)),
    "row": (Shard(1), Shard(1), R, P),
    "whole": (R, R, R, R),
}


def place_conv(node: Node, ctx) -> Decision:
    """conv(x, W, b): batch split over depth and row, channels over col as the module
    docstring says; spatial dims whole."""
    x, weight = node.args[:2]
    bias = get_arg(node, 2, "bias")
    transposed = node.target is aten.convolution.default and get_arg(node, 6, "transposed")
    if transposed or len(shape_of(x)) != len(shape_of(weight)):
        _warn(node, ctx, "transposed convs and unbatched inputs have no sharding rule, so it runs replicated; "
                         "give the input a batch dim")
        return place_replicated(node, ctx)
    layout = channels_layout(ctx, x, 1)
    batch = batch_placements(ctx, layout, shape_of(x)[0])
    kind = _col_split(node, ctx, layout.col, weight)
    if kind == "whole" and ctx.mesh.size("col") > 1 and ctx.layout(weight) is None:
        _warn(node, ctx, f"neither its groups nor its channels divide by col's {ctx.mesh.size('col')} ranks, so its "
                         "channels are whole on every rank of col (the batch stays split); use channel and group "
                         "counts that are multiples of q")
    x_col, w_col, b_col, out_col = _COL[kind]
    args = {x: Layout(*batch, x_col), weight: Layout(R, R, w_col)}
    if isinstance(bias, Node):
        args[bias] = Layout(R, R, b_col)
    return Decision(args, Layout(*batch, out_col))


def lower_conv(b: Builder, node: Node, args, kwargs):
    """A grouped conv with its channels split runs its own `groups / parts` groups; a
    row-parallel conv (partial output) adds its bias on the rank at col 0 only."""
    args, kwargs = list(args), dict(kwargs)
    groups = _local_groups(b, node)
    if len(args) > groups_index(node):
        args[groups_index(node)] = groups
    elif groups != conv_groups(node):
        kwargs["groups"] = groups
    if len(args) > 2:
        args[2] = _local_bias(b, node, args[2])
    return b.call(node.target, *args, **kwargs)


def _local_groups(b: Builder, node: Node) -> int:
    """The groups a rank runs: its `groups / parts` where col splits a grouped conv's channels."""
    channel_axes = split_axes(b, arg_layout(node, node.args[0]), [1])
    groups, parts = conv_groups(node), math.prod(b.mesh.size(axis) for axis in channel_axes)
    return groups // parts if groups > 1 and parts > 1 else groups


def _local_bias(b: Builder, node: Node, bias):
    """The bias a rank adds: a row-parallel conv's (partial output) on the rank at col 0 only."""
    if isinstance(LAYOUT.of(node).col, Partial) and bias is not None:
        return b.collective(c.keep_first, bias, "col")
    return bias


def place_causal_conv(node: Node, ctx) -> Decision:
    """causal_conv1d(x, W, b, groups): as a conv (`place_conv`), and the tokens (x's last dim) keep
    each plain split that divides them, col's too, where the channels are then whole (module
    docstring)."""
    decision = place_conv(node, ctx)
    x, weight, bias = node.args[:3]
    shape, dim = shape_of(x), len(shape_of(x)) - 1
    axes = plain_split_axes(keep_dim_split(layout_of(ctx, x), dim, True, shape, ctx.mesh), dim, ctx.mesh)
    args, out = dict(decision.args), decision.out
    for axis in axes:
        args[x], out = args[x].with_axis(axis, Shard(dim)), out.with_axis(axis, Shard(dim))
    if "col" in axes:
        for param in (weight, bias) if isinstance(bias, Node) else (weight,):
            args[param] = args[param].with_axis("col", R)
    return Decision(args, out)


def lower_causal_conv(b: Builder, node: Node, args, kwargs):
    """The rank's block of the causal conv: its input block with the halo before it, convolved without
    padding; with the tokens whole, the conv padded by k-1 and its first L outputs."""
    x_node, weight = node.args[:2]
    shape = x_node.meta["val"].shape
    dim, halo = len(shape) - 1, shape_of(weight)[-1] - 1
    layout = arg_layout(node, x_node)
    axes = plain_split_axes(layout, dim, b.mesh)
    x, size = args[0], layout.local_shape(shape, b.mesh)[dim]
    padding = halo
    if axes and halo:
        x, padding = _with_halo(b, x, len(shape), dim, halo, size, axes), 0
    out = b.call(aten.conv1d.default, x, args[1], _local_bias(b, node, args[2]), [1], [padding], [1],
                 _local_groups(b, node))
    return b.call(aten.slice.Tensor, out, dim, 0, size) if padding else out


def _with_halo(b: Builder, x: Node, ndim: int, dim: int, halo: int, size: int, axes: list[str]) -> Node:
    """This rank's block `x` (`size` long along its last dim `dim`, split over `axes`) with the `halo`
    elements before it, zeros before the first. A halo wider than a block is cut from the whole
    sequence gathered, zeros before it: the rank's window of `size + halo` from its block's start."""
    if halo <= size:
        return b.call(aten.cat.default, [neighbour_edges(b, x, ndim, dim, halo, size, axes), x], dim)
    whole = b.call(aten.constant_pad_nd.default, blocks_of(b, x, axes, dim), pad_of(ndim, dim, halo, 0))
    windows = b.call(aten.unfold.default, whole, dim, size + halo, size)  # [..., ranks, size + halo]
    return b.call(aten.squeeze.dim, own_block(b, windows, axes, dim), dim)


_CONVOLUTIONS = [
    aten.conv1d.default,
    aten.conv2d.default,
    aten.conv3d.default,
    aten.conv1d.padding,
    aten.conv2d.padding,
    aten.conv3d.padding,
    aten.convolution.default,
]


PLACEMENT = {**{op: place_conv for op in _CONVOLUTIONS}, causal_conv1d: place_causal_conv}


LOWERING = {**{op: lower_conv for op in _CONVOLUTIONS}, causal_conv1d: lower_causal_conv}

FAMILY = Family("convolutions", PLACEMENT, lowering=LOWERING)
