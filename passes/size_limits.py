"""Upper bounds that table lookups put on a dynamic program's symbolic sizes.

A learned position table is looked up with ids computed from sizes: GPT-2's
`wpe(arange(past, past + seq))`. A dynamic program takes any sequence
length, so a long enough call looks up a row the table does not have. This
analysis finds such lookups on the captured (global) graph and gives, for
each, the largest id as a formula in the symbols; `DynamicShapes.bind`
refuses a call whose sizes take it past the table, naming the input dims and
the table. Ids that come from data (a `position_ids` input) have no formula:
the program's own id check (`tess_compile.passes.rules.index_checks`) covers them.
"""

from __future__ import annotations

import sympy
import torch
from torch.fx import GraphModule, Node

from tess_compile.passes.rules.common import display_name
from tess_compile.core.dynamic import Limit

__all__ = ["lookup_limits"]

aten = torch.ops.aten

# Ops whose largest element is at most their first input's largest element.
_KEEPS_LARGEST = frozenset({
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.view.default, aten.reshape.default,
    aten._unsafe_view.default, aten.expand.default, aten.slice.Tensor, aten.select.int, aten.clone.default,
    aten._to_copy.default, aten.alias.default, aten.permute.default, aten.transpose.int, aten.t.default,
    aten.contiguous.default, aten.repeat.default, aten.lift_fresh_copy.default,
})

# Lookups: op -> (position of the table, position of the ids).
_LOOKUPS = {
    aten.embedding.default: (0, 1),
    aten.index_select.default: (0, 2),
}


def lookup_limits(gm: GraphModule) -> list[Limit]:
    """A `Limit` for each lookup in `gm` whose ids' largest value is a formula in symbolic sizes."""
    limits = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _LOOKUPS:
            continue
        if node.target is aten.index_select.default and node.args[1] != 0:
            continue
        table_at, ids_at = _LOOKUPS[node.target]
        table, largest = node.args[table_at], _largest(node.args[ids_at])
        if largest is None or not largest.free_symbols:
            continue
        limits.append(Limit(largest, int(table.meta["val"].shape[0]), display_name(table)))
    return limits


def _largest(arg, depth: int = 0) -> sympy.Expr | None:
    """An upper bound of the elements of `arg` (a node, a SymInt or a number) as a formula in the
    symbols, or None where the ops that compute it give none."""
    if isinstance(arg, bool) or depth > 16:
        return None
    if isinstance(arg, int):
        return sympy.Integer(arg)
    if not isinstance(arg, Node):
        return None
    val = arg.meta.get("val")
    if isinstance(val, torch.SymInt):
        return val.node.expr
    if isinstance(val, int):
        return sympy.Integer(val)
    if arg.op != "call_function":
        return None
    target = arg.target
    if target in (aten.arange.default, aten.arange.start):
        end = _largest(arg.args[-1], depth + 1)
        return None if end is None else end - 1
    if target is aten.arange.start_step and arg.args[2] == 1:
        end = _largest(arg.args[1], depth + 1)
        return None if end is None else end - 1
    if target in _KEEPS_LARGEST:
        return _largest(arg.args[0], depth + 1)
    if target in (aten.add.Tensor, aten.add.Scalar) and arg.kwargs.get("alpha", 1) == 1:
        parts = [_largest(a, depth + 1) for a in arg.args[:2]]
        return None if None in parts else parts[0] + parts[1]
    return None
