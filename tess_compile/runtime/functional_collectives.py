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

Each lowering gives exactly what the record's `on_process_group`
(`tess_compile.core.collective_table`) gives on this rank:

- broadcast: `broadcast(x, src)`, `src` the group rank, which is the coordinate
  along the axis (the axis's group lists its ranks in coordinate order, as
  `group_src` of the eager call assumes).
- broadcast_start: the same broadcast without its wait; each `tess::wait` of it
  becomes `wait_tensor`, so the broadcast is in flight until then.
- reduce: torch has no functional reduce. An `all_reduce`, whose sum every rank
  receives; the destination keeps it, the others take zeros, as the eager reduce
  leaves them. It moves more bytes than a reduce (ring: 2(g-1)/g of the tensor
  against 1), the price of a collective inductor can see.
- all_reduce: `all_reduce(x, "sum")`.
- all_gather / reduce_scatter: `all_gather_into_tensor` / `reduce_scatter_tensor`
  of the blocks in rank order (flattened, as the eager calls send them), put in
  place along `dim`, with `groups` interleaved blocks (`put_blocks`, `take_block`).
- keep_first, shard_slice, shard_pad: rank-local, with this rank's coordinate on the
  axis, a constant of the process; shard_slice and shard_pad run the record's own
  function.
- all_gather_alike, all_reduce_alike, keep_first_alike: as all_gather, all_reduce
  and keep_first (they differ in their adjoints only).
- grad_sync, seed_once and sum_shares do not reach the compiled graphs: they are
  identities in forward whose backward AOTAutograd traces as all_reduce, keep_first
  and all_reduce; the identity adjoint of the `*_alike` ops passes the gradient on.

Every rank's lowered graph has the same nodes; ranks differ only in constants (group
names, coordinates, which rank keeps a sum: a `where` on a constant flag). So
inductor's fusion and scheduling decide alike on every rank, and it issues the
collectives in the graph's order (`comms.decide_global_ordering_of_comms`): the
collectives meet. Op outputs keep the strides of the custom ops' fake kernels,
which the rest of the graph was traced with.

The bytes a lowered graph hands its collectives are no longer recorded at run time
(`Comm.record` runs in the communicator, which the lowered graph no longer calls);
`collectives_in` lists them from the graph, as `Comm.record` counts them, before
lowering (docs/compiled.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch._prims_common import is_contiguous_or_false
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from tess_compile.core.collective_table import COLLECTIVES, in_rank_order, put_in_place, rank_ordered, split_dim
from tess_compile.core.mesh import AXES
from tess_compile.ops.collectives import CommRecord
from tess_compile.runtime.dist_comm import DistComm

__all__ = ["LOWERINGS", "AxisGroup", "axis_groups", "collective_name", "collectives_in", "lower_collectives"]

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class AxisGroup:
    """This rank's process group along one mesh axis: its name (`ProcessGroup.group_name`, as the
    functional collectives address it), its size, and this rank's coordinate on the axis (its rank in
    the group)."""

    name: str
    size: int
    coord: int


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
    `tess::` collective and wait replaced by its functional-collective lowering (`LOWERINGS`) on this rank's
    `groups`, in place. Reads `meta["val"]`; the new nodes carry their own."""
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
        lowering = LOWERINGS["broadcast" if name == "broadcast_start" and not _waited_apart(node) else name]
        _replace(gm.graph, node, functools.partial(lowering, group, *own), x)
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


def _flag(value: bool, like: torch.Tensor) -> torch.Tensor:
    """A boolean scalar tensor holding the constant `value` (a `where` on it keeps every rank's graph alike)."""
    return torch.full((), value, dtype=torch.bool, device=like.device)


def _wait(x: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor.default(x)


def _broadcast(group: AxisGroup, src: int, x: torch.Tensor) -> torch.Tensor:
    return _wait(_c10d.broadcast.default(x.contiguous(), src, group.name))


def _broadcast_start(group: AxisGroup, src: int, x: torch.Tensor) -> torch.Tensor:
    """The broadcast in flight: its `tess::wait`s wait for it (`lower_collectives` takes this lowering
    only for a contiguous input that nothing but waits reads)."""
    return _c10d.broadcast.default(x, src, group.name)


def _reduce(group: AxisGroup, dst: int, x: torch.Tensor) -> torch.Tensor:
    total = _wait(_c10d.all_reduce.default(x.contiguous(), "sum", group.name))
    # Every rank reads the sum (so dead-code elimination keeps the collective); all but `dst` take zeros.
    return torch.where(_flag(group.coord == dst, total), total, torch.zeros_like(total))


def _all_reduce(group: AxisGroup, x: torch.Tensor) -> torch.Tensor:
    return _wait(_c10d.all_reduce.default(x.contiguous(), "sum", group.name))


def _keep_first(group: AxisGroup, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    return torch.where(_flag(group.coord == 0, x), x, torch.zeros_like(x))


def _all_gather(group: AxisGroup, parts: int, dim: int, groups: int, x: torch.Tensor) -> torch.Tensor:
    """The blocks of all ranks in rank order along dim 0 of a flat buffer (`all_gather_into_tensor`), put
    in place along `dim` as `put_blocks` puts them; contiguous, as the op's fake kernel says."""
    x = x.contiguous()
    gathered = _wait(_c10d.all_gather_into_tensor.default(x.view(-1), parts, group.name))
    return put_in_place(gathered, x.shape, parts, dim, groups, _in_rank_order(x.shape, dim, groups))


def _reduce_scatter(group: AxisGroup, parts: int, dim: int, groups: int, x: torch.Tensor) -> torch.Tensor:
    """The sum's block of this rank (`take_block`): the blocks flattened in rank order through one
    `reduce_scatter_tensor`."""
    x = x.contiguous()
    blocks = rank_ordered(x, parts, dim, groups, _in_rank_order(x.shape, dim, groups))
    summed = _wait(_c10d.reduce_scatter_tensor.default(blocks, "sum", parts, group.name))
    return summed.view(split_dim(x.shape, dim, x.shape[dim] // parts))


class _Coordinate:
    """The part of a `DistComm` that a rank-local record reads: this rank's coordinate on the axis."""

    def __init__(self, coord: int):
        self._coord = coord

    def coord(self, axis: str) -> int:
        return self._coord


def _rank_local(name: str) -> Callable:
    """The record's own `on_process_group` of the rank-local op `name`, at this rank's coordinate, on the
    contiguous input (as `DistComm.run` passes it); its result contiguous, as the op's fake kernel says."""
    record = COLLECTIVES[name]

    def lowering(group: AxisGroup, parts: int, dim: int, groups: int, x: torch.Tensor) -> torch.Tensor:
        out = record.on_process_group(_Coordinate(group.coord), x.contiguous(), "", parts, dim, groups)
        return out.contiguous()

    lowering.__name__ = f"_{name}"
    return lowering


def _in_rank_order(shape, dim: int, groups: int) -> bool:
    """`in_rank_order`; of a symbolic shape, where that is known without a guard (else False: the
    general path, right for every shape)."""
    if all(isinstance(size, int) for size in shape):
        return in_rank_order(shape, dim, groups)
    return groups == 1 and all(statically_known_true(size == 1) for size in shape[:dim])


# Collective -> its lowering `lowering(group, *own_arguments, x)` (the op's arguments after the axis).
LOWERINGS: dict[str, Callable[..., torch.Tensor]] = {
    "broadcast": _broadcast,
    "broadcast_start": _broadcast_start,
    "reduce": _reduce,
    "all_reduce": _all_reduce,
    "all_reduce_alike": _all_reduce,
    "keep_first": _keep_first,
    "keep_first_alike": _keep_first,
    "all_gather": _all_gather,
    "all_gather_alike": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "shard_slice": _rank_local("shard_slice"),
    "shard_pad": _rank_local("shard_pad"),
}
