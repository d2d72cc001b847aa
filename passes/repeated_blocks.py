"""Stage 1b, repeated blocks: find a captured graph's repeated blocks, and shorten it to four of them.

A transformer's layers are the elements of a ModuleList (or Sequential) whose
captured subgraphs are the same up to their parameters. `find_repeated_blocks`
finds them in the captured graph: the longest run of elements `path.0` ..
`path.N-1` (torch's `meta["nn_module_stack"]`) whose ops are contiguous in the
graph and whose subgraphs are identical from the second on (the same ops, on
the same shapes, reading their own parameters by the same relative names, the
previous block's values at the same places and the same values from before
the blocks), each used only by itself and the next. The first block may read
what comes before it otherwise. `shorten` keeps the first three blocks and
the last: block 2 then stands for blocks 2 .. N-2 (`RepeatedBlocks.repeats`),
and the last reads block 2's values where it read block N-2's. The driver
places and rewrites the short graph and copies block 2's per-rank nodes for
the others (`tess_compile.passes.expand_blocks`), in the spirit of
torch.compile's regional compilation: every block but the first and the last
is compiled once.

Reads `ROLE`, `RECOMPUTE_REGION` and `AUTOCAST_REGION` (`tess_compile.core.meta_keys`) and torch's
`val` and `nn_module_stack`; writes `BLOCK_REPEATS` on the short graph.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_aggregate

from tess_compile.core.meta_keys import AUTOCAST_REGION, BLOCK_REPEATS, GLOBAL_NODE, RECOMPUTE_REGION, ROLE
from tess_compile.ops.collectives import COLLECTIVE_OPS

__all__ = ["MIN_BLOCKS", "RepeatedBlocks", "find_repeated_blocks", "repeats_of", "shorten"]

log = logging.getLogger("tess_compile.passes")

# Fewer blocks than this compile whole: the short graph keeps four, so there is nothing to save.
MIN_BLOCKS = 5

_KEPT = (0, 1, 2)  # the blocks kept before the last


@dataclass(frozen=True)
class RepeatedBlocks:
    """The repeated blocks of a captured graph: their module path (`model.layers`), and per block the
    names of its ops and of its placeholders (parameters, buffers, constants), in graph order, the
    placeholders' `ROLE`s and the ops' `RECOMPUTE_REGION`s (None: none)."""

    path: str
    ops: tuple[tuple[str, ...], ...]
    placeholders: tuple[tuple[str, ...], ...]
    roles: tuple[tuple[tuple[str, str], ...], ...]
    regions: tuple[tuple[str | None, ...], ...]

    @property
    def count(self) -> int:
        return len(self.ops)

    @property
    def repeats(self) -> int:
        """How many blocks block 2 of the short graph stands for."""
        return self.count - len(_KEPT)

    @property
    def kept(self) -> tuple[int, ...]:
        """The blocks the short graph keeps, in order."""
        return (*_KEPT, self.count - 1)

    def block_path(self, index: int) -> str:
        return f"{self.path}.{index}"


def find_repeated_blocks(gm: GraphModule) -> RepeatedBlocks | None:
    """The repeated blocks of the captured `gm` (see the module docstring), or None if it has fewer than
    `MIN_BLOCKS` or they are not alike."""
    path = _longest_list(gm)
    if path is None:
        return None
    ops = _block_ops(gm, path)
    if ops is None or len(ops) < MIN_BLOCKS:
        return None
    placeholders = _block_placeholders(gm, path, len(ops))
    signatures = [_signature(ops, placeholders, k, path) for k in range(1, len(ops))]
    if any(s is None or s != signatures[0] for s in signatures) or not _used_by_next_only(gm, ops, placeholders):
        log.info("repeated blocks: the %d blocks of %s are not alike; compiled whole", len(ops), path)
        return None
    return RepeatedBlocks(path, tuple(tuple(n.name for n in block) for block in ops),
                          tuple(tuple(n.name for n in block) for block in placeholders),
                          tuple(tuple(ROLE.of(n) for n in block) for block in placeholders),
                          tuple(tuple(RECOMPUTE_REGION.get(n) for n in block) for block in ops))


def _stack_paths(node: Node) -> list[str]:
    return [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]


def _longest_list(gm: GraphModule) -> str | None:
    """The module path whose numbered children (two or more, of one class) hold the most blocks."""
    children: dict[tuple[str, str], set[str]] = {}
    for node in gm.graph.nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            parent, _, index = path.rpartition(".")
            if index.isdigit():
                children.setdefault((parent, str(kind)), set()).add(index)
    lists = {parent: len(indices) for (parent, _), indices in children.items() if len(indices) > 1}
    # two classes under one parent are no list of alike blocks
    kinds = {parent: sum(1 for (p, _) in children if p == parent) for parent in lists}
    candidates = [parent for parent in lists if kinds[parent] == 1]
    return max(candidates, key=lambda parent: (lists[parent], -len(parent)), default=None)


def _block_of(node: Node, path: str) -> int | None:
    prefix = path + "."
    for module in _stack_paths(node):
        if module.startswith(prefix):
            index = module[len(prefix):].split(".")[0]
            if index.isdigit():
                return int(index)
    return None


def _block_ops(gm: GraphModule, path: str) -> list[list[Node]] | None:
    """Each block's ops, in order, if the blocks are numbered 0 .. N-1 and each is one contiguous run of
    the graph's ops (an op of no module inside a run belongs to it); else None."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    found = [(position, _block_of(node, path)) for position, node in enumerate(ops)]
    spans: dict[int, list[int]] = {}
    for position, block in found:
        if block is not None:
            spans.setdefault(block, [position, position])[1] = position
    if sorted(spans) != list(range(len(spans))):
        return None
    blocks = []
    for index in range(len(spans)):
        first, last = spans[index]
        if any(block not in (None, index) for _, block in found[first:last + 1]):
            return None  # another block's op inside: not one run
        if index and first <= spans[index - 1][1]:
            return None
        blocks.append(ops[first:last + 1])
    return blocks


def _block_placeholders(gm: GraphModule, path: str, count: int) -> list[list[Node]]:
    """Each block's placeholders (parameters, buffers, constants, tied names), in graph order."""
    blocks: list[list[Node]] = [[] for _ in range(count)]
    prefix = path + "."
    for node in gm.graph.find_nodes(op="placeholder"):
        name = ROLE.of(node)[1]
        if ROLE.of(node)[0] != "input" and isinstance(name, str) and name.startswith(prefix):
            index = name[len(prefix):].split(".")[0]
            if index.isdigit() and int(index) < count:
                blocks[int(index)].append(node)
    return blocks


def _signature(ops: list[list[Node]], placeholders: list[list[Node]], k: int, path: str) -> tuple | None:
    """What block k computes, in terms that are the same for alike blocks: per op its target, its
    arguments (an op of the block, of the one before by place, a parameter by relative name, or another
    value by itself), its value's shape and dtype and its regions. None if it reads another block."""
    inside = {node: i for i, node in enumerate(ops[k])}
    before = {node: i for i, node in enumerate(ops[k - 1])}
    own = set(placeholders[k])
    others = {node for j, block in enumerate(ops) if j not in (k, k - 1) for node in block}
    others |= {node for j, block in enumerate(placeholders) if j != k for node in block}
    regions: dict[str, int] = {}
    bad = []

    def ref(arg):
        if not isinstance(arg, Node):
            return arg
        if arg in inside:
            return ("in", inside[arg])
        if arg in before:
            return ("before", before[arg])
        if arg in own:
            return ("own", _param_key(arg, path))
        if arg in others:
            bad.append(arg)
        return ("value", arg.name)

    rows = []
    for node in ops[k]:
        region = RECOMPUTE_REGION.get(node)
        rows.append((node.target, map_aggregate(node.args, ref), map_aggregate(node.kwargs, ref), _value(node),
                     AUTOCAST_REGION.get(node), None if region is None else regions.setdefault(region, len(regions))))
    state = tuple((_param_key(node, path), _value(node)) for node in placeholders[k])
    return None if bad else (tuple(rows), state)


def _param_key(node: Node, path: str) -> tuple[str, str]:
    """A block's placeholder by its role and its name after the block's index (`mlp.up.weight`)."""
    role, name = ROLE.of(node)
    return role, name[len(path) + 1:].partition(".")[2]


def _value(node: Node):
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return str(tuple(val.shape)), val.dtype, val.requires_grad
    return type(val).__name__


def _used_by_next_only(gm: GraphModule, ops: list[list[Node]], placeholders: list[list[Node]]) -> bool:
    """Whether each block's values are read only by itself and the next block (the last's by anything
    after), and each block's placeholders by its own ops only."""
    last = len(ops) - 1
    for k, block in enumerate(ops[:last]):
        allowed = set(block) | set(ops[k + 1])
        if any(user not in allowed for node in block for user in node.users):
            return False
    for k, block in enumerate(placeholders):
        allowed = set(ops[k])
        if any(user not in allowed for node in block for user in node.users):
            return False
    return True


def shorten(gm: GraphModule, blocks: RepeatedBlocks) -> GraphModule:
    """`gm` without blocks 3 .. N-2 (ops and placeholders): the last block reads block 2's values where it
    read block N-2's. Writes `BLOCK_REPEATS` on the result (see `repeats_of`)."""
    nodes = {node.name: node for node in gm.graph.nodes}
    dropped = {name for k in range(len(_KEPT), blocks.count - 1)
               for name in (*blocks.ops[k], *blocks.placeholders[k])}
    standing_in = dict(zip(blocks.ops[blocks.count - 2], blocks.ops[len(_KEPT) - 1]))
    graph = Graph()
    env: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        if node.name in dropped:
            continue
        env[node] = graph.node_copy(node, lambda arg: env[nodes[standing_in.get(arg.name, arg.name)]])
    short = GraphModule(gm, graph)
    short.meta.update(gm.meta)
    middle = len(_KEPT) - 1
    BLOCK_REPEATS.set(short, {name: blocks.repeats for name in (*blocks.ops[middle], *blocks.placeholders[middle])})
    log.info("repeated blocks: %d blocks of %s, compiled as 4 (block 2 stands for %d)", blocks.count, blocks.path,
             blocks.repeats)
    return short


def repeats_of(gm: GraphModule, node: Node) -> int:
    """How many nodes of the whole graph `node` of a short graph (its placed or per-rank graph) stands
    for: `BLOCK_REPEATS` of the captured node it was made for (itself; or its `GLOBAL_NODE`, the first
    of a merged product's), or of the parameter a chain of collectives without one starts at (a
    parameter's `grad_sync`s); 1 where the graph is not short."""
    repeats = BLOCK_REPEATS.get(gm)
    if not repeats:
        return 1
    while not GLOBAL_NODE.has(node) and node.op == "call_function" and node.target in COLLECTIVE_OPS:
        node = node.args[0]
    return repeats.get(GLOBAL_NODE.get(node, node.name).split(", ")[0], 1)
