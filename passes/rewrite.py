"""Stage 3, rewrite: the placed global graph becomes one SPMD per-rank graph.

Reads (`tess_compile.core.meta_keys`) `LAYOUT`, `ARG_LAYOUTS`, `ROLE`, `WEIGHT_INPUT`, `ALIAS_OF`,
`LOCAL_INPUT`, `REPLICATED`, `RECOMPUTE_REGION`, and on the output node `LOCAL_OUTPUTS` and
`CARRIED_OUTPUTS`, besides torch's `meta["val"]`. Emits a new GraphModule whose placeholders are,
in the captured order, the local shards of parameters, buffers and constants and
the global user inputs; each op runs on local tensors (`tess_compile.passes.rules.lowering_rules`),
with the collectives of `redistribute` wherever a value's layout differs
from the layout its consumer needs. Writes `LAYOUT`, `GLOBAL_SHAPE` and `REPLICATED` on the node
that holds each original value, `GLOBAL_NODE` (the original node's name) on it and on every node
emitted for an original op, `RECOMPUTE_REGION` on every node emitted for a node of a recompute
region; on the placeholders `ROLE`, `WEIGHT_INPUT`, `ALIAS_OF`, `LOCAL_INPUT`, `DTYPE` and, for a value that
is no tensor, `CONSTANT_VALUE`; and on the graph, besides the captured graph's meta, `SCHEDULE_COUNTS`
(products per schedule; with summa="auto" each product's is priced on a cluster) and
`PRODUCT_SCHEDULES` (each captured product's).

Replicated parameters pass through `grad_sync` over their replica axes;
outputs pass through `seed_once` over theirs (see docs/gradients.md). Inputs,
weights that arrive as inputs included, come whole and are sliced locally;
their gradients are each rank's share (the runtime sums them).

A pipeline stage's boundary (`LOCAL_INPUT` on an input, `LOCAL_OUTPUTS` on the output
node) is local blocks: such an input
arrives as this rank's block in its layout (no slicing), and such outputs
leave without `seed_once`; a gradient that crosses the boundary is this
rank's share of the block, as any value's gradient inside one graph is.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from tess_compile.passes.builder import Builder
from tess_compile.passes.redistribute import redistribute
from tess_compile.passes.rules import lowering_rules
from tess_compile.passes.rules.common import lower_default
from tess_compile.core.cluster import CALIBRATED_CLUSTER, Cluster
from tess_compile.core.dynamic import concrete, has_symbols, local_value
from tess_compile.core.layout import Layout, Replicate
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import (
    ALIAS_OF,
    ARG_LAYOUTS,
    CARRIED_OUTPUTS,
    CONSTANT_VALUE,
    DTYPE,
    GLOBAL_NODE,
    GLOBAL_SHAPE,
    LAYOUT,
    LOCAL_INPUT,
    LOCAL_OUTPUTS,
    PRODUCT_SCHEDULES,
    RECOMPUTE_REGION,
    REPLICATED,
    ROLE,
    SCHEDULE_COUNTS,
    WEIGHT_INPUT,
)
from tess_compile.core.options import AUTO, SCHEDULES
from tess_compile.ops import collectives as c

__all__ = ["rewrite"]

log = logging.getLogger("tess_compile.passes")


def rewrite(gm: GraphModule, mesh: Mesh, *, summa: str = "broadcast", keep_blocks: bool = False,
            cluster: Cluster = CALIBRATED_CLUSTER, context: str = "gather") -> GraphModule:
    """The per-rank graph of the placed graph `gm`; see the module docstring.

    `summa` schedules the steps of the matrix products (`tess_compile.core.options.SCHEDULES`,
    or "auto": each product's cheapest on `cluster`); `keep_blocks` keeps their fetched blocks
    for backward (see `tess_compile.passes.summa`); `context` schedules attention over a token split.
    Writes `SCHEDULE_COUNTS` on the result: how many
    products took each schedule.
    """
    if summa not in (*SCHEDULES, AUTO):
        raise ValueError(f"summa={summa!r} is not a schedule: use one of {', '.join(map(repr, (*SCHEDULES, AUTO)))}")
    start = time.perf_counter()
    b = Builder(mesh, summa, keep_blocks, cluster, context)
    env: dict[Node, object] = {}
    converted: dict[tuple[Node, Layout], Node] = {}
    rules = lowering_rules(mesh.mode)
    products: dict[str, dict[str, int]] = {}

    entry = _RegionEntry()

    def local(node: Node, needed: Layout | None, user: Node | None = None) -> Node:
        if needed is None:
            return env[node]
        key = (node, needed)
        if key not in converted:
            before = _last_node(b)
            converted[key] = redistribute(b, env[node], LAYOUT.of(node), needed, node.meta["val"].shape)
            if user is not None and _enters(node, RECOMPUTE_REGION.get(user), needed, b.mesh):
                entry.keep_out(before)
        return converted[key]

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = _placeholder(b, node)
        elif node.op == "call_function":
            needed = ARG_LAYOUTS.of(node)
            last, counts = _last_node(b), dict(b.schedules)
            entry.begin(RECOMPUTE_REGION.get(node), last)
            args, kwargs = map_arg((node.args, node.kwargs), lambda n, user=node: local(n, needed.get(n), user))
            out = rules.get(node.target, lower_default)(b, node, args, kwargs)
            if b.schedules != counts:
                products[node.name] = {name: n - counts.get(name, 0) for name, n in b.schedules.items()
                                       if n != counts.get(name, 0)}
            _annotate(out, node)
            _mark_emitted(b, last, node, entry.outside)
            env[node] = out
        elif node.op == "output":
            needed = ARG_LAYOUTS.of(node)
            if LOCAL_OUTPUTS.has(node):  # blocks for the next pipeline stage: shares flow back
                b.graph.output(map_arg(node.args[0], lambda n: local(n, needed[n])))
            else:
                carried = [leaf for index, leaf in enumerate(pytree.tree_leaves(node.args[0]))
                           if index in CARRIED_OUTPUTS.get(node, {})]  # blocks fed back as they are
                b.graph.output(map_arg(node.args[0], lambda n: local(n, needed[n]) if n in carried
                                       else _seed(b, local(n, needed[n]), needed[n])))
        else:
            raise ValueError(f"node {node.name} ({node.op}) is not supported by the rewrite pass")
    out = GraphModule(torch.nn.Module(), b.graph)
    out.meta.update(gm.meta)
    SCHEDULE_COUNTS.set(out, dict(sorted(b.schedules.items())))
    PRODUCT_SCHEDULES.set(out, products)
    log.info("rewrite: %d -> %d nodes in %.2fs", len(gm.graph.nodes), len(out.graph.nodes), time.perf_counter() - start)
    return out


def _last_node(b: Builder) -> Node:
    return next(iter(reversed(b.graph.nodes)))


def _mark_emitted(b: Builder, last: Node, original: Node, outside: set[Node]) -> None:
    """Every node emitted after `last` (one captured node's conversions and kernels) records
    the captured node's name, and belongs to its recompute region if it has one, but for the
    conversions that enter it (`outside`, `_RegionEntry`)."""
    region = RECOMPUTE_REGION.get(original)
    node = last.next
    while node.op != "root":
        GLOBAL_NODE.set(node, original.name)
        if region is not None and node not in outside:
            RECOMPUTE_REGION.set(node, region)
        node = node.next


class _RegionEntry:
    """Conversions of values that enter a recompute region and do not grow (`_enters`), emitted before the
    region's first node, stay out of it, so that the region saves the converted value for backward, not the
    one it came as (a reduce-scatter of partial sums over the tokens: the token block, not the whole pending
    sum). One emitted inside a run stays in it (recomputed, as any other)."""

    def __init__(self):
        self.outside: set[Node] = set()
        self.started = False  # whether the region run being emitted has a node

    def begin(self, region: str | None, last: Node) -> None:
        """A captured node of `region` is lowered after `last`: a new run unless `last` is of it."""
        self.started = region is not None and RECOMPUTE_REGION.get(last) == region

    def keep_out(self, before: Node) -> None:
        """The nodes after `before` (one conversion) stay out of the region if its run has not begun."""
        if not self.started:
            self.outside.update(_after(before))


def _after(node: Node):
    node = node.next
    while node.op != "root":
        yield node
        node = node.next


def _enters(arg: Node, region: str | None, needed: Layout, mesh: Mesh) -> bool:
    """Whether `arg` is an activation from outside `region` that converting to `needed` keeps as small or
    smaller (a placeholder is held anyway: its conversions stay in the region, recomputed)."""
    if region is None or arg.op != "call_function" or RECOMPUTE_REGION.get(arg) == region:
        return False
    shape = arg.meta["val"].shape
    held, converted = math.prod(LAYOUT.of(arg).local_shape(shape, mesh)), math.prod(needed.local_shape(shape, mesh))
    return statically_known_true(converted <= held)


def _placeholder(b: Builder, node: Node) -> Node:
    role, layout = ROLE.of(node)[0], LAYOUT.of(node)
    x = b.graph.placeholder(node.name)
    ROLE.set(x, ROLE.of(node))
    GLOBAL_NODE.set(x, node.name)
    if WEIGHT_INPUT.has(node):
        WEIGHT_INPUT.set(x, WEIGHT_INPUT.of(node))
    if ALIAS_OF.has(node):
        ALIAS_OF.set(x, ALIAS_OF.of(node))
    if not isinstance(node.meta["val"], torch.Tensor):
        CONSTANT_VALUE.set(x, node.meta["val"])  # a flag or number the model takes
        return x
    whole = role == "input" and not LOCAL_INPUT.has(node)  # a local input is this rank's block
    if LOCAL_INPUT.has(node):
        LOCAL_INPUT.set(x, True)
    LAYOUT.set(x, Layout.replicated() if whole else layout)
    GLOBAL_SHAPE.set(x, concrete(node.meta["val"].shape))
    DTYPE.set(x, node.meta["val"].dtype)
    if has_symbols(node.meta["val"].shape):  # its sizes are the symbols' source (`Builder.call`)
        x.meta["val"] = node.meta["val"] if whole else local_value(node.meta["val"], layout, b.mesh)
    if whole:
        x = redistribute(b, x, Layout.replicated(), layout, node.meta["val"].shape)
    if role == "param":
        for axis in layout.axes_where(Replicate, b.mesh):
            x = b.call(c.grad_sync, x, axis)
    _annotate(x, node)
    return x


def _seed(b: Builder, x: Node, layout: Layout) -> Node:
    for axis in layout.axes_where(Replicate, b.mesh):
        x = b.call(c.seed_once, x, axis)
    return x


def _annotate(out, node: Node) -> None:
    """Mark the per-rank node that holds `node`'s value with its layout, global
    shape and name, and whether it runs replicated."""
    if isinstance(out, Node) and REPLICATED.has(node):
        REPLICATED.set(out, REPLICATED.of(node))
    if isinstance(out, Node):
        GLOBAL_NODE.setdefault(out, node.name)
    if isinstance(out, Node) and isinstance(LAYOUT.get(node), Layout):
        LAYOUT.setdefault(out, LAYOUT.of(node))
        GLOBAL_SHAPE.setdefault(out, concrete(node.meta["val"].shape))
