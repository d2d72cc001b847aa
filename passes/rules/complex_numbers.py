"""Placement rules of complex numbers: `view_as_complex`, `view_as_real`, the
ops that make complex values (`polar`, `complex`) and those that take their parts (`real`, `imag`).

`view_as_complex` of `[..., n, 2]` drops the last dim, which holds a number's
real and imaginary parts and so must be whole on every rank; `view_as_real`
adds it back. Splits on the other dims carry over as they are (rotary
embeddings keep their batch and head splits through the complex product).
Elementwise ops on complex values (`mul`, `add`, ...) are the pointwise rules, and so
are `polar`, `complex`, `real` and `imag`: their rule is the pointwise family's, asked through the table.
"""

from __future__ import annotations

from torch.fx import Node

from tess_compile.passes.rules.common import R, aten, shape_of
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Shard

__all__ = ["FAMILY", "PLACEMENT", "place_elementwise", "place_view_as_complex", "place_view_as_real"]


def place_view_as_complex(node: Node, ctx) -> Decision:
    """`[..., n, 2]` real -> `[..., n]` complex: the last dim whole, other splits kept."""
    x = node.args[0]
    last = len(shape_of(x)) - 1
    layout = ctx.layout(x) or Layout.replicated()
    needed = Layout(*(R if isinstance(p, Shard) and p.dim == last else p for p in layout.placements))
    return Decision({x: needed}, needed)


def place_view_as_real(node: Node, ctx) -> Decision:
    """`[..., n]` complex -> `[..., n, 2]` real: every split kept on its dim.

    A partial sum of complex numbers is the partial sum of their parts, so
    partial placements carry over too.
    """
    x = node.args[0]
    layout = ctx.layout(x) or Layout.replicated()
    return Decision({x: layout}, layout)


def place_elementwise(node: Node, ctx) -> Decision:
    """`polar(abs, angle)` / `complex(real, imag)` / `real(z)` / `imag(z)`: elementwise, placed by the
    pointwise family's rule of a binary op (`mul`), which the table gives."""
    return ctx.rule(aten.mul.Tensor, ("pointwise",))(node, ctx)


PLACEMENT = {
    aten.view_as_complex.default: place_view_as_complex,
    aten.view_as_real.default: place_view_as_real,
    aten.polar.default: place_elementwise,
    aten.complex.default: place_elementwise,
    aten.real.default: place_elementwise,
    aten.imag.default: place_elementwise,
}

FAMILY = Family("complex_numbers", PLACEMENT)
