"""Which ops take uneven splits: a check the place pass runs on every decision.

A plain split of a dim its parts do not divide (a vocabulary of 50257 over 2,
an MLP width of 11008 over 3) is uneven: each rank's block is padded at the
end to the full block size (`tess_compile.core.layout`). Padding is never
seen outside, because the rules that take such blocks handle it: elementwise
ops leave it where it is; a product's padded weight rows and columns are
zeros, so a padded output holds zeros and a padded contraction adds nothing;
a sum or mean over the dim, a prefix sum along it and a cross-entropy over padded classes
mask it
(`tess_compile.passes.rules.common.masked_padding`); a lookup in a padded vocabulary never
reaches it; a view that keeps the dim whole keeps the padding at its end; a
gather cuts it off (`tess_compile.passes.redistribute`). Any other op that would take an
uneven block, a norm over a padded hidden size, or a view that cuts the dim
into heads, is refused here with a ValueError: exactness would need the true
size there.
"""

from __future__ import annotations

import math
import operator

from torch.fx import Node

from tess_compile.passes.rules.common import aten, shape_of, uses_summa
from tess_compile.passes.rules.family import Decision
from tess_compile.passes.source_lines import source_line
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import AXES

__all__ = ["check_uneven"]

# Families whose every op takes uneven blocks (see the module docstring).
_TAKE_UNEVEN = ("pointwise", "embeddings", "losses", "reductions", "factories", "scans")
# Ops that contract the last dim of their first operand with the second's second-to-last:
# an uneven contraction needs a zero-padded side, which only a weight is.
_ACTIVATION_PRODUCTS = (aten.bmm.default, aten.matmul.default, aten.baddbmm.default)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints, aten.unflatten.int)
_KEEP_SPLITS = (aten.permute.default, aten.transpose.int, aten.t.default, aten.numpy_T.default, aten.expand.default,
                aten.slice.Tensor, aten.select.int, aten.unbind.int, aten.clone.default, aten.alias.default)


def _uneven(layout, val, mesh) -> list[tuple[str, int]]:
    """(axis, dim) of each uneven split of a value laid out by `layout`."""
    if not isinstance(layout, Layout) or not hasattr(val, "shape"):
        return []
    dims = layout.uneven_dims(val.shape, mesh)
    return [(axis, layout.on(axis).dim) for axis in AXES
            if isinstance(layout.on(axis), Shard) and layout.on(axis).dim in dims]


def _kept_by_view(node: Node, dim: int) -> bool:
    """Whether a view keeps input dim `dim` as one whole dim of its output."""
    in_shape, out_shape = shape_of(node.args[0]), shape_of(node)
    before = math.prod(in_shape[:dim])
    return any(math.prod(out_shape[:e]) == before and out_shape[e] == in_shape[dim] for e in range(len(out_shape)))


def _refusal(node: Node, family: str | None, uneven: dict[Node, list[tuple[str, int]]]) -> str | None:
    """Why `node` cannot take the uneven blocks `uneven` (value -> [(axis, dim)]), or None."""
    if family in _TAKE_UNEVEN or node.target is operator.getitem:
        return None
    if family == "products":
        if node.target in _ACTIVATION_PRODUCTS and not uses_summa(node):
            a, b = node.args[-2:] if node.target is aten.baddbmm.default else node.args[:2]
            contracted = any(dim == len(shape_of(a)) - 1 for _, dim in uneven.get(a, [])) or any(
                dim == len(shape_of(b)) - 2 for _, dim in uneven.get(b, []))
            if contracted:
                return "a product of two activations over it would add the padding of both"
        return None
    if family == "views" and node.target in _KEEP_SPLITS:
        return None
    if family == "views" and node.target in _VIEWS:
        kept = all(_kept_by_view(node, dim) for arg, found in uneven.items() if arg is node.args[0] for _, dim in found)
        return None if kept else "a view that cuts or merges it (into heads, say) would move the padding inside it"
    return f"the {family} rules need its true size"


def check_uneven(node: Node, decision: Decision, family: str | None, ctx) -> None:
    """ValueError if `node`'s decision gives it or its output an uneven split it cannot take."""
    uneven = {arg: _uneven(layout, arg.meta.get("val"), ctx.mesh) for arg, layout in decision.args.items()}
    outs = decision.out if isinstance(decision.out, tuple) else (decision.out,)
    vals = node.meta.get("val") if isinstance(decision.out, tuple) else (node.meta.get("val"),)
    uneven[node] = [found for out, val in zip(outs, vals or ()) for found in _uneven(out, val, ctx.mesh)]
    uneven = {value: found for value, found in uneven.items() if found}
    if not uneven:
        return
    problem = _refusal(node, family, uneven)
    if problem is None:
        return
    value, [(axis, dim), *_] = next(iter(uneven.items()))
    size, parts = shape_of(value)[dim], ctx.mesh.size(axis)
    raise ValueError(
        f"{node.target} ({node.name}) at {source_line(node)} takes {value.name!r} of shape {list(shape_of(value))} "
        f"split over {axis} on dim {dim}, whose size {size} is not divisible by {parts} on mesh {ctx.mesh}, so its "
        f"blocks are padded: {problem}; use a size that is a multiple of {parts} there, or another mesh"
    )
