"""Rules of the ops that compute sizes: `aten.sym_size` of a tensor, and Python arithmetic and
comparisons of sizes, which a graph captured with symbolic batch and sequence holds
(`dynamic=True`, `tess_compile.core.dynamic`), and export's run-time assertions of them.

A size in the captured graph is the global tensor's. Such an op makes no tensor and needs
no layout. Its lowering computes the global value on every rank: a tensor's size from the
inputs' sizes (`Builder.size`: a user input arrives whole, so its sizes are global), the
arithmetic and the assertions as they are, on those values.
"""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import aten, place_nothing
from tess_compile.passes.rules.family import Family

__all__ = ["FAMILY"]


def lower_tensor_size(b: Builder, node: Node, args, kwargs):
    """`x.size(dim)` (or numel) of a global tensor: its value, computed from the inputs' sizes."""
    return b.size(node.meta["val"])


def lower_as_is(b: Builder, node: Node, args, kwargs):
    """Arithmetic, comparisons and assertions of global sizes: the same op on the same values."""
    return b.call(node.target, *args, **kwargs)


_TENSOR_SIZES = [aten.sym_size.int, aten.sym_numel.default]
_ON_SIZES = [
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod, operator.pow,
    operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_float, torch.sym_int, math.ceil, math.floor,
    aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
]

PLACEMENT = {op: place_nothing for op in (*_TENSOR_SIZES, *_ON_SIZES)}
LOWERING = {**{op: lower_tensor_size for op in _TENSOR_SIZES}, **{op: lower_as_is for op in _ON_SIZES}}

FAMILY = Family("sizes", PLACEMENT, lowering=LOWERING)
