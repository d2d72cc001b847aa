"""The one-per-compile summary of work that ranks repeat: ops that run replicated, and ops whose
FLOPs repeat across ranks.

An analysis of the per-rank graph beside the placed graph it came from; it
writes nothing. An op with no rule runs replicated (the place pass marks it,
`REPLICATED` of `tess_compile.core.meta_keys`). An op with a rule may still repeat work: a product of
a tensor replicated over an axis, experts computed for every token. So every
compile counts, per op of the model, the matmul-like FLOPs of the unsharded
op (a fake run of the placed graph, global shapes) and of the per-rank nodes
made for it (a fake run of the per-rank graph, `GLOBAL_NODE`), and
names each op whose FLOPs over all ranks exceed the unsharded op's by more
than `REPEATED_SHARE` of the model's FLOPs, with its source line and the
repeated FLOPs. Ops under the share each can still add up: when the whole
forward's FLOPs over all ranks exceed the model's by more than the share (the
ratio `check` reports as redundant work), the largest contributors are named
too. One warning lists both kinds; `strict=True` makes repeated work an error
(ops without a rule are refused already by the place pass).
Of a graph shortened to four of its repeated blocks, each op counts for the ops of the whole
graph it stands for (`repeated_blocks.repeats_of`).
Reads `REPLICATED`, `GLOBAL_NODE`, `LAYOUT` (the bytes a replicated op gathers) and `BLOCK_REPEATS`.
"""

from __future__ import annotations

import logging
import math
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Interpreter, Node

from tess_compile.passes.repeated_blocks import repeats_of
from tess_compile.core.fake_run import UNCHECKABLE, global_placeholder, placeholder_values
from tess_compile.core.flops import flop_counter
from tess_compile.core.layout import Layout, Partial
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import GLOBAL_NODE, LAYOUT, REPLICATED
from tess_compile.passes.source_lines import source_line

__all__ = ["REPEATED_SHARE", "report_repeated_work"]

log = logging.getLogger("tess_compile")

# Repeated FLOPs of one op, or of the whole forward, as a share of the model's, above which they are named.
REPEATED_SHARE = 0.05
NUM_CONTRIBUTORS = 5  # the ops named when the sum passes the share


def report_repeated_work(gm: GraphModule, mesh: Mesh, *, placed: GraphModule, strict: bool = False,
                         count_flops: bool = True) -> GraphModule:
    """Warn once about the ops of `placed` that run replicated or repeat FLOPs across the ranks
    of the per-rank `gm` (see the module docstring); `strict`: a ValueError for the latter.
    `count_flops=False` (a compile only to be priced, whose redundant work the planner prints) leaves
    out the FLOPs, which take two fake runs, and names the ops that run replicated only."""
    lines = _repeated_lines(gm, mesh, placed) if count_flops or strict else []
    if lines and strict:
        raise ValueError(
            "\n".join(lines) + "\nstrict=True forbids repeated work: shard the op (split the dim the repeated work "
            "runs over), or pass strict=False"
        )
    replicated, count = _replicated_lines(placed, mesh)
    sections = []
    if replicated:
        sections.append(f"{count} op(s) have no sharding rule and run replicated on mesh {mesh} (inputs gathered on "
                        "every rank, outputs re-split by their consumers; strict=True makes this an error):\n"
                        + "\n".join(replicated))
    if lines:
        sections.append("\n".join(lines) + "\n(strict=True makes repeated work an error)")
    if sections:
        warnings.warn("\n".join(sections), UserWarning, stacklevel=2)
    return gm


def _repeated_lines(gm: GraphModule, mesh: Mesh, placed: GraphModule) -> list[str]:
    """A heading and a line per op that repeats work: each op whose FLOPs over all ranks exceed
    its unsharded FLOPs by over `REPEATED_SHARE` of the model's, and, when the whole forward's
    repeated FLOPs pass the share, its largest contributors (replicated ops included). None if
    a fake run cannot count them (`UNCHECKABLE`: data-dependent shapes, a meta model)."""
    counted = _repeated_flops(gm, mesh, placed)
    if counted is None:
        return []
    repeated, model, total = counted
    if not model:
        return []
    over = [node for node, flops in repeated.items() if flops > REPEATED_SHARE * model and not REPLICATED.has(node)]
    if total > REPEATED_SHARE * model:
        largest = sorted(repeated, key=lambda node: -repeated[node])[:NUM_CONTRIBUTORS]
        over += [node for node in largest if node not in over and repeated[node] > 0]
    if not over:
        return []
    if total > REPEATED_SHARE * model:
        heading = (f"ops repeat work across the ranks of mesh {mesh}: the forward's FLOPs over all ranks are "
                   f"{1 + total / model:.2f}x the unsharded model's {model} ({total / model:.0%} repeated, over "
                   f"{REPEATED_SHARE:.0%}); the ops that repeat the most:")
    else:
        heading = (f"{len(over)} op(s) repeat work across the ranks of mesh {mesh}, each over {REPEATED_SHARE:.0%} "
                   f"of the model's {model} FLOPs:")
    return [heading] + [f"  {node.target} at {source_line(node)}: repeats {repeated[node]} FLOPs "
                        f"({repeated[node] / model:.0%} of the model's)" for node in over]


def _repeated_flops(gm: GraphModule, mesh: Mesh, placed: GraphModule) -> tuple[dict[Node, int], int, int] | None:
    """`({op of placed: FLOPs over all ranks beyond its unsharded FLOPs}, the model's FLOPs, the whole
    forward's FLOPs over all ranks beyond the model's)`, or None if a fake run cannot count them."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = placeholder_values(gm, mesh)
        whole = [global_placeholder(n) for n in _placeholders(placed)]  # fake: no weight of full size
    try:
        unsharded = flops_by_node(placed, whole)
        local = flops_by_node(gm, inputs)
    except UNCHECKABLE as err:
        log.debug("repeated work not counted: %s", err)
        return None
    per_rank: dict[str, int] = {}
    for node, flops in local.items():
        name = GLOBAL_NODE.get(node)
        per_rank[name] = per_rank.get(name, 0) + flops
    repeats = {node: repeats_of(placed, node) for node in unsharded}
    model = sum(flops * repeats[node] for node, flops in unsharded.items())
    repeated = {node: (mesh.num_ranks * per_rank.get(node.name, 0) - flops) * repeats[node]
                for node, flops in unsharded.items()}
    names = {node.name for node in unsharded}
    unmatched = sum(flops for name, flops in per_rank.items() if name not in names)
    return repeated, model, sum(repeated.values()) + mesh.num_ranks * unmatched


def flops_by_node(gm: GraphModule, inputs: list) -> dict[Node, int]:
    """The matmul-like, attention and FFT FLOPs (`tess_compile.core.flops.flop_counter`) each node of
    `gm` runs on `inputs`, on fake tensors; nodes that run none are left out."""
    counter = flop_counter()
    run = _CountingRun(gm, counter)
    with FakeTensorMode(allow_non_fake_inputs=True), counter:
        run.run(*inputs)
    return run.flops


class _CountingRun(Interpreter):
    def __init__(self, gm: GraphModule, counter):
        super().__init__(gm)
        self.counter, self.flops = counter, {}

    def run_node(self, node: Node):
        before = self.counter.get_total_flops()
        value = super().run_node(node)
        spent = self.counter.get_total_flops() - before
        if spent:
            self.flops[node] = spent
        return value


def _placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _replicated_lines(placed: GraphModule, mesh: Mesh) -> tuple[list[str], int]:
    """A line per op and source line that runs replicated, with the input bytes a rank gathers;
    and the number of such nodes."""
    groups: dict[tuple[str, str], list[int]] = {}  # (op, line) -> [nodes, bytes gathered]
    for node in placed.graph.nodes:
        if REPLICATED.has(node):
            group = groups.setdefault((str(node.target), REPLICATED.of(node)), [0, 0])
            group[0] += repeats_of(placed, node)
            group[1] += _gathered_bytes(node, mesh) * repeats_of(placed, node)
    lines = [f"  {op} x{count} at {where}: gathers {num_bytes} bytes a rank"
             for (op, where), (count, num_bytes) in groups.items()]
    return lines, sum(count for count, _ in groups.values())


def _gathered_bytes(node: Node, mesh: Mesh) -> int:
    """Bytes of `node`'s inputs that a rank does not hold and receives to run it whole
    (a partial sum counts whole)."""
    total = 0
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        layout = LAYOUT.get(arg) if isinstance(LAYOUT.get(arg), Layout) else Layout.replicated()
        held = 0 if layout.axes_where(Partial, mesh) else math.prod(layout.local_shape(val.shape, mesh))
        total += (val.numel() - held) * val.element_size()
    return total
