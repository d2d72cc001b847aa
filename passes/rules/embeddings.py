"""Rules of embedding lookups: vocab-parallel tables (`R S(0) S(1)`) looked up by
the ids of each row group, or tables split over hidden only.

A vocab-parallel lookup gathers the row group's ids, looks up those in this
rank's vocab block (`masked_lookup`; other ids give zeros) and reduce-scatters
the rows along row back to their owners. Every lookup checks its ids first,
as torch's embedding does (`tess_compile.passes.rules.index_checks`). In mode "1d" a free
table is split by vocab over col; each rank looks up the ids inside its
block, and the partial sums are all-reduced by the consumer.
"""

from __future__ import annotations

from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import (
    WHOLE, P, R, arg_layout, aten, block_indices, get_arg, layout_of, lower_default, shape_of, without_partial,
)
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.passes.rules.index_checks import check_lookup_ids
from tess_compile.core.layout import Layout, Partial, Shard, split_size
from tess_compile.core.mesh import AXES
from tess_compile.core.meta_keys import LAYOUT
from tess_compile.ops import collectives as c

__all__ = [
    "FAMILY", "LOWERING", "LOWERING_1D", "PLACEMENT", "PLACEMENT_1D", "lower_embedding", "lower_embedding_1d",
    "masked_lookup", "place_embedding", "place_embedding_1d", "vocab_parallel",
]


def vocab_parallel(node: Node, weight_layout: Layout | None) -> bool:
    """Whether an embedding looks up a table split over rows by vocab (`R S(0) S(1)`)."""
    return weight_layout is not None and weight_layout.row == Shard(0) and weight_layout.col == Shard(1)


def place_embedding(node: Node, ctx) -> Decision:
    """Token lookup. A free table [V, h] is split vocab over row and hidden over col
    (1/q^2 of it a rank, and a tied output head multiplies it where it lies); each
    rank looks up the ids of its row group that fall in its vocab block, and a
    reduce-scatter along row sums and splits them; ids whole over row (a batch
    that did not split over it) are looked up in the rank's block as they are, a
    partial sum over row. Other ids not split over row (e.g. positions) use a
    free table split over col only.

    `padding_idx` changes backward only (that row gets no gradient), so it splits
    as a plain lookup does. `scale_grad_by_freq` divides each row's gradient by the
    id's count in the whole batch, so its ids are looked up whole. `max_norm`
    renorms the table in place before the lookup (`embedding_renorm_`, which runs
    replicated and so leaves the table whole)."""
    weight, ids = node.args[:2]
    by_freq = get_arg(node, 3, "scale_grad_by_freq", False)
    ids_layout = Layout.replicated() if by_freq else without_partial(layout_of(ctx, ids))
    w_layout = ctx.layout(weight)
    hidden = shape_of(weight)[1]
    n_ids = len(shape_of(ids))
    q = ctx.mesh.q
    batch_split = ids_layout.row == Shard(0) and ids_layout.col == R
    if batch_split and (vocab_parallel(node, w_layout) or (w_layout is None and hidden % q == 0)):
        w_needed = Layout(R, Shard(0), Shard(1))
        return Decision({weight: w_needed, ids: ids_layout}, Layout(ids_layout.depth, Shard(0), Shard(n_ids)))
    if vocab_parallel(node, w_layout) and ids_layout.row == R and ids_layout.col == R:
        # ids whole over row (a batch that did not split over it): each rank looks them up in its vocab
        # block, a partial sum over row, instead of gathering the table
        return Decision({weight: w_layout, ids: ids_layout}, Layout(ids_layout.depth, P, Shard(n_ids)))
    w_needed, out = [], []
    for axis, p in zip(AXES, ids_layout.placements):
        w_p = w_layout.on(axis) if w_layout else None
        if isinstance(p, Shard):
            w_needed.append(R)
            out.append(p)
        elif isinstance(w_p, Shard) and w_p.dim == 1:
            w_needed.append(w_p)
            out.append(Shard(n_ids, w_p.groups))
        elif w_p is None and axis == "col" and hidden % ctx.mesh.size(axis) == 0:
            w_needed.append(Shard(1))
            out.append(Shard(n_ids))
        else:
            w_needed.append(R)
            out.append(R)
    return Decision({weight: Layout(*w_needed), ids: ids_layout}, Layout(*out))


def masked_lookup(b: Builder, table: Node, ids: Node, vocab: int, axis: str, padding_idx: int = -1) -> Node:
    """Rows of this rank's vocab block (split over `axis`) for `ids`; ids outside the
    block give zeros, so the sum over `axis` is the whole lookup (ids outside the
    table are refused before, by `check_lookup_ids`). A `padding_idx` (global; -1:
    none) row is looked up but gets no gradient, as in torch: its lookups are
    detached (the graph is one for all ranks, so no rank-local index can say it)."""
    block = block_indices(b, ids, vocab, Layout(R, R, R).with_axis(axis, Shard(0)), 0)
    local = b.call(aten.sub.Tensor, ids, b.call(aten.select.int, block, 0, 0))
    size = split_size(vocab, b.mesh.size(axis))  # an uneven split's last blocks are padded; no id is there
    inside = b.call(aten.logical_and.default, b.call(aten.ge.Scalar, local, 0), b.call(aten.lt.Scalar, local, size))
    rows = b.call(aten.embedding.default, table, b.call(aten.where.ScalarOther, inside, local, 0))
    if padding_idx != -1:
        padding = b.call(aten.unsqueeze.default, b.call(aten.eq.Scalar, ids, padding_idx), -1)
        rows = b.call(aten.where.self, padding, b.call(aten.detach.default, rows), rows)
    return b.call(aten.mul.Tensor, rows, b.call(aten.unsqueeze.default, inside, -1))


def lower_embedding(b: Builder, node: Node, args, kwargs):
    """Vocab-parallel lookup: gather the row group's ids, look up those in this rank's
    vocab block, reduce-scatter along row back to own rows. Every lookup checks its
    ids first, as torch's embedding does (`check_lookup_ids`)."""
    check_lookup_ids(b, node, args[1])
    weight_node = node.args[0]
    w_layout = arg_layout(node, weight_node)
    if not vocab_parallel(node, w_layout) or b.mesh.size("row") == 1:
        return lower_default(b, node, args, kwargs)
    vocab = weight_node.meta["val"].shape[0]
    padding_idx = get_arg(node, 2, "padding_idx", -1)
    if isinstance(LAYOUT.of(node).row, Partial):  # ids whole over row: the partial sums are the consumer's
        return masked_lookup(b, args[0], args[1], vocab, "row", padding_idx)
    all_ids = b.split_op(c.all_gather, args[1], "row", 0, 1)
    rows = masked_lookup(b, args[0], all_ids, vocab, "row", padding_idx)
    return b.split_op(c.reduce_scatter, rows, "row", 0, 1)


def _vocab_split(layout: Layout | None) -> bool:
    return layout == Layout(R, R, Shard(0))


def place_embedding_1d(node: Node, ctx) -> Decision:
    """A free table (or one tied to a column-parallel head) split by vocab over col (unevenly
    where p does not divide it): the lookup gives partial sums. Otherwise the table is whole.

    `padding_idx` changes backward only (that row gets no gradient; see
    `masked_lookup`), so it splits too. `scale_grad_by_freq` stays whole: a
    masked lookup sends other blocks' ids to local row 0, which would count
    them. (`max_norm` renorms the table before, replicated, leaving it whole.)"""
    weight, ids = node.args[:2]
    w_layout = ctx.layout(weight)
    if not get_arg(node, 3, "scale_grad_by_freq", False) and (w_layout is None or _vocab_split(w_layout)):
        return Decision({weight: Layout(R, R, Shard(0)), ids: WHOLE}, Layout(R, R, P))
    return Decision({weight: WHOLE, ids: WHOLE}, WHOLE)


def lower_embedding_1d(b: Builder, node: Node, args, kwargs):
    check_lookup_ids(b, node, args[1])
    if not _vocab_split(arg_layout(node, node.args[0])) or b.mesh.size("col") == 1:
        return lower_default(b, node, args, kwargs)
    vocab = node.args[0].meta["val"].shape[0]
    return masked_lookup(b, args[0], args[1], vocab, "col", get_arg(node, 2, "padding_idx", -1))


PLACEMENT = {
    aten.embedding.default: place_embedding,
}


LOWERING = {aten.embedding.default: lower_embedding}


PLACEMENT_1D = {aten.embedding.default: place_embedding_1d}


LOWERING_1D = {aten.embedding.default: lower_embedding_1d}

FAMILY = Family("embeddings", PLACEMENT, lowering=LOWERING, placement_1d=PLACEMENT_1D, lowering_1d=LOWERING_1D)
