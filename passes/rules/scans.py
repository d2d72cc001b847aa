"""Rules of the ops that carry along a dim: prefix sums (`cumsum`), cyclic shifts (`roll`) and shifts
that pad one end and cut the other (`pad` / `constant_pad_nd` by (k, -k): RWKV's token shift).

Over a split dim (the tokens of a token split, `tess_compile.core.row_split`) each keeps the split:

- cumsum: each rank's local prefix sum plus its carry, the sum of the blocks before it: one
  all-gather per axis of each block's total, an exclusive prefix sum of those, and the rank's own
  entry of it;
- roll and a shift by k (|k| at most a block): the rank's block shifted, its k elements from the
  neighbouring block (the previous one for k > 0, the next for k < 0), cyclically for roll and zero
  at the ends for a shift: one all-gather per axis of each block's k edge elements.

A split they cannot keep (grouped, uneven for the shifts, a shift over a block, several dims at
once) makes the dim whole first, as `dims_local` does. Everything is a graph op or a collective,
so backward is autograd's through the collectives' adjoints.
"""

from __future__ import annotations

from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import (
    arg_layout,
    aten,
    blocks_of,
    dim_arg,
    dims_local,
    get_arg,
    keep_dim_split,
    layout_of,
    lower_default,
    masked_padding,
    neighbour_edges,
    normalize_dim,
    own_block,
    plain_split_axes,
    shape_of,
)
from tess_compile.passes.rules.family import Decision, Family

__all__ = ["FAMILY", "LOWERING", "PLACEMENT", "lower_cumsum", "lower_shift", "place_cumsum", "place_shift"]


def place_cumsum(node: Node, ctx) -> Decision:
    """cumsum(x, dim): its splits kept, `dim`'s too (the carry is added by the lowering)."""
    x = node.args[0]
    dim = normalize_dim(dim_arg(node)[0], len(shape_of(x)))
    layout = keep_dim_split(layout_of(ctx, x), dim, even=False, shape=shape_of(x), mesh=ctx.mesh)
    return Decision({x: layout}, layout)


def lower_cumsum(b: Builder, node: Node, args, kwargs):
    """The local prefix sum plus the totals of the blocks before this rank's (see the module docstring)."""
    x_node = node.args[0]
    dim = normalize_dim(dim_arg(node)[0], x_node.meta["val"].dim())
    layout = arg_layout(node, x_node)
    axes = plain_split_axes(layout, dim, b.mesh)
    if not axes:
        return lower_default(b, node, args, kwargs)
    x = masked_padding(b, args[0], x_node.meta["val"].shape, layout, dim, 0)  # padding adds nothing
    local = b.call(aten.cumsum.default, x, dim, **kwargs)
    size = _local_size(b, node, x_node, dim)
    totals = b.call(aten.narrow.default, local, dim, size - 1, 1)
    before = blocks_of(b, totals, axes, dim)
    before = b.call(aten.sub.Tensor, b.call(aten.cumsum.default, before, dim), before)  # exclusive
    return b.call(aten.add.Tensor, local, own_block(b, before, axes, dim))


def _local_size(b: Builder, node: Node, x: Node, dim: int) -> int:
    return arg_layout(node, x).local_shape(x.meta["val"].shape, b.mesh)[dim]


def _shift_of(node: Node) -> tuple[int, int, bool] | None:
    """(dim, k, cyclic) of a roll by k along one dim, or of a constant pad by (k, -k) with zero along
    one dim; None for any other."""
    ndim = len(shape_of(node.args[0]))
    if node.target is aten.roll.default:
        shifts, dims = get_arg(node, 1, "shifts"), get_arg(node, 2, "dims", [])
        if len(shifts) != 1 or len(dims) != 1:
            return None
        dim = normalize_dim(dims[0], ndim)
        size = shape_of(node.args[0])[dim]
        k = shifts[0] % size
        return dim, k - size if k > size // 2 else k, True  # the shorter way round
    pad = list(get_arg(node, 1, "pad"))
    mode = get_arg(node, 2, "mode", "constant") if node.target is aten.pad.default else "constant"
    value = get_arg(node, 3 if node.target is aten.pad.default else 2, "value", 0)
    moved = [k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]]
    if mode != "constant" or value not in (0, None) or len(moved) != 1 or sum(pad[2 * moved[0]:2 * moved[0] + 2]):
        return None
    return ndim - 1 - moved[0], pad[2 * moved[0]], False


def _moved_dims(node: Node) -> list[int]:
    """The dims a roll or pad moves elements along (made whole where the split cannot stay)."""
    ndim = len(shape_of(node.args[0]))
    if node.target is aten.roll.default:
        dims = get_arg(node, 2, "dims", [])
        return [normalize_dim(d, ndim) for d in dims] if dims else list(range(ndim))
    pad = get_arg(node, 1, "pad")
    return [ndim - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]]


def place_shift(node: Node, ctx) -> Decision:
    """roll / pad: a shift by k along a dim split evenly into blocks of at least |k| keeps its split;
    any other makes the dims it moves whole (`dims_local`)."""
    x = node.args[0]
    shift = _shift_of(node)
    if shift is not None:
        dim, k, _ = shift
        layout = keep_dim_split(layout_of(ctx, x), dim, even=True, shape=shape_of(x), mesh=ctx.mesh)
        if plain_split_axes(layout, dim, ctx.mesh) and abs(k) <= layout.local_shape(shape_of(x), ctx.mesh)[dim]:
            return Decision({x: layout}, layout)
    return dims_local(_moved_dims)(node, ctx)


def lower_shift(b: Builder, node: Node, args, kwargs):
    """The rank's block shifted by k, its k edge elements from the neighbouring block (see the module
    docstring)."""
    shift = _shift_of(node)
    x_node = node.args[0]
    axes = [] if shift is None else plain_split_axes(arg_layout(node, x_node), shift[0], b.mesh)
    if not axes:
        return lower_default(b, node, args, kwargs)
    dim, k, cyclic = shift
    if k == 0:
        return args[0]
    size, x, count = _local_size(b, node, x_node, dim), args[0], abs(k)
    neighbour = neighbour_edges(b, x, x_node.meta["val"].dim(), dim, k, size, axes, cyclic)
    kept = b.call(aten.narrow.default, x, dim, 0 if k > 0 else count, size - count)
    return b.call(aten.cat.default, [neighbour, kept] if k > 0 else [kept, neighbour], dim)


PLACEMENT = {
    aten.cumsum.default: place_cumsum,
    aten.roll.default: place_shift,
    aten.pad.default: place_shift,
    aten.constant_pad_nd.default: place_shift,
}

LOWERING = {
    aten.cumsum.default: lower_cumsum,
    aten.roll.default: lower_shift,
    aten.pad.default: lower_shift,
    aten.constant_pad_nd.default: lower_shift,
}

FAMILY = Family("scans", PLACEMENT, lowering=LOWERING)
