"""Stage 1, capture's autocast: the casts torch.autocast makes, written into the graph as ops.

torch.export records the ops a model calls above autocast, without autocast's casts, and a sharded
program runs many ops as pieces: a linear's bias is added after the product's reduction, a cross
entropy over a split vocabulary runs as its sums, a norm over a split dim as its moments. Under
autocast each piece would take autocast's rule for itself (an add of a bfloat16 product and a float32
bias promotes to float32; a log-sum-exp stays in bfloat16 where autocast runs the whole cross entropy
in float32), not the rule of the op it comes from.

The same holds without autocast for a norm of a low-precision input with float32 weights (the
mixed-dtype norms torch runs in float32 and returns in the input's dtype): its pieces would promote to
float32, or sum in bfloat16. So such a norm gets its input cast up to the weights' dtype and its
output cast back (`_widen_mixed_norm`), which is what torch computes.

A program is compiled for an autocast state (`Program.autocast`, `tess_compile.core.autocast`),
captured under it (so code that reads a dtype, `mask.to(h.dtype)`, traces as it runs there), and
`apply_autocast` writes before each op the casts autocast makes of that op's inputs in that state;
the runtimes run the per-rank graph with autocast off. The casts follow from calling the op on the
node's fake inputs (moved to the state's device type) under `torch.autocast`:

- an op with an autocast kernel of its own (`linear`, `scaled_dot_product_attention`,
  `cross_entropy_loss`, `cat`) is put in torch's class for it by probing it: lower precision (its
  output takes the autocast dtype from float32 inputs), float32 (it gives float32 from inputs of the
  autocast dtype), or promote; its inputs are cast by that class's rule. (What the op's kernel
  calls is no guide: the CPU attention upcasts q, k and v itself.)
- a composite op without one (`einsum`), whose own ops autocast casts: if its output's dtype
  differs from the one without autocast, its inputs are cast to that dtype.

The ops of a region under its own `torch.autocast(...)` (`AUTOCAST_REGION`) take that region's
state. Under autocast every value gets its fake value again: the graph's dtypes, casts included.
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from tess_compile.core.autocast import Autocast, autocast_off_everywhere, running_under
from tess_compile.core.meta_keys import AUTOCAST_REGION, RECOMPUTE_REGION
from tess_compile.passes.view_mutations import node_like

__all__ = ["apply_autocast", "needs_casts"]

aten = torch.ops.aten


def needs_casts(gm: GraphModule, autocast: Autocast | None) -> bool:
    """Whether `apply_autocast` changes `gm`: under an autocast, or with autocast regions or mixed norms."""
    return autocast is not None or any(AUTOCAST_REGION.has(node) or _mixed_norm(node) for node in gm.graph.nodes)


def apply_autocast(gm: GraphModule, autocast: Autocast | None) -> GraphModule:
    """`gm` with autocast's casts of `autocast` (None: none, but in autocast regions) as ops, and its
    mixed-dtype norms computed in their weights' dtype."""
    if not needs_casts(gm, autocast):
        return gm
    fake_mode = detect_fake_mode([node.meta.get("val") for node in gm.graph.nodes if node.op == "placeholder"])
    made: dict[tuple, Node] = {}  # (input, dtype, recompute region) -> its cast, shared by later ops
    changed: set[Node] = set()
    with autocast_off_everywhere():
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            state = _state(node, autocast)
            if _mixed_norm(node):
                changed.update(_widen_mixed_norm(node, state, made, fake_mode))
                continue
            casts = _casts(node, state, fake_mode) if state is not None else {}
            if casts:
                _insert_casts(node, casts, made)
            if state is not None or casts or any(arg in changed for arg in node.all_input_nodes):
                # Captured under autocast, a value may be of the dtype autocast gave it: now the graph's.
                node.meta["val"] = _fake_value(node, fake_mode)
                changed.add(node)
    gm.graph.lint()
    gm.recompile()
    return gm


# Norms that take an input of lower precision than their weights and return the input's dtype.
_NORMS = (aten.layer_norm.default, aten.rms_norm.default, aten.group_norm.default, aten.batch_norm.default,
          aten.instance_norm.default)


def _mixed_norm(node: Node) -> bool:
    """A norm whose input is of lower precision than a floating tensor among its other arguments."""
    if node.op != "call_function" or node.target not in _NORMS:
        return False
    x, *rest = [n.meta["val"] for n in node.all_input_nodes]
    return any(t.is_floating_point() and t.dtype.itemsize > x.dtype.itemsize for t in rest)


def _widen_mixed_norm(node: Node, state: Autocast | None, made: dict[tuple, Node], fake_mode) -> list[Node]:
    """Cast the norm's input up to its widest argument's dtype, and its output to the dtype torch
    gives it (under `state`: the input's, or float32 where autocast runs the norm so); the nodes
    made or changed."""
    target = _dtype_of(_fake_value(node, fake_mode, state))
    wide = max((n.meta["val"].dtype for n in node.all_input_nodes), key=lambda dtype: dtype.itemsize)
    _insert_casts(node, {0: wide}, made)
    node.meta["val"] = _fake_value(node, fake_mode)
    if node.meta["val"].dtype == target:
        return [node, node.args[0]]
    users = list(node.users)
    with node.graph.inserting_after(node):
        back = node_like(node, aten._to_copy.default, (node,), {"dtype": target})
    for user in users:
        user.replace_input_with(node, back)
    return [node, back, node.args[0]]


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
    if not any(_is_float(leaf) for leaf in leaves):
        return {}
    if _has_autocast_kernel(node.target, device_type):
        return _kernel_casts(node.target, args, kwargs, leaves, state, fake_mode)
    # A composite op (einsum) whose own ops autocast casts: its inputs cast to what it computes in. Inputs of
    # mixed dtypes (which it takes only under autocast, its products casting both) are cast alike.
    mixed = len({leaf.dtype for leaf in leaves if _is_float(leaf)}) > 1
    try:
        computes_in = _dtype_of(_call(node.target, args, kwargs, state, True, fake_mode))
    except RuntimeError:
        return {}
    if not mixed and computes_in == _dtype_of(_call(node.target, args, kwargs, state, False, fake_mode)):
        return {}
    return {i: computes_in for i, leaf in enumerate(leaves) if _is_float(leaf) and leaf.dtype != computes_in}


def _kernel_casts(op, args, kwargs, leaves: list, state: Autocast, fake_mode) -> dict[int, torch.dtype]:
    """The casts of autocast's own kernel for `op`, by the class of the op (torch's autocast rules):
    an op it runs in lower precision (its output is of the autocast dtype from float32 inputs) takes
    every eligible input (floating, not float64) in the autocast dtype; an op it runs in float32
    (float32 output from inputs of the autocast dtype) takes them in float32; another (a promote
    op: `cat`, `index_put`) takes its floating inputs in the widest of their dtypes."""
    _, dtype = state
    if _dtype_of(_call_with(op, args, kwargs, torch.float32, state, fake_mode)) == dtype:
        target = dtype
    elif _dtype_of(_call_with(op, args, kwargs, dtype, state, fake_mode)) == torch.float32:
        target = torch.float32
    else:
        floats = [leaf.dtype for leaf in leaves if _is_float(leaf)]
        target = max(floats, key=lambda d: (d.itemsize, d == torch.float32)) if floats else None
    return {i: target for i, leaf in enumerate(leaves)
            if _is_float(leaf) and leaf.dtype not in (target, torch.float64)}


def _is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _call_with(op, args, kwargs, dtype: torch.dtype, state: Autocast, fake_mode):
    """`op` under autocast with every eligible input (floating, not float64) made `dtype`; None where it
    cannot take them so."""
    with fake_mode:
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t,
            (args, kwargs))
    try:
        return _call(op, args, kwargs, state, True, fake_mode)
    except RuntimeError:
        return None


def _has_autocast_kernel(op, device_type: str) -> bool:
    """Whether autocast has a kernel of its own for `op` on `device_type` (which casts the inputs
    before the op runs); else any casts come from the ops it is made of."""
    key = _AUTOCAST_KEYS.get(device_type)
    return key is None or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)


_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS"}


def _dtype_of(value) -> torch.dtype | None:
    """The dtype of the first floating tensor in `value`."""
    return next((t.dtype for t in pytree.tree_leaves(value) if _is_float(t)), None)


def _call(op, args, kwargs, state: Autocast, enabled: bool, fake_mode):
    """`op` on fake values, under the autocast `state` if `enabled`."""
    device_type, dtype = state
    with fake_mode, torch.autocast(device_type, dtype=dtype, enabled=enabled):
        return op(*args, **kwargs)


def _insert_casts(node: Node, casts: dict[int, torch.dtype], made: dict[tuple, Node]) -> None:
    """Feed `node` its inputs cast as `casts` says, each by a `_to_copy` before it (one per input,
    dtype and recompute region, shared with later ops)."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    for position, dtype in casts.items():
        source = leaves[position]
        key = (source, dtype, RECOMPUTE_REGION.get(node))
        if key not in made:
            with node.graph.inserting_before(node):
                made[key] = node_like(node, aten._to_copy.default, (source,), {"dtype": dtype})
        leaves[position] = made[key]
    node.args, node.kwargs = pytree.tree_unflatten(leaves, spec)


def _fake_value(node: Node, fake_mode, state: Autocast | None = None):
    """`node`'s value on its inputs' fake values, under the autocast `state` (None: none)."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with fake_mode, running_under(state):
        return node.target(*args, **kwargs)
