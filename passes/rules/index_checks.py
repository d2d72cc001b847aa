"""Index range checks of lookups and losses, placed by the lowering rules.

torch's embedding and cross entropy raise IndexError for an index outside
[0, size); a sharded lookup looks each id up in one block of the table, and
an id outside every block would give zeros. So the per-rank graph checks the
ids itself (`tess_compile.ops.local.check_in_range`), on their global value,
right after the placeholders: every rank checks the same ids before any
collective, so every rank raises and none waits for peers that stopped. Where
the global value cannot be had without communication, each rank checks its
own ids where the lookup is.
"""

from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from tess_compile.passes.builder import Builder
from tess_compile.passes.rules.common import display_name
from tess_compile.core.layout import Layout, Partial, Shard
from tess_compile.core.meta_keys import INDEX_CHECK, LAYOUT, LOCAL_INPUT, ROLE
from tess_compile.ops.local import check_in_range, device_of

__all__ = ["check_lookup_ids", "check_targets"]

# Ops that a global index value is recomputed through on every rank (deterministic,
# cheap on integer tensors); at most _MAX_REPLAYED of them per value.
_MAX_REPLAYED = 16


def _global_placeholder(b: Builder, node: Node) -> Node | None:
    """The per-rank placeholder of `node` if it holds the whole (global) value: a user
    input (inputs arrive whole), or a buffer or constant replicated on every axis."""
    role = ROLE.get(node, (None,))[0]
    layout = LAYOUT.get(node)
    whole = (isinstance(layout, Layout) and not layout.axes_where(Shard, b.mesh)
             and not layout.axes_where(Partial, b.mesh))
    if role != "input" and not (role in ("buffer", "constant") and whole):
        return None
    if LOCAL_INPUT.has(node):  # a pipeline stage's input: this rank's block only
        return None
    return next((n for n in b.graph.nodes if n.op == "placeholder" and n.target == node.name), None)


def _replayable(node: Node) -> bool:
    target = node.target
    val = node.meta.get("val")
    if target is device_of:  # the run-time device that factories such as arange read
        return True
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded not in target.tags
        and isinstance(val, torch.Tensor)
        and not val.is_floating_point()
        and not val.is_complex()
    )


def _replay_plan(node: Node, plan: list[Node]) -> bool:
    """Append to `plan`, inputs first, the ops that recompute `node` from placeholders;
    False if it cannot be recomputed on global values (see `_global_index_check`)."""
    if node in plan:
        return True
    if node.op == "placeholder":
        plan.append(node)
        return True
    if not _replayable(node) or len(plan) >= _MAX_REPLAYED:
        return False
    for arg in node.all_input_nodes:
        if not _replay_plan(arg, plan):
            return False
    plan.append(node)
    return True


def _check_anchor(b: Builder) -> Node | None:
    """Where global checks go: after the last placeholder and the checks there already."""
    anchor = None
    for node in b.graph.nodes:
        if node.op == "placeholder":
            anchor = node
    while anchor is not None and INDEX_CHECK.get(anchor.next):
        anchor = anchor.next
    return anchor


def _emit_after(b: Builder, anchor: Node, target, *args, **kwargs) -> Node:
    """`target(*args, **kwargs)` right after `anchor`, marked as part of the checks."""
    with b.graph.inserting_after(anchor):
        out = b.call(target, *args, **kwargs)
    INDEX_CHECK.set(out, True)
    return out


def _global_index_check(b: Builder, ids: Node, *check_args) -> bool:
    """Emit `check_in_range(global ids, *check_args)` right after the placeholders if the
    global value of the captured node `ids` can be recomputed there from whole
    placeholders by deterministic integer ops (an input, its views and slices,
    arange); False if not."""
    plan: list[Node] = []
    anchor = _check_anchor(b)
    if anchor is None or not _replay_plan(ids, plan):
        return False
    local: dict[Node, Node] = {}
    for node in plan:
        if node.op == "placeholder":
            local[node] = _global_placeholder(b, node)
            if local[node] is None:
                return False
    for node in plan:
        if node.op == "call_function":
            args, kwargs = map_arg((node.args, node.kwargs), lambda n: local[n])
            local[node] = anchor = _emit_after(b, anchor, node.target, *args, **kwargs)
    checked = local[ids]
    for user in checked.users:
        if user.target is check_in_range and user.args[1:] == check_args:
            return True  # the same check on the same value, already there
    _emit_after(b, anchor, check_in_range, checked, *check_args)
    return True


def _index_check(b: Builder, ids: Node, local_ids: Node, *check_args) -> None:
    """Check the captured index node `ids` (per-rank value `local_ids`) on its global
    value where that can be had without communication; otherwise on this rank's ids,
    where the lookup is (ranks whose ids are in range then go on without the others)."""
    if not _global_index_check(b, ids, *check_args):
        b.call(check_in_range, local_ids, *check_args)


def check_lookup_ids(b: Builder, node: Node, local_ids: Node) -> None:
    """The range check of an embedding's ids (see `check_in_range`)."""
    weight = node.args[0]
    vocab = weight.meta["val"].shape[0]
    owner = f"the embedding of vocabulary size {vocab} ({display_name(weight)})"
    _index_check(b, node.args[1], local_ids, vocab, "token id", owner)


def check_targets(b: Builder, node: Node, local_target: Node, ignore_index: int) -> None:
    x, target = node.args[0], node.args[1]
    if target.meta["val"].is_floating_point():
        return  # class probabilities, not indices
    shape = x.meta["val"].shape
    num_classes = shape[1] if len(shape) > 1 else shape[0]
    owner = f"the cross entropy over {num_classes} classes ({node.name})"
    _index_check(b, target, local_target, num_classes, "target", owner, ignore_index)
