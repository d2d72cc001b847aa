"""Which rows of a product's input each rank takes (the products family's, imported only by `products.py`).

Tesseract splits a product's rows (every dim of its input but the features) over depth and row:
`row_blocks` keeps the splits the input comes with, else splits its batch, and for a table that
no axis divides by rows (relative positions, a batch of one) `rows_whole` splits the weight's out
features instead. `rows_whole_over_row` tells activations whose rows stay whole over row (a
decode step's few tokens), which the weight-stationary layout serves.
"""

from __future__ import annotations

import warnings

from torch.fx import Node

from tess_compile.core.layout import Layout, Placement, Shard, split_size
from tess_compile.core.mesh import AXES
from tess_compile.core.meta_keys import ROLE
from tess_compile.passes.rules.common import WHOLE, R, aten, display_name, place_replicated, shape_of
from tess_compile.passes.rules.family import Decision
from tess_compile.passes.source_lines import source_line

__all__ = ["reads_inputs", "row_blocks", "rows_whole", "rows_whole_over_row"]


def row_blocks(node: Node, ctx, x: Node, layout: Layout) -> tuple[Placement, Placement] | None:
    """x's rows (every dim but its features) split over depth and row: the splits x comes
    with, else its batch (dim 0). A table that is no batch (leading dim 1, or made from
    parameters alone: a relative-position table projected by attention's own weights)
    splits the first other row dim that divides instead; None if none does."""
    shape = list(shape_of(x))
    if len(shape) < 2:
        raise ValueError(
            f"{node.target} at {source_line(node)}: {display_name(x)!r} of shape {shape} feeds it without a batch "
            "dim; Tesseract splits rows over depth and row: give the input a batch dim"
        )
    table = None  # whether x is no batch, asked only where its splits do not serve
    blocks = []
    for axis in ("depth", "row"):
        p, parts = layout.on(axis), ctx.mesh.size(axis)
        on_rows = isinstance(p, Shard) and p.dim < len(shape) - 1
        # padded rows give padded output rows, where one axis alone splits their dim unevenly
        alone = on_rows and not any(isinstance(other, Shard) and other.dim == p.dim
                                    for other in (*blocks, layout.on("row" if axis == "depth" else "depth")))
        if on_rows and (shape[p.dim] % parts == 0 or (p.groups == 1 and alone)):
            blocks.append(p)
            shape[p.dim] = split_size(shape[p.dim], parts)
            continue
        dim = p.dim if on_rows else 0
        if shape[dim] % parts:
            if table is None:
                table = shape[0] == 1 or not reads_inputs(x)
            if not table:
                raise ValueError(
                    f"{node.target} input {display_name(x)!r} of shape {list(shape_of(x))}: dim {dim} "
                    f"is not divisible by d*q = {ctx.mesh.d * ctx.mesh.q} on mesh {ctx.mesh}; "
                    f"use a batch that is a multiple of {ctx.mesh.d * ctx.mesh.q}"
                )
            dim = next((i for i in range(len(shape) - 1) if shape[i] % parts == 0), None)
            if dim is None:
                return None
        blocks.append(Shard(dim))
        shape[dim] //= parts
    return blocks[0], blocks[1]


def reads_inputs(x: Node) -> bool:
    """Whether a model input (not a parameter, buffer or constant) flows into `x`."""
    seen, stack = set(), [x]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder" and ROLE.get(node, ("input",))[0] == "input":
            return True
        stack.extend(node.all_input_nodes)
    return False


def rows_whole(node: Node, ctx, x: Node, w: Node, bias: Node | None, w_out: int) -> Decision:
    """A product whose rows no mesh axis divides (a small table: relative positions, a batch of
    one): x whole on every rank, the weight's out features split over each axis that divides them
    (so no rank repeats another's products), and the output's features with them; if none does,
    the product runs whole on every rank (a warning says so)."""
    placements, parts, whole = [], 1, _whole_groups(node, shape_of(w)[w_out])
    for axis in AXES:
        size = ctx.mesh.size(axis)
        splits = size > 1 and whole % (parts * size) == 0
        placements.append(Shard(w_out) if splits else R)
        parts *= size if splits else 1
    if parts == 1:
        warnings.warn(
            f"{node.target} of {display_name(x)!r} (shape {list(shape_of(x))}) by {display_name(w)!r}: neither a "
            f"row dim of this table nor the weight's out features divide over the axes of mesh {ctx.mesh}, so "
            "every rank computes it whole",
            stacklevel=2,
        )
        return place_replicated(node, ctx)
    out = Layout(*(Shard(len(shape_of(node)) - 1) if isinstance(p, Shard) else R for p in placements))
    args = {x: WHOLE, w: Layout(*placements)}
    if bias is not None:
        args[bias] = Layout(*(Shard(0) if isinstance(p, Shard) else R for p in placements))
    return Decision(args, out)


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int)


def _whole_groups(node: Node, features: int) -> int:
    """How many blocks a product's out `features` may be cut into: as many as there are features,
    or where a view cuts them into `[n, size]` (attention heads), the `n` groups, kept whole."""
    for user in node.users:
        shape = shape_of(user) if user.target in _VIEWS else ()
        if len(shape) >= 2 and all(isinstance(size, int) for size in shape[-2:]) and shape[-2] > 1 \
                and shape[-2] * shape[-1] == features:
            return shape[-2]
    return features


def rows_whole_over_row(ctx, x: Node, x_layout: Layout) -> bool:
    """Whether activations `x` (a model input flows into them) come with their rows whole over
    row in a program whose rows (batch or tokens) do not split over row
    (`tess_compile.passes.place.home_layout`). Where they do, rows an op left whole are split again
    for SUMMA instead."""
    row = x_layout.row
    whole = not (isinstance(row, Shard) and row.dim < len(shape_of(x)) - 1)
    return whole and not ctx.rows.splits_rows("row") and reads_inputs(x)
