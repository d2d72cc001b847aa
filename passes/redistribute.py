"""Layout conversions as sequences of collectives (used by the rewrite pass).

Order matters when two axes split one dim (`S(0)S(0)` over depth then row):
splits are undone innermost first and made outermost first, so each rank's
block is always the one DTensor's left-to-right order gives it.
"""

from __future__ import annotations

from torch.fx import Node

from passes.builder import Builder
from tess_compile.core.layout import Layout, Partial, Replicate, Shard
from tess_compile.core.mesh import AXES
from tess_compile.ops import collectives as c

__all__ = ["redistribute"]


def redistribute(b: Builder, x: Node, src: Layout, dst: Layout) -> Node:
    """Emit the collectives that turn `x` from layout `src` into `dst`."""
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
            current[AXES.index(axis)] = Replicate()
    for index, axis in enumerate(AXES):
        if isinstance(current[index], Partial) and not isinstance(dst.on(axis), Partial):
            x = b.collective(c.all_reduce, x, axis)
            current[index] = Replicate()
    for index, axis in enumerate(AXES):
        target = dst.on(axis)
        if isinstance(current[index], Replicate) and isinstance(target, Shard):
            x = b.split_op(c.shard_slice, x, axis, target.dim, target.groups)
            current[index] = target
    return x


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
