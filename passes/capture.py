"""Stage 1, capture: an ATen-level FX graph of the model via torch.export.

Non-strict export keeps high-level ops (linear, layer_norm,
scaled_dot_product_attention, embedding) and lifts parameters, buffers and
tensor constants to placeholders.

Writes `node.meta["role"]` on every placeholder: `("param", fqn)`,
`("buffer", fqn)` (persistent buffers), `("constant", name)` (tensor
constants and non-persistent buffers), `("alias", fqn)` (a second name of a
tied weight) or `("input", index)`, and
`gm.meta["in_spec"]` / `gm.meta["out_spec"]` (pytree specs of the model's
inputs and outputs), `gm.meta["tensors"]` (the lifted tensors by name) and
`gm.meta["state_keys"]` (the model's state-dict keys, in order).
"""

from __future__ import annotations

import logging
import time

import torch
from torch.export.graph_signature import InputKind, OutputKind

__all__ = ["capture"]

log = logging.getLogger("tess_compile.passes")

_ROLE = {
    InputKind.PARAMETER: "param",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
}


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, weight_inputs: dict[int, str] | None = None) -> torch.fx.GraphModule:
    """Export `model` on example inputs and tag each placeholder with its role.

    `weight_inputs` maps user-input positions that are really weights (as in
    Dynamo's graphs, where parameters arrive as inputs) to their names; those
    placeholders get `meta["weight_input"] = name`.
    """
    start = time.perf_counter()
    ep = torch.export.export(model, args, kwargs or {}, strict=False)
    _check_outputs(ep)
    gm = ep.graph_module
    specs = {spec.arg.name: spec for spec in ep.graph_signature.input_specs}
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    tensors.update(ep.constants)
    num_inputs = 0
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        spec = specs[node.name]
        if spec.kind == InputKind.USER_INPUT:
            node.meta["role"] = ("input", num_inputs)
            if weight_inputs and num_inputs in weight_inputs:
                node.meta["weight_input"] = weight_inputs[num_inputs]
            num_inputs += 1
        elif spec.kind == InputKind.BUFFER and spec.persistent is False:
            node.meta["role"] = ("constant", spec.target)  # not in the state dict
        elif spec.kind in _ROLE:
            node.meta["role"] = (_ROLE[spec.kind], spec.target)
        else:
            raise ValueError(f"input {node.name!r} of kind {spec.kind.name} is not supported")
    _merge_tied(gm, tensors)
    gm.meta["in_spec"] = ep.call_spec.in_spec
    gm.meta["out_spec"] = ep.call_spec.out_spec
    gm.meta["tensors"] = tensors
    gm.meta["state_keys"] = list(model.state_dict(keep_vars=True))
    log.info("capture: %d nodes in %.2fs", len(gm.graph.nodes), time.perf_counter() - start)
    return gm


def _merge_tied(gm: torch.fx.GraphModule, tensors: dict[str, torch.Tensor]) -> None:
    """Tied weights (one tensor, several names) become one placeholder.

    Every use moves to the first placeholder of the tensor; the others keep
    the role `("alias", name)` and `meta["alias_of"]`, so the sharded module
    ties the same names as the model does.
    """
    first_of: dict[int, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        role = node.meta.get("role", ("",))
        if node.op != "placeholder" or role[0] not in ("param", "buffer"):
            continue
        first = first_of.setdefault(id(tensors[role[1]]), node)
        if first is not node:
            node.replace_all_uses_with(first)
            node.meta["role"] = ("alias", role[1])
            node.meta["alias_of"] = first.meta["role"][1]


def _check_outputs(ep) -> None:
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise ValueError(
                f"the model's forward writes {spec.target!r} ({spec.kind.name}): in-place updates of "
                "buffers or inputs are not supported by the sharding pass; compute them outside "
                "forward, or return the new value instead"
            )
