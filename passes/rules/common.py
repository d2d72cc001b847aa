"""What the rule families share: helpers for arguments, shapes and layouts (broadcast
alignment, channel and batch splits, which products multiply by a weight), and the generic
rules that run an op replicated, dims-local, as it is, or with no layout at all (the rule
contracts are in `passes/rules/family.py`). A family's own rules are its own: a family that
needs another's rule asks the table for it (`PlacementContext.rule`), never its file."""

from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.family import Decision
from tess_compile.passes.source_lines import source_line
from tess_compile.core.layout import Layout, Partial, Placement, Replicate, Shard, split_size
from tess_compile.core.mesh import AXES
from tess_compile.core.meta_keys import ARG_LAYOUTS, ROLE, WEIGHT_INPUT
from tess_compile.ops import collectives as c
from tess_compile.ops.local import arange_like

__all__ = [
    "WHOLE",
    "P",
    "R",
    "align",
    "aligned",
    "all_same",
    "arg_layout",
    "aten",
    "batch_placements",
    "block_indices",
    "blocks_of",
    "channels_layout",
    "check_divisible",
    "dim_arg",
    "dims_local",
    "display_name",
    "get_arg",
    "is_dtype_cast",
    "is_narrow_projection",
    "is_one",
    "is_param",
    "is_param_or_transpose",
    "keep_dim_split",
    "layout_of",
    "lower_default",
    "masked_padding",
    "neighbour_edges",
    "normalize_dim",
    "own_block",
    "pad_of",
    "partials_to_tokens",
    "place_nothing",
    "place_replicated",
    "plain_split_axes",
    "resolve_partials",
    "shape_of",
    "split_axes",
    "tensor_inputs",
    "users_past_casts",
    "uses_summa",
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


def arg_layout(node: Node, arg: Node) -> Layout:
    """The layout the placed op `node` needs its input `arg` in (`ARG_LAYOUTS`): in a lowering
    rule, the layout of the local argument it was given."""
    return ARG_LAYOUTS.of(node)[arg]


def without_partial(layout: Layout) -> Layout:
    return Layout(*(R if isinstance(p, Partial) else p for p in layout.placements))


def partials_to_tokens(ctx, x: Node, frozen=()) -> Layout:
    """x's layout with its partial sums over an axis that splits the tokens resolved to the split of
    x's token dim outside `frozen` (a reduce-scatter, as `align` picks it); its other placements,
    other partial sums included, as they are."""
    layout = layout_of(ctx, x)
    _, out = align(ctx, x, [x], shape_of(x), frozen)
    return Layout(*(out[index] if isinstance(p, Partial) and isinstance(out[index], Shard) else p
                    for index, p in enumerate(layout.placements)))


def resolve_partials(ctx, x: Node, frozen=()) -> Layout:
    """x's layout with its partial sums resolved for an op that cannot take them: over an axis that
    splits the tokens, to the token split (`partials_to_tokens`, as Megatron-LM's sequence
    parallelism resolves a row-parallel product before a norm); elsewhere, or where that split would
    not fit x, replicated (an all-reduce)."""
    layout = layout_of(ctx, x)
    if not any(isinstance(p, Partial) for p in layout.placements):
        return layout
    resolved = partials_to_tokens(ctx, x, frozen)
    return without_partial(layout if resolved.unfit_axes(shape_of(x), ctx.mesh) else resolved)


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def get_arg(node: Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def is_dtype_cast(node: Node) -> bool:
    """A `_to_copy` to a dtype and nothing else: autocast's casts, which
    `tess_compile.passes.autocast_casts` writes. (A model's own `x.to(dtype)` is `to.dtype` in the
    captured graph, placed as any pointwise op.)"""
    return (node.op == "call_function" and node.target is aten._to_copy.default and len(node.args) == 1
            and set(node.kwargs) <= {"dtype"})


def users_past_casts(node: Node) -> list[tuple[Node, Node]]:
    """(user, the input it takes) for each user of `node`, looking past autocast's casts
    (`is_dtype_cast`): a product that takes the cast of a weight is that weight's user."""
    pairs = []
    for user in node.users:
        if is_dtype_cast(user):
            pairs.extend((after, user) for after in user.users)
        else:
            pairs.append((user, node))
    return pairs


def is_param(node: Node) -> bool:
    """A parameter, or autocast's cast of one (`is_dtype_cast`)."""
    while is_dtype_cast(node):
        node = node.args[0]
    return node.op == "placeholder" and ROLE.get(node, ("",))[0] == "param"


def is_param_or_transpose(node: Node) -> bool:
    """A parameter, or a transpose (`x @ W.T`) or autocast's cast of one."""
    while is_dtype_cast(node) or (node.op == "call_function" and node.target in (
            aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default)):
        node = node.args[0]
    return is_param(node)


def uses_summa(node: Node) -> bool:
    """Whether a matmul-like node multiplies by a 2-D parameter (Tesseract's SUMMA)."""
    if node.target is aten.linear.default:
        return True
    if node.target is aten.addmm.default:
        plain = get_arg(node, 3, "beta", 1) == 1 and get_arg(node, 4, "alpha", 1) == 1
        return plain and is_param(node.args[2])
    weight = node.args[1]
    return is_param_or_transpose(weight) and len(shape_of(weight)) == 2


def is_narrow_projection(x: Node) -> bool:
    """A projection to fewer features than it takes: grouped-query attention's key and
    value heads, whose count need not divide q (they then run replicated)."""
    if x.target is not aten.linear.default:
        return False
    out_features, in_features = shape_of(x.args[1])[:2]
    return out_features < in_features


def display_name(node: Node) -> str:
    """The model's name for a parameter, buffer or input; the node's name otherwise."""
    role = ROLE.get(node)
    if role and role[0] != "input":
        return role[1]
    return WEIGHT_INPUT.get(node, node.name)


def check_divisible(op: Node, what: str, node: Node, size: int, parts: int, groups: int, ctx, fix: str) -> None:
    """ValueError, naming the op whose rule asks, unless a dim of `size` splits in `parts` blocks, each
    holding `groups` groups. A plain split (`groups == 1`) may be uneven: its blocks are padded
    (`tess_compile.core.layout`)."""
    if groups > 1 and size % (parts * groups):
        raise ValueError(
            f"{op.target} at {source_line(op)}: its {what} of {display_name(node)!r} (shape {list(shape_of(node))}) "
            f"are {size}, in {groups} groups (the parts a split or chunk cuts them into), each split in {parts} "
            f"blocks on mesh {ctx.mesh}, and {size} is not divisible by {parts * groups}: {fix}"
        )


def place_nothing(node: Node, ctx) -> Decision:
    """An op that makes no tensor (a metadata assertion, a device, a size): no layouts needed."""
    return Decision({}, None)


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
            out = Layout(*(Shard(p.dim - (p.dim > dims[0]), p.groups) if isinstance(p, Shard) else p
                           for p in needed.placements))
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


def plain_split_axes(layout: Layout, dim: int, mesh) -> list[str]:
    """The axes of size > 1 that split `dim` plainly (a block a rank, no stripes), outermost first."""
    return [a for a in AXES if layout.on(a) == Shard(dim) and mesh.size(a) > 1]


def keep_dim_split(layout: Layout, dim: int, even: bool, shape, mesh) -> Layout:
    """`layout` without partial sums, `dim`'s plain splits kept (where `even`, only if each divides)
    and any other split of `dim` made whole: the layout of an op that carries along `dim` (a prefix
    sum, a shift, a causal conv) and keeps its split."""
    layout = without_partial(layout)
    kept, size = [], shape[dim]
    for axis, p in zip(AXES, layout.placements):
        plain = p == Shard(dim) and (not even or size % mesh.size(axis) == 0)
        if isinstance(p, Shard) and p.dim == dim and not plain:
            p = R
        if plain:
            size = split_size(size, mesh.size(axis))
        kept.append(p)
    return Layout(*kept)


def blocks_of(b: Builder, piece: Node, axes: list[str], dim: int) -> Node:
    """Every rank's `piece` along `dim`, in global block order (gathered inner axis first)."""
    for axis in reversed(axes):
        piece = b.call(c.all_gather, piece, axis, b.mesh.size(axis), dim, 1)
    return piece


def own_block(b: Builder, whole: Node, axes: list[str], dim: int) -> Node:
    """This rank's block of `whole` along `dim` (split outer axis first)."""
    for axis in axes:
        whole = b.call(c.shard_slice, whole, axis, b.mesh.size(axis), dim, 1)
    return whole


def pad_of(ndim: int, dim: int, before: int, after: int) -> list[int]:
    """constant_pad_nd's `pad` that pads `dim` of a tensor of `ndim` dims by (before, after)."""
    return [0, 0] * (ndim - 1 - dim) + [before, after]


def neighbour_edges(b: Builder, x: Node, ndim: int, dim: int, k: int, size: int, axes: list[str],
                    cyclic: bool = False) -> Node:
    """The |k| elements along `dim` next to this rank's block `x` (`size` long, of a value split plainly
    and evenly along `dim` over `axes`, |k| <= `size`): the end of the block before it (k > 0) or the
    start of the block after it (k < 0), zeros past the ends or, `cyclic`, round them (the halo of a
    shift, a roll, a causal conv). One all-gather per axis of every block's |k| edge elements."""
    count = abs(k)
    edge = b.call(aten.narrow.default, x, dim, size - count if k > 0 else 0, count)
    edges = blocks_of(b, edge, axes, dim)
    if cyclic:
        edges = b.call(aten.roll.default, edges, [k], [dim])
    else:  # the block before each with zeros before the first, or the block after each with zeros after the last
        pad = pad_of(ndim, dim, count, -count) if k > 0 else pad_of(ndim, dim, -count, count)
        edges = b.call(aten.constant_pad_nd.default, edges, pad)
    return own_block(b, edges, axes, dim)


def _partial_stays(node: Node, tensors: list[Node], placements: dict, linearity: str | None) -> bool:
    """Whether partial sums on an axis pass through `node`, given how it treats them (`align`)."""
    partial = [t for t in tensors if isinstance(placements[t], Partial)]
    if not partial or linearity is None:
        return False
    if linearity == "unary":
        return True
    if linearity == "sum":
        numbers = [a for a in node.args if isinstance(a, (int, float))]
        return len(partial) == len(tensors) and not numbers
    others_replicated = all(isinstance(placements[t], Replicate) or placements[t] is None
                            for t in tensors if t not in partial)
    is_divisor = node.target is aten.div.Tensor and tensors[0] not in partial
    return len(partial) == 1 and others_replicated and not is_divisor


def align(ctx, node: Node, tensors: list[Node], out_shape, frozen=(),
          linearity: str | None = None) -> tuple[dict, list]:
    """Broadcast-align the splits of `tensors` to `out_shape`, per axis.

    Out dims in `frozen` stay unsplit. `linearity` says how the op treats partial sums: "sum"
    (every tensor may be partial), "scale" (one partial tensor times replicated ones), "unary"
    (passes through), None (none pass; the pointwise family's table says it of its ops).
    Returns (required layouts, output placements).
    """
    n_out = len(out_shape)
    tensors = list(dict.fromkeys(tensors))  # a tensor may come twice (cat([x, x]))
    required = {t: [] for t in tensors}
    out: list[Placement] = []
    for axis in AXES:
        placements = {t: (ctx.layout(t).on(axis) if ctx.layout(t) else None) for t in tensors}
        if _partial_stays(node, tensors, placements, linearity):
            for t in tensors:
                required[t].append(placements[t] or R)
            out.append(P)
            continue
        chosen = None
        for t in tensors:
            p = placements[t]
            if isinstance(p, Shard):
                od = p.dim + n_out - len(shape_of(t))
                if od not in frozen and shape_of(t)[p.dim] == out_shape[od]:
                    chosen = Shard(od, p.groups)
                    break
        if chosen is None and any(isinstance(p, Partial) for p in placements.values()):
            chosen = _token_split(ctx, axis, out_shape, frozen)
        for t in tensors:
            required[t].append(aligned(chosen, shape_of(t), out_shape))
        out.append(chosen or R)
    for axis in Layout(*out).unfit_axes(out_shape, ctx.mesh):  # splits of one dim that do not fit it together
        index = AXES.index(axis)
        out[index] = R
        for t in tensors:
            required[t][index] = R
    return {t: Layout(*ps) for t, ps in required.items()}, out


def _token_split(ctx, axis: str, out_shape, frozen) -> Shard | None:
    """Where partial sums over an axis that splits the tokens (`tess_compile.core.row_split`) meet an op
    that cannot take them: the split of the output's token dim (the first dim but the last of the
    inputs' token count, in the stripes of a striped order), so that they are reduce-scattered over the
    tokens rather than all-reduced (Megatron-LM's sequence parallelism); None if there is none."""
    rows = getattr(ctx, "rows", None)
    if rows is None or axis not in rows.token_axes():
        return None
    dims = [d for d in range(len(out_shape) - 1) if d not in frozen and out_shape[d] == rows.length]
    return Shard(dims[0], rows.stripes) if dims else None


def aligned(chosen, shape, out_shape) -> Placement:
    """The split of a tensor of `shape` that broadcasts to the output split `chosen`."""
    if not isinstance(chosen, Shard):
        return R
    dim = chosen.dim - (len(out_shape) - len(shape))
    if dim >= 0 and shape[dim] == out_shape[chosen.dim]:
        return Shard(dim, chosen.groups)
    return R


def channels_layout(ctx, x: Node, channel_dim: int) -> Layout:
    """x's layout with partial sums resolved: on col, split by channels where they divide
    and no other axis splits them (a reduce, then a slice); elsewhere replicated."""
    layout = without_partial(layout_of(ctx, x))
    if not isinstance(layout_of(ctx, x).col, Partial):
        return layout
    taken = any(isinstance(p, Shard) and p.dim == channel_dim for p in layout.placements)
    divides = shape_of(x)[channel_dim] % ctx.mesh.size("col") == 0
    return layout.with_axis("col", Shard(channel_dim) if divides and not taken else R)


def batch_placements(ctx, layout: Layout, batch: int) -> list:
    """Placements on depth and row that split dim 0 (the batch) where it divides,
    outermost first; an axis of size 1 stays as it is."""
    out, parts = [], 1
    for axis, p in zip(("depth", "row"), layout.placements[:2]):
        size = ctx.mesh.size(axis)
        if size == 1:
            out.append(p if isinstance(p, Shard) and p.dim == 0 else R)
        elif batch % (parts * size) == 0:
            out.append(Shard(0))
            parts *= size
        else:
            out.append(R)
    return out
