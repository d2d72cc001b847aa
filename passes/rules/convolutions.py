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
    channels_layout,
    display_name,
    get_arg,
    place_replicated,
    shape_of,
    split_axes,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Partial, Shard
from tess_compile.core.meta_keys import LAYOUT
from tess_compile.ops import collectives as c

__all__ = ["FAMILY", "LOWERING", "PLACEMENT", "conv_groups", "groups_index", "lower_conv", "place_conv"]


def groups_index(node: Node) -> int:
    """The position of a conv node's `groups` argument."""
    return 8 if node.target is aten.convolution.default else 6


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
    channel_axes = split_axes(b, arg_layout(node, node.args[0]), [1])
    groups, parts = conv_groups(node), math.prod(b.mesh.size(axis) for axis in channel_axes)
    if groups > 1 and parts > 1:
        if len(args) > groups_index(node):
            args[groups_index(node)] = groups // parts
        else:
            kwargs["groups"] = groups // parts
    if isinstance(LAYOUT.of(node).col, Partial) and len(args) > 2 and args[2] is not None:
        args[2] = b.collective(c.keep_first, args[2], "col")
    return b.call(node.target, *args, **kwargs)


_CONVOLUTIONS = [
    aten.conv1d.default,
    aten.conv2d.default,
    aten.conv3d.default,
    aten.conv1d.padding,
    aten.conv2d.padding,
    aten.conv3d.padding,
    aten.convolution.default,
]


PLACEMENT = {op: place_conv for op in _CONVOLUTIONS}


LOWERING = {op: lower_conv for op in _CONVOLUTIONS}

FAMILY = Family("convolutions", PLACEMENT, lowering=LOWERING)
