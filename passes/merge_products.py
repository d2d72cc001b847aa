"""Stage 3a, merge products: the matrix products that read one input become one (horizontal fusion).

A transformer's q, k and v (a gated MLP's gate and up) are products of one
input. The rewrite gives each its own product, its own weight fetch and, in
backward, its own refetches and weight-gradient reduction. This pass, on the
per-rank graph right after the rewrite, turns each group of products of one
input into one product over the concatenation of their weights, then splits
its output's last dim into the products' outputs:

    y_i = product(fetch_a(x), fetch_w(w_i))  ->  y = product(fetch_a(x), fetch_w(cat(w_i))); y_i = split(y)[i]

A group's products are `fetched_product`s, or plain products whose record
merges (`tess_compile.core.product_table`: `aten.linear` and `aten.matmul`) with
2-D weights (1-D mode, `keep_blocks`), with the same kernel,
the same input fetched alike (the same source through fetches of the same
arguments: one all-gather, step t's broadcast, or a broadcast_start and its
wait), the same refetch specs, and weights that are the graph's weights
(parameters, after their `grad_sync`s, or weight inputs) of one dtype and one
size but the out dim, each fetched alike. A fetch must commute with the
concatenation along the out dim: a broadcast always does; an all-gather only
when it joins another dim (its groups reorder blocks within that dim only);
so `A @ B^T` in the gather schedule, whose weight is gathered along its out
dim, stays as it is. Linear biases are concatenated too (all or none).
Products merge only within a stretch free of in-place ops and only if they
reach the same graph outputs (a loss of some outputs leaves the weights of
the others without a gradient, None, not zeros), into the first product's
place: the input's fetch is the first product's, the weights' fetches are
made again of the concatenation where the first product's were.

Then each split whose pieces each feed one like op (`add`, as a SUMMA loop
sums its steps; a `broadcast`, `reduce` or `all_reduce` of equal arguments,
as `A @ B^T` reduces each step) moves after that op, which then runs once on
the whole: a loop's steps are summed, and reduced, once.

What the merged product keeps for backward is what its products kept: a
`fetched_product` keeps its own blocks to fetch them again, and the merged
one keeps the weights as pieces (`w_own` a tuple), which its backward
concatenates, not a copy of their concatenation; a plain product of local
weights (1-D) becomes such a `fetched_product` that fetches nothing, its
biases added after. With kept blocks (`keep_blocks`), the merged product
keeps the fetched concatenation, as its products kept their fetched blocks.

Reads (`tess_compile.core.meta_keys`) `ROLE`, `WEIGHT_INPUT` and `DTYPE` of the
weights' placeholders and `LAYOUT` and `GLOBAL_SHAPE` of the weights, `GLOBAL_NODE`, and
`RECOMPUTE_REGION` (products merge only within one region). Writes: each piece takes its
product's `meta` whole (`val`, `LAYOUT`, `GLOBAL_SHAPE`, `GLOBAL_NODE`, `RECOMPUTE_REGION`,
`SUMMA_STEP`, ...); the new nodes take the first product's `RECOMPUTE_REGION` and `SUMMA_STEP`
(the concatenated weights, read by every step, no `SUMMA_STEP`) and, in `GLOBAL_NODE`, the
names of all.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node
from torch.utils import _pytree as pytree

from tess_compile.core.layout import Layout
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import (
    DTYPE,
    GLOBAL_NODE,
    GLOBAL_SHAPE,
    LAYOUT,
    RECOMPUTE_REGION,
    REPLICATED,
    ROLE,
    SUMMA_STEP,
    WEIGHT_INPUT,
)
from tess_compile.core.product_table import PRODUCT_KERNELS, ProductKernel, product_kernel
from tess_compile.ops import collectives as c
from tess_compile.ops.fetched_product import fetched_product

__all__ = ["merge_products"]

aten = torch.ops.aten

# Collectives that fetch an operand's block for a product.
_FETCHES = (c.broadcast, c.broadcast_start, c.wait, c.all_gather)

# Ops that act on each piece of a split alike, so that they may run once before it.
_SINKS = (aten.add.Tensor, c.broadcast, c.reduce, c.all_reduce)

# What a weight's placeholder may pass through before a product reads it.
_WEIGHT_STEPS = (c.grad_sync, c.shard_slice)

# Meta keys that only the node holding an original value carries.
_VALUE_KEYS = ("val", LAYOUT.name, GLOBAL_SHAPE.name, REPLICATED.name)


def merge_products(gm: GraphModule, mesh: Mesh) -> GraphModule:
    """`gm` with its groups of products of one input merged; see the module docstring."""
    cats: dict[tuple, Node] = {}
    splits = [_merge(gm.graph, group, cats) for group in _groups(gm.graph, mesh)]
    if splits:
        _sink_all(gm.graph, splits)
        gm.graph.lint()
        gm.recompile()
    return gm


@dataclass(frozen=True)
class _Product:
    """One product of the per-rank graph, its operands traced back to their sources."""

    node: Node
    kernel: ProductKernel
    a_chain: tuple[Node, ...]  # the input's source, then its fetches
    w_chain: tuple[Node, ...]  # the weight's source, then its fetches
    w_shape: tuple[int, ...]  # the weight's local shape
    bias: Node | None

    @property
    def out_dim(self) -> int:
        return self.kernel.out_dim

    @property
    def w_source(self) -> Node:
        return self.w_chain[0]

    @property
    def fetches(self) -> tuple[Node, ...]:
        return self.a_chain[1:] + self.w_chain[1:]

    @property
    def fetched_at(self) -> Node:
        """The first node that reads the weight: its first fetch, or the product."""
        return self.w_chain[1] if len(self.w_chain) > 1 else self.node

    def key(self) -> tuple:
        """Products with equal keys compute `product(a, w_i)` of one input, fetched alike."""
        node = self.node
        refetches = node.args[4:] if node.target is fetched_product else ()
        other_dims = tuple(size for dim, size in enumerate(self.w_shape) if dim != self.out_dim)
        bias_dtype = None if self.bias is None else _dtype(self.bias)
        return (node.target, refetches, self.a_chain[0], _signature(self.a_chain[1:]), _signature(self.w_chain[1:]),
                _dtype(self.w_source), other_dims, self.bias is None, bias_dtype, RECOMPUTE_REGION.get(node))


def _groups(graph: Graph, mesh: Mesh) -> list[list[_Product]]:
    """The groups of two or more products that may merge, in graph order."""
    segments: dict[Node, int] = {}  # the number of in-place ops before each node
    groups: dict[tuple, list[_Product]] = {}
    reached = _outputs_reached(graph)
    segment = 0
    for node in graph.nodes:
        segments[node] = segment
        segment += _mutates(node)
        product = _product(node, mesh)
        if product is not None and all(segments[link] == segments[node] for link in product.fetches):
            groups.setdefault((segments[node], reached.get(node, 0), product.key()), []).append(product)
    return [group for group in groups.values() if len(group) > 1 and _defined_in_time(group)]


def _outputs_reached(graph: Graph) -> dict[Node, int]:
    """The graph outputs each node's value flows into other than through `detach`, as a bit
    set. Products that reach different outputs stay apart: a loss of some outputs must leave
    the weights of the others without a gradient (None, as the unsharded model's), not zeros."""
    reached: dict[Node, int] = {}
    for node in reversed(graph.nodes):
        if node.op == "output":
            leaves = pytree.tree_leaves(node.args[0])
            for index, leaf in enumerate(leaves):
                if isinstance(leaf, Node):
                    reached[leaf] = reached.get(leaf, 0) | 1 << index
        elif node.target is not aten.detach.default:
            for arg in node.all_input_nodes:
                reached[arg] = reached.get(arg, 0) | reached.get(node, 0)
    return reached


def _mutates(node: Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _product(node: Node, mesh: Mesh) -> _Product | None:
    """`node` as a product that may merge, or None."""
    if node.op != "call_function" or node.kwargs:
        return None
    kernel = product_kernel(node.target)
    if node.target is fetched_product:
        a_used, w_used, a_own, w_own, name, _, w_refetch = node.args
        kernel = PRODUCT_KERNELS[name]
        a_chain, w_chain, bias = _chain(a_used, a_own), _chain(w_used, w_own), None
        if w_refetch is not None and w_refetch[0] == "all_gather" and w_refetch[3] == kernel.out_dim:
            return None
    elif kernel is not None and kernel.merges and 2 <= len(node.args) <= len(kernel.operands):
        a_used, w_used, bias = (kernel.arg(node.args, role) for role in ("input", "weight", "bias"))
        a_chain, w_chain = _chain(a_used), _chain(w_used)
    else:
        return None
    if a_chain is None or w_chain is None or not all(_commutes(link, kernel.out_dim) for link in w_chain[1:]):
        return None
    w_shape = _weight_shape(w_chain[0], mesh)
    bias_shape = None if bias is None else _weight_shape(bias, mesh)
    if w_shape is None or len(w_shape) != 2 or (bias is not None and (bias_shape is None or len(bias_shape) != 1)):
        return None
    return _Product(node, kernel, a_chain, w_chain, w_shape, bias)


def _chain(used, source: Node | None = None) -> tuple[Node, ...] | None:
    """`used` and the fetches it was made by, back to `source` (or the first node that is no
    fetch), source first; None if `source` is not reached."""
    chain = [used]
    while chain[-1] is not source and isinstance(chain[-1], Node) and chain[-1].target in _FETCHES:
        chain.append(chain[-1].args[0])
    if not isinstance(chain[-1], Node) or (source is not None and chain[-1] is not source):
        return None
    return tuple(reversed(chain))


def _commutes(link: Node, out_dim: int) -> bool:
    """Whether a weight's fetch commutes with concatenating weights along `out_dim`: a broadcast
    does; an all-gather joins its own dim only (its groups order the blocks within that dim)."""
    return link.target is not c.all_gather or link.args[3] != out_dim


def _weight_shape(node, mesh: Mesh) -> tuple[int, ...] | None:
    """The local shape of a weight of the graph (a parameter or weight input, as the rewrite
    hands it to its products), or None if `node` is not one."""
    if not isinstance(node, Node):
        return None
    root = node
    while root.op == "call_function" and root.target in _WEIGHT_STEPS:
        root = root.args[0]
    weight = root.op == "placeholder" and (ROLE.get(root, ("",))[0] == "param" or WEIGHT_INPUT.has(root))
    layout, shape = LAYOUT.get(node), GLOBAL_SHAPE.get(node)
    if not weight or not isinstance(layout, Layout) or shape is None:
        return None
    return tuple(layout.local_shape(shape, mesh))


def _dtype(node: Node) -> torch.dtype:
    """The dtype of a weight (`_weight_shape`): its placeholder's."""
    while node.op != "placeholder":
        node = node.args[0]
    return DTYPE.of(node)


def _signature(chain: tuple[Node, ...]) -> tuple:
    return tuple((link.target, tuple(link.args[1:])) for link in chain)


def _defined_in_time(group: list[_Product]) -> bool:
    """Every weight is defined before the first product's weight is fetched, every bias before
    the first product."""
    first = group[0]
    return all(p.w_source < first.fetched_at and (p.bias is None or p.bias < first.node) for p in group)


def _merge(graph: Graph, group: list[_Product], cats: dict) -> Node:
    """One product of the group's concatenated weights where the first was; its pieces replace
    the products. Returns the split."""
    first = group[0]
    names = ", ".join(GLOBAL_NODE.get(p.node, p.node.name) for p in group)
    merged_meta = _merged_meta(first.node, names)
    w = w_cat = _weights_cat(graph, group, cats, merged_meta)
    for link in first.w_chain[1:]:
        with graph.inserting_before(link):
            w = _call(graph, link.target, w, *link.args[1:], meta={**link.meta, GLOBAL_NODE.name: names})
    pieces = tuple(p.w_source for p in group)  # what backward keeps: the weights, not their concatenation
    with graph.inserting_before(first.node):
        a_used = first.a_chain[-1]
        if first.node.target is fetched_product:
            y = _call(graph, fetched_product, a_used, w, first.node.args[2], pieces, *first.node.args[4:],
                      meta=merged_meta)
        elif w is w_cat:  # a plain product of local weights (1-D): a product that fetches nothing keeps the pieces
            y = _call(graph, fetched_product, a_used, w, a_used, pieces, first.kernel.name, None, None,
                      meta=merged_meta)
        else:  # the blocks fetched and kept (keep_blocks): the product keeps the fetched concatenation
            y = _call(graph, first.node.target, a_used, w, meta=merged_meta)
        if first.bias is not None:
            bias = _call(graph, aten.cat.default, [p.bias for p in group], 0, meta=merged_meta)
            y = _call(graph, aten.add.Tensor, y, bias, meta=merged_meta)
        split = _split(graph, y, [p.w_shape[p.out_dim] for p in group], [p.node for p in group], merged_meta)
    for product in group:
        _erase_with_chains(graph, product.node, (product.a_chain, product.w_chain))
    return split


def _weights_cat(graph: Graph, group: list[_Product], cats: dict, meta: dict) -> Node:
    """The group's weights concatenated along their out dim, before the first fetch of the first;
    one node for all the groups of the same weights (a SUMMA loop's steps)."""
    at, weights = group[0].fetched_at, [p.w_source for p in group]
    key = (tuple(weights), group[0].out_dim, RECOMPUTE_REGION.get(meta))
    cat = cats.get(key)
    if cat is None:
        with graph.inserting_before(at):
            cat = cats[key] = _call(graph, aten.cat.default, weights, group[0].out_dim,
                                    meta={k: v for k, v in meta.items() if k != SUMMA_STEP.name})
    elif at < cat:
        at.prepend(cat)
    return cat


def _merged_meta(first: Node, names: str) -> dict:
    """The meta of the nodes that replace a group of nodes (`first` the first of them): the first's,
    but for the keys of its value, with `GLOBAL_NODE` the names of all."""
    meta = {k: v for k, v in first.meta.items() if k not in _VALUE_KEYS}
    GLOBAL_NODE.set(meta, names)
    return meta


def _call(graph: Graph, target, *args, meta: dict) -> Node:
    node = graph.create_node("call_function", target, args, name=getattr(target, "_opname", None))
    node.meta.update(meta)
    return node


def _split(graph: Graph, y: Node, sizes: list[int], originals: list[Node], meta: dict) -> Node:
    """`split(y, sizes)` along the last dim; piece i takes the place (uses and meta) of `originals[i]`."""
    split = _call(graph, aten.split_with_sizes.default, y, sizes, -1, meta=meta)
    for index, original in enumerate(originals):
        piece = _call(graph, operator.getitem, split, index, meta=dict(original.meta))
        original.replace_all_uses_with(piece)
    return split


def _erase_with_chains(graph: Graph, node: Node, chains) -> None:
    """Erase `node`, then what of each chain (source first) only it used."""
    graph.erase_node(node)
    for chain in chains:
        for link in reversed(chain[1:]):
            if link.users:
                break
            graph.erase_node(link)


def _sink_all(graph: Graph, splits: list[Node]) -> None:
    """Move each split after the like ops its pieces feed, as long as there are some."""
    pending, mine = list(splits), set(splits)
    while pending:
        split = pending.pop(0)
        moved = _sink(graph, split, mine) if split in mine else None
        if moved is not None:
            pending.append(moved)


def _pieces(split: Node) -> list[Node] | None:
    """The getitems of every piece of `split`, in order, or None if some piece is not read
    or is read otherwise."""
    users = sorted(split.users, key=lambda n: n.args[1] if n.target is operator.getitem else -1)
    num = len(split.args[1])
    if [u.args[1] if u.target is operator.getitem else None for u in users] != list(range(num)):
        return None
    return users


def _sink(graph: Graph, split: Node, mine: set[Node]) -> Node | None:
    """`op(split(y)[i], ...)` for every i -> `split(op(y, ...))[i]`, if the pieces each feed one
    like op (see `_like`); returns the new split, or None. `mine` holds the splits this pass
    made (and loses those it erases)."""
    pieces = _pieces(split)
    if pieces is None or any(len(piece.users) != 1 for piece in pieces):
        return None
    ops = [next(iter(piece.users)) for piece in pieces]
    like = _like(ops, pieces, split, mine)
    if like is None:
        return None
    whole_args, others = like
    first = min(ops)
    meta = _merged_meta(first, ", ".join(GLOBAL_NODE.get(op, op.name) for op in ops))
    with graph.inserting_before(first):
        whole = _call(graph, first.target, *whole_args, meta=meta)
        moved = _split(graph, whole, split.args[1], ops, meta)
    for op in ops:
        graph.erase_node(op)
    for dead in [split, *others]:
        for piece in list(dead.users):
            graph.erase_node(piece)
        graph.erase_node(dead)
        mine.discard(dead)
    mine.add(moved)
    return moved


def _like(ops: list[Node], pieces: list[Node], split: Node, mine: set[Node]) -> tuple[tuple, list[Node]] | None:
    """The arguments of the op on the whole and the other splits it reads, if `ops[i]` is one op
    of `pieces[i]`: the same target in `_SINKS`, the same other arguments, or for `add` piece i
    of another of `mine` of the same sizes, in the same place; all in one recompute region."""
    first = ops[0]
    if first.target not in _SINKS or any(op.kwargs for op in ops):
        return None
    if any(op.target is not first.target or RECOMPUTE_REGION.get(op) != RECOMPUTE_REGION.get(first) for op in ops):
        return None
    place = first.args.index(pieces[0])
    if any(len(op.args) != len(first.args) or op.args[place] is not piece for op, piece in zip(ops, pieces)):
        return None
    whole, others = [], []
    for position, arg in enumerate(first.args):
        if position == place:
            whole.append(split.args[0])
        elif not isinstance(arg, Node) and all(op.args[position] == arg for op in ops):
            whole.append(arg)
        elif first.target is aten.add.Tensor and (other := _same_split(ops, position, split, mine)) is not None:
            whole.append(other.args[0])
            others.append(other)
        else:
            return None
    return tuple(whole), others


def _same_split(ops: list[Node], position: int, split: Node, mine: set[Node]) -> Node | None:
    """The other split of `mine` whose piece i is argument `position` of `ops[i]`, read by nothing
    else, if it splits like `split`."""
    args = [op.args[position] for op in ops]
    if not all(isinstance(a, Node) and a.target is operator.getitem for a in args):
        return None
    other = args[0].args[0]
    if other not in mine or other is split or other.args[1:] != split.args[1:]:
        return None
    if any(a.args != (other, index) or len(a.users) != 1 for index, a in enumerate(args)):
        return None
    if len(other.users) != len(args):
        return None
    return other
