"""Fake runs of a per-rank graph: its placeholders' local values, and every node's value.

What the passes that read a per-rank graph (the verifier, the selective
recompute analysis, the gradient buckets) and every analysis share: a
per-rank placeholder's local shape from its layout, whether it requires
grad in a training step, and a run of the whole graph on fake tensors of
those shapes (no memory, no communication: each collective's fake kernel
gives its output's shape). A per-rank placeholder's `LAYOUT`, `GLOBAL_SHAPE`, `DTYPE`, `ROLE`,
`WEIGHT_INPUT` and `CONSTANT_VALUE` (`tess_compile.core.meta_keys`, written by the rewrite) say it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Interpreter, Node

from tess_compile.core.dynamic import concrete
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import ALIAS_OF, CONSTANT_VALUE, DTYPE, GLOBAL_SHAPE, LAYOUT, ROLE, WEIGHT_INPUT

# What stops a fake run early: data-dependent shapes, ops with no fake kernel, and devices fixed
# in the graph (a model built on the meta device makes some tensors there, beside CPU inputs;
# torch before 2.13 has no class of its own for that).
UNCHECKABLE = tuple(getattr(fake_tensor, name) for name in (
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "UnsupportedOperatorException",
    "FakeTensorDeviceMismatchError",
) if hasattr(fake_tensor, name))

__all__ = [
    "UNCHECKABLE",
    "fake_run",
    "global_placeholder",
    "local_bytes",
    "local_placeholder",
    "placeholder_values",
    "requires_grad",
    "tensor_bytes",
    "tensor_leaves",
]


def local_placeholder(node, mesh: Mesh, requires_grad: bool = False):
    """The value a per-rank placeholder takes: an empty tensor of its local shape (call
    inside a FakeTensorMode for a fake one), or the flag or number the model takes there."""
    if CONSTANT_VALUE.has(node):
        return CONSTANT_VALUE.of(node)
    shape = LAYOUT.of(node).local_shape(GLOBAL_SHAPE.of(node), mesh)
    return torch.empty(shape, dtype=DTYPE.of(node), requires_grad=requires_grad)


def global_placeholder(node: Node, device=None):
    """An empty tensor like a captured or placed graph's placeholder (a symbolic size at its
    example's value; on `device`, default
    the default device), requiring grad if it is a parameter, as in `fake_run` (some
    kernels, such as CPU attention, take another path when grad is required, and
    FlopCounterMode counts only one of them), or the value itself."""
    val = node.meta["val"]
    if not isinstance(val, torch.Tensor):
        return val
    weight = ROLE.get(node, ("",))[0] == "param" and (val.is_floating_point() or val.is_complex())
    return torch.empty(concrete(val.shape), dtype=val.dtype, device=device, requires_grad=weight)


def local_bytes(node, mesh: Mesh) -> int:
    """The bytes of the local tensor a per-rank tensor placeholder takes (nothing allocated)."""
    shape = LAYOUT.of(node).local_shape(GLOBAL_SHAPE.of(node), mesh)
    return torch.Size(shape).numel() * DTYPE.of(node).itemsize


def placeholder_values(gm: GraphModule, mesh: Mesh, inputs_require_grad: bool = False) -> list:
    """Every placeholder's local value (`local_placeholder`), parameters requiring grad and, with
    `inputs_require_grad`, floating user inputs (`requires_grad`); fake inside a FakeTensorMode.
    A tied weight's second placeholder (role "alias") takes the very value of the tensor it ties
    to, as the runtime feeds it."""
    values, by_name = [], {}
    for node in gm.graph.find_nodes(op="placeholder"):
        role, name = ROLE.of(node)
        value = by_name.get(ALIAS_OF.of(node)) if role == "alias" else None
        if value is None:
            value = local_placeholder(node, mesh, requires_grad(node, inputs_require_grad))
        by_name[name] = value
        values.append(value)
    return values


def tensor_leaves(*values) -> list[torch.Tensor]:
    """The tensors among `values` and everything nested in them (lists, tuples, dicts)."""
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


def tensor_bytes(value) -> int:
    return value.numel() * value.element_size()


def requires_grad(node: Node, inputs_require_grad: bool) -> bool:
    """Parameters (weights given as inputs included) and, if asked, floating user inputs."""
    if CONSTANT_VALUE.has(node):  # a flag or number
        return False
    role = ROLE.of(node)[0]
    floating = DTYPE.of(node).is_floating_point or DTYPE.of(node).is_complex
    weight = role == "param" or WEIGHT_INPUT.has(node)
    return floating and (weight or (role == "input" and inputs_require_grad))


def fake_run(gm: GraphModule, mesh: Mesh, *, inputs_require_grad: bool = False, within=None) -> dict[Node, object]:
    """Every node's local value (fake tensors) from a run of the per-rank `gm`.

    Parameters require grad; user inputs do if `inputs_require_grad` and
    they are floating point; buffers and constants never. `within`, a
    dispatch mode such as a FLOP counter, sees every op of the run. The
    graph's nodes are left as they were (no `meta["val"]` is written).
    """
    interpreter = Interpreter(gm, garbage_collect_values=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = placeholder_values(gm, mesh, inputs_require_grad)
        with within or contextlib.nullcontext():
            interpreter.run(*inputs)
    return interpreter.env
