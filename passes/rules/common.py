"""What the rule families share: helpers for arguments, shapes and layouts, and the
rules that run an op replicated, dims-local or as it is (the rule contracts are in
`passes/rules/family.py`)."""

from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.family import Decision
from tess_compile.core.layout import Layout, Partial, Replicate, Shard, split_size
from tess_compile.ops import collectives as c
from tess_compile.ops.local import arange_like

__all__ = [
    "P",
    "R",
    "WHOLE",
    "aten",
    "check_divisible",
    "dim_arg",
    "dims_local",
    "display_name",
    "get_arg",
    "is_one",
    "is_param",
    "layout_of",
    "lower_default",
    "normalize_dim",
    "place_replicated",
    "shape_of",
    "split_axes",
    "tensor_inputs",
    "without_partial",
]

aten = torch.ops.aten


R, P = Replicate(), Partial()
WHOLE = Layout(R, R, R)


def tensor_inputs(node: Node) -> list[Node]:
    return [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]


def is_one(size) -> bool:
    """`size == 1`; of a symbolic size (a dynamic compile's) asked size-obliviously: False unless it is 1 in
    every call, so a rule takes the general case, which holds at 1 too, and adds no condition."""
    return guard_or_false(size == 1) if isinstance(size, torch.SymInt) else size == 1


def all_same(sizes) -> bool:
    """Every size in `sizes` the same in every call (symbolic sizes: the same formula)."""
    return all(statically_known_true(size == sizes[0]) for size in sizes)


def shape_of(node: Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def layout_of(ctx, node: Node) -> Layout:
    """The node's layout; a free tensor counts as replicated."""
    return ctx.layout(node) or Layout.replicated()


def without_partial(layout: Layout) -> Layout:
    return Layout(*(R if isinstance(p, Partial) else p for p in layout.placements))


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def get_arg(node: Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def is_param(node: Node) -> bool:
    return node.op == "placeholder" and node.meta.get("role", ("",))[0] == "param"


def display_name(node: Node) -> str:
    """The model's name for a parameter, buffer or input; the node's name otherwise."""
    role = node.meta.get("role")
    if role and role[0] != "input":
        return role[1]
    return node.meta.get("weight_input", node.name)


def check_divisible(what: str, node: Node, size: int, parts: int, groups: int, ctx, fix: str) -> None:
    """ValueError unless a dim of `size` splits in `parts` blocks, each holding `groups` groups.
    A plain split (`groups == 1`) may be uneven: its blocks are padded (`tess_compile.core.layout`)."""
    if groups > 1 and size % (parts * groups):
        parts *= groups
        raise ValueError(
            f"{what} of {display_name(node)!r} (shape {list(shape_of(node))}) is {size}, not divisible by {parts} "
            f"on mesh {ctx.mesh}: {fix}"
        )


def place_replicated(node: Node, ctx) -> Decision:
    """The fallback: every input whole on every rank, the op run as is."""
    args = {t: Layout.replicated() for t in tensor_inputs(node)}
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return Decision(args, tuple(Layout.replicated() for _ in val))
    return Decision(args, Layout.replicated() if isinstance(val, torch.Tensor) else None)


def dims_local(dims_of):
    """Rule for an op that works across some dims: those dims must be whole."""

    def rule(node: Node, ctx) -> Decision:
        x = node.args[0]
        ndim = len(shape_of(x))
        dims = [normalize_dim(d, ndim) for d in dims_of(node)]
        layout = without_partial(layout_of(ctx, x))
        needed = Layout(*(R if isinstance(p, Shard) and p.dim in dims else p for p in layout.placements))
        out = needed
        if node.target is aten.select.int:
            out = Layout(*(Shard(p.dim - (p.dim > dims[0]), p.groups) if isinstance(p, Shard) else p for p in needed.placements))
        return Decision({x: needed}, out)

    return rule


def dim_arg(node: Node) -> list[int]:
    return [get_arg(node, 1, "dim", 0)]


def lower_default(b: Builder, node: Node, args, kwargs):
    return b.call(node.target, *args, **kwargs)


def block_indices(b: Builder, like: Node, size: int, layout: Layout, dim: int) -> Node:
    """The global indices along `dim` (of `size`) of this rank's block of a value laid out by
    `layout`, one per element of the block: an uneven split's padding has indices >= `size`."""
    axes = split_axes(b, layout, [dim])
    total = size
    if len(axes) == 1 and layout.on(axes[0]).groups == 1:
        total = split_size(size, b.mesh.size(axes[0])) * b.mesh.size(axes[0])
    ids = b.call(arange_like, like, total)
    for axis in axes:
        ids = b.split_op(c.shard_slice, ids, axis, 0, layout.on(axis).groups)
    return ids


def masked_padding(b: Builder, x: Node, shape, layout: Layout, dim: int, fill: float) -> Node:
    """`x` (a block of a value of global `shape` laid out by `layout`) with the padding of an uneven
    split of `dim` set to `fill`: 0 before a sum over the dim, -inf before a max or a log-sum-exp.
    `x` itself where the dim is split evenly or not at all."""
    if not any(shape[dim] % b.mesh.size(axis) for axis in split_axes(b, layout, [dim])):
        return x
    inside = b.call(aten.lt.Scalar, block_indices(b, x, shape[dim], layout, dim), shape[dim])
    inside = b.call(aten.reshape.default, inside, [-1] + [1] * (len(shape) - 1 - dim))
    return b.call(aten.where.ScalarOther, inside, x, fill)


def split_axes(b: Builder, layout: Layout, dims) -> list[str]:
    """Axes of size > 1 that split one of `dims`."""
    return [a for a in layout.axes_where(Shard, b.mesh) if layout.on(a).dim in dims]
