"""Layout conversions as sequences of collectives (used by the rewrite pass).

Order matters when two axes split one dim (`S(0)S(0)` over depth then row):
splits are undone innermost first and made outermost first, so each rank's
block is always the one DTensor's left-to-right order gives it.

An uneven split (a dim its parts do not divide; `tess_compile.core.layout`)
holds padded blocks: gathering them gives the dim padded at its end, which
is cut back to its true size; a whole dim is padded at its end before it is
split. The collectives themselves always see even splits. Partial sums that
become a split are reduce-scattered (Megatron-LM's sequence-parallel "g"), not
all-reduced and then sliced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.fx import Node

from tess_compile.passes.builder import Builder
from tess_compile.core.layout import Layout, Partial, Replicate, Shard, split_size
from tess_compile.core.mesh import AXES
from tess_compile.ops import collectives as c

__all__ = ["redistribute"]

aten = torch.ops.aten


def redistribute(b: Builder, x: Node, src: Layout, dst: Layout, shape: Sequence[int]) -> Node:
    """Emit the collectives that turn `x`, of global `shape`, from layout `src` into `dst`."""
    if src == dst:
        return x
    if any(isinstance(p, Partial) for p in dst.placements if p not in src.placements):
        raise AssertionError(f"no conversion makes partial sums: {src} -> {dst}")
    current = list(src.placements)
    gather = _axes_to_gather(src, dst)
    for axis in reversed(AXES):
        if axis in gather:
            p = current[AXES.index(axis)]
            x = b.split_op(c.all_gather, x, axis, p.dim, p.groups)
            if shape[p.dim] % b.mesh.size(axis):  # padded at the end: cut back to the true size
                x = b.call(aten.slice.Tensor, x, p.dim, 0, shape[p.dim])
            current[AXES.index(axis)] = Replicate()
    for index, axis in enumerate(AXES):
        if isinstance(current[index], Partial) and not isinstance(dst.on(axis), (Partial, Shard)):
            x = b.collective(c.all_reduce, x, axis)
            current[index] = Replicate()
    for index, axis in enumerate(AXES):
        target = dst.on(axis)
        if isinstance(current[index], (Replicate, Partial)) and isinstance(target, Shard):
            x = _padded_to_split(b, x, target.dim, shape, b.mesh.size(axis))
            op = c.reduce_scatter if isinstance(current[index], Partial) else c.shard_slice
            x = b.split_op(op, x, axis, target.dim, target.groups)
            current[index] = target
    return x


def _padded_to_split(b: Builder, x: Node, dim: int, shape: Sequence[int], parts: int) -> Node:
    """`x`, whole along `dim` (of its true size), padded at the end to a multiple of `parts`."""
    missing = split_size(shape[dim], parts) * parts - shape[dim]
    if not missing:
        return x
    return b.call(aten.constant_pad_nd.default, x, [0, 0] * (len(shape) - 1 - dim) + [0, missing])


def _axes_to_gather(src: Layout, dst: Layout) -> list[str]:
    """Axes whose split must be undone: changed ones, and inner axes splitting a dim
    that an outer axis gathers or re-splits."""
    gather: list[str] = []
    touched: set[int] = set()
    for axis in AXES:
        p, target = src.on(axis), dst.on(axis)
        if isinstance(p, Shard) and (p != target or p.dim in touched):
            gather.append(axis)
            touched.add(p.dim)
        if isinstance(target, Shard) and p != target:
            touched.add(target.dim)
    return gather
