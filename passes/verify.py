"""The verifier, run after each pass in tests and debug mode.

After place: every value has a layout, and every split fits its tensor
(the dim exists and divides evenly). After rewrite: a fake run of the
per-rank graph on local shapes gives every value the local shape its
layout promises. Reads `meta["layout"]`, `meta["arg_layouts"]`,
`meta["val"]` and `meta["global_shape"]`; writes nothing.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from tess_compile.layout import Layout, Shard
from tess_compile.mesh import AXES, Mesh

__all__ = ["local_placeholder", "verify_placed", "verify_rewritten"]


def verify_placed(gm: GraphModule, mesh: Mesh) -> GraphModule:
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        layout = node.meta.get("layout")
        if layout is None and isinstance(node.meta.get("val"), torch.Tensor):
            raise AssertionError(f"placement left {node.name} without a layout")
        if layout is None:
            continue
        layouts = layout if isinstance(layout, tuple) else (layout,)
        vals = node.meta.get("val") if isinstance(layout, tuple) else (node.meta.get("val"),)
        for lay, val in zip(layouts, vals):
            if isinstance(val, torch.Tensor):
                _check_fits(node.name, lay, tuple(val.shape), mesh)
        for arg, lay in node.meta.get("arg_layouts", {}).items():
            if isinstance(arg.meta.get("val"), torch.Tensor):
                _check_fits(f"{node.name} (argument {arg.name})", lay, tuple(arg.meta["val"].shape), mesh)
    return gm


def _check_fits(what: str, layout: Layout, shape: tuple[int, ...], mesh: Mesh) -> None:
    local = list(shape)
    for axis in AXES:
        p = layout.on(axis)
        if not isinstance(p, Shard):
            continue
        parts = mesh.size(axis)
        if p.dim >= len(local) or local[p.dim] % (parts * p.groups):
            raise AssertionError(f"{what}: layout {layout} does not fit shape {list(shape)} on mesh {mesh}")
        local[p.dim] //= parts


def local_placeholder(node, mesh: Mesh, requires_grad: bool = False):
    """The value a per-rank placeholder takes: an empty tensor of its local shape (call
    inside a FakeTensorMode for a fake one), or the flag or number the model takes there."""
    if "constant_value" in node.meta:
        return node.meta["constant_value"]
    shape = node.meta["layout"].local_shape(node.meta["global_shape"], mesh)
    return torch.empty(shape, dtype=node.meta["dtype"], requires_grad=requires_grad)


def verify_rewritten(gm: GraphModule, mesh: Mesh) -> GraphModule:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [local_placeholder(node, mesh) for node in gm.graph.nodes if node.op == "placeholder"]
    FakeTensorProp(gm, mode).propagate(*inputs)
    for node in gm.graph.nodes:
        layout = node.meta.get("layout")
        if node.op == "placeholder" or not isinstance(layout, Layout):
            continue
        expected = layout.local_shape(node.meta["global_shape"], mesh)
        got = list(node.meta["val"].shape)
        if got != expected:
            raise AssertionError(f"per-rank node {node.name}: local shape {got}, layout {layout} promises {expected}")
    return gm
