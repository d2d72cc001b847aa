"""Placement rules of attention: scaled_dot_product_attention runs locally on
each rank's batch block and heads; sequence and head dims stay whole.
Grouped-query attention keeps each query head with its key/value head.
"""

from __future__ import annotations

from torch.fx import Node

from passes.rules.common import R, aten, get_arg, shape_of, tensor_inputs
from passes.rules.family import Decision, Family
from passes.rules.pointwise import align
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import AXES

__all__ = ["FAMILY", "PLACEMENT", "place_attention"]


def place_attention(node: Node, ctx) -> Decision:
    """scaled_dot_product_attention: local when batch and heads are split, not seq or head dim."""
    tensors = tensor_inputs(node)
    out_shape = shape_of(node)
    n_out = len(out_shape)
    required, out = align(ctx, node, tensors, out_shape, frozen=(n_out - 2, n_out - 1))
    if get_arg(node, 7, "enable_gqa", False):
        _keep_gqa_pairing(ctx, node, required, out)
    return Decision(required, Layout(*out))


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


PLACEMENT = {
    aten.scaled_dot_product_attention.default: place_attention,
}

FAMILY = Family("attention", PLACEMENT)
