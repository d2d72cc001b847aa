"""After merge products, alike tails: a replicated output whose gradient needs no collective back.

Under exact adjoints (docs/gradients.md) the gradient a rank holds for a value
replicated along an axis is its share: an output replicated along an axis
seeds its gradient on coordinate 0 only (`seed_once`), and the all-gather that
made the value replicated sends the shares back by a reduce-scatter. Where
every rank of the axis computes the output alike from such all-gathers, every
rank can hold the whole gradient instead: the output then seeds it on every
rank (no `seed_once` along the axis), and each all-gather's adjoint takes the
rank's own block (`all_gather_alike`, whose adjoint `shard_slice` sends
nothing). The sums are the same; one collective a gathered tail fewer. A split
cross-entropy's tail is such: every rank combines the gathered log-sum-exps
and target-logit parts alike (`passes/rules/losses.py`).

The tail along `axis` is what the output's value is computed from, walking
back to the all-gathers along `axis`. It qualifies only if every node in it
is computed alike on the ranks of `axis`, and only its own nodes take its
gradients:

- each node is a deterministic torch op, a getitem, or a collective along
  another axis (a function of its inputs and of coordinates along that axis
  only); any other collective along `axis` (its result differs between the
  ranks, or its gradient is a share) stops it;
- its placeholders take no gradient (floating-point inputs and parameters
  stop it: their gradient would be counted on every rank) and arrive whole;
- nothing outside the tail uses one of its nodes that a gradient flows
  through, or the all-gathers (a share from outside would meet the whole
  gradient inside), and no recompute region holds one.

Runs after merge products and before the gradient buckets; reads `ROLE`, `DTYPE`,
`CONSTANT_VALUE`, `WEIGHT_INPUT` (through `core.fake_run.requires_grad`), `LOCAL_INPUT`
and `RECOMPUTE_REGION` (`tess_compile.core.meta_keys`).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from tess_compile.core.fake_run import requires_grad
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import LOCAL_INPUT, RECOMPUTE_REGION, ROLE
from tess_compile.ops import collectives as c

__all__ = ["alike_tails"]

_COLLECTIVE_TARGETS = set(c.COLLECTIVE_OPS) | {c.wait}  # grad_sync and seed_once among them


def alike_tails(gm: GraphModule, mesh: Mesh) -> GraphModule:
    """`gm` with each qualifying output seeded on every rank and its all-gathers made
    `all_gather_alike` (see the module docstring)."""
    seeds = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is c.seed_once]
    if not seeds:
        return gm
    reach = _gradient_reach(gm)
    tails = [(seed, gathers) for seed in seeds if (gathers := _gathers_of_tail(seed, reach))]
    for seed, gathers in tails:
        for gather in gathers:
            gather.target = c.all_gather_alike
        seed.replace_all_uses_with(seed.args[0])
        gm.graph.erase_node(seed)
    if tails:
        gm.recompile()
    return gm


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


def _gathers_of_tail(seed: Node, reach: set[Node]) -> set[Node] | None:
    """The all-gathers along `seed`'s axis that `seed`'s value is computed from alike, if its
    tail qualifies (`reach`: the nodes a gradient flows through); else None."""
    axis = seed.args[1]
    tail, gathers, stack = set(), set(), [seed.args[0]]
    while stack:
        node = stack.pop()
        if node in tail or node in gathers:
            continue
        if node.op == "call_function" and node.target is c.all_gather and node.args[1] == axis:
            gathers.add(node)
            continue
        if not _alike(node, axis) or (node.op == "placeholder" and node in reach):
            return None
        tail.add(node)
        stack.extend(node.all_input_nodes)
    inside = tail | gathers | {seed}
    if any(node in reach and any(user not in inside for user in node.users) for node in tail | gathers):
        return None  # a share from outside would meet the whole gradient inside
    return gathers or None


def _alike(node: Node, axis: str) -> bool:
    """Whether `node` computes the same value on every rank of `axis` from inputs that do."""
    if RECOMPUTE_REGION.has(node):
        return False
    if node.op in ("placeholder", "get_attr"):
        return not LOCAL_INPUT.has(node)
    if node.op != "call_function":
        return False
    if node.target in _COLLECTIVE_TARGETS:
        return node.target is c.wait or (len(node.args) > 1 and node.args[1] != axis)
    if node.target is operator.getitem:
        return True
    return (isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "aten"
            and torch.Tag.nondeterministic_seeded not in node.target.tags)
