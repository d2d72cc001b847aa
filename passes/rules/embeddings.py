"""Placement rules of embedding lookups: vocab-parallel tables (`R S(0) S(1)`)
looked up by the ids of each row group, or tables split over hidden only.
"""

from __future__ import annotations

from torch.fx import Node

from passes.rules.common import R, Decision, aten, get_arg, layout_of, shape_of, without_partial
from tess_compile.layout import Layout, Shard
from tess_compile.mesh import AXES

__all__ = ["EMBEDDING_RULES", "vocab_parallel"]


def vocab_parallel(node: Node, weight_layout: Layout | None) -> bool:
    """Whether an embedding looks up a table split over rows by vocab (`R S(0) S(1)`)."""
    return weight_layout is not None and weight_layout.row == Shard(0) and weight_layout.col == Shard(1)


def place_embedding(node: Node, ctx) -> Decision:
    """Token lookup. A free table [V, h] is split vocab over row and hidden over col
    (1/q^2 of it a rank, and a tied output head multiplies it where it lies); each
    rank looks up the ids of its row group that fall in its vocab block, and a
    reduce-scatter along row sums and splits them. Ids not split over row (e.g.
    positions) use a table split over col only.

    `padding_idx` changes backward only (that row gets no gradient), so it splits
    as a plain lookup does. `scale_grad_by_freq` divides each row's gradient by the
    id's count in the whole batch, so its ids are looked up whole. `max_norm`
    renorms the table in place before the lookup (`embedding_renorm_`, which runs
    replicated and so leaves the table whole)."""
    weight, ids = node.args[:2]
    by_freq = get_arg(node, 3, "scale_grad_by_freq", False)
    ids_layout = Layout.replicated() if by_freq else without_partial(layout_of(ctx, ids))
    w_layout = ctx.layout(weight)
    vocab, hidden = shape_of(weight)
    n_ids = len(shape_of(ids))
    q = ctx.mesh.q
    batch_split = ids_layout.row == Shard(0) and ids_layout.col == R
    if batch_split and (vocab_parallel(node, w_layout) or (w_layout is None and vocab % q == 0 and hidden % q == 0)):
        w_needed = Layout(R, Shard(0), Shard(1))
        return Decision({weight: w_needed, ids: ids_layout}, Layout(ids_layout.depth, Shard(0), Shard(n_ids)))
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


EMBEDDING_RULES = {
    aten.embedding.default: place_embedding,
}
