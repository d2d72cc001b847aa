"""Rules of elementwise ops: inputs broadcast-aligned, splits kept.

Each mesh axis keeps one input's split if it lands on an output dim of the
same size; the other inputs are split alike where they have that dim and
replicated where they broadcast (`common.align`, which other families use too).
Partial sums pass through the ops that are linear in them (`_LINEARITY`).

In-place ops (`add_`, `copy_`, ...) keep their target's layout. Dropout keeps
its input's layout, replicated values included: each rank draws the full mask
of the unsharded model and keeps its block (`tess_compile.ops.dropout`), so
masks equal the unsharded model's; with p = 0 or outside training it lowers to
its input. Other random ops (rand, randn, bernoulli, ...) run whole on every
rank, each rank drawing what the unsharded model draws.
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import (
    align,
    aligned,
    arg_layout,
    aten,
    get_arg,
    is_dtype_cast,
    layout_of,
    lower_default,
    place_replicated,
    shape_of,
    tensor_inputs,
    without_partial,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout
from tess_compile.core.meta_keys import LAYOUT
from tess_compile.ops.dropout import block_spec, replicated_draw, sharded_dropout, sharded_native_dropout

__all__ = [
    "FAMILY",
    "LOWERING",
    "PLACEMENT",
    "lower_dropout",
    "lower_native_dropout",
    "lower_random",
    "place_inplace",
    "place_native_dropout",
    "place_pointwise",
    "place_type_as",
]

# How an op treats partial sums (`common.align`): "sum" (every tensor may be partial),
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


def place_pointwise(node: Node, ctx) -> Decision:
    """Inputs aligned by their linearity (`common.align`); autocast's cast of a free tensor (a weight)
    stays free, as a permutation of one does: its first consumer fixes both, so that a program under
    autocast lays its weights out as the program without."""
    if is_dtype_cast(node) and ctx.layout(node.args[0]) is None:
        return ctx.permute_free(node, node.args[0], list(range(len(shape_of(node)))))
    tensors = tensor_inputs(node)
    required, out = align(ctx, node, tensors, shape_of(node), linearity=_LINEARITY.get(node.target))
    return Decision(required, Layout(*out))


def place_inplace(node: Node, ctx) -> Decision:
    """x.add_(y) and kin: x is written in place, so it keeps its layout (partial sums
    made whole) and the other inputs align to it."""
    x = node.args[0]
    layout = without_partial(layout_of(ctx, x))
    required = {t: Layout(*(aligned(p, shape_of(t), shape_of(node)) for p in layout.placements))
                for t in tensor_inputs(node)}
    required[x] = layout
    return Decision(required, layout)


def place_type_as(node: Node, ctx) -> Decision:
    """type_as(x, other): other gives only a dtype; x keeps its layout."""
    x = node.args[0]
    return Decision({x: layout_of(ctx, x)}, layout_of(ctx, x))


def place_native_dropout(node: Node, ctx) -> Decision:
    """native_dropout(x) -> (output, mask): both laid out as x, as a pointwise op would be."""
    x = node.args[0]
    required, out = align(ctx, node, [x], shape_of(x), linearity=_LINEARITY.get(node.target))
    return Decision(required, (Layout(*out), Layout(*out)))


_POINTWISE = [
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar,
    aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor, aten.neg.default, aten.exp.default, aten.log.default, aten.sqrt.default,
    aten.rsqrt.default, aten.abs.default, aten.tanh.default, aten.sigmoid.default, aten.relu.default,
    aten.gelu.default, aten.silu.default, aten.erf.default, aten.sin.default, aten.cos.default,
    aten.clone.default, aten.alias.default, aten._to_copy.default, aten.to.dtype,
    aten.to.dtype_layout, aten.to.device, aten.ge.Scalar, aten.le.Scalar, aten.ge.Tensor,
    aten.le.Tensor, aten.lt.Tensor, aten.gt.Tensor, aten.__and__.Tensor, aten.__or__.Tensor,
    aten.contiguous.default, aten.detach.default, aten.where.self, aten.where.ScalarOther,
    aten.where.ScalarSelf, aten.where.Scalar, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.maximum.default, aten.minimum.default, aten.clamp.default,
    aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.lt.Scalar, aten.gt.Scalar,
    aten.logical_not.default, aten.logical_and.default, aten.logical_or.default,
    aten.bitwise_not.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.square.default,
    aten.reciprocal.default, aten.hardtanh.default, aten.relu6.default, aten.hardswish.default,
    aten.hardsigmoid.default, aten.leaky_relu.default,
    aten.elu.default, aten.softplus.default, aten.mish.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.log1p.default, aten.expm1.default, aten.sign.default, aten.floor.default, aten.ceil.default,
    aten.min.other, aten.max.other, aten.fill.Scalar, aten.fill.Tensor, aten.remainder.Scalar,
    aten.remainder.Tensor, aten.fmod.Scalar, aten.fmod.Tensor,
    # made like the input: its layout, no partial sums (ones_like of a partial sum is no partial sum)
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
]


def _empty_like_stride(val: torch.Tensor) -> list[int]:
    """The strides of `empty_like(val)`, the tensor that torch's dropout fills (dense strides are kept)."""
    like = torch.empty_like(torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta"))
    return list(like.stride())


def lower_dropout(b: Builder, node: Node, args, kwargs):
    """dropout / dropout_: this rank's block of the unsharded model's mask (`tess_compile.ops.dropout`);
    the input itself with p = 0, outside training or on an empty tensor, as torch does."""
    x, p, train = args[0], get_arg(node, 1, "p"), get_arg(node, 2, "train")
    shape = shape_of(node)
    if p == 0 or not train or math.prod(shape) == 0:
        return x
    if p == 1:
        return lower_default(b, node, args, kwargs)  # x * 0, nothing drawn
    inplace = node.target is aten.dropout_.default
    if inplace:
        b.shared.clear()  # a fetched block may be x
    layout = LAYOUT.of(node)
    assert arg_layout(node, node.args[0]) == layout, "dropout's input and output layouts differ"
    stride = _empty_like_stride(node.args[0].meta["val"])
    return b.call(sharded_dropout, x, p, inplace, list(shape), stride, *block_spec(layout, shape, b.mesh))


def lower_native_dropout(b: Builder, node: Node, args, kwargs):
    """native_dropout(x, p, train) -> (output, mask): the unsharded model's mask, as `lower_dropout`."""
    x, p, train = args[0], get_arg(node, 1, "p"), get_arg(node, 2, "train")
    shape = shape_of(node.args[0])
    if train is False or math.prod(shape) == 0:
        return lower_default(b, node, args, kwargs)  # (a copy of x, ones): nothing drawn
    layout, stride = LAYOUT.of(node)[0], _empty_like_stride(node.args[0].meta["val"])
    return b.call(sharded_native_dropout, x, p, list(shape), stride, *block_spec(layout, shape, b.mesh))


def lower_random(b: Builder, node: Node, args, kwargs):
    """A random op whose inputs and output are whole on every rank: `replicated_draw`, which
    the simulator runs for every rank from the same generator state."""
    if node.target._schema.is_mutable:
        b.shared.clear()  # a fetched block may be its target
    node_args = tuple(i for i, a in enumerate(args) if isinstance(a, Node))
    node_kwargs = tuple(k for k, v in kwargs.items() if isinstance(v, Node))
    return b.call(replicated_draw, str(node.target), tuple(args), dict(kwargs), node_args, node_kwargs)


# Random ops that run whole on every rank (any input gathered, as an op without a rule).
_RANDOM = [
    aten.rand.default, aten.randn.default, aten.rand_like.default, aten.randn_like.default, aten.randint.default,
    aten.randint.low, aten.randint_like.default, aten.randint_like.low_dtype, aten.randperm.default,
    aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli.Tensor, aten.normal.Tensor_Tensor,
    aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.float_float, aten.multinomial.default,
    aten.poisson.default, aten.feature_dropout.default, aten.alpha_dropout.default,
    aten.feature_alpha_dropout.default, aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.uniform_.default,
    aten.normal_.default, aten.exponential_.default, aten.geometric_.default, aten.log_normal_.default,
    aten.cauchy_.default, aten.random_.default, getattr(aten.random_, "from"), aten.random_.to,
]


PLACEMENT = {
    **{op: place_pointwise for op in _POINTWISE},
    aten.dropout.default: place_pointwise,
    aten.native_dropout.default: place_native_dropout,
    aten.type_as.default: place_type_as,
    **{op: place_inplace for op in (aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor,
                                    aten.relu_.default, aten.relu6_.default, aten.hardtanh_.default,
                                    aten.copy_.default, aten.dropout_.default, aten.detach_.default,
                                    aten.masked_fill_.Scalar, aten.masked_fill_.Tensor, aten.fill_.Scalar,
                                    aten.fill_.Tensor, aten.zero_.default)},
    **{op: place_replicated for op in _RANDOM},
}


LOWERING = {
    aten.dropout.default: lower_dropout,
    aten.dropout_.default: lower_dropout,
    aten.native_dropout.default: lower_native_dropout,
    **{op: lower_random for op in _RANDOM},
}

FAMILY = Family("pointwise", PLACEMENT, lowering=LOWERING)
