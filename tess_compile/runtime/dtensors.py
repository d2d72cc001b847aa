"""Layouts as DTensor placements, and the global value of a sharded module's DTensor output.

A layout maps one-to-one onto DTensor placements on the `(depth, row, col)`
mesh; a grouped split `S(dim, g)` is DTensor's `_StridedShard`. `full_tensor`
gathers an output in one all-gather over all ranks, under the module's timeout.
"""

from __future__ import annotations

import torch
from torch.distributed import tensor as dt
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from tess_compile.core.layout import Layout, Partial, Replicate, Shard, assemble, local_block, pad_block, unpad_block
from tess_compile.core.mesh import Mesh
from tess_compile.runtime.groups import world_of

__all__ = ["contiguous_stride", "full_tensor", "layout_of", "placements_of", "tess_mesh"]


def placements_of(layout: Layout) -> tuple:
    """DTensor placements of `layout`. A grouped split `S(dim,g=g)` over n ranks is
    `_StridedShard(dim, split_factor=g)`: both give coordinate i the chunks i, n+i, ...
    of the dim cut into n*g."""

    def convert(placement):
        if isinstance(placement, Shard):
            return dt.Shard(placement.dim) if placement.groups == 1 else _StridedShard(placement.dim, split_factor=placement.groups)
        return dt.Partial() if isinstance(placement, Partial) else dt.Replicate()

    return tuple(convert(p) for p in layout.placements)


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))


def layout_of(placements) -> Layout:
    """The Layout of DTensor placements on the (depth, row, col) mesh (inverse of `placements_of`)."""

    def convert(placement):
        if isinstance(placement, _StridedShard):
            return Shard(placement.dim, groups=placement.split_factor)
        if isinstance(placement, dt.Shard):
            return Shard(placement.dim)
        return Partial() if placement.is_partial() else Replicate()

    return Layout(*(convert(p) for p in placements))


def tess_mesh(device_mesh) -> Mesh | None:
    """The Mesh of a sharded module's DeviceMesh; None for any other DeviceMesh."""
    world = world_of(device_mesh)
    return None if world is None else world.mesh


def full_tensor(x):
    """The global value of `x`, a DTensor output of a sharded module, on every rank.

    One all-gather over all ranks, under the module's timeout (a failure names
    the op and this rank), where `x.full_tensor()` runs one per split dim (on a
    mesh without the flattened axes, one per axis, and torch logs a warning on
    every rank). Differentiable like `x.full_tensor()`: each rank's gradient is
    its block of the (replicated) gradient. A DTensor on another mesh goes
    through `x.full_tensor()`; other values come back as they are.
    """
    if not isinstance(x, DTensor):
        return x
    world = world_of(x.device_mesh)
    if world is None:
        return x.full_tensor()
    return _GatherFull.apply(x.to_local(), world, layout_of(x.placements), tuple(x.shape))


class _GatherFull(torch.autograd.Function):
    """Every rank's local tensor gathered and assembled; backward: this rank's block."""

    @staticmethod
    def forward(ctx, local, world, layout, shape):
        ctx.world, ctx.layout = world, layout
        return gather_blocks(world, local, layout, shape, "full_tensor")

    @staticmethod
    def backward(ctx, grad):
        summed = [Replicate() if isinstance(p, Partial) else p for p in ctx.layout.placements]
        return local_block(grad, Layout(*summed), ctx.world.mesh, ctx.world.rank).contiguous(), None, None, None


def gather_blocks(world, local: torch.Tensor, layout: Layout, shape, op: str) -> torch.Tensor:
    """The global tensor of `shape` from this rank's true block `local` (laid out by `layout`) and
    every other rank's, in one all-gather over `world` (blocks of uneven splits padded to one size
    for it, and cut back)."""
    mesh = world.mesh
    padded = pad_block(local, layout, shape, mesh)
    blocks = world.all_gather(padded, op)
    return assemble([unpad_block(block, layout, shape, mesh, r) for r, block in enumerate(blocks)], layout, mesh)
