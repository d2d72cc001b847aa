"""Recompute regions: which nodes the runtimes recompute in backward instead of saving.

Two analyses, each writing `meta["recompute"] = name` and changing nothing
else; nodes already in a region (the model's own `torch.utils.checkpoint`
calls, marked by `passes.capture`) keep theirs.

- `mark_blocks` (the placed graph): each repeated block of the model, an
  element of a ModuleList or Sequential with two or more elements of one
  class (a transformer's layers), is one region. Reads `meta["nn_module_stack"]`.
- `mark_selective` (the per-rank graph): each run of two or more
  consecutive cheap local ops (pointwise, views, the local parts of norms,
  softmax) is one region; matrix products, attention and collectives are
  saved, as torch's selective activation checkpointing policies save
  matmul outputs. A region without collectives recomputes without
  communicating.

`tess_compile.regions` runs the regions under `torch.utils.checkpoint`.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from tess_compile.collectives import COLLECTIVE_OPS, wait
from tess_compile.mesh import Mesh
from tess_compile.products import fetched_product

__all__ = ["CHECKPOINTS", "mark_blocks", "mark_selective"]

# The compiler's checkpointing options (`compile_model(..., checkpoint=...)`).
CHECKPOINTS = ("none", "blocks", "selective")

aten = torch.ops.aten

# Ops whose outputs the selective policy saves: products, attention, lookups.
_SAVED_OPS = (
    aten.linear.default, aten.matmul.default, aten.mm.default, aten.bmm.default, aten.addmm.default,
    aten.baddbmm.default, aten.convolution.default, aten.conv1d.default, aten.conv2d.default,
    aten.conv3d.default, aten.einsum.default, aten.embedding.default,
    aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
    fetched_product, wait,
)


def mark_blocks(gm: GraphModule, mesh: Mesh) -> GraphModule:
    """Each repeated block of the model becomes a recompute region (see the module docstring)."""
    blocks = _repeated_blocks(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function" or "recompute" in node.meta:
            continue
        paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
        block = next((path for path in paths if path in blocks), None)
        if block is not None:
            node.meta["recompute"] = f"block {block}"
    return gm


def _repeated_blocks(gm: GraphModule) -> set[str]:
    """Module paths `parent.i` with two or more siblings `parent.j` of the same class."""
    siblings: dict[tuple[str, str], set[str]] = {}
    for node in gm.graph.nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            parent, _, index = path.rpartition(".")
            if index.isdigit():
                siblings.setdefault((parent, str(kind)), set()).add(path)
    return {path for paths in siblings.values() if len(paths) > 1 for path in paths}


def _recomputable(node: Node) -> bool:
    return (
        node.op == "call_function"
        and "recompute" not in node.meta
        and "summa_step" not in node.meta  # a product's steps and their sum
        and node.target not in COLLECTIVE_OPS
        and node.target not in _SAVED_OPS
    )


def mark_selective(gm: GraphModule, mesh: Mesh) -> GraphModule:
    """Each run of two or more consecutive recomputable nodes becomes a region."""
    runs: list[list[Node]] = [[]]
    for node in gm.graph.nodes:
        if _recomputable(node):
            runs[-1].append(node)
        elif runs[-1]:
            runs.append([])
    for number, run in enumerate(r for r in runs if len(r) > 1):
        for node in run:
            node.meta["recompute"] = f"selective {number}"
    return gm
