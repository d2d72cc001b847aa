"""Rules of ops that make tensors from sizes alone (arange, ones, eye,
new_zeros, ...): whole on every rank; and of ops that make no tensor (metadata
assertions, the run-time device that factories read, `tess_compile.ops.local.device_of`).
A metadata assertion of the global graph says nothing of local tensors and
lowers to nothing.
"""

from __future__ import annotations

from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import aten, place_nothing, place_replicated
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout
from tess_compile.ops.local import device_of

__all__ = ["FAMILY", "LOWERING", "PLACEMENT", "lower_nothing", "place_like_factory"]


def place_like_factory(node: Node, ctx) -> Decision:
    """new_ones / new_zeros / new_full: the input gives only dtype and device."""
    return Decision({}, Layout.replicated())


_FACTORIES = [
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.ones.default,
    aten.zeros.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default, aten.eye.default,
    aten.eye.m,
    aten.lift_fresh_copy.default,  # a constant tensor made in forward (torch.tensor(...)): whole everywhere
]


def lower_nothing(b: Builder, node: Node, args, kwargs):
    """Metadata assertions of the global graph say nothing of local tensors."""
    return None


PLACEMENT = {
    **{op: place_replicated for op in _FACTORIES},
    aten.new_ones.default: place_like_factory,
    aten.new_zeros.default: place_like_factory,
    aten.new_full.default: place_like_factory,
    aten.new_empty.default: place_like_factory,
    aten._assert_tensor_metadata.default: place_nothing,
    device_of: place_nothing,
}


LOWERING = {aten._assert_tensor_metadata.default: lower_nothing}

FAMILY = Family("factories", PLACEMENT, lowering=LOWERING)
