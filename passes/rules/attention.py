"""Placement and lowering rules of attention: scaled_dot_product_attention runs
locally on each rank's batch block and heads; sequence and head dims stay whole.
Grouped-query attention keeps each query head with its key/value head.

With dropout_p > 0 the local op would draw its own dropout mask; it lowers to
`tess_compile.ops.dropout.sharded_attention`, which runs the same op with the
block of the unsharded model's mask that the rank's batch and heads select.
"""

from __future__ import annotations

from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import R, align, aligned, aten, get_arg, lower_default, shape_of, tensor_inputs
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.passes.source_lines import source_line
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import AXES
from tess_compile.core.meta_keys import LAYOUT
from tess_compile.ops.dropout import block_spec, sharded_attention

__all__ = ["FAMILY", "LOWERING", "PLACEMENT", "lower_attention", "place_attention"]


def place_attention(node: Node, ctx) -> Decision:
    """scaled_dot_product_attention: local when batch and heads are split, not seq or head dim."""
    tensors = tensor_inputs(node)
    out_shape = shape_of(node)
    n_out = len(out_shape)
    required, out = align(ctx, node, tensors, out_shape, frozen=(n_out - 2, n_out - 1))
    if get_arg(node, 7, "enable_gqa", False):
        _keep_gqa_pairing(ctx, node, required, out)
    else:
        _split_whole_heads(ctx, node, required, out)
    return Decision(required, Layout(*out))


def _split_whole_heads(ctx, node: Node, required: dict, out: list) -> None:
    """Attention whose inputs arrive whole along an axis would run every head on every rank of it
    (as after a fused projection gathered for a view it cannot split): split the query heads there
    instead, a free slice of a whole value, keys and values with them, or whole where they have one
    head (multi-query attention broadcasts it to every query head)."""
    query, key, value = node.args[:3]
    heads_dim = len(shape_of(query)) - 3
    heads = shape_of(query)[heads_dim] if heads_dim >= 0 else 1
    if heads_dim < 0 or len(shape_of(node)) - 3 != heads_dim or any(p == Shard(heads_dim) for p in out):
        return
    if any(len(shape_of(t)) >= 3 and shape_of(t)[-3] not in (1, heads) for t in (key, value)):
        return  # grouped-query heads without enable_gqa: left as they are
    for index, axis in enumerate(AXES):
        size = ctx.mesh.size(axis)
        if size == 1 or out[index] != R or heads % size:
            continue
        split = Shard(heads_dim)
        for t, layout in required.items():
            required[t] = layout.with_axis(axis, aligned(split, shape_of(t), shape_of(node)))
        out[index] = split
        return


def _keep_gqa_pairing(ctx, node: Node, required: dict, out: list) -> None:
    """Grouped-query attention: query head n uses kv head n // (heads / kv_heads),
    so kv heads are split like query heads, or nobody's heads are split."""
    query, key, value = node.args[:3]
    heads_dim = len(shape_of(query)) - 3
    kv_heads = shape_of(key)[heads_dim]
    for index, axis in enumerate(AXES):
        if out[index] != Shard(heads_dim):
            continue
        split_kv = kv_heads % ctx.mesh.size(axis) == 0
        for t in (query, key, value):
            required[t] = required[t].with_axis(axis, Shard(heads_dim) if split_kv else R)
        out[index] = Shard(heads_dim) if split_kv else R


def lower_attention(b: Builder, node: Node, args, kwargs):
    """scaled_dot_product_attention: as it is, or with dropout_p > 0 `sharded_attention`, whose
    mask is this rank's block of the unsharded model's (weights `[..., L, S]`, laid out as the output)."""
    dropout_p = get_arg(node, 4, "dropout_p", 0.0)
    if not dropout_p:
        return lower_default(b, node, args, kwargs)

    def local(index: int, name: str, default=None):  # a lowered argument, by position or keyword
        return args[index] if len(args) > index else kwargs.get(name, default)

    weights_shape = list(shape_of(node)[:-1]) + [shape_of(get_arg(node, 1, "key"))[-2]]
    return b.call(
        sharded_attention, local(0, "query"), local(1, "key"), local(2, "value"), local(3, "attn_mask"), dropout_p,
        local(5, "is_causal", False), kwargs.get("scale"), kwargs.get("enable_gqa", False),
        weights_shape, *block_spec(LAYOUT.of(node), weights_shape, b.mesh), source_line(node),
    )


PLACEMENT = {
    aten.scaled_dot_product_attention.default: place_attention,
}

LOWERING = {
    aten.scaled_dot_product_attention.default: lower_attention,
}

FAMILY = Family("attention", PLACEMENT, lowering=LOWERING)
