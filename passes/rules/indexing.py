"""Placement rules of indexing along a dim: gather, scatter (of a tensor or a value,
in place or not), scatter_add, scatter_reduce, slice_scatter, select_scatter and
masked_scatter.

gather and scatter work along one dim with an index tensor of the values' rank:
that dim is whole in the values (any index may point anywhere along it), and
the other dims are split alike in the values, the index and the source where
all have the same size there (an index shorter than the values on a dim takes
only their first rows, so that dim stays whole). A gather's index may stay split
on the gathered dim itself: each rank gathers its own rows of the output from the
whole values. In-place forms follow the same rules: the captured graph's later
uses read the op's result, not the tensor it was given.

slice_scatter and select_scatter (a write into a slice or a row, made functional by
`tess_compile.passes.view_mutations`) keep the written dim whole in the values; the other dims
are split alike in the values and the source.

masked_scatter fills the mask's positions, in row-major order, with the
source's elements in order. Where the mask is constant along the last dims
(broadcast or expanded there, as a per-token image mask over the hidden size),
each masked position takes one whole source row of those dims, so they may stay
split in x, the mask and the source alike, and each rank fills its own part.
Which source row a masked position takes depends on the masked positions before
it, which are data: a plain split of dim 0 (the batch over depth and row) stays,
each rank counting its masked rows and learning those of the ranks before it by
one all-gather of the counts per axis, and takes its rows of the source, which
is whole there. Splits of other leading dims are gathered, with a warning that
the op runs replicated over their axes.
"""

from __future__ import annotations

import math
import warnings

from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import (
    R,
    arg_layout,
    aten,
    display_name,
    get_arg,
    is_one,
    layout_of,
    lower_default,
    normalize_dim,
    shape_of,
    split_axes,
    without_partial,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import AXES
from tess_compile.ops import collectives as c
from tess_compile.ops.local import arange_like

__all__ = [
    "FAMILY",
    "LOWERING",
    "PLACEMENT",
    "lower_masked_scatter",
    "place_gather",
    "place_masked_scatter",
    "place_scatter",
    "place_select_scatter",
    "place_slice_scatter",
]


def _even(placements, shape, mesh) -> list:
    """`placements` (one per axis) with each split that would not divide `shape` evenly,
    given the splits before it, made whole."""
    local, out = list(shape), []
    for axis, p in zip(AXES, placements):
        if isinstance(p, Shard) and local[p.dim] % (mesh.size(axis) * p.groups):
            p = R
        if isinstance(p, Shard):
            local[p.dim] //= mesh.size(axis)
        out.append(p)
    return out


def _split_alike(ctx, tensors: list[Node], dim: int, keep_dim_split: Node | None = None) -> tuple[dict, list]:
    """Per axis, the first of `tensors` split on a dim other than `dim` where all have the
    same size gives its split to all (the output's too); `keep_dim_split` may also keep
    its own split of `dim`, the others whole there. Returns (needed layouts, output placements)."""
    shapes = {t: shape_of(t) for t in tensors}
    layouts = {t: without_partial(layout_of(ctx, t)) for t in tensors}
    needed = {t: [] for t in tensors}
    out = []
    for axis in AXES:
        chosen, owner = R, None
        for t in tensors:
            p = layouts[t].on(axis)
            alongside = isinstance(p, Shard) and p.dim != dim and len({s[p.dim] for s in shapes.values()}) == 1
            if alongside or (t is keep_dim_split and isinstance(p, Shard) and p.dim == dim):
                chosen, owner = p, t
                break
        for t in tensors:
            needed[t].append(R if isinstance(chosen, Shard) and chosen.dim == dim and t is not owner else chosen)
        if any(_even(needed[t], shapes[t], ctx.mesh)[-1] != needed[t][-1] for t in tensors):
            for t in tensors:
                needed[t][-1] = R
            chosen = R
        out.append(chosen)
    return {t: Layout(*ps) for t, ps in needed.items()}, out


def place_gather(node: Node, ctx) -> Decision:
    """gather(x, dim, index): `dim` whole in x; the other dims split alike in x and the
    index where their sizes agree; the index's split of `dim` itself kept (the output
    has the index's shape)."""
    x, dim, index = node.args[:3]
    dim = normalize_dim(dim, len(shape_of(x)))
    needed, out = _split_alike(ctx, [x, index], dim, keep_dim_split=index)
    return Decision(needed, Layout(*out))


def place_scatter(node: Node, ctx) -> Decision:
    """scatter(x, dim, index, src) and kin: `dim` whole in every tensor; the other dims
    split alike in x, the index and the source where their sizes agree."""
    x, dim, index = node.args[:3]
    dim = normalize_dim(dim, len(shape_of(x)))
    source = node.args[3] if len(node.args) > 3 and isinstance(node.args[3], Node) else None
    tensors = [x, index] + ([source] if source is not None else [])
    needed, out = _split_alike(ctx, tensors, dim)
    return Decision(needed, Layout(*out))


def place_slice_scatter(node: Node, ctx) -> Decision:
    """slice_scatter(x, src, dim, ...): `dim` whole in both; the other dims split alike where their sizes agree."""
    x, src = node.args[:2]
    dim = normalize_dim(get_arg(node, 2, "dim", 0), len(shape_of(x)))
    needed, out = _split_alike(ctx, [x, src], dim)
    return Decision(needed, Layout(*out))


def place_select_scatter(node: Node, ctx) -> Decision:
    """select_scatter(x, src, dim, index): `dim` whole in x; src, which lacks that dim, split as x is."""
    x, src, dim = node.args[:3]
    dim = normalize_dim(dim, len(shape_of(x)))
    kept = [R if isinstance(p, Shard) and p.dim == dim else p for p in without_partial(layout_of(ctx, x)).placements]
    placements = _even(kept, shape_of(x), ctx.mesh)
    of_src = [Shard(p.dim - (p.dim > dim), p.groups) if isinstance(p, Shard) else p for p in placements]
    return Decision({x: Layout(*placements), src: Layout(*of_src)}, Layout(*placements))


def _constant_mask_dims(mask: Node, ndim: int) -> set[int]:
    """The dims (of the masked tensor, of rank `ndim`) along which the mask is provably
    constant: it broadcasts there, or is an expand of a tensor that does."""
    constant = set()
    for source in (mask, mask.args[0] if mask.target in (aten.expand.default, aten.expand_as.default) else None):
        if isinstance(source, Node):
            shape = shape_of(source)
            shift = ndim - len(shape)
            constant |= {d for d in range(ndim) if d < shift or is_one(shape[d - shift])}
    return constant


def _tail_start(x: Node, mask: Node, source: Node) -> int:
    """The first of the last dims of x along which the mask is constant and whose sizes the
    source's last dims repeat; len(x's shape) if there are none."""
    x_shape, s_shape = shape_of(x), shape_of(source)
    constant = _constant_mask_dims(mask, len(x_shape))
    start = len(x_shape)
    while start > 0 and start - 1 in constant:
        start -= 1
    while start < len(x_shape) and tuple(s_shape[len(s_shape) - (len(x_shape) - start):]) != tuple(x_shape[start:]):
        start += 1
    return start if len(x_shape) - start <= len(s_shape) else len(x_shape)


def _has_rows(x: Node, source: Node, start: int) -> bool:
    """Whether the source holds at least one row of x's dims from `start` on."""
    return 0 < start and math.prod(shape_of(source)) >= math.prod(shape_of(x)[start:]) > 0


def place_masked_scatter(node: Node, ctx) -> Decision:
    """masked_scatter(x, mask, source): x's splits of the last dims along which the mask is
    constant are kept, in the mask (where it has the dim) and the source (aligned from
    the right) alike, and so is a plain split of dim 0 (the lowering finds each rank's
    first source row); other leading dims are whole (see the module docstring)."""
    x, mask, source = node.args[:3]
    x_shape = shape_of(x)
    start = _tail_start(x, mask, source)
    rows = _has_rows(x, source, start)
    layout = without_partial(layout_of(ctx, x))
    kept = [p if isinstance(p, Shard) and (p.dim >= start or (p.dim == 0 and p.groups == 1 and rows)) else R
            for p in layout.placements]
    needed = Layout(*_even(kept, x_shape, ctx.mesh))
    dropped = [a for a in layout.axes_where(Shard, ctx.mesh) if not isinstance(needed.on(a), Shard)]
    if dropped:
        warnings.warn(
            f"{node.target} into {display_name(x)!r} of shape {list(x_shape)} on mesh {ctx.mesh} runs replicated over "
            f"{', '.join(dropped)}: which source element a masked position takes depends on the mask's positions "
            "before it, so only dim 0 and the last dims the mask is constant along may stay split",
            stacklevel=2,
        )
    tail = Layout(*(p if isinstance(p, Shard) and p.dim >= start else R for p in needed.placements))
    return Decision({x: needed, mask: _aligned(needed, mask, x_shape), source: _aligned(tail, source, x_shape)}, needed)


def _aligned(layout: Layout, tensor: Node, x_shape) -> Layout:
    """`layout` (of x) for a tensor aligned with x from the right: its splits where the
    tensor has the dim with x's size, whole elsewhere."""
    shape = shape_of(tensor)
    shift = len(x_shape) - len(shape)
    return Layout(*(Shard(p.dim - shift, p.groups) if isinstance(p, Shard) and p.dim >= shift
                    and shape[p.dim - shift] == x_shape[p.dim] else R for p in layout.placements))


def lower_masked_scatter(b: Builder, node: Node, args, kwargs):
    """masked_scatter with dim 0 split: each rank counts its masked rows, the ranks before
    it in the split's order give its first source row (`_rows_before`), and it scatters
    the source rows from there on (as many as it has rows, the last repeated past the
    end: only as many as it masks are read)."""
    x_node, mask_node, source_node = node.args[:3]
    layout = arg_layout(node, x_node)
    axes = split_axes(b, layout, [0])
    start = _tail_start(x_node, mask_node, source_node)
    if not axes or start == 0:
        return lower_default(b, node, args, kwargs)
    x, mask, source = args[:3]
    x_shape = shape_of(x_node)
    local = layout.local_shape(x_shape, b.mesh)
    mask = b.call(aten.expand.default, mask, local)
    first = mask
    for dim in range(start, len(local)):  # the mask is constant there: one entry a row
        first = b.call(aten.slice.Tensor, first, dim, 0, 1)
    count = b.call(aten.sum.dim_IntList, b.call(aten.reshape.default, first, [1, -1]), [1])
    num_rows = math.prod(shape_of(source_node)) // math.prod(x_shape[start:])
    rows = b.call(aten.add.Tensor, b.call(arange_like, x, math.prod(local[:start])), _rows_before(b, count, axes))
    rows = b.call(aten.clamp_max.default, rows, num_rows - 1)
    source = b.call(aten.reshape.default, source, [-1, *local[start:]])
    return b.call(node.target, x, mask, b.call(aten.index_select.default, source, 0, rows))


def _rows_before(b: Builder, count: Node, axes: list[str]) -> Node:
    """The masked rows of the ranks before this one in the order of dim 0's blocks (the
    outer axis first), from each rank's `count` (shape [1]): per axis, innermost first,
    one all-gather of the counts, their sum before this rank's and their total."""
    before, total = None, count
    for axis in reversed(axes):
        counts = b.split_op(c.all_gather, total, axis, 0, 1)
        earlier = b.call(aten.sub.Tensor, b.call(aten.cumsum.default, counts, 0), counts)
        own = b.split_op(c.shard_slice, earlier, axis, 0, 1)
        before = own if before is None else b.call(aten.add.Tensor, before, own)
        total = b.call(aten.sum.dim_IntList, counts, [0], True)
    return before


_GATHERS = (aten.gather.default,)
_SCATTERS = (
    aten.scatter.src, aten.scatter.value, aten.scatter_.src, aten.scatter_.value, aten.scatter_add.default,
    aten.scatter_add_.default, aten.scatter_reduce.two, aten.scatter_reduce_.two,
)


PLACEMENT = {
    **{op: place_gather for op in _GATHERS},
    **{op: place_scatter for op in _SCATTERS},
    aten.masked_scatter.default: place_masked_scatter,
    aten.masked_scatter_.default: place_masked_scatter,
    aten.slice_scatter.default: place_slice_scatter,
    aten.select_scatter.default: place_select_scatter,
}

LOWERING = {
    aten.masked_scatter.default: lower_masked_scatter,
    aten.masked_scatter_.default: lower_masked_scatter,
}

FAMILY = Family("indexing", PLACEMENT, lowering=LOWERING)
