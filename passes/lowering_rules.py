"""Lowering rules: how each op runs on one rank's local tensors.

A rule is `lower(b, node, args, kwargs) -> Node | tuple`: `node` is the
placed node (global shapes in `meta["val"]`, layouts in `meta`), `args`
and `kwargs` its arguments with every tensor already converted to the
layout the op asked for. Ops without a rule run as they are on local
tensors. Shape arguments are global in the captured graph; rules that take
shapes make them local.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx import Node
from torch.fx.node import has_side_effect, map_arg

from passes.builder import Builder, aten
from passes.capture import device_of
from passes.rules.common import display_name, get_arg
from passes.rules.convolutions import conv_groups, groups_index
from passes.rules.embeddings import vocab_parallel
from passes.rules.losses import cross_entropy_is_split
from passes.rules.products import uses_summa
from passes.summa import matmul
from tess_compile import collectives as c
from tess_compile.layout import Layout, Partial, Shard
from tess_compile.norms import split_norm

__all__ = ["LOWERING_RULES", "check_in_range", "check_lookup_ids", "lower_default", "masked_lookup"]


def lower_default(b: Builder, node: Node, args, kwargs):
    return b.call(node.target, *args, **kwargs)


def _local_shape(b: Builder, node: Node) -> list[int]:
    return node.meta["layout"].local_shape(node.meta["val"].shape, b.mesh)


def _split_axes(b: Builder, layout: Layout, dims) -> list[str]:
    """Axes of size > 1 that split one of `dims`."""
    return [a for a in layout.axes_where(Shard, b.mesh) if layout.on(a).dim in dims]


def lower_reshape(b: Builder, node: Node, args, kwargs):
    return b.call(aten.reshape.default, args[0], _local_shape(b, node))


def lower_expand(b: Builder, node: Node, args, kwargs):
    return b.call(aten.expand.default, args[0], _local_shape(b, node))


def lower_split(b: Builder, node: Node, args, kwargs):
    x = node.args[0]
    ndim = x.meta["val"].dim()
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    dim = dim + ndim if dim < 0 else dim
    global_size = x.meta["val"].shape[dim]
    local_size = node.meta["arg_layouts"][x].local_shape(x.meta["val"].shape, b.mesh)[dim]
    sizes = args[1]
    if isinstance(sizes, int):
        local = sizes * local_size // global_size
    else:
        local = [s * local_size // global_size for s in sizes]
    return b.call(node.target, args[0], local, dim)


def _last_dim(x: Node) -> int:
    return x.meta["val"].dim() - 1


def _weight_layout(node: Node, index: int) -> Layout:
    return node.meta["arg_layouts"][node.args[index]]


def lower_linear(b: Builder, node: Node, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    y = matmul(b, x, w, _weight_layout(node, 1), out_dim=0, product=aten.linear.default, a_dim=_last_dim(node.args[0]))
    return y if bias is None else b.call(aten.add.Tensor, y, bias)


def lower_matmul(b: Builder, node: Node, args, kwargs):
    if not uses_summa(node):
        return lower_default(b, node, args, kwargs)
    return matmul(b, args[0], args[1], _weight_layout(node, 1), out_dim=1, product=aten.matmul.default, a_dim=_last_dim(node.args[0]))


def lower_addmm(b: Builder, node: Node, args, kwargs):
    if not uses_summa(node):
        return lower_default(b, node, args, kwargs)
    y = matmul(b, args[1], args[2], _weight_layout(node, 2), out_dim=1, product=aten.matmul.default, a_dim=_last_dim(node.args[1]))
    return b.call(aten.add.Tensor, y, args[0])


def lower_mean(b: Builder, node: Node, args, kwargs):
    """Mean over a split dim: local sum over the global count gives partial sums."""
    x = node.args[0]
    ndim = x.meta["val"].dim()
    dims = list(range(ndim)) if node.target is aten.mean.default or not args[1] else [d % ndim for d in args[1]]
    if not _split_axes(b, node.meta["arg_layouts"][x], dims):
        return lower_default(b, node, args, kwargs)
    keepdim = node.target is aten.mean.dim and (args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    count = math.prod(x.meta["val"].shape[d] for d in dims)
    total = b.call(aten.sum.dim_IntList, args[0], dims, keepdim)
    return b.call(aten.div.Tensor, total, count)


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
    axes = _split_axes(b, node.meta["arg_layouts"][node.args[0]], dims)
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
    axes = _split_axes(b, node.meta["arg_layouts"][node.args[0]], dims)
    if not axes:
        return lower_default(b, node, args, kwargs)
    eps = torch.finfo(val.dtype).eps if eps is None else eps
    count = math.prod(shape)
    xs = _statistics_input(b, b.call(aten.detach.default, x), val.dtype)
    squares = b.call(aten.mul.Tensor, xs, xs)
    mean_square = b.call(aten.div.Tensor, _sum_over(b, squares, dims, axes), count)
    rstd = b.call(aten.rsqrt.default, b.call(aten.add.Tensor, mean_square, eps))
    return b.call(split_norm, x, None, rstd, weight, None, tuple(axes), dims, count)


def lower_conv(b: Builder, node: Node, args, kwargs):
    """A grouped conv with its channels split runs its own `groups / parts` groups; a
    row-parallel conv (partial output) adds its bias on the rank at col 0 only."""
    args, kwargs = list(args), dict(kwargs)
    channel_axes = _split_axes(b, node.meta["arg_layouts"][node.args[0]], [1])
    groups, parts = conv_groups(node), math.prod(b.mesh.size(axis) for axis in channel_axes)
    if groups > 1 and parts > 1:
        if len(args) > groups_index(node):
            args[groups_index(node)] = groups // parts
        else:
            kwargs["groups"] = groups // parts
    if isinstance(node.meta["layout"].col, Partial) and len(args) > 2 and args[2] is not None:
        args[2] = b.collective(c.keep_first, args[2], "col")
    return b.call(node.target, *args, **kwargs)


def lower_batch_norm(b: Builder, node: Node, args, kwargs):
    """Training batch norm over dims split on some axes: per-channel mean and variance by
    `_mean_and_variance` (as `lower_layer_norm`'s), `split_norm`
    to normalise, and the running statistics updated in place with the global ones.
    Evaluation, and training with the batch and space whole, run as they are."""
    x, weight, bias, running_mean, running_var, training, momentum, eps = args[:8]
    val = node.args[0].meta["val"]
    dims = [0, *range(2, val.dim())]
    axes = _split_axes(b, node.meta["arg_layouts"][node.args[0]], dims)
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


def lower_dropout(b: Builder, node: Node, args, kwargs):
    p = args[1] if len(args) > 1 else kwargs.get("p")
    train = args[2] if len(args) > 2 else kwargs.get("train")
    if p == 0 or not train:
        return args[0]
    return lower_default(b, node, args, kwargs)


def arange_like(x: torch.Tensor, n: int) -> torch.Tensor:
    """0..n-1 on x's device (a graph target: the device is known at run time only)."""
    return torch.arange(n, device=x.device)


def _local_class_ids(b: Builder, logits: Node, layout: Layout, num_classes: int) -> Node:
    """The class indices this rank's logits columns stand for."""
    ids = b.call(arange_like, logits, num_classes)
    for axis in layout.axes_where(Shard, b.mesh):
        if layout.on(axis).dim == 1:
            ids = b.split_op(c.shard_slice, ids, axis, 0, layout.on(axis).groups)
    return ids


def lower_cross_entropy(b: Builder, node: Node, args, kwargs):
    """-log softmax(x)[target] with the class dim split: per-rank log-sum-exps are
    gathered (q numbers a row) and combined; the target logit is a one-hot sum,
    all-reduced. Rows split over other axes are summed by all-reduce."""
    reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
    ignore_index = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    _check_targets(b, node, args[1], ignore_index)
    if not cross_entropy_is_split(node):
        return lower_default(b, node, args, kwargs)
    x, target = args[0], args[1]
    layout = node.meta["arg_layouts"][node.args[0]]
    class_axes = [a for a in layout.axes_where(Shard, b.mesh) if layout.on(a).dim == 1]
    row_axes = [a for a in layout.axes_where(Shard, b.mesh) if layout.on(a).dim == 0]
    lse = b.call(aten.logsumexp.default, x, [1], True)
    for axis in class_axes:
        lse = b.split_op(c.all_gather, lse, axis, 1, 1)
    lse = b.call(aten.logsumexp.default, lse, [1])
    ids = _local_class_ids(b, x, layout, node.args[0].meta["val"].shape[1])
    onehot = b.call(aten.eq.Tensor, b.call(aten.unsqueeze.default, target, 1), ids)
    picked = b.call(aten.sum.dim_IntList, b.call(aten.where.ScalarOther, onehot, x, 0.0), [1])
    for axis in class_axes:
        picked = b.collective(c.all_reduce, picked, axis)
    keep = b.call(aten.ne.Scalar, target, ignore_index)
    per_row = b.call(aten.where.ScalarOther, keep, b.call(aten.sub.Tensor, lse, picked), 0.0)
    if reduction == 0:
        return per_row
    total = _sum_all(b, per_row, row_axes)
    if reduction == 2:
        return total
    count = _sum_all(b, b.call(aten._to_copy.default, keep, dtype=node.meta["val"].dtype), row_axes)
    return b.call(aten.div.Tensor, total, count)


def _sum_all(b: Builder, x: Node, axes) -> Node:
    total = b.call(aten.sum.default, x)
    for axis in axes:
        total = b.collective(c.all_reduce, total, axis)
    return total


def masked_lookup(b: Builder, table: Node, ids: Node, vocab: int, axis: str, padding_idx: int = -1) -> Node:
    """Rows of this rank's vocab block (split over `axis`) for `ids`; ids outside the
    block give zeros, so the sum over `axis` is the whole lookup (ids outside the
    table are refused before, by `check_lookup_ids`). A `padding_idx` (global; -1:
    none) row is looked up but gets no gradient, as in torch: its lookups are
    detached (the graph is one for all ranks, so no rank-local index can say it)."""
    parts = b.mesh.size(axis)
    block = b.split_op(c.shard_slice, b.call(arange_like, ids, vocab), axis, 0, 1)
    local = b.call(aten.sub.Tensor, ids, b.call(aten.select.int, block, 0, 0))
    inside = b.call(aten.logical_and.default, b.call(aten.ge.Scalar, local, 0), b.call(aten.lt.Scalar, local, vocab // parts))
    rows = b.call(aten.embedding.default, table, b.call(aten.where.ScalarOther, inside, local, 0))
    if padding_idx != -1:
        padding = b.call(aten.unsqueeze.default, b.call(aten.eq.Scalar, ids, padding_idx), -1)
        rows = b.call(aten.where.self, padding, b.call(aten.detach.default, rows), rows)
    return b.call(aten.mul.Tensor, rows, b.call(aten.unsqueeze.default, inside, -1))


def lower_embedding(b: Builder, node: Node, args, kwargs):
    """Vocab-parallel lookup: gather the row group's ids, look up those in this rank's
    vocab block, reduce-scatter along row back to own rows. Every lookup checks its
    ids first, as torch's embedding does (`check_lookup_ids`)."""
    check_lookup_ids(b, node, args[1])
    weight_node = node.args[0]
    w_layout = node.meta["arg_layouts"][weight_node]
    if not vocab_parallel(node, w_layout) or b.mesh.size("row") == 1:
        return lower_default(b, node, args, kwargs)
    all_ids = b.split_op(c.all_gather, args[1], "row", 0, 1)
    rows = masked_lookup(b, args[0], all_ids, weight_node.meta["val"].shape[0], "row", get_arg(node, 2, "padding_idx", -1))
    return b.split_op(c.reduce_scatter, rows, "row", 0, 1)


# ------------------------------------------------------- index range checks
#
# torch's embedding and cross entropy raise IndexError for an index outside
# [0, size); a sharded lookup looks each id up in one block of the table, and
# an id outside every block would give zeros. So the per-rank graph checks the
# ids itself, on their global value, right after the placeholders: every rank
# checks the same ids before any collective, so every rank raises and none
# waits for peers that stopped.


def _fake_or_meta(x: torch.Tensor) -> bool:
    if x.is_meta or is_fake(x):
        return True
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


@has_side_effect
def check_in_range(values: torch.Tensor, size: int, noun: str, owner: str, ignore_index: int | None = None) -> None:
    """IndexError if an element of `values` lies outside [0, size) (and is not
    `ignore_index`). A graph target: skipped on fake and meta tensors (compile-time
    runs); on CUDA an asynchronous assert, so that the check does not synchronise."""
    if _fake_or_meta(values) or values.numel() == 0:
        return
    valid = (values >= 0) & (values < size)
    if ignore_index is not None:
        valid |= values == ignore_index
    allowed = f"[0, {size})" + ("" if ignore_index is None else f" or equal ignore_index {ignore_index}")
    if values.is_cuda:
        torch._assert_async(valid.all(), f"a {noun} is out of range for {owner}: it must be in {allowed}")
        return
    if not bool(valid.all()):
        bad = int(values[~valid].reshape(-1)[0])
        raise IndexError(f"{noun} {bad} is out of range for {owner}: {noun}s must be in {allowed}")


# Ops that a global index value is recomputed through on every rank (deterministic,
# cheap on integer tensors); at most _MAX_REPLAYED of them per value.
_MAX_REPLAYED = 16


def _global_placeholder(b: Builder, node: Node) -> Node | None:
    """The per-rank placeholder of `node` if it holds the whole (global) value: a user
    input (inputs arrive whole), or a buffer or constant replicated on every axis."""
    role = node.meta.get("role", (None,))[0]
    layout = node.meta.get("layout")
    whole = isinstance(layout, Layout) and not layout.axes_where(Shard, b.mesh) and not layout.axes_where(Partial, b.mesh)
    if role != "input" and not (role in ("buffer", "constant") and whole):
        return None
    if "local_input" in node.meta:  # a pipeline stage's input: this rank's block only
        return None
    return next((n for n in b.graph.nodes if n.op == "placeholder" and n.target == node.name), None)


def _replayable(node: Node) -> bool:
    target = node.target
    val = node.meta.get("val")
    if target is device_of:  # the run-time device that factories such as arange read
        return True
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded not in target.tags
        and isinstance(val, torch.Tensor)
        and not val.is_floating_point()
        and not val.is_complex()
    )


def _replay_plan(node: Node, plan: list[Node]) -> bool:
    """Append to `plan`, inputs first, the ops that recompute `node` from placeholders;
    False if it cannot be recomputed on global values (see `_global_index_check`)."""
    if node in plan:
        return True
    if node.op == "placeholder":
        plan.append(node)
        return True
    if not _replayable(node) or len(plan) >= _MAX_REPLAYED:
        return False
    for arg in node.all_input_nodes:
        if not _replay_plan(arg, plan):
            return False
    plan.append(node)
    return True


def _check_anchor(b: Builder) -> Node | None:
    """Where global checks go: after the last placeholder and the checks there already."""
    anchor = None
    for node in b.graph.nodes:
        if node.op == "placeholder":
            anchor = node
    while anchor is not None and anchor.next.meta.get("index_check"):
        anchor = anchor.next
    return anchor


def _emit_after(b: Builder, anchor: Node, target, *args, **kwargs) -> Node:
    """`target(*args, **kwargs)` right after `anchor`, marked as part of the checks."""
    with b.graph.inserting_after(anchor):
        out = b.call(target, *args, **kwargs)
    out.meta["index_check"] = True
    return out


def _global_index_check(b: Builder, ids: Node, *check_args) -> bool:
    """Emit `check_in_range(global ids, *check_args)` right after the placeholders if the
    global value of the captured node `ids` can be recomputed there from whole
    placeholders by deterministic integer ops (an input, its views and slices,
    arange); False if not."""
    plan: list[Node] = []
    anchor = _check_anchor(b)
    if anchor is None or not _replay_plan(ids, plan):
        return False
    local: dict[Node, Node] = {}
    for node in plan:
        if node.op == "placeholder":
            local[node] = _global_placeholder(b, node)
            if local[node] is None:
                return False
    for node in plan:
        if node.op == "call_function":
            args, kwargs = map_arg((node.args, node.kwargs), lambda n: local[n])
            local[node] = anchor = _emit_after(b, anchor, node.target, *args, **kwargs)
    checked = local[ids]
    for user in checked.users:
        if user.target is check_in_range and user.args[1:] == check_args:
            return True  # the same check on the same value, already there
    _emit_after(b, anchor, check_in_range, checked, *check_args)
    return True


def _index_check(b: Builder, ids: Node, local_ids: Node, *check_args) -> None:
    """Check the captured index node `ids` (per-rank value `local_ids`) on its global
    value where that can be had without communication; otherwise on this rank's ids,
    where the lookup is (ranks whose ids are in range then go on without the others)."""
    if not _global_index_check(b, ids, *check_args):
        b.call(check_in_range, local_ids, *check_args)


def check_lookup_ids(b: Builder, node: Node, local_ids: Node) -> None:
    """The range check of an embedding's ids (see `check_in_range`)."""
    weight = node.args[0]
    vocab = weight.meta["val"].shape[0]
    owner = f"the embedding of vocabulary size {vocab} ({display_name(weight)})"
    _index_check(b, node.args[1], local_ids, vocab, "token id", owner)


def _check_targets(b: Builder, node: Node, local_target: Node, ignore_index: int) -> None:
    x, target = node.args[0], node.args[1]
    if target.meta["val"].is_floating_point():
        return  # class probabilities, not indices
    shape = x.meta["val"].shape
    num_classes = shape[1] if len(shape) > 1 else shape[0]
    owner = f"the cross entropy over {num_classes} classes ({node.name})"
    _index_check(b, target, local_target, num_classes, "target", owner, ignore_index)


def lower_nothing(b: Builder, node: Node, args, kwargs):
    """Metadata assertions of the global graph say nothing of local tensors."""
    return None


LOWERING_RULES = {
    aten._assert_tensor_metadata.default: lower_nothing,
    aten.view.default: lower_reshape,
    aten.reshape.default: lower_reshape,
    aten._unsafe_view.default: lower_reshape,
    aten.unflatten.int: lower_reshape,
    aten.expand.default: lower_expand,
    aten.split.Tensor: lower_split,
    aten.split_with_sizes.default: lower_split,
    aten.linear.default: lower_linear,
    aten.matmul.default: lower_matmul,
    aten.mm.default: lower_matmul,
    aten.bmm.default: lower_matmul,
    aten.addmm.default: lower_addmm,
    aten.mean.dim: lower_mean,
    aten.mean.default: lower_mean,
    aten.layer_norm.default: lower_layer_norm,
    aten.rms_norm.default: lower_rms_norm,
    aten.dropout.default: lower_dropout,
    aten.conv1d.default: lower_conv,
    aten.conv2d.default: lower_conv,
    aten.conv3d.default: lower_conv,
    aten.conv1d.padding: lower_conv,
    aten.conv2d.padding: lower_conv,
    aten.conv3d.padding: lower_conv,
    aten.convolution.default: lower_conv,
    aten.batch_norm.default: lower_batch_norm,
    aten.cross_entropy_loss.default: lower_cross_entropy,
    aten.embedding.default: lower_embedding,
}
