"""Stage 3c, expand blocks: the per-rank nodes of a short graph's block 2 copied for the blocks it stands for.

A graph shortened to four of its repeated blocks (`tess_compile.passes.repeated_blocks`: blocks
0, 1, 2 and N-1) is placed and rewritten like any other. Its per-rank graph holds each kept
block's nodes in runs: a block's parameters with their conversions among the placeholders, its
ops among the ops. `expand_blocks` copies block 2's runs, right after them, once for each of
blocks 3 .. N-2: a copy reads its own parameters, the previous copy's values where block 2 read
block 1's, and the same values as block 2 otherwise; the last block reads the last copy's values.
That is the per-rank graph a compile of the whole graph gives, node for node, if blocks 1 and 2
came out alike (the same nodes, reading the block before at the same places): the blocks after
the first see the same layouts, so every pass treats them alike (`alike_regions` counts block 2
for the blocks it stands for). Where blocks 1 and 2 differ, or a value of one is read beyond the
next, `expand_blocks` returns None and the driver compiles the whole graph.

A copy's nodes take block 2's `meta`, renamed for their block: `GLOBAL_NODE` (the captured node of
block k in the same place), `ROLE` and `ALIAS_OF` of its placeholders (named as capture names
them), `RECOMPUTE_REGION`; the schedule counts (`SCHEDULE_COUNTS`, `PRODUCT_SCHEDULES`) count the
copies' products. `block_labels` gives each per-rank node its block, for the analyses that price
a program from its short forms (`tess_compile.analysis.block_reuse`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_aggregate

from tess_compile.passes.repeated_blocks import RepeatedBlocks
from tess_compile.core.program import Slot
from tess_compile.ops.grad_bucket import grad_bucket
from tess_compile.core.meta_keys import (
    ALIAS_OF,
    BLOCK_REPEATS,
    CONSTANT_VALUE,
    DTYPE,
    GLOBAL_NODE,
    GLOBAL_SHAPE,
    LAYOUT,
    PRODUCT_SCHEDULES,
    RECOMPUTE_REGION,
    REPLICATED,
    ROLE,
    SCHEDULE_COUNTS,
    SUMMA_STEP,
)

__all__ = ["block_labels", "expand_blocks", "expand_slots", "expanded_schedules"]

_FIRST, _BEFORE, _MIDDLE = 0, 1, 2  # the block before the copied one, and the copied one
_COMPARED = (LAYOUT, GLOBAL_SHAPE, DTYPE, SUMMA_STEP, CONSTANT_VALUE, REPLICATED)


def block_labels(gm: GraphModule, blocks: RepeatedBlocks) -> dict[Node, int | None]:
    """Each node's block (None: none): that of the captured node it was made for (`GLOBAL_NODE`, the first
    of a merged product's), of the parameter for its placeholder, of its members for a gradient bucket; a
    node made for none (a parameter's `grad_sync`) takes the block of the node before it."""
    owner = {name: k for k, names in enumerate(blocks.ops) for name in names}
    owner.update({name: k for k, names in enumerate(blocks.placeholders) for name in names})
    labels: dict[Node, int | None] = {}
    current = None
    for node in gm.graph.nodes:
        if node.target is grad_bucket:  # a block's gradient bucket (`bucket_gradients(block_path=...)`)
            current = labels[node.args[0][0]]
        elif GLOBAL_NODE.has(node):
            current = owner.get(GLOBAL_NODE.of(node).split(", ")[0])
        labels[node] = None if node.op == "output" else current
    return labels


def _runs(gm: GraphModule, labels: dict[Node, int | None], block: int) -> list[list[Node]]:
    """The maximal runs of consecutive nodes of `block`, in order."""
    runs: list[list[Node]] = []
    inside = False
    for node in gm.graph.nodes:
        if labels[node] == block:
            if not inside:
                runs.append([])
            runs[-1].append(node)
        inside = labels[node] == block
    return runs


def expand_blocks(gm: GraphModule, blocks: RepeatedBlocks, copies: int) -> GraphModule | None:
    """A new per-rank graph: `gm`'s block 2 followed by `copies` copies, which stand for blocks 3 ..
    2 + copies (see the module docstring); None where blocks 1 and 2 are not alike."""
    labels = block_labels(gm, blocks)
    before, middle = _runs(gm, labels, _BEFORE), _runs(gm, labels, _MIDDLE)
    if not _alike(before, middle, labels) or not _read_by_next_only(before, middle, labels, blocks.count - 1):
        return None
    where_before = {node: (j, p) for j, run in enumerate(before) for p, node in enumerate(run)}
    where_middle = {node: (j, p) for j, run in enumerate(middle) for p, node in enumerate(run)}
    ends = {run[-1]: j for j, run in enumerate(middle)}
    graph = Graph()
    env: dict[Node, Node] = {}
    made: list[list[list[Node]]] = [[[] for _ in middle] for _ in range(copies)]  # made[c][run][place]
    last = blocks.count - 1

    def read(node: Node, arg: Node) -> Node:  # a node outside the copies: the last block reads the last copy
        if copies and labels[node] == last and arg in where_middle:
            j, p = where_middle[arg]
            return made[-1][j][p]
        return env[arg]

    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda arg, node=node: read(node, arg))
        if node not in ends:
            continue
        j = ends[node]
        for c in range(copies):
            renames = _Renames(blocks, 3 + c)

            def copied_arg(arg: Node, c=c) -> Node:
                if arg in where_middle:
                    j2, p2 = where_middle[arg]
                    return made[c][j2][p2]
                if arg in where_before:
                    j1, p1 = where_before[arg]
                    return env[middle[j1][p1]] if c == 0 else made[c - 1][j1][p1]
                return env[arg]

            for original in middle[j]:
                made[c][j].append(renames.copy(graph, original, copied_arg))
    out = GraphModule(gm, graph)
    out.meta.update(gm.meta)
    BLOCK_REPEATS.pop(out)
    products, counts = expanded_schedules(gm, blocks, copies)
    PRODUCT_SCHEDULES.set(out, products)
    SCHEDULE_COUNTS.set(out, counts)
    return out


def expand_slots(slots: list[Slot], blocks: RepeatedBlocks, copies: int) -> list[Slot]:
    """The slots of `expand_blocks(gm, blocks, copies)` from those of `gm` (with no copies): each run of
    block 2's slots (its parameters, then its buffers) once more after it for each copy, under the copy's
    names."""
    middle = {role[1] for role in blocks.roles[_MIDDLE]}
    out: list[Slot] = []
    run: list[Slot] = []
    for slot in [*slots, None]:
        if slot is not None and slot.name in middle:
            run.append(slot)
            continue
        out += run
        for c in range(copies if run else 0):
            renames = {role[1]: other[1] for role, other in zip(blocks.roles[_MIDDLE], blocks.roles[3 + c])}
            out += [dataclasses.replace(s, name=renames[s.name], alias_of=renames.get(s.alias_of, s.alias_of))
                    for s in run]
        run = []
        if slot is not None:
            out.append(slot)
    return out


class _Renames:
    """The names of block 2's captured nodes, placeholders and regions in block `k`, and a copy of a
    per-rank node of block 2 for block k."""

    def __init__(self, blocks: RepeatedBlocks, k: int):
        self.k = k
        self.names = dict(zip(blocks.ops[_MIDDLE], blocks.ops[k]))
        self.names.update(zip(blocks.placeholders[_MIDDLE], blocks.placeholders[k]))
        self.roles = dict(zip(blocks.roles[_MIDDLE], blocks.roles[k]))
        self.role_names = {role[1]: other[1] for role, other in self.roles.items()}
        self.regions = {r: other for r, other in zip(blocks.regions[_MIDDLE], blocks.regions[k]) if r is not None}
        self.regions[f"block {blocks.block_path(_MIDDLE)}"] = f"block {blocks.block_path(k)}"

    def copy(self, graph: Graph, node: Node, arg_of) -> Node:
        if node.op == "placeholder":
            name = self.names[GLOBAL_NODE.of(node)]
            new = graph.create_node("placeholder", name, name=name)
            new.meta = copy.copy(node.meta)
        else:
            new = graph.node_copy(node, arg_of)
        if GLOBAL_NODE.has(node):
            GLOBAL_NODE.set(new, ", ".join(self.names.get(n, n) for n in GLOBAL_NODE.of(node).split(", ")))
        if ROLE.has(node):
            ROLE.set(new, self.roles.get(ROLE.of(node), ROLE.of(node)))
        if ALIAS_OF.has(node):
            ALIAS_OF.set(new, self.role_names.get(ALIAS_OF.of(node), ALIAS_OF.of(node)))
        if RECOMPUTE_REGION.has(node):
            RECOMPUTE_REGION.set(new, self.regions.get(RECOMPUTE_REGION.of(node), RECOMPUTE_REGION.of(node)))
        return new


def expanded_schedules(gm: GraphModule, blocks: RepeatedBlocks, copies: int) -> tuple[dict, dict[str, int]]:
    """`PRODUCT_SCHEDULES` and `SCHEDULE_COUNTS` of `expand_blocks(gm, blocks, copies)`: `gm`'s, and those of
    block 2's products once more for each copy."""
    products = dict(PRODUCT_SCHEDULES.get(gm, {}))
    counts = Counter(SCHEDULE_COUNTS.get(gm, {}))
    for c in range(copies):
        names = dict(zip(blocks.ops[_MIDDLE], blocks.ops[3 + c]))
        for name, schedules in PRODUCT_SCHEDULES.get(gm, {}).items():
            if name in names:
                products[names[name]] = schedules
                counts.update(schedules)
    return products, dict(sorted(counts.items()))


def _alike(before: list[list[Node]], middle: list[list[Node]], labels: dict[Node, int | None]) -> bool:
    """Whether blocks 1 and 2 are alike: runs of the same lengths, block 1's each right before block 2's,
    and in each place the same op with the same `meta` (`_COMPARED`) on the same arguments: block 2's own
    nodes where block 1 reads its own in the same place, block 1's where block 1 reads the first block's,
    the same node otherwise."""
    if not middle or len(before) != len(middle):
        return False
    where_before = {node: (j, p) for j, run in enumerate(before) for p, node in enumerate(run)}
    where_middle = {node: (j, p) for j, run in enumerate(middle) for p, node in enumerate(run)}
    for run1, run2 in zip(before, middle):
        if len(run1) != len(run2) or run1[-1].next is not run2[0]:
            return False
        for a, b in zip(run1, run2):
            if a.op != b.op or (a.op != "placeholder" and a.target != b.target) or list(a.kwargs) != list(b.kwargs):
                return False
            if ROLE.get(a, ("",))[0] != ROLE.get(b, ("",))[0]:
                return False
            if any(key.get(a) != key.get(b) for key in _COMPARED) or _region_kind(a) != _region_kind(b):
                return False
            pairs: list[tuple[object, object]] = []
            map_aggregate((a.args, a.kwargs), pairs.append)
            other: list[object] = []
            map_aggregate((b.args, b.kwargs), other.append)
            if len(pairs) != len(other) or not all(
                    _same_argument(x, y, labels, where_before, where_middle) for x, y in zip(pairs, other)):
                return False
    return True


def _same_argument(x, y, labels, where_before, where_middle) -> bool:
    if not isinstance(y, Node):
        return not isinstance(x, Node) and x == y
    if not isinstance(x, Node):
        return False
    if y in where_middle:
        return where_before.get(x) == where_middle[y]
    if y in where_before:  # block 2 reads block 1: block 1 reads the first block there
        return labels.get(x) == _FIRST
    return x is y


def _region_kind(node: Node) -> str | None:
    """A recompute region by its kind ("block", "checkpoint", "selective"), not its number or block."""
    region = RECOMPUTE_REGION.get(node)
    return None if region is None else region.split(" ")[0]


def _read_by_next_only(before: list[list[Node]], middle: list[list[Node]], labels: dict[Node, int | None],
                       last: int) -> bool:
    """Whether block 1's nodes are read by blocks 1 and 2 only, and block 2's by block 2 and the last."""
    ones = {node for run in before for node in run}
    twos = {node for run in middle for node in run}
    return (all(user in ones or user in twos for node in ones for user in node.users)
            and all(user in twos or labels.get(user) == last for node in twos for user in node.users))
