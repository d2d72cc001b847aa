"""Stage 1, capture: one capture of a model serves every compile inside `captures_reused()`.

torch.export is the slowest step of a compile (of a 32-layer model, most of it), and it
gives the same graph for every mesh. The planner compiles one model for every mesh,
`keep_blocks="auto"` compiles each face's model twice, and `dump` counts the unsharded
model's FLOPs on the captured graph: inside `captures_reused()`, `tess_compile.passes.capture`
exports a model once for each way it is called (the same inputs' structure, shapes, dtypes
and values that are not tensors, the same mode, autocast and capture options) and hands each
compile a copy of that graph: its own nodes, whose `meta` dicts are copies (the values in them,
fake tensors and torch's keys, are shared, and no pass changes them). The model must not change
inside the block. A dynamic capture (`batch_factor`), whose shape environment the later passes add
guards to, is its compile's own. Reads and writes no meta keys.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Callable

import torch
from torch.fx import Graph, GraphModule
from torch.utils import _pytree as pytree

__all__ = ["captures_reused", "owned", "reused_capture"]

_CAPTURES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tess_captures", default=None)


@contextlib.contextmanager
def captures_reused():
    """Inside this block each model is captured once per way it is called (see the module docstring);
    nested blocks share the outermost one's captures."""
    if _CAPTURES.get() is not None:
        yield
        return
    token = _CAPTURES.set({})
    try:
        yield
    finally:
        _CAPTURES.reset(token)


def reused_capture(model: torch.nn.Module, inputs, options: tuple, make: Callable[[], GraphModule],
                   shared: bool = False) -> GraphModule:
    """`make()`, the capture of `model` on `inputs` with `options` (hashable: weight inputs, batch factor,
    autocast), or inside `captures_reused()` a copy of the graph it gave the first time; with `shared`, that
    graph itself, which the caller must not change (`owned` gives a copy to change)."""
    captures = _CAPTURES.get()
    if captures is None or options[1] is not None:  # a dynamic capture's guards are its compile's own
        return make()
    key = (id(model), model.training, options, _described(inputs))
    if key not in captures:
        captures[key] = (model, make())  # the model too: its id stays its own while the block lasts
    return captures[key][1] if shared else _copied(captures[key][1])


def owned(gm: GraphModule) -> GraphModule:
    """`gm`, or a copy of it if it is a capture that `captures_reused()` shares."""
    captures = _CAPTURES.get()
    return _copied(gm) if captures and any(gm is held for _, held in captures.values()) else gm


def _described(inputs) -> tuple:
    """The inputs as capture sees them: their structure, and each leaf's shape and dtype (a tensor) or value."""
    leaves, spec = pytree.tree_flatten(inputs)
    return str(spec), tuple(_leaf(leaf) for leaf in leaves)


def _leaf(leaf):
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad,
                tuple(getattr(leaf, "_dynamo_static_indices", ())))
    return type(leaf).__name__, repr(leaf)


def _copied(gm: GraphModule) -> GraphModule:
    """A graph module of new nodes, each with a copy of its `meta` dict, over `gm`'s attributes."""
    graph = Graph()
    value, output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(value, type_expr=output.type).meta = copy.copy(output.meta)
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    out = GraphModule(gm, graph)
    out.meta.update(gm.meta)
    return out
