"""Placement rules: for each op, the layouts it needs and the layout it makes.

A rule is `rule(node, ctx) -> Decision`. `ctx` is the placement pass's
`PlacementContext` (layouts so far, global shapes, the mesh, hints). A
`None` layout is a free parameter or buffer: the rule's requirement becomes
its layout. Rules never touch the graph.

Conventions: activations `[b, s, h]` are `S(0)S(0)S(2)`; weights of
`x @ W` are split over row (in features) and col (out features) and
replicated over depth; norm/bias vectors are split over col.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch.fx import Node

from tess_compile.layout import Layout, Partial, Placement, Replicate, Shard
from tess_compile.mesh import AXES

__all__ = [
    "Decision",
    "PLACEMENT_RULES",
    "cross_entropy_is_split",
    "display_name",
    "place_replicated",
    "uses_summa",
    "vocab_parallel",
    "weight_product_rules",
]

aten = torch.ops.aten
R, P = Replicate(), Partial()


@dataclass
class Decision:
    """Layouts an op needs of its tensor inputs, and the layout of its output."""

    args: dict[Node, Layout]
    out: object  # Layout, or a tuple of Layouts for multi-output ops


# ----------------------------------------------------------------- helpers


def _tensor_inputs(node: Node) -> list[Node]:
    return [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]


def _shape(node: Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _layout(ctx, node: Node) -> Layout:
    """The node's layout; a free tensor counts as replicated."""
    return ctx.layout(node) or Layout.replicated()


def _no_partial(layout: Layout) -> Layout:
    return Layout(*(R if isinstance(p, Partial) else p for p in layout.placements))


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _arg(node: Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _axis_size(ctx, axis: str) -> int:
    return ctx.mesh.size(axis)


# ----------------------------------------------------------- elementwise

# How an op treats partial sums: "sum" (every tensor may be partial),
# "scale" (one partial tensor times replicated ones), "unary" (passes through).
_LINEARITY = {
    aten.add.Tensor: "sum",
    aten.sub.Tensor: "sum",
    aten.mul.Tensor: "scale",
    aten.div.Tensor: "scale",
    aten.neg.default: "unary",
    aten.clone.default: "unary",
    aten.alias.default: "unary",
    aten._to_copy.default: "unary",
    aten.to.dtype: "unary",
    aten.to.dtype_layout: "unary",
    aten.to.device: "unary",
    aten.contiguous.default: "unary",
    aten.detach.default: "unary",
    aten.mul.Scalar: "unary",
    aten.div.Scalar: "unary",
}


def _partial_stays(node: Node, tensors: list[Node], placements: dict) -> bool:
    kind = _LINEARITY.get(node.target)
    partial = [t for t in tensors if isinstance(placements[t], Partial)]
    if not partial or kind is None:
        return False
    if kind == "unary":
        return True
    if kind == "sum":
        numbers = [a for a in node.args if isinstance(a, (int, float))]
        return len(partial) == len(tensors) and not numbers
    others_replicated = all(isinstance(placements[t], Replicate) or placements[t] is None for t in tensors if t not in partial)
    is_divisor = node.target is aten.div.Tensor and tensors[0] not in partial
    return len(partial) == 1 and others_replicated and not is_divisor


def _align(ctx, node: Node, tensors: list[Node], out_shape, frozen=()) -> tuple[dict, list]:
    """Broadcast-align the splits of `tensors` to `out_shape`, per axis.

    Out dims in `frozen` stay unsplit. Returns (required layouts, output placements).
    """
    n_out = len(out_shape)
    tensors = list(dict.fromkeys(tensors))  # a tensor may come twice (cat([x, x]))
    required = {t: [] for t in tensors}
    out: list[Placement] = []
    for axis in AXES:
        placements = {t: (ctx.layout(t).on(axis) if ctx.layout(t) else None) for t in tensors}
        if _partial_stays(node, tensors, placements):
            for t in tensors:
                required[t].append(placements[t] or R)
            out.append(P)
            continue
        chosen = None
        for t in tensors:
            p = placements[t]
            if isinstance(p, Shard):
                od = p.dim + n_out - len(_shape(t))
                if od not in frozen and _shape(t)[p.dim] == out_shape[od]:
                    chosen = Shard(od, p.groups)
                    break
        for t in tensors:
            required[t].append(_aligned(chosen, _shape(t), out_shape))
        out.append(chosen or R)
    return {t: Layout(*ps) for t, ps in required.items()}, out


def _aligned(chosen, shape, out_shape) -> Placement:
    if chosen is None:
        return R
    dim = chosen.dim - (len(out_shape) - len(shape))
    if dim >= 0 and shape[dim] == out_shape[chosen.dim]:
        return Shard(dim, chosen.groups)
    return R


def place_pointwise(node: Node, ctx) -> Decision:
    tensors = _tensor_inputs(node)
    required, out = _align(ctx, node, tensors, _shape(node))
    return Decision(required, Layout(*out))


def place_type_as(node: Node, ctx) -> Decision:
    """type_as(x, other): other gives only a dtype; x keeps its layout."""
    x = node.args[0]
    return Decision({x: _layout(ctx, x)}, _layout(ctx, x))


def place_nothing(node: Node, ctx) -> Decision:
    """An op that makes no value (a metadata assertion): no layouts needed."""
    return Decision({}, None)


def place_dropout(node: Node, ctx) -> Decision:
    decision = place_pointwise(node, ctx)
    p, train = _arg(node, 1, "p"), _arg(node, 2, "train")
    replicated = decision.out.axes_where(Replicate, ctx.mesh)
    if train and p > 0 and replicated:
        raise ValueError(
            f"dropout(p={p}) on {node.args[0].name!r} of shape {list(_shape(node))} is replicated along "
            f"{replicated} on mesh {ctx.mesh}: replicas would draw different masks; apply dropout "
            "to split activations only, or use p=0"
        )
    return decision


# ------------------------------------------------------------ reductions


def _reduced_dims(node: Node, ndim: int) -> list[int]:
    dims = _arg(node, 1, "dim") if node.target in (aten.sum.dim_IntList, aten.mean.dim) else None
    if not dims:
        return list(range(ndim))
    return sorted(_norm_dim(d, ndim) for d in dims)


def place_reduction(node: Node, ctx) -> Decision:
    x = node.args[0]
    layout = _layout(ctx, x)
    ndim = len(_shape(x))
    dims = _reduced_dims(node, ndim)
    keepdim = node.target in (aten.sum.dim_IntList, aten.mean.dim) and _arg(node, 2, "keepdim", False)
    out = []
    for p in layout.placements:
        if isinstance(p, Shard) and p.dim in dims:
            out.append(P)
        elif isinstance(p, Shard):
            shift = 0 if keepdim else sum(d < p.dim for d in dims)
            out.append(Shard(p.dim - shift, p.groups))
        else:
            out.append(p)
    return Decision({x: layout}, Layout(*out))


# -------------------------------------------- ops that work across dims


def _dims_local(dims_of):
    """Rule for an op that works across some dims: those dims must be whole."""

    def rule(node: Node, ctx) -> Decision:
        x = node.args[0]
        ndim = len(_shape(x))
        dims = [_norm_dim(d, ndim) for d in dims_of(node)]
        layout = _no_partial(_layout(ctx, x))
        needed = Layout(*(R if isinstance(p, Shard) and p.dim in dims else p for p in layout.placements))
        out = needed
        if node.target is aten.select.int:
            out = Layout(*(Shard(p.dim - (p.dim > dims[0]), p.groups) if isinstance(p, Shard) else p for p in needed.placements))
        return Decision({x: needed}, out)

    return rule


def _dim_arg(node: Node) -> list[int]:
    return [_arg(node, 1, "dim", 0)]


def _last_two(node: Node) -> list[int]:
    return [-2, -1]


def _padded_dims(node: Node) -> list[int]:
    """aten.pad's `pad` lists (before, after) pairs from the last dim backwards."""
    return [-1 - k for k in range(len(node.args[1]) // 2)]


# ------------------------------------------------------------------ views


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


def _view_error(node, x, in_shape, out_shape, dim, axis, parts, ctx):
    a, b, c, e = _segment(in_shape, out_shape, dim)
    factors = list(out_shape[c:e])
    return ValueError(
        f"{node.target} of {display_name(x)!r} from {list(_shape(x))} to {list(_shape(node))} splits dim {dim} "
        f"(split over {axis} in {parts} parts on mesh {ctx.mesh}) into {factors}: the outer factor "
        f"{factors[0]} is not divisible by {parts}. For attention this is a head count not divisible "
        f"by {parts}: use a head count (and hidden size) that is a multiple of {parts}, or another mesh"
    )


def place_view(node: Node, ctx) -> Decision:
    x = node.args[0]
    layout = _layout(ctx, x)
    cur_in, cur_out = list(_shape(x)), list(_shape(node))
    needed, out = [], []
    for axis, p in zip(AXES, layout.placements):
        parts = _axis_size(ctx, axis)
        if not isinstance(p, Shard):
            needed.append(p)
            out.append(p)
            continue
        mapped = _map_view_split(cur_in, cur_out, p, parts)
        if mapped is None:
            if not _ask_groups(ctx, x, cur_in, cur_out, p, parts):
                error = _view_error(node, x, cur_in, cur_out, p.dim, axis, parts, ctx)
                if not _is_narrow_projection(x):
                    raise error
                warnings.warn(f"{error.args[0].split(': use')[0]}: key/value heads run replicated over {axis}", stacklevel=2)
            needed.append(R)  # provisional if groups were asked for; else replicated heads
            out.append(R)
            continue
        o, groups = mapped
        needed.append(p)
        out.append(Shard(o, groups))
        cur_in[p.dim] //= parts
        cur_out[o] //= parts
    return Decision({x: Layout(*needed)}, Layout(*out))


def _map_view_split(in_shape, out_shape, p: Shard, parts):
    """Where the split `p` of an input dim lands after a view: (out dim, groups), or None.

    Splitting inside the innermost new dim (a head's own dim) is refused.
    """
    a, _, c, e = _segment(in_shape, out_shape, p.dim)
    outer = math.prod(in_shape[a : p.dim]) * p.groups
    prefix = 1
    for o in range(c, e):
        size = out_shape[o]
        if outer % prefix == 0 and size % ((outer // prefix) * parts) == 0:
            if parts > 1 and e - c > 1 and o == e - 1 and in_shape[p.dim] == math.prod(out_shape[c:e]):
                return None
            return o, outer // prefix
        prefix *= size
    return None


def _is_narrow_projection(x: Node) -> bool:
    """A projection to fewer features than it takes: grouped-query attention's key and
    value heads, whose count need not divide q (they then run replicated)."""
    if x.target is not aten.linear.default:
        return False
    out_features, in_features = _shape(x.args[1])[:2]
    return out_features < in_features


def _ask_groups(ctx, x, in_shape, out_shape, p: Shard, parts) -> bool:
    """Ask x's producer for a grouped split that this view could keep."""
    if p.dim != len(in_shape) - 1:
        return False
    for groups in range(2, in_shape[p.dim] // parts + 1):
        if in_shape[p.dim] % (groups * parts) == 0 and _map_view_split(in_shape, out_shape, Shard(p.dim, groups), parts):
            return ctx.want_groups(x, groups)
    return False


def place_expand(node: Node, ctx) -> Decision:
    x = node.args[0]
    layout = _layout(ctx, x)
    shift = len(_shape(node)) - len(_shape(x))
    out = [Shard(p.dim + shift, p.groups) if isinstance(p, Shard) else p for p in layout.placements]
    return Decision({x: layout}, Layout(*out))


def _permutation(node: Node) -> list[int]:
    ndim = len(_shape(node.args[0]))
    if node.target is aten.permute.default:
        return [_norm_dim(d, ndim) for d in node.args[1]]
    order = list(range(ndim))
    if node.target is aten.transpose.int:
        d0, d1 = (_norm_dim(d, ndim) for d in node.args[1:3])
        order[d0], order[d1] = order[d1], order[d0]
    else:  # aten.t
        order.reverse()
    return order


def place_permute(node: Node, ctx) -> Decision:
    x = node.args[0]
    layout = _layout(ctx, x)
    order = _permutation(node)
    out = [Shard(order.index(p.dim), p.groups) if isinstance(p, Shard) else p for p in layout.placements]
    return Decision({x: layout}, Layout(*out))


def _split_sizes(node: Node) -> list[int]:
    x, size_or_sizes = node.args[0], node.args[1]
    dim = _norm_dim(_arg(node, 2, "dim", 0), len(_shape(x)))
    if isinstance(size_or_sizes, int):
        total = _shape(x)[dim]
        return [min(size_or_sizes, total - s) for s in range(0, total, size_or_sizes)]
    return list(size_or_sizes)


def place_split(node: Node, ctx) -> Decision:
    x = node.args[0]
    dim = _norm_dim(_arg(node, 2, "dim", 0), len(_shape(x)))
    sizes = _split_sizes(node)
    chunks, equal = len(sizes), len(set(sizes)) == 1
    layout = _layout(ctx, x)
    needed, out = [], []
    for p in layout.placements:
        if not (isinstance(p, Shard) and p.dim == dim):
            needed.append(p)
            out.append(p)
        elif equal and p.groups % chunks == 0:
            needed.append(p)
            out.append(Shard(dim, p.groups // chunks))
        else:
            if equal and dim == len(_shape(x)) - 1:
                ctx.want_groups(x, chunks)
            needed.append(R)
            out.append(R)
    return Decision({x: Layout(*needed)}, tuple(Layout(*out) for _ in sizes))


def place_cat(node: Node, ctx) -> Decision:
    tensors = list(node.args[0])
    ndim = len(_shape(tensors[0]))
    dim = _norm_dim(_arg(node, 1, "dim", 0), ndim)
    required, out = _align(ctx, node, tensors, _shape(node), frozen=(dim,))
    sizes = {_shape(t)[dim] for t in tensors}
    for index, axis in enumerate(AXES):
        own = [ctx.layout(t).on(axis) if ctx.layout(t) else None for t in tensors]
        first = own[0]
        if isinstance(first, Shard) and first.dim == dim and len(sizes) == 1 and all(p == first for p in own):
            for t in tensors:
                required[t] = required[t].with_axis(axis, first)
            out[index] = Shard(dim, first.groups * len(tensors))
    return Decision(required, Layout(*out))


# ------------------------------------------------------------ matmuls


def _is_param(node: Node) -> bool:
    return node.op == "placeholder" and node.meta.get("role", ("",))[0] == "param"


def display_name(node: Node) -> str:
    """The model's name for a parameter, buffer or input; the node's name otherwise."""
    role = node.meta.get("role")
    if role and role[0] != "input":
        return role[1]
    return node.meta.get("weight_input", node.name)


def _check_divisible(what: str, node: Node, size: int, parts: int, ctx, fix: str) -> None:
    if size % parts:
        raise ValueError(
            f"{what} of {display_name(node)!r} (shape {list(_shape(node))}) is {size}, not divisible by {parts} "
            f"on mesh {ctx.mesh}: {fix}"
        )


def _row_block_dim(ctx, x: Node, layout: Layout, axis: str) -> Placement:
    """x's split along depth or row: kept on its leading dim, else dim 0."""
    p = layout.on(axis)
    ndim = len(_shape(x))
    if isinstance(p, Shard) and p.dim < ndim - 1:
        return p
    if ndim < 2:
        raise ValueError(
            f"{display_name(x)!r} of shape {list(_shape(x))} feeds a matmul without a batch dim; "
            "Tesseract splits rows over depth and row: give the input a batch dim"
        )
    return Shard(0)


def _place_summa(node: Node, ctx, x: Node, w: Node, bias: Node | None, w_in: int, w_out: int) -> Decision:
    """C = x @ W by Tesseract's algorithms: x rows over depth and row, features over col.

    W takes in features over row and out features over col (`C = A @ B`),
    unless an earlier consumer already laid it out the other way round
    (out over row, in over col): then `C = A @ B^T` uses it as it is.
    """
    mesh = ctx.mesh
    x_layout = _no_partial(_layout(ctx, x))
    ndim = len(_shape(x))
    col = x_layout.col
    groups_in = col.groups if isinstance(col, Shard) and col.dim == ndim - 1 else 1
    groups_out = ctx.hints.get(node, 1)
    w_layout = ctx.layout(w)
    transposed = (
        w_layout is not None
        and w_layout.depth == R
        and w_layout.col == Shard(w_in, groups_in)
        and isinstance(w_layout.row, Shard)
        and w_layout.row.dim == w_out
    )
    if transposed:
        groups_out = w_layout.row.groups
    in_features, out_features = _shape(w)[w_in], _shape(w)[w_out]
    fix = f"use sizes that are multiples of q={mesh.q} (hidden size, heads, MLP width), or another q"
    _check_divisible("in features", w, in_features, mesh.q * groups_in, ctx, fix)
    split_out = transposed or out_features % (mesh.q * groups_out) == 0 or not _is_narrow_projection(node)
    if not split_out:
        warnings.warn(
            f"{node.target} with weight {display_name(w)!r} of shape {list(_shape(w))}: out features "
            f"{out_features} do not divide by q={mesh.q} on mesh {mesh}, so its output (e.g. grouped-query "
            "key/value heads) runs replicated over col",
            stacklevel=2,
        )
        return _place_narrow_summa(node, ctx, x, w, bias, w_in, w_out, groups_in)
    _check_divisible("out features", w, out_features, mesh.q * groups_out, ctx, fix)
    depth = _row_block_dim(ctx, x, x_layout, "depth")
    row = _row_block_dim(ctx, x, x_layout, "row")
    x_needed = Layout(depth, row, Shard(ndim - 1, groups_in))
    _check_rows(node, x, x_needed, ctx)
    w_needed = w_layout if transposed else Layout(R, Shard(w_in, groups_in), Shard(w_out, groups_out))
    args = {x: x_needed, w: w_needed}
    if bias is not None:
        args[bias] = Layout(R, R, Shard(0, groups_out))
    return Decision(args, Layout(depth, row, Shard(ndim - 1, groups_out)))


def _place_narrow_summa(node: Node, ctx, x: Node, w: Node, bias, w_in: int, w_out: int, groups_in: int) -> Decision:
    """x @ W with W's out features whole on every column: each column computes the
    whole output of its rows (the same SUMMA steps; the output is replicated over col)."""
    x_layout = _no_partial(_layout(ctx, x))
    ndim = len(_shape(x))
    depth = _row_block_dim(ctx, x, x_layout, "depth")
    row = _row_block_dim(ctx, x, x_layout, "row")
    x_needed = Layout(depth, row, Shard(ndim - 1, groups_in))
    _check_rows(node, x, x_needed, ctx)
    args = {x: x_needed, w: Layout(R, Shard(w_in, groups_in), R)}
    if bias is not None:
        args[bias] = Layout.replicated()
    return Decision(args, Layout(depth, row, R))


def _check_rows(node: Node, x: Node, layout: Layout, ctx) -> None:
    local = list(_shape(x))
    for axis in ("depth", "row"):
        p = layout.on(axis)
        parts = ctx.mesh.size(axis)
        if local[p.dim] % parts:
            raise ValueError(
                f"{node.target} input {display_name(x)!r} of shape {list(_shape(x))}: dim {p.dim} "
                f"is not divisible by d*q = {ctx.mesh.d * ctx.mesh.q} on mesh {ctx.mesh}; "
                f"use a batch that is a multiple of {ctx.mesh.d * ctx.mesh.q}"
            )
        local[p.dim] //= parts


def uses_summa(node: Node) -> bool:
    """Whether a matmul-like node multiplies by a 2-D parameter (Tesseract's SUMMA)."""
    if node.target is aten.linear.default:
        return True
    if node.target is aten.addmm.default:
        plain = _arg(node, 3, "beta", 1) == 1 and _arg(node, 4, "alpha", 1) == 1
        return plain and _is_param(node.args[2])
    weight = node.args[1]
    return _is_param(weight) and len(_shape(weight)) == 2


def weight_product_rules(place_product) -> dict:
    """The rules of the ops that may multiply by a weight, given how a mode places
    `x @ W`: `place_product(node, ctx, x, w, bias, w_in, w_out)`. Products of two
    activations are batched matmuls; addmm by a non-parameter runs replicated."""

    def place_linear(node: Node, ctx) -> Decision:
        return place_product(node, ctx, node.args[0], node.args[1], _arg(node, 2, "bias"), w_in=1, w_out=0)

    def place_addmm(node: Node, ctx) -> Decision:
        if not uses_summa(node):
            return place_replicated(node, ctx)
        bias, x, w = node.args[:3]
        return place_product(node, ctx, x, w, bias, w_in=0, w_out=1)

    def place_matmul(node: Node, ctx) -> Decision:
        a, b = node.args[:2]
        if uses_summa(node):
            return place_product(node, ctx, a, b, None, w_in=0, w_out=1)
        if len(_shape(a)) < 2 or len(_shape(b)) < 2:
            return place_replicated(node, ctx)
        return _place_batched_matmul(node, ctx, a, b)

    return {
        aten.linear.default: place_linear,
        aten.addmm.default: place_addmm,
        aten.matmul.default: place_matmul,
        aten.mm.default: place_matmul,
        aten.bmm.default: place_matmul,
    }


def _place_batched_matmul(node: Node, ctx, a: Node, b: Node) -> Decision:
    """Activation @ activation: batch dims aligned, m or n kept split, k split -> partial."""
    out_shape = _shape(node)
    n_out = len(out_shape)
    batch = tuple(range(n_out - 2))
    required, out = _align(ctx, node, [a, b], out_shape, frozen=(n_out - 2, n_out - 1))
    la, lb = _no_partial(_layout(ctx, a)), _no_partial(_layout(ctx, b))
    nda, ndb = len(_shape(a)), len(_shape(b))
    for index, axis in enumerate(AXES):
        if out[index] != R and isinstance(out[index], Shard) and out[index].dim in batch:
            continue
        pa, pb = la.on(axis), lb.on(axis)
        if isinstance(pa, Shard) and pa.dim == nda - 2:
            pair, out[index] = (pa, R), Shard(n_out - 2, pa.groups)
        elif isinstance(pb, Shard) and pb.dim == ndb - 1:
            pair, out[index] = (R, pb), Shard(n_out - 1, pb.groups)
        elif isinstance(pa, Shard) and pa.dim == nda - 1 and pb == Shard(ndb - 2, pa.groups):
            pair, out[index] = (pa, pb), P
        else:
            pair, out[index] = (R, R), R
        required[a] = required[a].with_axis(axis, pair[0])
        required[b] = required[b].with_axis(axis, pair[1])
    return Decision(required, Layout(*out))


def place_attention(node: Node, ctx) -> Decision:
    """scaled_dot_product_attention: local when batch and heads are split, not seq or head dim."""
    tensors = _tensor_inputs(node)
    out_shape = _shape(node)
    n_out = len(out_shape)
    required, out = _align(ctx, node, tensors, out_shape, frozen=(n_out - 2, n_out - 1))
    if _arg(node, 7, "enable_gqa", False):
        _keep_gqa_pairing(ctx, node, required, out)
    return Decision(required, Layout(*out))


def _keep_gqa_pairing(ctx, node: Node, required: dict, out: list) -> None:
    """Grouped-query attention: query head n uses kv head n // (heads / kv_heads),
    so kv heads are split like query heads, or nobody's heads are split."""
    query, key, value = node.args[:3]
    heads_dim = len(_shape(query)) - 3
    kv_heads = _shape(key)[heads_dim]
    for index, axis in enumerate(AXES):
        if out[index] != Shard(heads_dim):
            continue
        split_kv = kv_heads % ctx.mesh.size(axis) == 0
        for t in (query, key, value):
            required[t] = required[t].with_axis(axis, Shard(heads_dim) if split_kv else R)
        out[index] = Shard(heads_dim) if split_kv else R


def vocab_parallel(node: Node, weight_layout: Layout | None) -> bool:
    """Whether an embedding looks up a table split over rows by vocab (`R S(0) S(1)`)."""
    return weight_layout is not None and weight_layout.row == Shard(0) and weight_layout.col == Shard(1)


def place_embedding(node: Node, ctx) -> Decision:
    """Token lookup. A free table [V, h] is split vocab over row and hidden over col
    (1/q^2 of it a rank, and a tied output head multiplies it where it lies); each
    rank looks up the ids of its row group that fall in its vocab block, and a
    reduce-scatter along row sums and splits them. Ids not split over row (e.g.
    positions) use a table split over col only."""
    weight, ids = node.args[:2]
    ids_layout = _no_partial(_layout(ctx, ids))
    w_layout = ctx.layout(weight)
    vocab, hidden = _shape(weight)
    n_ids = len(_shape(ids))
    q = ctx.mesh.q
    batch_split = ids_layout.row == Shard(0) and ids_layout.col == R
    plain_lookup = _arg(node, 2, "padding_idx", -1) == -1 and not _arg(node, 3, "scale_grad_by_freq", False)
    if batch_split and plain_lookup and (vocab_parallel(node, w_layout) or (w_layout is None and vocab % q == 0 and hidden % q == 0)):
        w_needed = Layout(R, Shard(0), Shard(1))
        return Decision({weight: w_needed, ids: ids_layout}, Layout(ids_layout.depth, Shard(0), Shard(n_ids)))
    w_needed, out = [], []
    for axis, p in zip(AXES, ids_layout.placements):
        w_p = w_layout.on(axis) if w_layout else None
        if isinstance(p, Shard):
            w_needed.append(R)
            out.append(p)
        elif isinstance(w_p, Shard) and w_p.dim == 1:
            w_needed.append(w_p)
            out.append(Shard(n_ids, w_p.groups))
        elif w_p is None and axis == "col" and hidden % ctx.mesh.size(axis) == 0:
            w_needed.append(Shard(1))
            out.append(Shard(n_ids))
        else:
            w_needed.append(R)
            out.append(R)
    return Decision({weight: Layout(*w_needed), ids: ids_layout}, Layout(*out))


# ------------------------------------------------------------------ norms


def place_norm(node: Node, ctx) -> Decision:
    """layer_norm / rms_norm over the last dims; a split normalised dim is reduced by all-reduce."""
    x = node.args[0]
    layout = _no_partial(_layout(ctx, x))
    ndim = len(_shape(x))
    first = ndim - len(node.args[1])
    affine = Layout(*(Shard(p.dim - first, p.groups) if isinstance(p, Shard) and p.dim >= first else R for p in layout.placements))
    args = {x: layout}
    params = node.args[2:4] if node.target is aten.layer_norm.default else node.args[2:3]
    for param in params:
        if isinstance(param, Node):
            args[param] = affine
    return Decision(args, layout)


def place_conv(node: Node, ctx) -> Decision:
    """convNd(x, W, b): batch kept split over depth and row; out channels over col
    (a column-parallel conv, no communication); x's channels and space whole."""
    x, weight = node.args[:2]
    bias = _arg(node, 2, "bias")
    x_layout = _layout(ctx, x)
    batch = [p if isinstance(p, Shard) and p.dim == 0 else R for p in x_layout.placements[:2]]
    split_out = _shape(weight)[0] % ctx.mesh.size("col") == 0
    col = Shard(0) if split_out else R
    args = {x: Layout(*batch, R), weight: Layout(R, R, col)}
    if isinstance(bias, Node):
        args[bias] = Layout(R, R, col)
    return Decision(args, Layout(*batch, Shard(1) if split_out else R))


def place_like_factory(node: Node, ctx) -> Decision:
    """new_ones / new_zeros / new_full: the input gives only dtype and device."""
    return Decision({}, Layout.replicated())


def cross_entropy_is_split(node: Node) -> bool:
    """Whether cross_entropy_loss takes the vocab-parallel path: [N, C] logits,
    no class weights, no label smoothing."""
    plain = _arg(node, 2, "weight") is None and _arg(node, 5, "label_smoothing", 0.0) == 0.0
    return plain and len(_shape(node.args[0])) == 2


def place_cross_entropy(node: Node, ctx) -> Decision:
    """Cross-entropy over [N, C] logits split over rows and classes: log-sum-exp and the
    target logit by collectives (Optimus 3.2), never the whole logits on a rank."""
    if not cross_entropy_is_split(node):
        return place_replicated(node, ctx)
    logits, target = node.args[:2]
    layout = _no_partial(_layout(ctx, logits))
    target_layout = Layout(*(p if isinstance(p, Shard) and p.dim == 0 else R for p in layout.placements))
    reduction = _arg(node, 3, "reduction", 1)
    out = target_layout if reduction == 0 else Layout.replicated()
    return Decision({logits: layout, target: target_layout}, out)


def place_replicated(node: Node, ctx) -> Decision:
    """The fallback: every input whole on every rank, the op run as is."""
    args = {t: Layout.replicated() for t in _tensor_inputs(node)}
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return Decision(args, tuple(Layout.replicated() for _ in val))
    return Decision(args, Layout.replicated() if isinstance(val, torch.Tensor) else None)


_POINTWISE = [
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar,
    aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor, aten.neg.default, aten.exp.default, aten.log.default, aten.sqrt.default,
    aten.rsqrt.default, aten.abs.default, aten.tanh.default, aten.sigmoid.default, aten.relu.default,
    aten.gelu.default, aten.silu.default, aten.erf.default, aten.sin.default, aten.cos.default,
    aten.clone.default, aten.alias.default, aten._to_copy.default, aten.to.dtype,
    aten.to.dtype_layout, aten.to.device, aten.ge.Scalar, aten.le.Scalar, aten.ge.Tensor,
    aten.le.Tensor, aten.lt.Tensor, aten.gt.Tensor, aten.__and__.Tensor, aten.__or__.Tensor,
    aten.contiguous.default, aten.detach.default, aten.where.self, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.maximum.default, aten.minimum.default, aten.clamp.default,
    aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.lt.Scalar, aten.gt.Scalar,
    aten.logical_not.default, aten.logical_and.default, aten.logical_or.default,
    aten.bitwise_not.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.square.default, aten.reciprocal.default,
]
_VIEWS = [
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
    aten.unflatten.int,
]
_FACTORIES = [
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.ones.default,
    aten.zeros.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
]

PLACEMENT_RULES = {
    **{op: place_pointwise for op in _POINTWISE},
    **{op: place_view for op in _VIEWS},
    **{op: place_replicated for op in _FACTORIES},
    aten.dropout.default: place_dropout,
    aten.type_as.default: place_type_as,
    aten._assert_tensor_metadata.default: place_nothing,
    aten.sum.dim_IntList: place_reduction,
    aten.mean.dim: place_reduction,
    aten.sum.default: place_reduction,
    aten.mean.default: place_reduction,
    aten.softmax.int: _dims_local(_dim_arg),
    aten._softmax.default: _dims_local(_dim_arg),
    aten.log_softmax.int: _dims_local(_dim_arg),
    aten._log_softmax.default: _dims_local(_dim_arg),
    aten.cumsum.default: _dims_local(_dim_arg),
    aten.slice.Tensor: _dims_local(_dim_arg),
    aten.select.int: _dims_local(_dim_arg),
    aten.tril.default: _dims_local(_last_two),
    aten.pad.default: _dims_local(_padded_dims),
    aten.diff.default: _dims_local(lambda node: [_arg(node, 2, "dim", -1)]),
    aten.conv1d.default: place_conv,
    aten.conv2d.default: place_conv,
    aten.conv3d.default: place_conv,
    aten.new_ones.default: place_like_factory,
    aten.new_zeros.default: place_like_factory,
    aten.new_full.default: place_like_factory,
    aten.new_empty.default: place_like_factory,
    aten.cross_entropy_loss.default: place_cross_entropy,
    aten.triu.default: _dims_local(_last_two),
    aten.expand.default: place_expand,
    aten.transpose.int: place_permute,
    aten.permute.default: place_permute,
    aten.t.default: place_permute,
    aten.split.Tensor: place_split,
    aten.split_with_sizes.default: place_split,
    aten.cat.default: place_cat,
    **weight_product_rules(_place_summa),
    aten.scaled_dot_product_attention.default: place_attention,
    aten.embedding.default: place_embedding,
    aten.layer_norm.default: place_norm,
    aten.rms_norm.default: place_norm,
}
