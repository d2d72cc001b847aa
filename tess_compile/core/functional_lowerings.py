"""Each collective of the per-rank graph as torch's functional collectives: the records' `functional`.

A compiled program under a process group (`shard(..., compile=True)`) has its `tess::` collectives
replaced by these (`tess_compile.runtime.functional_collectives.lower_collectives`), traced into the
forward and backward graphs that inductor compiles. A lowering `lowering(group, *own, x)` takes this
rank's `AxisGroup` of the collective's axis, the op's own arguments (after the axis) and its input,
and gives exactly what the record's `on_process_group` gives on this rank:

- broadcast: `broadcast(x, src)`, `src` the group rank, which is the coordinate along the axis (the
  axis's group lists its ranks in coordinate order, as `group_src` of the eager call assumes).
- broadcast_start: the same broadcast without its wait; each `tess::wait` of it becomes
  `wait_tensor`, so the broadcast is in flight until then.
- reduce: torch has no functional reduce. An `all_reduce`, whose sum every rank receives; the
  destination keeps it, the others take zeros, as the eager reduce leaves them. It moves more bytes
  than a reduce (ring: 2(g-1)/g of the tensor against 1), the price of a collective inductor can see.
- all_reduce: `all_reduce(x, "sum")`.
- all_gather / reduce_scatter: `all_gather_into_tensor` / `reduce_scatter_tensor` of the blocks in
  rank order (flattened, as the eager calls send them), put in place along `dim`, with `groups`
  interleaved blocks (`put_blocks`, `take_block`).
- keep_first, shard_slice, shard_pad: rank-local, with this rank's coordinate on the axis, a
  constant of the process; shard_slice and shard_pad run the record's own function (`rank_local`).
- all_gather_alike, all_reduce_alike, keep_first_alike: as all_gather, all_reduce and keep_first
  (they differ in their adjoints only).
- grad_sync, seed_once, sum_shares and identity have none: they are identities in forward, which
  AOTAutograd traces away, and their backward is another record's op.

Every rank's lowered graph has the same ops; ranks differ only in constants (group names,
coordinates, which rank keeps a sum: a `where` on a constant flag), so inductor schedules them alike.
Results are contiguous, as the ops' fake kernels say.

Layer: core, beside the records (`tess_compile.core.collective_table`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from tess_compile.core.layout import in_rank_order, put_in_place, rank_ordered, split_dim

__all__ = ["AxisGroup", "all_gather", "all_reduce", "broadcast", "broadcast_start", "keep_first", "rank_local",
           "reduce", "reduce_scatter"]

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class AxisGroup:
    """This rank's process group along one mesh axis: its name (`ProcessGroup.group_name`, as the
    functional collectives address it), its size, and this rank's coordinate on the axis (its rank in
    the group)."""

    name: str
    size: int
    coord: int


def _flag(value: bool, like: torch.Tensor) -> torch.Tensor:
    """A boolean scalar tensor holding the constant `value` (a `where` on it keeps every rank's graph alike)."""
    return torch.full((), value, dtype=torch.bool, device=like.device)


def _wait(x: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor.default(x)


def broadcast(group: AxisGroup, src: int, x: torch.Tensor) -> torch.Tensor:
    return _wait(_c10d.broadcast.default(x.contiguous(), src, group.name))


def broadcast_start(group: AxisGroup, src: int, x: torch.Tensor) -> torch.Tensor:
    """The broadcast in flight: its `tess::wait`s wait for it (`lower_collectives` takes this lowering
    only for a contiguous input that nothing but waits reads)."""
    return _c10d.broadcast.default(x, src, group.name)


def reduce(group: AxisGroup, dst: int, x: torch.Tensor) -> torch.Tensor:
    total = _wait(_c10d.all_reduce.default(x.contiguous(), "sum", group.name))
    # Every rank reads the sum (so dead-code elimination keeps the collective); all but `dst` take zeros.
    return torch.where(_flag(group.coord == dst, total), total, torch.zeros_like(total))


def all_reduce(group: AxisGroup, x: torch.Tensor) -> torch.Tensor:
    return _wait(_c10d.all_reduce.default(x.contiguous(), "sum", group.name))


def keep_first(group: AxisGroup, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    return torch.where(_flag(group.coord == 0, x), x, torch.zeros_like(x))


def all_gather(group: AxisGroup, parts: int, dim: int, groups: int, x: torch.Tensor) -> torch.Tensor:
    """The blocks of all ranks in rank order along dim 0 of a flat buffer (`all_gather_into_tensor`), put
    in place along `dim` as `put_blocks` puts them; contiguous, as the op's fake kernel says."""
    x = x.contiguous()
    gathered = _wait(_c10d.all_gather_into_tensor.default(x.view(-1), parts, group.name))
    return put_in_place(gathered, x.shape, parts, dim, groups, _in_rank_order(x.shape, dim, groups))


def reduce_scatter(group: AxisGroup, parts: int, dim: int, groups: int, x: torch.Tensor) -> torch.Tensor:
    """The sum's block of this rank (`take_block`): the blocks flattened in rank order through one
    `reduce_scatter_tensor`."""
    x = x.contiguous()
    blocks = rank_ordered(x, parts, dim, groups, _in_rank_order(x.shape, dim, groups))
    summed = _wait(_c10d.reduce_scatter_tensor.default(blocks, "sum", parts, group.name))
    return summed.view(split_dim(x.shape, dim, x.shape[dim] // parts))


class _Coordinate:
    """The part of a communicator that a rank-local record reads: this rank's coordinate on the axis."""

    def __init__(self, coord: int):
        self._coord = coord

    def coord(self, axis: str) -> int:
        return self._coord


def rank_local(on_process_group: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The lowering of a rank-local split op: its record's own `on_process_group`, at this rank's
    coordinate, on the contiguous input (as `DistComm.run` passes it); its result contiguous."""

    def lowering(group: AxisGroup, parts: int, dim: int, groups: int, x: torch.Tensor) -> torch.Tensor:
        return on_process_group(_Coordinate(group.coord), "", parts, dim, groups)(x.contiguous()).contiguous()

    lowering.__name__ = on_process_group.__name__
    return lowering


def _in_rank_order(shape, dim: int, groups: int) -> bool:
    """`in_rank_order`; of a symbolic shape, where that is known without a guard (else False: the
    general path, right for every shape)."""
    if all(isinstance(size, int) for size in shape):
        return in_rank_order(shape, dim, groups)
    return groups == 1 and all(statically_known_true(size == 1) for size in shape[:dim])
