"""The communicator of one rank over torch.distributed: the per-rank graph's collectives.

Each collective names the mesh axis it spans and runs on that axis's process
group (`tess_compile.runtime.groups`): gloo on CPU, NCCL on CUDA. A collective
that cannot complete (a peer stopped, or took another path) fails after the
module's timeout with a message that names the op, the axis, this rank and
its peers.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist

from tess_compile.core.layout import put_blocks, take_block
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.ops.collectives import Comm

__all__ = ["DistComm", "in_rank_order"]


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """torch 2.13's `all_gather_single`; the GPU machines' older torch has it only as
    `all_gather_into_tensor` (its deprecated name in 2.13)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """torch 2.13's `reduce_scatter_single` (`reduce_scatter_tensor` before)."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


class DistComm(Comm):
    """Collectives of this rank over the mesh's process groups.

    `device_mesh` is the `(depth, row, col)` DeviceMesh (with `shard(..., mesh=...)`,
    the tensor-parallel submesh of the user's mesh): this rank's coordinates,
    hence `rank` (its rank within the tensor-parallel group), come from it, not
    from the global rank. `groups` (axis -> process group) overrides its groups.
    """

    def __init__(self, mesh: Mesh, device_mesh, timeout: timedelta, groups: dict | None = None):
        super().__init__()
        self.mesh = mesh
        self.timeout = timeout
        self.rank = mesh.rank(*device_mesh.get_coordinate())
        self.global_ranks = device_mesh.mesh.flatten().tolist()  # global rank of each tensor-parallel rank
        self.groups = groups or {axis: device_mesh.get_group(axis) for axis in AXES}
        self.pending: dict[int, tuple] = {}  # storage pointer -> (work, axis) of a broadcast_start

    def run(self, op: str, x: torch.Tensor, axis: str, *args) -> torch.Tensor:
        self.record(op, axis, x)
        try:
            return getattr(self, "_" + op)(x.contiguous(), axis, *args)
        except RuntimeError as err:
            raise self._failure(op, axis, err) from err

    def _failure(self, op: str, axis: str, err: RuntimeError) -> RuntimeError:
        """A collective's failure or timeout, told with the rank, the axis and the peers."""
        peers = [self.global_ranks[r] for r in self.mesh.group(self.rank, axis)]
        return RuntimeError(
            f"tess collective {op} along {axis} failed on rank {self.global_ranks[self.rank]} "
            f"{self.mesh.coords(self.rank)} of mesh {self.mesh} (peers {peers}): a peer rank stopped, "
            f"or did not reach the same collective within {self.timeout.total_seconds():g}s "
            f"(tess_compile.shard(..., timeout=...)). Cause: {err}"
        )

    def _coord(self, axis: str) -> int:
        return self.mesh.coord(self.rank, axis)

    def _broadcast(self, x, axis, src):
        out = x.clone()
        dist.broadcast(out, group=self.groups[axis], group_src=src)
        return out

    def _broadcast_start(self, x, axis, src):
        out = x.clone()
        work = dist.broadcast(out, group=self.groups[axis], group_src=src, async_op=True)
        self.pending[out.untyped_storage().data_ptr()] = (work, axis)
        return out

    def wait(self, x: torch.Tensor) -> torch.Tensor:
        work, axis = self.pending.pop(x.untyped_storage().data_ptr(), (None, None))
        if work is not None:
            try:
                work.wait()
            except RuntimeError as err:
                raise self._failure("broadcast_start", axis, err) from err
        return x

    def _reduce(self, x, axis, dst):
        out = x.clone()
        dist.reduce(out, group=self.groups[axis], group_dst=dst)
        return out if self._coord(axis) == dst else torch.zeros_like(x)

    def _all_reduce(self, x, axis):
        out = x.clone()
        dist.all_reduce(out, group=self.groups[axis])
        return out

    def _keep_first(self, x, axis):
        return x.clone() if self._coord(axis) == 0 else torch.zeros_like(x)

    def _all_gather(self, x, axis, parts, dim, groups):
        """One `all_gather_single` of the flattened blocks (NCCL's native all-gather into
        one tensor; gloo takes only the concatenated form), put in place by one copy."""
        flat = x.reshape(-1)
        gathered = flat.new_empty(parts * flat.numel())
        _all_gather_single(gathered, flat, group=self.groups[axis])
        shape = _split_dim(x.shape, dim, parts * x.shape[dim])
        if in_rank_order(x.shape, dim, groups):
            return gathered.view(shape)
        # Rank t's block [.., groups, n, ..] goes to [.., groups, t, n, ..], as `put_blocks` puts it;
        # contiguous, as the op's fake kernel says (where the reshape is a view, it is not).
        blocks = gathered.view(parts, *_split_dim(x.shape, dim, groups, x.shape[dim] // groups))
        return blocks.movedim(0, dim + 1).reshape(shape).contiguous()

    def _reduce_scatter(self, x, axis, parts, dim, groups):
        """One `reduce_scatter_single` of the blocks (`take_block`'s) flattened in rank order (NCCL's
        native call): one copy puts them in that order, none if they are in it already."""
        shape = _split_dim(x.shape, dim, x.shape[dim] // parts)
        if in_rank_order(x.shape, dim, groups):
            blocks = x.reshape(-1)
        else:
            split = _split_dim(x.shape, dim, groups, parts, x.shape[dim] // (groups * parts))
            blocks = x.view(split).movedim(dim + 1, 0).reshape(-1)
        out = x.new_empty(blocks.numel() // parts)
        _reduce_scatter_single(out, blocks, group=self.groups[axis])
        return out.view(shape)

    def _shard_slice(self, x, axis, parts, dim, groups):
        return take_block(x, dim, groups, parts, self._coord(axis)).clone()

    def _shard_pad(self, x, axis, parts, dim, groups):
        coord = self._coord(axis)
        return put_blocks([x if t == coord else torch.zeros_like(x) for t in range(parts)], dim, groups)


def in_rank_order(shape: torch.Size, dim: int, groups: int) -> bool:
    """Whether a contiguous tensor of `shape` is its blocks along `dim` (`take_block`) concatenated in
    index order: no groups, and every dim before `dim` of size 1. Then the flat buffer of an
    all-gather is its result and a reduce-scatter sends the tensor as it is."""
    return groups == 1 and math.prod(shape[:dim]) == 1


def _split_dim(shape: torch.Size, dim: int, *sizes: int) -> list[int]:
    """`shape` with `sizes` in place of its size along `dim`."""
    return [*shape[:dim], *sizes, *shape[dim + 1:]]
