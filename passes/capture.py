"""Stage 1, capture: an ATen-level FX graph of the model via torch.export.

Non-strict export keeps high-level ops (linear, layer_norm,
scaled_dot_product_attention, embedding) and lifts parameters, buffers and
tensor constants to placeholders.

Calls of `torch.utils.checkpoint.checkpoint` in the model (reentrant or
not) are traced as plain ops, each call's nodes one recompute region
(`tess_compile.passes.checkpoint_regions`).

Writes (`tess_compile.core.meta_keys`) `ROLE` on every placeholder, `WEIGHT_INPUT` on the weights
given as inputs, `ALIAS_OF` on a tied weight's second name, `RECOMPUTE_REGION` on the ops of a
checkpoint call, and on the graph `IN_SPEC`, `OUT_SPEC`, `TENSORS`, `STATE_KEYS` and, in a
dynamic capture, `GUARDS`.

Device constants: tensors made inside forward (`torch.ones(..., device=x.device)`,
`torch.arange(s, device=ids.device)`, `.to(x.device)`) would keep the capture
device in the graph. Every `torch.device` argument equal to the capture
device (a user input's, else the first lifted tensor's) becomes a
`device_of(that input)` node, so the per-rank graph makes them on the device
it runs on (a CUDA run of a CPU capture, a fake run on the meta device). Of a
model built on the meta device, so does every meta-device argument.

A model built on the meta device first gets its non-persistent buffers
recomputed on the CPU, and is captured on the meta device, its example inputs
with it (`tess_compile.passes.meta_device`).

Code that branches on, or sizes a tensor by, values in tensors: a ValueError naming its line
(`tess_compile.passes.data_dependent`). An error the model itself raises on the inputs is
raised as it is, with its line (`tess_compile.passes.model_errors`). An attention mask built from
sizes alone that is the causal mask becomes `is_causal=True` (`tess_compile.passes.causal_masks`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
import time

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.node import map_aggregate
from torch.fx.traceback import preserve_node_meta
from torch.utils import _pytree as pytree

from tess_compile.passes.capture_reuse import reused_capture
from tess_compile.passes.causal_masks import causal_masks_as_flags
from tess_compile.passes.checkpoint_regions import mark_checkpoints, traced_checkpoints
from tess_compile.passes.data_dependent import explained_data_dependence, refuse_data_dependent_shapes
from tess_compile.passes.dynamic_capture import dynamic_example, export_dynamic
from tess_compile.passes.model_errors import the_models_own_errors
from tess_compile.passes.meta_device import on_the_meta_device, recompute_meta_buffers
from tess_compile.passes.view_mutations import functionalize_view_mutations, may_alias_root, writes_in_place
from tess_compile.core.autocast import Autocast, autocast_off_everywhere, running_under
from tess_compile.core.meta_keys import (
    ALIAS_OF,
    AUTOCAST_REGION,
    GUARDS,
    IN_SPEC,
    OUT_SPEC,
    ROLE,
    STATE_KEYS,
    TENSORS,
    WEIGHT_INPUT,
)
from tess_compile.ops.local import device_of

__all__ = ["capture", "is_cache", "shape_env_of"]

log = logging.getLogger("tess_compile.passes")


_META = torch.device("meta")

_ROLE = {
    InputKind.PARAMETER: "param",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
}


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
            weight_inputs: dict[int, str] | None = None, batch_factor: int | None = None,
            autocast: Autocast | None = None, shared: bool = False) -> torch.fx.GraphModule:
    """Export `model` on example inputs and tag each placeholder with its role.

    `weight_inputs` maps user-input positions that are really weights (as in
    Dynamo's graphs, where parameters arrive as inputs) to their names; those
    placeholders get `WEIGHT_INPUT` = name. `batch_factor` (a dynamic
    compile's) captures the batch as a symbolic multiple of it and the other
    dims of the inputs symbolic where the model allows (`tess_compile.passes.dynamic_capture`),
    except the weight inputs' dims and those marked `torch._dynamo.mark_static`;
    `GUARDS` is then the number of guards the capture left, so
    that the driver can tell those the later passes add. The model runs under the
    torch.autocast `autocast` (None: none), so that code that reads a dtype (`x.to(h.dtype)`)
    traces as it runs there; export records no cast of autocast's
    (`tess_compile.passes.autocast_casts` writes them). Inside
    `tess_compile.passes.capture_reuse.captures_reused()` a model is exported once per way it is called
    (`shared`: the graph the compiles share, not to be changed; `capture_reuse.owned`).
    """
    kwargs = kwargs or {}
    options = (tuple(sorted((weight_inputs or {}).items())), batch_factor, autocast)
    return reused_capture(model, (args, kwargs), options,
                          lambda: _capture(model, args, kwargs, weight_inputs, batch_factor, autocast), shared)


def _capture(model: torch.nn.Module, args: tuple, kwargs: dict, weight_inputs: dict[int, str] | None,
             batch_factor: int | None, autocast: Autocast | None) -> torch.fx.GraphModule:
    start = time.perf_counter()
    recompute_meta_buffers(model)
    dims = None
    if batch_factor is not None:
        args, kwargs, dims = dynamic_example(args, kwargs, batch_factor, weight_inputs or {})
    with (explained_data_dependence(model), the_models_own_errors(model, args, kwargs), autocast_off_everywhere(),
          running_under(autocast), on_the_meta_device(model, args, kwargs) as (args, kwargs)):
        ep = _export(model, args, kwargs, dims)
    _check_outputs(ep)
    gm = ep.graph_module
    refuse_data_dependent_shapes(gm, model)
    specs = {spec.arg.name: spec for spec in ep.graph_signature.input_specs}
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    # the model's own tensors, not export's copies (of a model captured on the meta device, meta ones)
    tensors.update({name: t for name, t in ep.constants.items() if name not in tensors})
    num_inputs = 0
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        spec = specs[node.name]
        if spec.kind == InputKind.USER_INPUT:
            ROLE.set(node, ("input", num_inputs))
            if weight_inputs and num_inputs in weight_inputs:
                WEIGHT_INPUT.set(node, weight_inputs[num_inputs])
            num_inputs += 1
        elif spec.kind == InputKind.BUFFER and spec.persistent is False:
            ROLE.set(node, ("constant", spec.target))  # not in the state dict
        elif spec.kind in _ROLE:
            ROLE.set(node, (_ROLE[spec.kind], spec.target))
        else:
            raise ValueError(f"input {node.name!r} of kind {spec.kind.name} is not supported")
    _merge_tied(gm, tensors)
    _split_at_constant_indices(gm, tensors)
    _inline_grad_mode_wrappers(gm)
    functionalize_view_mutations(gm)
    causal_masks_as_flags(gm)
    _drop_dead_code(gm)
    mark_checkpoints(gm)
    _devices_at_run_time(gm)
    gm.recompile()  # once for the passes above, which change only the graph
    if batch_factor is not None:
        shape_env = shape_env_of(gm)
        GUARDS.set(gm, len(shape_env.guards) if shape_env is not None else 0)
    IN_SPEC.set(gm, ep.call_spec.in_spec)
    OUT_SPEC.set(gm, ep.call_spec.out_spec)
    TENSORS.set(gm, tensors)
    STATE_KEYS.set(gm, list(model.state_dict(keep_vars=True)))
    log.info("capture: %d nodes in %.2fs", len(gm.graph.nodes), time.perf_counter() - start)
    return gm


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, dims: tuple | None):
    """`torch.export.export` of the model, its outputs made exportable (`_exportable`). A model that
    returns a cache and takes `use_cache` (not given) is exported again with `use_cache=False`: a
    training forward does not need the cache, and its graph then holds none of the cache's ops."""
    dropped: list[str] = []
    ep = _export_with(model, args, kwargs, dropped, {}, dims)
    if not dropped:
        return ep
    takes = "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in kwargs
    if takes:
        ep = _export_with(model, args, kwargs, [], {"use_cache": False}, dims)
    log.warning("%s returns %s: the sharded module returns None there%s (a training forward does not need the "
                "cache)", type(model).__name__, ", ".join(dropped), ", compiled with use_cache=False" if takes else "")
    return ep


def _export_with(model: torch.nn.Module, args: tuple, kwargs: dict, dropped: list[str], fixed: dict,
                 dims: tuple | None):
    """Export with the model's forward called with the keywords `fixed` added and its outputs made
    exportable (the caches among them noted in `dropped`); the model's own forward afterwards."""
    own = model.__dict__.get("forward")  # an instance attribute, if the model has one
    bound = model.forward

    @functools.wraps(bound)
    def forward(*call_args, **call_kwargs):
        outputs = bound(*call_args, **call_kwargs, **fixed)
        return pytree.tree_map_with_path(functools.partial(_exportable, dropped), outputs)

    model.forward = forward
    try:
        with preserve_node_meta(), traced_checkpoints():
            if dims is None:
                return torch.export.export(model, args, kwargs, strict=False)
            return export_dynamic(model, args, kwargs, dims)
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def shape_env_of(gm: torch.fx.GraphModule):
    """The ShapeEnv of a graph captured with symbolic dims (from its inputs' sizes), or None."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            for size in val.shape:
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None


# Values an output may hold besides tensors: the sharded module returns them as they are.
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size)


def _exportable(dropped: list[str], path, value):
    """An output leaf as export takes it: a tensor or plain value as it is; a cache (an object of
    a `Cache` class, as transformers' past keys and values are) None, its place noted in
    `dropped`; anything else a ValueError naming its type, its place and the fix."""
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return value
    where = f"output{pytree.keystr(path)}"
    if is_cache(value):
        dropped.append(f"a {type(value).__name__} at {where}")
        return None
    raise ValueError(
        f"{where} of the model is a {type(value).__module__}.{type(value).__name__}, which the sharded module "
        "cannot return: return tensors, numbers, strings or lists, tuples and dicts of them (a type that holds "
        "tensors can be registered with torch.utils._pytree.register_pytree_node), or leave it out of forward's outputs"
    )


def is_cache(value) -> bool:
    """Whether `value` is a cache of past keys and values (an object of a class named `Cache` or of
    a subclass, as transformers' are), which the sharded module returns as None."""
    return any(cls.__name__ == "Cache" for cls in type(value).__mro__)


def _merge_tied(gm: torch.fx.GraphModule, tensors: dict[str, torch.Tensor]) -> None:
    """Tied weights (one tensor, several names) become one placeholder.

    Every use moves to the first placeholder of the tensor; the others keep
    the role `("alias", name)` and `ALIAS_OF`, so the sharded module
    ties the same names as the model does.
    """
    first_of: dict[int, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        role = ROLE.get(node, ("",))
        if node.op != "placeholder" or role[0] not in ("param", "buffer"):
            continue
        first = first_of.setdefault(id(tensors[role[1]]), node)
        if first is not node:
            node.replace_all_uses_with(first)
            ROLE.set(node, ("alias", role[1]))
            ALIAS_OF.set(node, ROLE.of(first)[1])


_COPIES = (torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.detach.default, torch.ops.aten.detach_.default)


def _split_at_constant_indices(gm: torch.fx.GraphModule, tensors: dict[str, torch.Tensor]) -> None:
    """`tensor_split(x, t, dim)` by a constant tensor `t` made in forward becomes the overload of its
    values (sections or a list of indices): a fake run has no values to split at."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.tensor_split.tensor_indices_or_sections):
        source = node.args[1]
        while source.op == "call_function" and source.target in _COPIES:
            source = source.args[0]
        if source.op != "placeholder" or ROLE.of(source)[0] != "constant":
            continue
        value = tensors[ROLE.of(source)[1]]
        overload = torch.ops.aten.tensor_split.sections if value.dim() == 0 else torch.ops.aten.tensor_split.indices
        node.target = overload
        node.args = (node.args[0], value.tolist(), *node.args[2:])


def _inline_grad_mode_wrappers(gm: torch.fx.GraphModule) -> None:
    """Inline `wrap_with_set_grad_enabled` regions (a `torch.no_grad()` block,
    such as rotary tables) so every rule sees plain ops; what a disabled region
    returns is detached, as it was. Regions under their own `torch.autocast(...)`
    (on, or off as MoE routers do to keep float32) are inlined too, each op
    marked with the state of the innermost such region around it
    (`AUTOCAST_REGION`), whose casts `tess_compile.passes.autocast_casts` writes
    into the graph. Regions inside regions are inlined in turn."""
    wrappers = _wrappers(gm)
    while wrappers:
        for node in wrappers:
            _inline_wrapper(gm, node)
        wrappers = _wrappers(gm)
    gm.graph.lint()


_GRAD_MODE, _AUTOCAST = torch.ops.higher_order.wrap_with_set_grad_enabled, torch.ops.higher_order.wrap_with_autocast


def _wrappers(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (_GRAD_MODE, _AUTOCAST)]


def _inline_wrapper(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    region = AUTOCAST_REGION.get(node)  # of a region this one is inside
    if node.target is _AUTOCAST:
        device_type, dtype, enabled, _cache, submodule_node, *operands = node.args
        region = (device_type, dtype or torch.get_autocast_dtype(device_type), bool(enabled))
    else:
        enabled, submodule_node, *operands = node.args
    outputs = _inline(gm, node, getattr(gm, submodule_node.target), operands, region)
    if node.target is _GRAD_MODE and not enabled:
        outputs = [_detached(gm, node, out) for out in outputs]
    for user in list(node.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    if not submodule_node.users:
        gm.graph.erase_node(submodule_node)


def _inline(gm: torch.fx.GraphModule, at: torch.fx.Node, sub: torch.fx.GraphModule, operands,
            autocast_region: tuple | None = None) -> list:
    """Copy `sub`'s nodes before `at`, fed by `operands`, each op marked with `autocast_region` (a
    region inside, inlined later, marks its own again); return its outputs. The submodules of
    regions inside go onto `gm`."""
    env = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], operands))
    with gm.graph.inserting_before(at):
        for n in sub.graph.nodes:
            if n.op == "output":
                return list(torch.fx.node.map_arg(n.args[0], env.__getitem__))
            if n.op == "get_attr":
                name = _free_name(gm, n.target.replace(".", "_"))
                setattr(gm, name, operator.attrgetter(n.target)(sub))
                env[n] = gm.graph.get_attr(name)
                env[n].meta.update(n.meta)
            elif n.op != "placeholder":
                env[n] = gm.graph.node_copy(n, env.__getitem__)
                if autocast_region is not None and n.op == "call_function":
                    AUTOCAST_REGION.set(env[n], autocast_region)
    raise AssertionError("subgraph without output")


def _free_name(gm: torch.fx.GraphModule, name: str) -> str:
    """`name`, or `name_<k>`, whichever `gm` has no attribute of."""
    candidate, k = name, 0
    while hasattr(gm, candidate):
        k += 1
        candidate = f"{name}_{k}"
    return candidate


def _drop_dead_code(gm: torch.fx.GraphModule) -> None:
    """Drop the ops whose values nothing reads: pure ones, and in-place ops on a tensor the graph
    made that nothing else reads (a key/value cache that forward builds and no output keeps)."""
    dropped = True
    while dropped:
        dead = [node for node in gm.graph.nodes if node.op == "call_function" and not node.users
                and (not node.is_impure() or _mutates_a_dead_temporary(node))]
        for node in reversed(dead):
            gm.graph.erase_node(node)
        dropped = bool(dead)


def _mutates_a_dead_temporary(node: torch.fx.Node) -> bool:
    """An in-place op on a whole tensor made by an op of the graph and read by nothing else. (A write
    through a view is functional by now: `tess_compile.passes.view_mutations`.)"""
    target = node.args[0] if writes_in_place(node) else None
    return (isinstance(target, torch.fx.Node) and target.op == "call_function" and set(target.users) == {node}
            and may_alias_root(target) is target)


def _detached(gm: torch.fx.GraphModule, at: torch.fx.Node, value: torch.fx.Node) -> torch.fx.Node:
    with gm.graph.inserting_before(at):
        out = gm.graph.call_function(torch.ops.aten.detach.default, (value,))
    out.meta.update(value.meta)
    return out


def _devices_at_run_time(gm: torch.fx.GraphModule) -> None:
    """Arguments equal to the capture device read the device of an input instead. Of a model built on
    the meta device, the meta device too: its weights run where its inputs do."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [n for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
    if not tensors:
        return
    source = next((n for n in tensors if ROLE.of(n)[0] == "input"), tensors[0])
    captured = {source.meta["val"].device}
    if any(n.meta["val"].is_meta for n in tensors if ROLE.of(n)[0] in _ROLE.values()):
        captured.add(_META)
    with gm.graph.inserting_after(placeholders[-1]):
        device = gm.graph.call_function(device_of, (source,))
    device.meta["val"] = source.meta["val"].device

    def at_run_time(value):
        return device if isinstance(value, torch.device) and value in captured else value

    for node in gm.graph.nodes:
        if node.op == "call_function" and node is not device:
            node.args, node.kwargs = map_aggregate(node.args, at_run_time), map_aggregate(node.kwargs, at_run_time)
    if not device.users:
        gm.graph.erase_node(device)


def _check_outputs(ep) -> None:
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise ValueError(
                f"the model's forward writes {spec.target!r} ({spec.kind.name}): in-place updates of "
                "buffers or inputs are not supported by the sharding pass; compute them outside "
                "forward, or return the new value instead"
            )
