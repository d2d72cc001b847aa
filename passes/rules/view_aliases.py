"""Rules of the ops that are other spellings of views: `tensor_split` and `view_as` / `reshape_as`.

`tensor_split(x, indices_or_sections, dim)` (its three overloads: a list of
indices, a number of sections, a tensor of either) cuts `x` along `dim` into
pieces as `split_with_sizes` does; the pieces' sizes are those of the captured
values, so all three are placed by the views family's rule of `split` (chunks
that cover whole groups of a split dim keep the split) and lowered as
`split_with_sizes` of the local sizes. `view_as(x, other)` and
`reshape_as(x, other)` are a view of `x` to `other`'s shape: placed by the
views family's rule of `reshape` (`other` only gives the shape; its layout is
not asked for) and lowered as a reshape to the local shape. (`expand_as` is the
views family's own.)
"""

from __future__ import annotations

from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import arg_layout, aten, get_arg, normalize_dim, shape_of
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.meta_keys import LAYOUT

__all__ = ["FAMILY", "LOWERING", "PLACEMENT", "lower_tensor_split", "lower_view_as", "place_tensor_split",
           "place_view_as"]

_TENSOR_SPLITS = (aten.tensor_split.indices, aten.tensor_split.sections, aten.tensor_split.tensor_indices_or_sections)


def place_tensor_split(node: Node, ctx) -> Decision:
    """As `split` of the pieces' sizes (the views family's rule)."""
    return ctx.rule(aten.split_with_sizes.default, ("views",))(node, ctx)


def place_view_as(node: Node, ctx) -> Decision:
    """As `reshape` to the output's shape (the views family's rule)."""
    return ctx.rule(aten.reshape.default, ("views",))(node, ctx)


def lower_tensor_split(b: Builder, node: Node, args, kwargs):
    """`split_with_sizes` of each piece's local size (a piece of a split dim: its share of it)."""
    x = node.args[0]
    dim = normalize_dim(get_arg(node, 2, "dim", 0), len(shape_of(x)))
    global_size = shape_of(x)[dim]
    local_size = arg_layout(node, x).local_shape(shape_of(x), b.mesh)[dim]
    sizes = [piece.shape[dim] for piece in node.meta["val"]]
    local = sizes if statically_known_true(local_size == global_size) else [
        size * local_size // global_size for size in sizes]
    return b.call(aten.split_with_sizes.default, args[0], local, dim)


def lower_view_as(b: Builder, node: Node, args, kwargs):
    """A reshape of `x` to the output's local shape."""
    return b.call(aten.reshape.default, args[0], LAYOUT.of(node).local_shape(node.meta["val"].shape, b.mesh))


PLACEMENT = {
    **{op: place_tensor_split for op in _TENSOR_SPLITS},
    aten.view_as.default: place_view_as,
    aten.reshape_as.default: place_view_as,
}

LOWERING = {
    **{op: lower_tensor_split for op in _TENSOR_SPLITS},
    aten.view_as.default: lower_view_as,
    aten.reshape_as.default: lower_view_as,
}

FAMILY = Family("view_aliases", PLACEMENT, lowering=LOWERING)
