"""The graph builder that the rewrite pass (stage 3) and its lowering rules emit into."""

from __future__ import annotations

from collections import Counter

import torch
from torch.fx import Graph, Node

from tess_compile.core.cluster import CALIBRATED_CLUSTER, Cluster
from tess_compile.core.mesh import Mesh

__all__ = ["Builder"]


class Builder:
    """Appends nodes to a new per-rank graph; collectives on axes of size 1 vanish.

    `summa` is the schedule of the matrix products' steps (`tess_compile.core.options.SCHEDULES`),
    or "auto": each product's cheapest on `cluster` (`tess_compile.passes.summa.cheapest_schedule`);
    `schedules` counts the products of each schedule. `keep_blocks` keeps their fetched blocks for
    backward instead of fetching again. `context` schedules attention over a token split
    (`tess_compile.core.options.CONTEXT_SCHEDULES`).
    `shared` holds values that later products may read again instead of fetching them
    once more (`tess_compile.passes.summa`); any in-place op empties it, as it may change a source.
    """

    def __init__(self, mesh: Mesh, summa: str = "broadcast", keep_blocks: bool = False,
                 cluster: Cluster = CALIBRATED_CLUSTER, context: str = "gather"):
        self.mesh = mesh
        self.context = context  # attention over a token split: "gather" or "ring"
        self.summa = summa
        self.keep_blocks = keep_blocks
        self.cluster = cluster
        self.schedules: Counter[str] = Counter()
        self.graph = Graph()
        self.shared: dict[tuple, Node] = {}
        self._sizes: dict[object, Node | int] = {}  # a symbolic size's formula -> the node computing it

    def call(self, target, *args, **kwargs) -> Node:
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            self.shared.clear()
        name = getattr(target, "_opname", None)  # "broadcast", not "broadcast_default"
        args, kwargs = self.size((args, kwargs))
        return self.graph.create_node("call_function", target, args, kwargs, name=name)

    def size(self, value):
        """`value` with each symbolic size in it (a dynamic compile's, `tess_compile.core.dynamic`)
        replaced by nodes that compute it from the inputs' sizes at run time
        (`Graph.materialize_symints`, which reads them from the placeholders' `meta["val"]`),
        each formula emitted once."""
        if isinstance(value, torch.SymInt):
            expr = value.node.expr
            if expr not in self._sizes:
                self._sizes[expr] = self.graph.materialize_symints([value])[0]
            return self._sizes[expr]
        if isinstance(value, (list, tuple)):
            return type(value)(self.size(v) for v in value)
        if isinstance(value, dict):
            return {k: self.size(v) for k, v in value.items()}
        return value

    def collective(self, op, x: Node, axis: str, *args) -> Node:
        """`op(x, axis, *args)`, or `x` itself when `axis` has size 1."""
        if self.mesh.size(axis) == 1:
            return x
        return self.call(op, x, axis, *args)

    def split_op(self, op, x: Node, axis: str, dim: int, groups: int) -> Node:
        """A collective that splits or joins `dim` in the parts of `axis`."""
        parts = self.mesh.size(axis)
        if parts == 1:
            return x
        return self.call(op, x, axis, parts, dim, groups)
