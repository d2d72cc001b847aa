"""Recompute regions of repeated blocks: an analysis of the captured graph, run before place.

`mark_blocks` makes each repeated block of the model, an element of a
ModuleList or Sequential with two or more elements of one class (a
transformer's layers), one recompute region: it writes
`RECOMPUTE_REGION` = "block <path>" (`tess_compile.core.meta_keys`) and changes nothing else;
nodes already in a region (the model's own `torch.utils.checkpoint` calls, marked by
`tess_compile.passes.capture`) keep theirs. Reads torch's `meta["nn_module_stack"]`. The runtimes
run each region under `torch.utils.checkpoint` (`tess_compile.ops.recompute_region`).
"""

from __future__ import annotations

from torch.fx import GraphModule

from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import RECOMPUTE_REGION

__all__ = ["mark_blocks"]


def mark_blocks(gm: GraphModule, mesh: Mesh) -> GraphModule:
    """Each repeated block of the model becomes a recompute region (see the module docstring)."""
    blocks = _repeated_blocks(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function" or RECOMPUTE_REGION.has(node):
            continue
        paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
        block = next((path for path in paths if path in blocks), None)
        if block is not None:
            RECOMPUTE_REGION.set(node, f"block {block}")
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
