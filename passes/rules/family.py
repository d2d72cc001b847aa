"""The contracts of the rules: the `Family` each op family's file defines, and the
`Decision` its placement rules return.

A placement rule is `rule(node, ctx) -> Decision`. `ctx` is the placement
pass's `PlacementContext` (layouts so far, global shapes, the mesh, hints, and
the rules of other families: `ctx.rule`, so that no family imports another).
A `None` layout is a free parameter or buffer: the rule's requirement
becomes its layout. Placement rules never touch the graph.

A lowering rule is `lower(b, node, args, kwargs) -> Node | tuple`: `b` is the
rewrite pass's `Builder`, `node` the placed node (global shapes in
`meta["val"]`, layouts in `LAYOUT` and `ARG_LAYOUTS` of `tess_compile.core.meta_keys`;
`common.arg_layout`), `args` and `kwargs` its arguments with
every tensor already converted to the layout the op asked for. An op without
a lowering rule runs as it is on local tensors (`lower_default`). Shape
arguments are global in the captured graph; rules that take shapes make
them local.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import Node

from tess_compile.core.layout import Layout

__all__ = ["Decision", "Family"]


@dataclass(frozen=True)
class Family:
    """One op family's rules, by op: how each is placed and lowered, and the rules of mode
    "1d" (Megatron-LM) where they differ from the others'. `tess_compile.passes.rules` assembles the
    families' tables; no op is in two families."""

    name: str
    placement: dict
    lowering: dict = field(default_factory=dict)
    placement_1d: dict = field(default_factory=dict)
    lowering_1d: dict = field(default_factory=dict)


@dataclass
class Decision:
    """Layouts an op needs of its tensor inputs, and the layout of its output."""

    args: dict[Node, Layout]
    out: object  # Layout, or a tuple of Layouts for multi-output ops
