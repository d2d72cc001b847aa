"""Lowering of the `tess::` collectives of a compiled graph to torch's functional collectives.

Stage: runtime, inside inductor's inner compile (`tess_compile.runtime.inductor.CompiledRank`).
AOTAutograd traces a rank's program with every collective as its `tess::` custom op,
whose adjoints give the backward graph. Under a real process group (the communicator
is a `DistComm`), `lower_collectives` then replaces each such node, in the forward
and in the backward graph, with torch's functional collectives
(`torch.ops._c10d_functional.*` on the axis's process group, by its `group_name`)
and the local ATen ops around them, before `compile_fx_inner` sees the graph. So
the collectives are nodes inductor sees, orders and buckets, and no Python runs
per collective.

Each collective's lowering is its record's `functional`
(`tess_compile.core.collective_table`; the lowerings, with what each gives, are
`tess_compile.core.functional_lowerings`), exactly what the record's
`on_process_group` gives on this rank. A broadcast_start whose result anything
but its waits reads is lowered as a broadcast. Every rank's lowered graph has
the same nodes; ranks differ only in constants, so inductor's fusion and
scheduling decide alike on every rank, and it issues the collectives in the
graph's order (`comms.decide_global_ordering_of_comms`): the collectives meet.
Op outputs keep the strides of the custom ops' fake kernels, which the rest of
the graph was traced with.

The bytes a lowered graph hands its collectives are no longer recorded at run time
(`Comm.record` runs in the communicator, which the lowered graph no longer calls);
`collectives_in` lists them from the graph, as `Comm.record` counts them, before
lowering (docs/compiled.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch._prims_common import is_contiguous_or_false
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

from tess_compile.core.collective_table import COLLECTIVES
from tess_compile.core.functional_lowerings import AxisGroup
from tess_compile.core.mesh import AXES
from tess_compile.ops.collectives import CommRecord
from tess_compile.runtime.dist_comm import DistComm

__all__ = ["axis_groups", "collective_name", "collectives_in", "lower_collectives"]


def axis_groups(comm) -> dict[str, AxisGroup] | None:
    """Axis -> this rank's `AxisGroup`, for a communicator over torch.distributed process groups (a
    `DistComm`); None for any other (the simulator's, a fake run's), whose collectives stay custom ops."""
    if not isinstance(comm, DistComm):
        return None
    return {axis: AxisGroup(comm.groups[axis].group_name, comm.mesh.size(axis), comm.coord(axis)) for axis in AXES}


# The `tess::` ops a lowered graph holds no more, by graph target: every collective with a custom op, and wait.
_OPS: dict[object, str] = {getattr(torch.ops.tess, name).default: name
                           for name, record in COLLECTIVES.items() if record.schema is not None}
_OPS[torch.ops.tess.wait.default] = "wait"


def collective_name(node: Node) -> str | None:
    """The collective (or "wait") that `node` calls as a `tess::` custom op; None for any other node."""
    return _OPS.get(node.target) if node.op == "call_function" else None


def collectives_in(gm: GraphModule, phase: str) -> list[CommRecord]:
    """The collectives that send bytes in `gm` (a graph of `tess::` ops, before `lower_collectives`), one
    `CommRecord` each, in graph order, as `Comm.record` records them when they run: the op each counts as,
    its axis, the bytes of its input (a sympy expression of the compile's symbols where its shape is
    symbolic), `phase`."""
    records = []
    for node in gm.graph.nodes:
        name = collective_name(node)
        if name is None or name == "wait" or not COLLECTIVES[name].sends:
            continue
        x, axis = node.args[0].meta["val"], node.args[1]
        num_bytes = x.numel() * x.element_size()
        if isinstance(num_bytes, torch.SymInt):
            num_bytes = num_bytes.node.expr
        records.append(CommRecord(COLLECTIVES[name].counts_as, axis, num_bytes, phase))
    return records


def lower_collectives(gm: GraphModule, groups: dict[str, AxisGroup]) -> GraphModule:
    """`gm` (a forward or backward graph of AOTAutograd, its nodes' `meta["val"]` fake tensors) with every
    `tess::` collective and wait replaced by its functional-collective lowering (its record's `functional`)
    on this rank's `groups`, in place. Reads `meta["val"]`; the new nodes carry their own."""
    for node in list(gm.graph.nodes):
        name = collective_name(node)
        if name is None:
            continue
        x, *args = node.args
        if name == "wait":
            _replace(gm.graph, node, _wait, x)
            continue
        axis, *own = args
        group = groups[axis]
        assert not COLLECTIVES[name].scale or own[0] == group.size, f"{node.format_node()}: a group of {group.size}"
        record = COLLECTIVES["broadcast" if name == "broadcast_start" and not _waited_apart(node) else name]
        _replace(gm.graph, node, functools.partial(record.functional, group, *own), x)
    gm.graph.lint()
    gm.recompile()
    return gm


def _waited_apart(node: Node) -> bool:
    """Whether the broadcast_start `node` can stay in flight until its waits: every user is a `tess::wait`,
    and its input is contiguous, so that the functional broadcast's own output is what the waits get."""
    return all(collective_name(user) == "wait" for user in node.users) and is_contiguous_or_false(
        node.args[0].meta["val"])


def _replace(graph: torch.fx.Graph, node: Node, lowering: Callable, x: Node) -> None:
    """Replace `node` with the ops that `lowering(x)` runs, traced (as inductor's own replacements are)
    on `x`'s fake value, with inductor's decompositions."""
    value = x.meta["val"]
    with detect_fake_mode([value]), enable_python_dispatcher():
        traced = make_fx(lowering, select_decomp_table(), tracing_mode="real")(value)
    assert not traced.graph.find_nodes(op="get_attr"), f"the lowering of {node.target} holds a constant tensor"
    (placeholder,) = traced.graph.find_nodes(op="placeholder")
    with graph.inserting_before(node):
        out = graph.graph_copy(traced.graph, {placeholder: x})
    old, new = node.meta["val"], out.meta["val"]
    assert old.shape == new.shape and old.dtype == new.dtype, (node, old, new)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _wait(x: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor.default(x)
