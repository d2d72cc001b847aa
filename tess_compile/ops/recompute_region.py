"""Recompute regions at run time: the per-rank graph with each region outlined
into a module that runs it under `torch.utils.checkpoint` (non-reentrant).

A region (consecutive nodes with the same `RECOMPUTE_REGION` of `tess_compile.core.meta_keys`, marked by
`tess_compile.passes.capture` and `tess_compile.passes.recompute_blocks` / `tess_compile.passes.recompute_selective`) saves only its inputs for
backward; backward runs it again, its collectives included, with the
forward's communicator, recorded as backward. Every rank recomputes the same
regions at the same point of backward, so the collectives meet in order.
Recomputation runs the whole region (no early stop), so the collectives it
re-issues are exactly the region's forward collectives.
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from tess_compile.core.meta_keys import RECOMPUTE_REGION
from tess_compile.ops.collectives import active_comm, use_comm

__all__ = ["RecomputeRegion", "checkpointed", "outline_regions", "region_runs"]


class RecomputeRegion(nn.Module):
    """One region: `graph_module(*inputs)` under non-reentrant checkpointing."""

    def __init__(self, name: str, graph_module: GraphModule):
        super().__init__()
        self.name = name
        self.graph_module = graph_module

    def forward(self, *inputs):
        return checkpointed(self.graph_module, *inputs)


def checkpointed(function, *inputs):
    """`function(*inputs)`, recomputed in backward with this forward's communicator."""
    comm = active_comm()

    def contexts():
        recompute = use_comm(comm, phase="backward") if comm is not None else contextlib.nullcontext()
        return contextlib.nullcontext(), recompute

    return torch.utils.checkpoint.checkpoint(
        function, *inputs, use_reentrant=False, context_fn=contexts, early_stop=False, preserve_rng_state=True
    )


def region_runs(graph: Graph) -> list[tuple[str, list[Node]]]:
    """(name, nodes) of each run of consecutive nodes in one recompute region."""
    runs: list[tuple[str, list[Node]]] = []
    for node in graph.nodes:
        name = RECOMPUTE_REGION.get(node) if node.op == "call_function" else None
        if name is None:
            continue
        if runs and runs[-1][0] == name and runs[-1][1][-1].next is node:
            runs[-1][1].append(node)
        else:
            runs.append((name, [node]))
    return runs


def outline_regions(gm: GraphModule) -> GraphModule:
    """A copy of the per-rank `gm` whose recompute regions are `RecomputeRegion` calls;
    `gm` itself when it has none."""
    runs = region_runs(gm.graph)
    if not runs:
        return gm
    graph = Graph()
    env: dict[Node, Node] = {}
    starts = {nodes[0]: (name, nodes) for name, nodes in runs}
    inside = {node for _, nodes in runs for node in nodes}
    root = nn.Module()
    for node in gm.graph.nodes:
        if node in starts:
            name, nodes = starts[node]
            _outline(graph, root, f"region_{len(root._modules)}", name, nodes, env)
        elif node not in inside:
            env[node] = graph.node_copy(node, env.__getitem__)
    out = GraphModule(root, graph)
    out.meta.update(gm.meta)
    return out


def _outline(graph: Graph, root: nn.Module, attr: str, name: str, nodes: list[Node], env: dict[Node, Node]) -> None:
    members = set(nodes)
    inputs = list(dict.fromkeys(arg for node in nodes for arg in node.all_input_nodes if arg not in members))
    outputs = [node for node in nodes if any(user not in members for user in node.users)]
    sub = Graph()
    sub_env = {arg: sub.placeholder(arg.name) for arg in inputs}
    for node in nodes:
        sub_env[node] = sub.node_copy(node, sub_env.__getitem__)
    sub.output(tuple(sub_env[node] for node in outputs))
    root.add_module(attr, RecomputeRegion(name, GraphModule(nn.Module(), sub)))
    call = graph.call_module(attr, tuple(env[arg] for arg in inputs))
    RECOMPUTE_REGION.set(call, name)
    for index, node in enumerate(outputs):
        env[node] = graph.call_function(operator.getitem, (call, index))
        env[node].meta.update(node.meta)
