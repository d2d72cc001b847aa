"""Stage 1, capture's autocast: the casts torch.autocast makes, written into the graph as ops.

torch.export records the ops a model calls above autocast, without autocast's casts, and a sharded
program runs many ops as pieces: a linear's bias is added after the product's reduction, a cross
entropy over a split vocabulary runs as its sums, a norm over a split dim as its moments. Under
autocast each piece would take autocast's rule for itself (an add of a bfloat16 product and a float32
bias promotes to float32; a log-sum-exp stays in bfloat16 where autocast runs the whole cross entropy
in float32), not the rule of the op it comes from.

So a program is compiled for an autocast state (`Program.autocast`, `tess_compile.core.autocast`):
`apply_autocast` writes before each op the casts autocast makes of that op's inputs in that state,
and the runtimes run the per-rank graph with autocast off. The casts are found by calling the op on
the node's fake inputs (moved to the state's device type) under `torch.autocast`, with a dispatch
mode that records each `_to_copy` of an input, less those the op makes without autocast. The ops of
a region under its own `torch.autocast(...)` (`AUTOCAST_REGION`) take that region's state. Every
value whose dtype changes gets its fake value again.
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tess_compile.core.autocast import Autocast, autocast_off_everywhere
from tess_compile.core.meta_keys import AUTOCAST_REGION, RECOMPUTE_REGION

__all__ = ["apply_autocast"]

aten = torch.ops.aten

# The meta a cast takes from the op it feeds (source lines, checkpoint regions).
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "custom", "from_node", "seq_nr",
              RECOMPUTE_REGION.name)


def apply_autocast(gm: GraphModule, autocast: Autocast | None) -> GraphModule:
    """`gm` with autocast's casts of `autocast` (None: none, but in autocast regions) as ops."""
    if autocast is None and not any(AUTOCAST_REGION.has(node) for node in gm.graph.nodes):
        return gm
    fake_mode = detect_fake_mode([node.meta.get("val") for node in gm.graph.nodes if node.op == "placeholder"])
    made: dict[tuple, Node] = {}  # (input, dtype, recompute region) -> its cast, shared by later ops
    changed: set[Node] = set()
    with autocast_off_everywhere():
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            state = _state(node, autocast)
            casts = _casts(node, state, fake_mode) if state is not None else {}
            if casts:
                _insert_casts(node, casts, made, fake_mode)
            if casts or any(arg in changed for arg in node.all_input_nodes):
                node.meta["val"] = _fake_value(node, fake_mode)
                changed.add(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _state(node: Node, autocast: Autocast | None) -> Autocast | None:
    """The autocast `node` runs under: its region's, else the program's."""
    region = AUTOCAST_REGION.get(node)
    if region is None:
        return autocast
    device_type, dtype, enabled = region
    return (device_type, dtype) if enabled else None


def _casts(node: Node, state: Autocast, fake_mode) -> dict[int, torch.dtype]:
    """{position among the flat arguments of `node`: the dtype autocast casts that input to}."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return {}
    device_type, _ = state
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with fake_mode:
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t if t.device.type == device_type else t.to(device_type), (args, kwargs))
    leaves = pytree.tree_leaves((args, kwargs))
    if not any(isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for leaf in leaves):
        return {}
    inputs = {id(leaf): i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    under = _recorded_casts(node.target, args, kwargs, inputs, state, True, fake_mode)
    plain = _recorded_casts(node.target, args, kwargs, inputs, state, False, fake_mode)
    return {i: dtype for i, dtype in under.items() if plain.get(i) != dtype}


def _recorded_casts(op, args, kwargs, inputs: dict[int, int], state: Autocast, enabled: bool,
                    fake_mode) -> dict[int, torch.dtype]:
    device_type, dtype = state
    recorder = _CastRecorder(inputs)
    with fake_mode, torch.autocast(device_type, dtype=dtype, enabled=enabled), recorder:
        op(*args, **kwargs)
    return recorder.casts


class _CastRecorder(TorchDispatchMode):
    """Records `_to_copy` calls on the given tensors: {their position: the dtype cast to}."""

    def __init__(self, inputs: dict[int, int]):
        super().__init__()
        self.inputs, self.casts = inputs, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default and id(args[0]) in self.inputs and "dtype" in kwargs:
            self.casts.setdefault(self.inputs[id(args[0])], kwargs["dtype"])
        return func(*args, **kwargs)


def _insert_casts(node: Node, casts: dict[int, torch.dtype], made: dict[tuple, Node], fake_mode) -> None:
    """Feed `node` its inputs cast as `casts` says, each by a `_to_copy` before it (one per input,
    dtype and recompute region, shared with later ops)."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    for position, dtype in casts.items():
        source = leaves[position]
        key = (source, dtype, RECOMPUTE_REGION.get(node))
        if key not in made:
            with node.graph.inserting_before(node):
                cast = node.graph.call_function(aten._to_copy.default, (source,), {"dtype": dtype})
            with fake_mode:
                cast.meta["val"] = source.meta["val"].to(dtype)
            cast.meta.update({k: node.meta[k] for k in _KEPT_META if k in node.meta})
            made[key] = cast
        leaves[position] = made[key]
    node.args, node.kwargs = pytree.tree_unflatten(leaves, spec)


def _fake_value(node: Node, fake_mode):
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with fake_mode:
        return node.target(*args, **kwargs)
