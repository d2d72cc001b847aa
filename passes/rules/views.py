"""Rules of views and data movement: view/reshape, expand, repeat,
permute, slice/select, split and chunk, unbind, cat and stack.

A view that only inserts or removes size-1 dims (unsqueeze, squeeze, `[n]` as
`[1, n, 1]`) keeps every split on its dim, shifted, groups included. Another
view keeps a split where the split dim's outer factor survives (a hidden
dim `h` split over col becomes heads `[n, h/n]` split on `n`); a split
inside a head's own dim is refused. A fused projection seen through `split`
or a grouped view asks its producer for a grouped layout (`S(dim,g=3)`).
Views, expands and splits take global sizes; their lowering makes them local.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import (
    P,
    R,
    align,
    all_same,
    arg_layout,
    aten,
    dim_arg,
    dims_local,
    display_name,
    get_arg,
    is_narrow_projection,
    is_one,
    is_param,
    is_param_or_transpose,
    layout_of,
    lower_default,
    normalize_dim,
    shape_of,
    users_past_casts,
    without_partial,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.passes.source_lines import source_line
from tess_compile.core.layout import Layout, Partial, Shard, split_size
from tess_compile.core.mesh import AXES
from tess_compile.core.meta_keys import LAYOUT

__all__ = [
    "FAMILY", "LOWERING", "PLACEMENT", "lower_expand", "lower_reshape", "lower_split", "lower_squeeze", "place_cat",
    "place_expand", "place_permute", "place_repeat", "place_slice", "place_split", "place_stack", "place_unbind",
    "place_view",
]


def _segment(in_shape, out_shape, dim):
    """The in dims [a, b) and out dims [c, e) that a view maps onto each other around `dim`."""
    i = o = 0
    while i < len(in_shape) or o < len(out_shape):
        a, c = i, o
        pin = in_shape[i] if i < len(in_shape) else 1
        pout = out_shape[o] if o < len(out_shape) else 1
        i, o = i + 1, o + 1
        while pin != pout:
            if pin < pout:
                pin *= in_shape[i]
                i += 1
            else:
                pout *= out_shape[o]
                o += 1
        if a <= dim < i:
            return a, i, c, o
    raise AssertionError("dim outside shape")


def _view_problem(node, x, in_shape, out_shape, dim, axis, parts, ctx) -> str:
    _, _, c, e = _segment(in_shape, out_shape, dim)
    factors = list(out_shape[c:e])
    return (
        f"{node.target} at {source_line(node)} of {display_name(x)!r} from {list(shape_of(x))} to "
        f"{list(shape_of(node))} splits dim {dim} "
        f"(split over {axis} in {parts} parts on mesh {ctx.mesh}) into {factors}: the outer factor "
        f"{factors[0]} is not divisible by {parts}"
    )


def _heads_error(problem: str, parts: int) -> ValueError:
    """The error of a view into attention heads that cannot keep a split."""
    return ValueError(f"{problem}. For attention this is a head count not divisible by {parts}: use a head count "
                      f"(and hidden size) that is a multiple of {parts}, or another mesh")


_ATTENTION_OPS = (
    aten.scaled_dot_product_attention.default, aten.softmax.int, aten._softmax.default, aten.bmm.default,
    aten.baddbmm.default, aten.matmul.default,
)

# Consumers that cut a fused value apart (Falcon's [n + 2] heads into q, k, v).
_TAKING_APART = (
    aten.slice.Tensor, aten.select.int, aten.index.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.chunk.default, aten.unbind.int,
)


_PERMUTATIONS = (aten.permute.default, aten.transpose.int, aten.t.default, aten.numpy_T.default)

_MAX_CONSUMERS = 8


def _feeds_attention(node: Node, last: int | None = None) -> bool:
    """Whether `node`'s value reaches attention (sdpa, softmax, a product of two
    activations) within a few consumers; with `last`, only through permutations
    and ops whose last dim keeps that size (the head dim of q, k, v)."""
    frontier, seen = [node], {node}
    for _ in range(_MAX_CONSUMERS):
        following = []
        for user in (u for n in frontier for u in n.users if u not in seen):
            seen.add(user)
            by_weights = any(is_param_or_transpose(arg) for arg in user.all_input_nodes)  # a grouped linear
            if user.target in _ATTENTION_OPS and not by_weights:
                return True
            val = user.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dim() == 0:
                continue
            if last is None or user.target in _PERMUTATIONS or val.shape[-1] == last:
                following.append(user)
        frontier = following
    return False


def place_view(node: Node, ctx) -> Decision:
    """A view keeps each split on the out dim its elements land on (see the module docstring)."""
    x = node.args[0]
    layout = layout_of(ctx, x)
    cur_in, cur_out = list(shape_of(x)), list(shape_of(node))
    unit_map = _unit_dim_map(cur_in, cur_out)
    if unit_map is not None:
        # A split of a size-1 dim holds the element on one rank and padding on the others: gathered first.
        needed = Layout(*(R if isinstance(p, Shard) and p.dim not in unit_map and ctx.mesh.size(axis) > 1 else p
                          for axis, p in zip(AXES, layout.placements)))
        moved = (Shard(unit_map[p.dim], p.groups) if isinstance(p, Shard) and p.dim in unit_map
                 else R if isinstance(p, Shard) else p for p in needed.placements)
        return Decision({x: needed}, Layout(*moved))
    head_dim_last = _feeds_attention(node, last=cur_out[-1]) if cur_out else False
    needed, out = [], []
    for axis, p in zip(AXES, layout.placements):
        parts = ctx.mesh.size(axis)
        if not isinstance(p, Shard):
            needed.append(p)
            out.append(p)
            continue
        mapped = (_kept_uneven(cur_in[p.dim], shape_of(x), shape_of(node), p, parts)
                  or _map_view_split(cur_in, cur_out, p, parts, head_dim_last))
        if mapped is None:
            if not _ask_groups(ctx, x, cur_in, cur_out, p, parts, head_dim_last):
                problem = _view_problem(node, x, cur_in, cur_out, p.dim, axis, parts, ctx)
                if is_narrow_projection(x):
                    warnings.warn(f"{problem}: key/value heads run replicated over {axis}", stacklevel=2)
                elif all(user.target in _TAKING_APART for user, _ in users_past_casts(node)):
                    warnings.warn(f"{problem}: the parts are cut from the whole value over {axis}", stacklevel=2)
                elif _feeds_attention(node):
                    raise _heads_error(problem, parts)
                else:  # groups (a grouped linear's, a grouped norm's) whose producer cannot split inside each
                    warnings.warn(f"{problem}, and its producer cannot split inside each group: gathered whole over "
                                  f"{axis} for the view (sizes whose outer factor is a multiple of {parts} keep the "
                                  "split)", stacklevel=2)
            needed.append(R)  # provisional if groups were asked for; else replicated heads
            out.append(R)
            continue
        o, groups = mapped
        needed.append(p)
        out.append(Shard(o, groups))
        cur_in[p.dim] = split_size(cur_in[p.dim], parts)
        cur_out[o] = split_size(cur_out[o], parts)
    return Decision({x: Layout(*needed)}, Layout(*out))


def _kept_uneven(local_size, in_shape, out_shape, p: Shard, parts: int):
    """(out dim, 1) where an uneven plain split (of a dim whose block here is `local_size`) lands on its own
    dim, whole (padding stays at its end): the out dim of the view's segment around it (of the global
    shapes) that has the dim's size after the same product of the segment's dims."""
    if p.groups != 1 or local_size % parts == 0:
        return None
    a, _, c, e = _segment(in_shape, out_shape, p.dim)
    before = math.prod(in_shape[a:p.dim])
    kept = [o for o in range(c, e) if out_shape[o] == in_shape[p.dim] and math.prod(out_shape[c:o]) == before]
    return (kept[0], 1) if kept else None


def _unit_dim_map(in_shape, out_shape) -> dict[int, int] | None:
    """{in dim: out dim} of the dims of size > 1 of a view that only inserts or removes
    size-1 dims; else None."""
    kept_in = [d for d, size in enumerate(in_shape) if not is_one(size)]
    kept_out = [d for d, size in enumerate(out_shape) if not is_one(size)]
    if [in_shape[d] for d in kept_in] != [out_shape[d] for d in kept_out]:
        return None
    return dict(zip(kept_in, kept_out))


def _map_view_split(in_shape, out_shape, p: Shard, parts, head_dim_last: bool):
    """Where the split `p` of an input dim lands after a view: (out dim, groups), or None.

    The split lands on the first out dim whose leading factors consume the outer
    factor (the dims before it and the groups): `[3E]` as `S(g=3)` viewed as
    `[3, E]` is a plain split of `E`, `[n]` as `[1, n]` one of `n`. Refused as
    splits inside a head's own dim: the innermost new dim when leading dims take
    part of the outer factor only, or when it is the last dim and reaches
    attention as the head dim (`head_dim_last`: `[n * hd]` as `[n, hd]`).
    """
    a, _, c, e = _segment(in_shape, out_shape, p.dim)
    outer = math.prod(in_shape[a : p.dim]) * p.groups
    prefix = 1
    for o in range(c, e):
        size = out_shape[o]
        if outer % prefix == 0 and size % ((outer // prefix) * parts) == 0:
            innermost = parts > 1 and e - c > 1 and o == e - 1 and in_shape[p.dim] == math.prod(out_shape[c:e])
            inside_head = prefix > 1 and outer // prefix > 1
            if innermost and (inside_head or (head_dim_last and o == len(out_shape) - 1)):
                return None
            return o, outer // prefix
        prefix *= size
    return None


def _ask_groups(ctx, x, in_shape, out_shape, p: Shard, parts, head_dim_last: bool) -> bool:
    """Ask x's producer for a grouped split that this view could keep."""
    if p.dim != len(in_shape) - 1:
        return False
    for groups in range(2, in_shape[p.dim] // parts + 1):
        grouped = Shard(p.dim, groups)
        fits = in_shape[p.dim] % (groups * parts) == 0
        if fits and _map_view_split(in_shape, out_shape, grouped, parts, head_dim_last):
            return ctx.want_groups(x, groups)
    return False


def place_expand(node: Node, ctx) -> Decision:
    """expand / expand_as: x's splits shifted by the new leading dims (expand_as's other
    tensor gives only a shape; the lowering expands to the local shape)."""
    x = node.args[0]
    layout = layout_of(ctx, x)
    shift = len(shape_of(node)) - len(shape_of(x))
    out = [Shard(p.dim + shift, p.groups) if isinstance(p, Shard) else p for p in layout.placements]
    return Decision({x: layout}, Layout(*out))


def place_repeat(node: Node, ctx) -> Decision:
    """x.repeat(r0, r1, ..): a split dim repeated r times holds r times its groups."""
    x, repeats = node.args[:2]
    layout = layout_of(ctx, x)
    shift = len(repeats) - len(shape_of(x))
    out = [Shard(p.dim + shift, p.groups * repeats[p.dim + shift]) if isinstance(p, Shard) else p
           for p in layout.placements]
    return Decision({x: layout}, Layout(*out))


def _permutation(node: Node) -> list[int]:
    ndim = len(shape_of(node.args[0]))
    if node.target is aten.permute.default:
        return [normalize_dim(d, ndim) for d in node.args[1]]
    order = list(range(ndim))
    if node.target is aten.transpose.int:
        d0, d1 = (normalize_dim(d, ndim) for d in node.args[1:3])
        order[d0], order[d1] = order[d1], order[d0]
    else:  # aten.t, aten.numpy_T
        order.reverse()
    return order


def place_permute(node: Node, ctx) -> Decision:
    """Splits follow their dims; a permuted free tensor (`W.T`) stays free."""
    x = node.args[0]
    order = _permutation(node)
    if ctx.layout(x) is None:
        return ctx.permute_free(node, x, order)
    layout = layout_of(ctx, x)
    out = [Shard(order.index(p.dim), p.groups) if isinstance(p, Shard) else p for p in layout.placements]
    return Decision({x: layout}, Layout(*out))


def place_unbind(node: Node, ctx) -> Decision:
    """unbind(x, dim): `dim` whole; each slice keeps the other splits (packed q, k, v)."""
    x = node.args[0]
    dim = normalize_dim(get_arg(node, 1, "dim", 0), len(shape_of(x)))
    layout = layout_of(ctx, x)
    needed = Layout(*(R if isinstance(p, Shard) and p.dim == dim else p for p in layout.placements))
    out = Layout(*(Shard(p.dim - (p.dim > dim), p.groups) if isinstance(p, Shard) else p for p in needed.placements))
    return Decision({x: needed}, tuple(out for _ in range(shape_of(x)[dim])))


def _split_sizes(node: Node, dim: int) -> list[int]:
    """The sizes along `dim` of the pieces a split or chunk returns."""
    return [piece.shape[dim] for piece in node.meta["val"]]


def place_split(node: Node, ctx) -> Decision:
    """Chunks that cover whole groups of a split dim keep the split (each its share
    of the groups); a free parameter cut into chunks is split so, over col."""
    x = node.args[0]
    dim = normalize_dim(get_arg(node, 2, "dim", 0), len(shape_of(x)))
    sizes = _split_sizes(node, dim)
    free = not ctx.layout(x) and is_param(x)
    layout = _chunked_param(ctx, shape_of(x)[dim], sizes, dim) if free else layout_of(ctx, x)
    needed, outs = [], [[] for _ in sizes]
    for axis, p in zip(AXES, layout.placements):
        if not (isinstance(p, Shard) and p.dim == dim):
            needed.append(p)
            chunk_placements = [p] * len(sizes)
        else:
            chunk_groups = _chunk_groups(sizes, p.groups)
            if chunk_groups is None and len(set(sizes)) == 1 and dim == len(shape_of(x)) - 1:
                ctx.want_groups(x, len(sizes))
            needed.append(p if chunk_groups else R)
            chunk_placements = [Shard(dim, g) for g in chunk_groups] if chunk_groups else [R] * len(sizes)
            sizes = [s // ctx.mesh.size(axis) for s in sizes] if chunk_groups else sizes
        for out, placement in zip(outs, chunk_placements):
            out.append(placement)
    return Decision({x: Layout(*needed)}, tuple(Layout(*out) for out in outs))


def _chunk_groups(sizes, groups):
    """Each chunk's number of groups when the chunks cover whole groups, else None."""
    group = sum(sizes) // groups
    if any(s % group for s in sizes):
        return None
    return [s // group for s in sizes]


def _chunked_param(ctx, total, sizes, dim) -> Layout:
    """A free parameter's layout for `split`: groups of the chunks' common size over col."""
    common = math.gcd(*sizes)
    if len(sizes) < 2 or common % ctx.mesh.size("col"):
        return Layout.replicated()
    return Layout(R, R, Shard(dim, total // common))


def place_cat(node: Node, ctx) -> Decision:
    tensors = list(node.args[0])
    ndim = len(shape_of(tensors[0]))
    dim = normalize_dim(get_arg(node, 1, "dim", 0), ndim)
    required, out = align(ctx, node, tensors, shape_of(node), frozen=(dim,))
    even = all_same([shape_of(t)[dim] for t in tensors])
    for index, axis in enumerate(AXES):
        own = [ctx.layout(t).on(axis) if ctx.layout(t) else None for t in tensors]
        first = own[0]
        if isinstance(first, Shard) and first.dim == dim and even and all(p == first for p in own):
            for t in tensors:
                required[t] = required[t].with_axis(axis, first)
            out[index] = Shard(dim, first.groups * len(tensors))
    return Decision(required, Layout(*out))


def place_slice(node: Node, ctx) -> Decision:
    """slice(x, dim, ...): the sliced dim whole; a slice of all of it (`x[:, :, None]`) keeps every split."""
    if shape_of(node) != shape_of(node.args[0]):
        return dims_local(dim_arg)(node, ctx)
    return Decision({node.args[0]: layout_of(ctx, node.args[0])}, layout_of(ctx, node.args[0]))


def place_stack(node: Node, ctx) -> Decision:
    """stack(tensors, dim): as cat along a new dim. Every input takes the layout of the
    input with the most splits (partial sums stay on an axis only where every input is
    partial); the output has it with split dims at or after `dim` shifted by one."""
    tensors = list(dict.fromkeys(node.args[0]))
    dim = normalize_dim(get_arg(node, 1, "dim", 0), len(shape_of(node)))
    layouts = [layout_of(ctx, t) for t in tensors]
    widest = max(layouts, key=lambda layout: sum(isinstance(p, Shard) for p in layout.placements))
    needed = [P if all(isinstance(layout.placements[index], Partial) for layout in layouts) else p
              for index, p in enumerate(without_partial(widest).placements)]
    out = [Shard(p.dim + (p.dim >= dim), p.groups) if isinstance(p, Shard) else p for p in needed]
    return Decision({t: Layout(*needed) for t in tensors}, Layout(*out))


_VIEWS = [
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
    aten.unflatten.int,
]


def _local_shape(b: Builder, node: Node) -> list[int]:
    return LAYOUT.of(node).local_shape(node.meta["val"].shape, b.mesh)


def lower_reshape(b: Builder, node: Node, args, kwargs):
    return b.call(aten.reshape.default, args[0], _local_shape(b, node))


def lower_expand(b: Builder, node: Node, args, kwargs):
    return b.call(aten.expand.default, args[0], _local_shape(b, node))


def lower_squeeze(b: Builder, node: Node, args, kwargs):
    """squeeze, or a reshape to the local shape where a split leaves a dim of size 1 on this rank."""
    x = node.args[0]
    local_in = arg_layout(node, x).local_shape(shape_of(x), b.mesh)
    if local_in.count(1) == shape_of(x).count(1):
        return lower_default(b, node, args, kwargs)
    return lower_reshape(b, node, args, kwargs)


def lower_split(b: Builder, node: Node, args, kwargs):
    x = node.args[0]
    ndim = x.meta["val"].dim()
    dim = normalize_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), ndim)
    global_size = x.meta["val"].shape[dim]
    local_size = arg_layout(node, x).local_shape(x.meta["val"].shape, b.mesh)[dim]
    sizes = args[1]
    if isinstance(sizes, int):
        local = sizes * local_size // global_size
    else:
        local = [s * local_size // global_size for s in sizes]
    return b.call(node.target, args[0], local, dim)


PLACEMENT = {
    **{op: place_view for op in _VIEWS},
    aten.slice.Tensor: place_slice,
    aten.select.int: dims_local(dim_arg),
    aten.expand.default: place_expand,
    aten.expand_as.default: place_expand,
    aten.repeat.default: place_repeat,
    aten.transpose.int: place_permute,
    aten.permute.default: place_permute,
    aten.t.default: place_permute,
    aten.numpy_T.default: place_permute,
    aten.split.Tensor: place_split,
    aten.unbind.int: place_unbind,
    aten.split_with_sizes.default: place_split,
    aten.chunk.default: place_split,
    aten.cat.default: place_cat,
    aten.stack.default: place_stack,
}


LOWERING = {
    aten.view.default: lower_reshape,
    aten.reshape.default: lower_reshape,
    aten._unsafe_view.default: lower_reshape,
    aten.unflatten.int: lower_reshape,
    aten.squeeze.dim: lower_squeeze,
    aten.squeeze.dims: lower_squeeze,
    aten.squeeze.default: lower_squeeze,
    aten.expand.default: lower_expand,
    aten.expand_as.default: lower_expand,
    aten.split.Tensor: lower_split,
    aten.split_with_sizes.default: lower_split,
}

FAMILY = Family("views", PLACEMENT, lowering=LOWERING)
