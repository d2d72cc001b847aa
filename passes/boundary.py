"""Stage 1b, boundary: how the captured graph's inputs and outputs meet its caller (an analysis).

A pipeline stage (`tess_compile.scale_out.pipeline`) takes its positional tensor inputs as this
rank's blocks and gives its outputs as blocks (`local_inputs`, `local_outputs`); a caller that
feeds outputs back as inputs (a KV cache, `tess_compile.generation`) passes `carried`, flat
output index -> flat input index. Keyword inputs stay whole (a pipeline schedule gives them to a
stage as the microbatch's global values). See `tess_compile.passes.driver.compile_model`.

Reads `ROLE`, `WEIGHT_INPUT` and `IN_SPEC` (`tess_compile.core.meta_keys`). Writes `LOCAL_INPUT`
on the local inputs (the carried ones included), `CARRIED` on the carried inputs, and on the
output node `LOCAL_OUTPUTS` and `CARRIED_OUTPUTS` (`{output index: that input's placeholder}`);
changes nothing else. place and rewrite read them.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import (
    CARRIED,
    CARRIED_OUTPUTS,
    IN_SPEC,
    LOCAL_INPUT,
    LOCAL_OUTPUTS,
    ROLE,
    WEIGHT_INPUT,
)

__all__ = ["mark_boundary"]


def mark_boundary(gm: GraphModule, mesh: Mesh, *, local_inputs: bool = False, local_outputs: bool = False,
                  carried: dict[int, int] | None = None) -> GraphModule:
    """Mark `gm`'s local inputs and outputs and its carried inputs; see the module docstring."""
    if local_inputs:
        _mark_local_inputs(gm)
    if local_outputs:
        LOCAL_OUTPUTS.set(_output(gm), True)
    if carried:
        _mark_carried(gm, carried)
    return gm


def _mark_local_inputs(gm: GraphModule) -> None:
    """`LOCAL_INPUT` on the positional tensor inputs (weights given as inputs stay whole)."""
    num_positional = IN_SPEC.of(gm).child(0).num_leaves
    for node in gm.graph.find_nodes(op="placeholder"):
        role, index = ROLE.of(node)
        positional = role == "input" and index < num_positional
        if positional and not WEIGHT_INPUT.has(node) and isinstance(node.meta.get("val"), torch.Tensor):
            LOCAL_INPUT.set(node, True)


def _mark_carried(gm: GraphModule, carried: dict[int, int]) -> None:
    """`LOCAL_INPUT` and `CARRIED` on the carried inputs, `CARRIED_OUTPUTS` on the output node."""
    inputs = {ROLE.of(n)[1]: n for n in gm.graph.find_nodes(op="placeholder") if ROLE.of(n)[0] == "input"}
    for index in carried.values():
        LOCAL_INPUT.set(inputs[index], True)
        CARRIED.set(inputs[index], True)
    CARRIED_OUTPUTS.set(_output(gm), {out: inputs[index] for out, index in carried.items()})


def _output(gm: GraphModule):
    return next(n for n in gm.graph.nodes if n.op == "output")
