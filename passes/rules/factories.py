"""Placement rules of ops that make tensors from sizes alone (arange, ones,
new_zeros, ...): whole on every rank; and of ops that make no tensor (metadata
assertions, the run-time device that factories read, `passes.capture.device_of`).
"""

from __future__ import annotations

from torch.fx import Node

from passes.capture import device_of
from passes.rules.common import Decision, aten, place_replicated
from tess_compile.layout import Layout

__all__ = ["FACTORY_RULES"]


def place_like_factory(node: Node, ctx) -> Decision:
    """new_ones / new_zeros / new_full: the input gives only dtype and device."""
    return Decision({}, Layout.replicated())


def place_nothing(node: Node, ctx) -> Decision:
    """An op that makes no tensor (a metadata assertion, a device): no layouts needed."""
    return Decision({}, None)


_FACTORIES = [
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.ones.default,
    aten.zeros.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
]


FACTORY_RULES = {
    **{op: place_replicated for op in _FACTORIES},
    aten.new_ones.default: place_like_factory,
    aten.new_zeros.default: place_like_factory,
    aten.new_full.default: place_like_factory,
    aten.new_empty.default: place_like_factory,
    aten._assert_tensor_metadata.default: place_nothing,
    device_of: place_nothing,
}
