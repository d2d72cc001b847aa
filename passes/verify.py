"""The verifier: after place (in tests and debug mode), and after rewrite (always).

After place: every value has a layout, and every split fits its tensor
(the dim exists and divides evenly, or is split unevenly by one axis, plainly:
`tess_compile.passes.rules.uneven`). After rewrite: a forward run of the
per-rank graph on fake tensors of the local shapes, in which every local
kernel accepts its local inputs and gives every value the local shape its
layout promises; otherwise a ValueError names the placement rule to blame.
Collectives are not dispatched but give their output's shape directly
(they check nothing, and their custom ops cost half the run).
Reads `LAYOUT`, `ARG_LAYOUTS`, `GLOBAL_SHAPE`, `GLOBAL_NODE` and `REPLICATED`
(`tess_compile.core.meta_keys`) and torch's `meta["val"]`; writes nothing.
"""

from __future__ import annotations

import operator

import torch
from torch._subclasses import fake_tensor
from torch.fx import GraphModule, Interpreter, Node

from tess_compile.passes.rules import family_of
from tess_compile.passes.source_lines import source_line
from tess_compile.core.fake_run import UNCHECKABLE, local_placeholder
from tess_compile.core.layout import Layout
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import ARG_LAYOUTS, GLOBAL_NODE, GLOBAL_SHAPE, LAYOUT, REPLICATED
from tess_compile.ops.collectives import COLLECTIVE_OPS, output_like

__all__ = ["verify_placed", "verify_rewritten"]


def verify_placed(gm: GraphModule, mesh: Mesh) -> GraphModule:
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        layout = LAYOUT.get(node)
        if layout is None and isinstance(node.meta.get("val"), torch.Tensor):
            raise AssertionError(f"placement left {node.name} without a layout")
        if layout is None:
            continue
        layouts = layout if isinstance(layout, tuple) else (layout,)
        vals = node.meta.get("val") if isinstance(layout, tuple) else (node.meta.get("val"),)
        for lay, val in zip(layouts, vals):
            if isinstance(val, torch.Tensor):
                _check_fits(node.name, lay, tuple(val.shape), mesh)
        for arg, lay in ARG_LAYOUTS.get(node, {}).items():
            if isinstance(arg.meta.get("val"), torch.Tensor):
                _check_fits(f"{node.name} (argument {arg.name})", lay, tuple(arg.meta["val"].shape), mesh)
    return gm


def _check_fits(what: str, layout: Layout, shape: tuple[int, ...], mesh: Mesh) -> None:
    if layout.unfit_axes(shape, mesh):
        raise AssertionError(f"{what}: layout {layout} does not fit shape {list(shape)} on mesh {mesh}")


def verify_rewritten(gm: GraphModule, mesh: Mesh, *, placed: GraphModule) -> GraphModule:
    """A forward run of the per-rank `gm` on fake tensors (see the module docstring);
    `placed` is the global graph it was rewritten from."""
    run = _LocalRun(gm, mesh, {node.name: node for node in placed.graph.nodes})
    with fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        inputs = [local_placeholder(node, mesh) for node in gm.graph.nodes if node.op == "placeholder"]
        try:
            run.run(*inputs)
        except UNCHECKABLE:  # not a shape the rules decide: the rest goes unchecked
            pass
    return gm


class _LocalRun(Interpreter):
    """Runs the per-rank graph node by node; a ValueError at the first local kernel that
    fails or gives a value another local shape than its layout promises."""

    def __init__(self, gm: GraphModule, mesh: Mesh, global_nodes: dict[str, Node]):
        super().__init__(gm)
        self.extra_traceback = False  # our message names the node
        self.mesh = mesh
        self.global_nodes = global_nodes

    def run_node(self, node: Node):
        try:
            value = super().run_node(node)
        except UNCHECKABLE:
            raise
        except Exception as err:
            raise ValueError(self._blame(node, f"its local kernel fails on {self._call(node)}: {err}")) from err
        layout = LAYOUT.get(node)
        if isinstance(layout, Layout) and isinstance(value, torch.Tensor):
            expected = layout.local_shape(GLOBAL_SHAPE.of(node), self.mesh)
            if list(value.shape) != expected:
                raise ValueError(self._blame(node, (
                    f"its local kernel {self._call(node)} gives shape {list(value.shape)}, but its layout "
                    f"{layout} promises {expected} of global shape {list(GLOBAL_SHAPE.of(node))}"
                )))
        return value

    def call_function(self, target, args, kwargs):
        """A collective's value without dispatching it (see the module docstring)."""
        op = COLLECTIVE_OPS.get(target)
        if op is not None:
            return output_like(op, *args)
        return super().call_function(target, args, kwargs)

    def _call(self, node: Node) -> str:
        return _describe_call(node, *self.fetch_args_kwargs_from_env(node))

    def _blame(self, node: Node, what: str) -> str:
        """The error text: the per-rank node, the global node, its rule and layouts, the fix."""
        origin = self.global_nodes.get(GLOBAL_NODE.get(node))
        if origin is None:
            return f"per-rank node {node.name} ({_op(node)}) on mesh {self.mesh}: {what}"
        arg_layouts = ", ".join(f"{arg.name} {lay}" for arg, lay in ARG_LAYOUTS.get(origin, {}).items())
        return (
            f"per-rank node {node.name} ({_op(node)}), made for {origin.name} ({_op(origin)}) at "
            f"{source_line(origin)}, on mesh {self.mesh}: {what}; {_rule_of(origin, self.mesh)} laid out "
            f"its inputs as [{arg_layouts}] and its output as {LAYOUT.get(origin)}: report this as "
            "a bug of that rule, or pass strict=True to see which ops have no rule"
        )


def _op(node: Node) -> str:
    return str(node.target) if node.op == "call_function" else node.op


def _rule_of(node: Node, mesh: Mesh) -> str:
    """Which placement rule decided `node`'s layouts."""
    if node.target is operator.getitem:  # a part of a tuple: the producer's rule
        return _rule_of(node.args[0], mesh)
    if REPLICATED.has(node):
        return "the replicated fallback (the op has no rule)"
    family = family_of(node.target)
    if family is None:
        return f"the placement pass ({node.op})"
    mode = ", mode 1d" if mesh.mode == "1d" else ""
    return f"the rule of family {family!r}{mode} (passes/rules/{family}.py)"


def _describe_call(node: Node, args: tuple, kwargs: dict) -> str:
    """`op(...)` with every tensor argument shown as `name [local shape]`."""
    shown = [_describe_arg(arg, value) for arg, value in zip(node.args, args)]
    shown += [f"{key}={_describe_arg(node.kwargs[key], value)}" for key, value in kwargs.items()]
    return f"{_op(node)}({', '.join(shown)})"


def _describe_arg(arg, value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{arg.name if isinstance(arg, Node) else 'tensor'} {list(value.shape)}"
    if isinstance(arg, (list, tuple)) and isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe_arg(a, v) for a, v in zip(arg, value)) + "]"
    return repr(value)
