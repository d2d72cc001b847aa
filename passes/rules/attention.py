"""Placement and lowering rules of attention: scaled_dot_product_attention runs
locally on each rank's batch block and heads; the head dim stays whole.
Grouped-query attention keeps each query head with its key/value head.

Queries that arrive split by tokens (a token split, `tess_compile.core.row_split`) keep
their split: each rank attends its own queries over every key (context parallelism).
The keys and values are all-gathered along those axes and the rank's queries run
against them in `tess_compile.ops.context_attention`, masked by their global positions
(the causal mask, the rank's rows of a given mask), which keeps only the own blocks for
backward and fetches again there. Otherwise the sequence dims stay whole.

With dropout_p > 0 the local op would draw its own dropout mask; it lowers to
`tess_compile.ops.dropout.sharded_attention`, which runs the same op with the
block of the unsharded model's mask that the rank's batch and heads select (the
queries' tokens whole).
"""

from __future__ import annotations

from torch.fx import Node

import math

from tess_compile.passes.builder import Builder
from tess_compile.passes.causal_masks import is_causal as causal
from tess_compile.passes.rules.common import (
    R,
    align,
    aligned,
    arg_layout,
    aten,
    block_indices,
    get_arg,
    layout_of,
    lower_default,
    shape_of,
    tensor_inputs,
    without_partial,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.passes.source_lines import source_line
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import AXES
from tess_compile.core.meta_keys import LAYOUT
from tess_compile.ops import collectives as c
from tess_compile.ops.attention_kernels import position_bias
from tess_compile.ops.context_attention import context_attention
from tess_compile.ops.dropout import block_spec, sharded_attention
from tess_compile.ops.ring_attention import ring_attention
from tess_compile.ops.local import arange_like

__all__ = ["FAMILY", "LOWERING", "PLACEMENT", "lower_attention", "place_attention"]


def place_attention(node: Node, ctx) -> Decision:
    """scaled_dot_product_attention: local when batch and heads are split; queries split by tokens
    keep their split (context parallelism, see the module docstring); the head dim stays whole."""
    tensors = tensor_inputs(node)
    out_shape = shape_of(node)
    n_out = len(out_shape)
    required, out = align(ctx, node, tensors, out_shape, frozen=(n_out - 2, n_out - 1))
    _split_queries_by_tokens(ctx, node, required, out)
    if get_arg(node, 7, "enable_gqa", False):
        _keep_gqa_pairing(ctx, node, required, out)
    else:
        _split_whole_heads(ctx, node, required, out)
    return Decision(required, Layout(*out))


def _split_queries_by_tokens(ctx, node: Node, required: dict, out: list) -> None:
    """On each axis where the queries come split by tokens (a plain split of their sequence dim), keep
    that split: the output's sequence dim is split alike, the keys and values are split by their
    tokens where the keys come so (both all-gathered by the lowering) and whole otherwise, and an attention mask
    takes the queries' rows (its key dim whole). With dropout only where the tokens split evenly
    (`sharded_attention` then draws the rank's rows of the unsharded model's mask)."""
    query, key, value = node.args[:3]
    mask = get_arg(node, 3, "attn_mask")
    dropout = get_arg(node, 4, "dropout_p", 0.0)
    q_layout = without_partial(layout_of(ctx, query))
    q_seq, n_out = len(shape_of(query)) - 2, len(shape_of(node))
    for index, axis in enumerate(AXES):
        split = q_layout.on(axis)
        if ctx.mesh.size(axis) == 1 or not isinstance(split, Shard) or split.dim != q_seq:
            continue
        groups = split.groups  # stripes of a load-balanced token order (`RowSplit.stripes`), else 1
        if dropout and (groups > 1 or any(shape_of(t)[-2] % ctx.mesh.size(axis) for t in (query, key))):
            continue
        required[query] = required[query].with_axis(axis, split)
        # keys and values alike (the lowering gathers both along the keys' split): split where the keys come so
        kv_split = without_partial(layout_of(ctx, key)).on(axis) == Shard(len(shape_of(key)) - 2, groups)
        for kv in (key, value):
            required[kv] = required[kv].with_axis(axis, Shard(len(shape_of(kv)) - 2, groups) if kv_split else R)
        if isinstance(mask, Node):
            rows = len(shape_of(mask)) - 2
            by_rows = rows >= 0 and shape_of(mask)[rows] == shape_of(node)[n_out - 2]
            required[mask] = required[mask].with_axis(axis, Shard(rows, groups) if by_rows else R)
        out[index] = Shard(n_out - 2, groups)


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
    """scaled_dot_product_attention: as it is, over a token split `context_attention`, or with
    dropout_p > 0 `sharded_attention`, whose mask is this rank's block of the unsharded model's
    (weights `[..., L, S]`, laid out as the output)."""

    def local(index: int, name: str, default=None):  # a lowered argument, by position or keyword
        return args[index] if len(args) > index else kwargs.get(name, default)

    n_out = len(shape_of(node))
    if any(isinstance(p, Shard) and p.dim == n_out - 2 and b.mesh.size(axis) > 1
           for axis, p in zip(AXES, LAYOUT.of(node).placements)):
        return _lower_context_attention(b, node, local)
    dropout_p = get_arg(node, 4, "dropout_p", 0.0)
    if not dropout_p:
        return lower_default(b, node, args, kwargs)

    weights_shape = list(shape_of(node)[:-1]) + [shape_of(get_arg(node, 1, "key"))[-2]]
    return b.call(
        sharded_attention, local(0, "query"), local(1, "key"), local(2, "value"), local(3, "attn_mask"), dropout_p,
        local(5, "is_causal", False), kwargs.get("scale"), kwargs.get("enable_gqa", False),
        weights_shape, *block_spec(LAYOUT.of(node), weights_shape, b.mesh), source_line(node),
    )


def _lower_context_attention(b: Builder, node: Node, local) -> Node:
    """Attention of this rank's queries over every key: with `context="ring"` (and no dropout) one key
    block at a time (`ring_attention`); else the keys and values split by tokens all-gathered along
    those axes, inner axis first (so that the blocks join in global token order), and
    `context_attention`; both on the global positions of the rank's queries."""
    query, key = node.args[:2]
    q_layout, k_layout = arg_layout(node, query), arg_layout(node, key)
    q_seq, k_seq = len(shape_of(query)) - 2, len(shape_of(key)) - 2
    fetch = tuple(("all_gather", axis, b.mesh.size(axis), k_seq, k_layout.on(axis).groups) for axis in reversed(AXES)
                  if _splits(k_layout.on(axis), k_seq) and b.mesh.size(axis) > 1)
    k_own, v_own = local(1, "key"), local(2, "value")
    if b.context == "ring" and fetch and not get_arg(node, 4, "dropout_p", 0.0):
        return _lower_ring_attention(b, node, local, fetch)
    k_used, v_used = k_own, v_own
    for _, axis, *rest in fetch:
        k_used = b.call(c.all_gather, k_used, axis, *rest)
        v_used = b.call(c.all_gather, v_used, axis, *rest)
    is_causal = causal(node)  # the flag, or a mask bounded by the causal one
    key_length = shape_of(key)[k_seq]
    padded = any(key_length % b.mesh.size(step[1]) for step in fetch)
    positions = None
    if is_causal or padded:
        positions = block_indices(b, local(0, "query"), shape_of(query)[q_seq], q_layout, q_seq)
    scale = get_arg(node, 6, "scale") or 1.0 / math.sqrt(shape_of(query)[-1])
    dropout_p = get_arg(node, 4, "dropout_p", 0.0)
    if dropout_p:  # the gathered keys kept: sharded_attention draws the rank's rows of the model's mask
        keys = b.call(arange_like, k_used, key_length)
        mask = b.call(position_bias, positions, keys, key_length, is_causal, local(3, "attn_mask"),
                      query.meta["val"].dtype)
        weights_shape = list(shape_of(node)[:-1]) + [key_length]
        return b.call(sharded_attention, local(0, "query"), k_used, v_used, mask, dropout_p, False, scale,
                      get_arg(node, 7, "enable_gqa", False), weights_shape,
                      *block_spec(LAYOUT.of(node), weights_shape, b.mesh), source_line(node))
    return b.call(context_attention, local(0, "query"), k_used, v_used, k_own, v_own, local(3, "attn_mask"),
                  positions, fetch, key_length, is_causal, scale, _stripes(b, q_layout, query, key, is_causal, padded))


def _stripes(b: Builder, q_layout: Layout, query: Node, key: Node, is_causal: bool, padded: bool) -> int:
    """The stripes of the queries' striped token order (`RowSplit.stripes`: the groups of their token
    split, alike on every axis) where a causal self-attention may run each stripe against the keys it
    sees alone (`context_attention`); 1 otherwise."""
    q_seq = len(shape_of(query)) - 2
    groups = {p.groups for axis, p in zip(AXES, q_layout.placements) if _splits(p, q_seq) and b.mesh.size(axis) > 1}
    if not is_causal or padded or len(groups) != 1 or shape_of(query)[q_seq] != shape_of(key)[-2]:
        return 1
    return groups.pop()


def _splits(placement, dim: int) -> bool:
    return isinstance(placement, Shard) and placement.dim == dim


def _lower_ring_attention(b: Builder, node: Node, local, fetch: tuple) -> Node:
    """`ring_attention` over the key blocks of the token axes that `fetch` gathers (outer axis first)."""
    query, key = node.args[:2]
    q_seq, k_seq = len(shape_of(query)) - 2, len(shape_of(key)) - 2
    key_length = shape_of(key)[k_seq]
    axes = tuple((axis, size) for _, axis, size, *_ in reversed(fetch))
    block = arg_layout(node, key).local_shape(shape_of(key), b.mesh)[k_seq]
    is_causal = causal(node)  # the flag, or a mask bounded by the causal one
    positions = None
    if is_causal or block * math.prod(size for _, size in axes) != key_length:
        positions = block_indices(b, local(0, "query"), shape_of(query)[q_seq], arg_layout(node, query), q_seq)
    scale = get_arg(node, 6, "scale") or 1.0 / math.sqrt(shape_of(query)[-1])
    stripes = max(arg_layout(node, key).on(axis).groups for _, axis, *_ in fetch)  # the keys' token order
    return b.call(ring_attention, local(0, "query"), local(1, "key"), local(2, "value"), local(3, "attn_mask"),
                  positions, axes, block, key_length, is_causal, scale, stripes)


PLACEMENT = {
    aten.scaled_dot_product_attention.default: place_attention,
}

LOWERING = {
    aten.scaled_dot_product_attention.default: lower_attention,
}

FAMILY = Family("attention", PLACEMENT, lowering=LOWERING)
