"""After merge products, alike regions: values every rank of an axis computes alike hold whole gradients.

Under exact adjoints (docs/gradients.md) the gradient a rank holds for a value
replicated along an axis is its share: an output replicated along an axis seeds
its gradient on coordinate 0 only (`seed_once`), a replicated parameter sums its
shares in backward (`grad_sync`), and the collective that made a value
replicated sends the shares back (an all-gather by a reduce-scatter, an
all-reduce by an all-reduce). Where every rank of `axis` computes a region of
values alike, every rank can hold the whole gradient of each instead, as
Megatron-LM holds the gradients of its replicated activations. The sums are
the same; what changes is the region's border:

- entries, where values become alike: an all-gather of blocks becomes
  `all_gather_alike` (adjoint: the rank's own block, `shard_slice`, no bytes),
  an all-reduce of partial sums `all_reduce_alike` (adjoint: the identity), a
  replicated parameter's `grad_sync` along `axis` goes (every rank computes its
  whole gradient);
- a region value added once into partial sums (`keep_first`, a row-parallel
  product's bias) becomes `keep_first_alike` (adjoint: the identity);
- outputs: their `seed_once` along `axis` goes, every rank seeds the whole
  gradient;
- exits, a region value used by an op outside the region (a column-parallel
  product, whose gradient for it is a share): one `sum_shares` on that value
  (identity; adjoint: an all-reduce, Megatron's f) sums the shares of every
  such use into the whole gradient.

Each connected region is rewritten where that saves collectives: one backward
collective fewer per all-gather and all-reduce entry, one more per exit; a
region whose entries and exits are even is rewritten where, with the others,
it leaves no parameter's `grad_sync` along `axis`, so that one bucket of
gradient all-reduces goes (`passes/bucket_gradients.py`). A split
cross-entropy's tail (`passes/rules/losses.py`) is a region with one entry and
no exit; mode 1d's residual stream one with an entry per row-parallel product
and an exit per column-parallel one.

A value is alike along `axis` if it is an entry, a placeholder replicated
along `axis` that takes no gradient (a constant, an input that arrives whole,
a replicated buffer), or the result of a deterministic torch op, a
getitem, or a collective along another axis, whose inputs are all alike. A
region is the alike values a gradient flows through, joined where one uses
another. An entry's input is never alike (a collective of alike values is not
an entry), no recompute region holds a region value, and a region whose value
is an output without its `seed_once` along `axis` is left as it is.

Of a graph shortened to four of its repeated blocks, each node counts for the nodes of the whole
graph it stands for (`repeated_blocks.repeats_of`), so that the choices are the whole graph's.

Runs after merge products and before the gradient buckets; reads `ROLE`, `DTYPE`,
`CONSTANT_VALUE`, `WEIGHT_INPUT` (through `core.fake_run.requires_grad`), `LAYOUT`,
`RECOMPUTE_REGION`, `GLOBAL_NODE` and `BLOCK_REPEATS` (`tess_compile.core.meta_keys`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from tess_compile.passes.repeated_blocks import repeats_of
from tess_compile.core.fake_run import requires_grad
from tess_compile.core.layout import Layout, Replicate
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.meta_keys import CONSTANT_VALUE, LAYOUT, RECOMPUTE_REGION, ROLE
from tess_compile.ops import collectives as c

__all__ = ["alike_regions"]

_COLLECTIVE_TARGETS = set(c.COLLECTIVE_OPS) | {c.wait}
# entry -> what it becomes; None: it goes (the parameter's gradient is whole)
_ENTRIES = {c.all_gather: c.all_gather_alike, c.all_reduce: c.all_reduce_alike, c.grad_sync: None}
_SAVES = {c.all_gather, c.all_reduce}  # entries whose backward collective goes


@dataclass
class _Region:
    """One connected region along an axis: its values (in graph order), entries, keep_firsts, seeds and
    exits; `count(node)` how many nodes of the whole graph a node stands for (block reuse)."""

    nodes: list[Node]
    count: Callable[[Node], int]
    entries: list[Node] = field(default_factory=list)
    keep_firsts: list[Node] = field(default_factory=list)
    seeds: list[Node] = field(default_factory=list)
    exits: dict[Node, list[Node]] = field(default_factory=dict)  # region value -> its users outside
    valid: bool = True

    @property
    def saved(self) -> int:
        """Backward collectives the rewrite saves, less the ones it adds."""
        return (sum(self.count(entry) for entry in self.entries if entry.target in _SAVES)
                - sum(map(self.count, self.exits)))

    @property
    def syncs(self) -> int:
        return sum(self.count(entry) for entry in self.entries if entry.target is c.grad_sync)


def alike_regions(gm: GraphModule, mesh: Mesh) -> GraphModule:
    """`gm` with each qualifying region along each axis holding whole gradients (see the module
    docstring)."""
    changed = False
    for axis in AXES:
        if mesh.size(axis) > 1:
            changed |= _rewrite_axis(gm, axis)
    if changed:
        gm.recompile()
    return gm


def _rewrite_axis(gm: GraphModule, axis: str) -> bool:
    """Rewrite the regions along `axis` that pay (module docstring); whether any was."""
    regions = [region for region in _regions(gm, axis) if region.valid]
    chosen = [region for region in regions if region.saved > 0]
    even = [region for region in regions if region.saved == 0 and region.syncs]
    syncs = sum(repeats_of(gm, node) for node in gm.graph.nodes
                if node.target is c.grad_sync and node.args[1] == axis)
    if even and sum(region.syncs for region in chosen + even) == syncs:
        chosen += even  # together they leave no grad_sync along the axis: its bucket goes
    for region in chosen:
        _rewrite(gm, region, axis)
    return bool(chosen)


def _regions(gm: GraphModule, axis: str) -> list[_Region]:
    """The connected regions of alike values along `axis` that a gradient flows through."""
    reach = _gradient_reach(gm)
    members = _alike_values(gm, axis, reach) & reach
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    regions, seen = [], set()
    for start in gm.graph.nodes:
        if start not in members or start in seen:
            continue
        found, stack = [], [start]
        seen.add(start)
        while stack:
            node = stack.pop()
            found.append(node)
            for other in (*node.all_input_nodes, *node.users):
                if other in members and other not in seen:
                    seen.add(other)
                    stack.append(other)
        region = _Region(sorted(found, key=order.__getitem__), lambda node: repeats_of(gm, node))
        _border(region, axis)
        regions.append(region)
    return regions


def _border(region: _Region, axis: str) -> None:
    """Fill the region's entries, keep_firsts, seeds and exits; mark it invalid where a value of
    it leaves as an output without a `seed_once` along `axis`."""
    inside = set(region.nodes)
    for node in region.nodes:
        if _is_entry(node, axis):
            region.entries.append(node)
        if node.target is c.seed_once and node.args[1] == axis:
            region.seeds.append(node)
        outside = []
        for user in node.users:
            if user in inside:
                continue
            if user.target is c.keep_first and user.args[1] == axis:
                region.keep_firsts.append(user)
            elif user.op == "output":
                region.valid &= _seeded(node, axis)
            else:
                outside.append(user)
        if outside:
            region.exits[node] = outside


def _seeded(node: Node, axis: str) -> bool:
    """Whether `node`, an output, is seeded once along `axis` by a chain of `seed_once` nodes."""
    while node.op == "call_function" and node.target is c.seed_once:
        if node.args[1] == axis:
            return True
        node = node.args[0]
    return False


def _rewrite(gm: GraphModule, region: _Region, axis: str) -> None:
    """Region `region` holding whole gradients: exits summed first (an exit may be a `grad_sync`
    entry, which then goes), entries, keep_firsts and seeds."""
    for node, users in region.exits.items():
        with gm.graph.inserting_after(node):
            summed = gm.graph.call_function(c.sum_shares, (node, axis))
        summed.meta.update(node.meta)  # its value, layout and global node
        for user in users:
            user.replace_input_with(node, summed)
    for entry in region.entries:
        alike = _ENTRIES[entry.target]
        if alike is None:
            entry.replace_all_uses_with(entry.args[0])
            gm.graph.erase_node(entry)
        else:
            entry.target = alike
    for node in region.keep_firsts:
        node.target = c.keep_first_alike
    for seed in region.seeds:
        seed.replace_all_uses_with(seed.args[0])
        gm.graph.erase_node(seed)


def _gradient_reach(gm: GraphModule) -> set[Node]:
    """The nodes a gradient can flow through: parameters (and their tied names), floating-point
    user inputs, and every node computed from one."""
    reach = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if requires_grad(node, inputs_require_grad=True) or ROLE.of(node)[0] == "alias":
                reach.add(node)
        elif any(n in reach for n in node.all_input_nodes):
            reach.add(node)
    return reach


def _alike_values(gm: GraphModule, axis: str, reach: set[Node]) -> set[Node]:
    """The values every rank of `axis` computes alike (module docstring), inputs first."""
    alike: set[Node] = set()
    for node in gm.graph.nodes:
        if RECOMPUTE_REGION.has(node):
            continue
        if node.op in ("placeholder", "get_attr"):
            if node not in reach and _same_on_every_rank(node, axis):
                alike.add(node)
        elif _is_entry(node, axis):
            if node.args[0] not in alike:
                alike.add(node)
        elif node.op == "call_function" and _alike_op(node, axis) and all(n in alike for n in node.all_input_nodes):
            alike.add(node)
    return alike


def _same_on_every_rank(node: Node, axis: str) -> bool:
    """Whether the placeholder `node` holds the same value on every rank of `axis`: a constant, or a
    tensor replicated along it (an input that arrives whole, a replicated buffer)."""
    if CONSTANT_VALUE.has(node):
        return True
    layout = LAYOUT.get(node)
    return isinstance(layout, Layout) and isinstance(layout.on(axis), Replicate)


def _is_entry(node: Node, axis: str) -> bool:
    """An all-gather or all-reduce along `axis`, or a parameter's `grad_sync` along it (the only use of
    what it syncs, a parameter or its `grad_sync` along another axis)."""
    if node.op != "call_function" or node.target not in _ENTRIES or node.args[1] != axis:
        return False
    return node.target is not c.grad_sync or (len(node.args[0].users) == 1 and _synced_parameter(node.args[0]))


def _synced_parameter(node: Node) -> bool:
    while node.op == "call_function" and node.target is c.grad_sync:
        node = node.args[0]
    return node.op == "placeholder" and ROLE.of(node)[0] == "param"


def _alike_op(node: Node, axis: str) -> bool:
    """Whether `node` gives alike values from alike inputs: a deterministic torch op, a getitem, a
    wait, or a collective along another axis (a function of its inputs and coordinates along it)."""
    if node.target in _COLLECTIVE_TARGETS:
        return node.target is c.wait or (len(node.args) > 1 and node.args[1] != axis) or node.target is c.seed_once
    if node.target is operator.getitem:
        return True
    return (isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "aten"
            and torch.Tag.nondeterministic_seeded not in node.target.tags)
