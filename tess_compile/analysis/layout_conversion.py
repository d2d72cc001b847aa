"""What laying a model's weights out anew costs: the bytes each rank must receive to go from one
program's parameter layouts to another's, and the time that takes on a cluster.

A module trained in SUMMA's layout (its batch over depth and row) decodes fastest in the
weight-stationary layout (`batch_split="depth"`, docs/generation.md), whose weights are laid out
otherwise. Converting them once for serving moves, per parameter, what a rank's new block holds
that its old block does not: the block's elements minus the overlap of the two blocks. Each
split dim of a layout takes a set of indices of that dim (`local_block` of the dim's indices), and
a block is the product of its dims' sets, so the overlap is the product of the dims' common
indices. A rank receives its missing elements from the ranks that hold them; the time is priced
as one transfer per parameter over the slowest link among the axes whose placement changes (its
latency plus the bytes over its bandwidth), on the rank that receives the most.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from tess_compile.core.cluster import Cluster
from tess_compile.core.layout import Layout, Replicate, Shard, local_block
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.program import Program

__all__ = ["Conversion", "conversion_cost", "pays_back_after"]


@dataclass(frozen=True)
class Conversion:
    """Laying the weights out anew: the most bytes one rank receives, and the priced seconds (that
    rank's, the slowest); `parameters` of them change layout."""

    bytes: int = 0
    seconds: float = 0.0
    parameters: int = 0


def conversion_cost(source: Program, target: Program, cluster: Cluster) -> Conversion:
    """The cost of going from `source`'s parameter layouts to `target`'s (same model, same mesh); see the
    module docstring. ValueError if a parameter of `target` is missing from `source`."""
    mesh, held = target.mesh, {slot.name: slot for slot in source.params}
    received = [0] * mesh.num_ranks
    seconds = [0.0] * mesh.num_ranks
    changed = 0
    for slot in target.params:
        old = held.get(slot.name)
        if old is None:
            raise ValueError(f"conversion_cost: parameter {slot.name!r} of the target program is not one of the "
                             f"source program's on mesh {mesh}: compare two programs of the same model")
        if old.layout == slot.layout:
            continue
        changed += 1
        link = _slowest_link(old.layout, slot.layout, mesh, cluster)
        size = torch.empty((), dtype=slot.dtype).element_size()
        for rank in range(mesh.num_ranks):
            missing = _missing(tuple(slot.shape), old.layout, slot.layout, mesh, rank) * size
            received[rank] += missing
            seconds[rank] += link.latency + missing / link.bandwidth if missing else 0.0
    return Conversion(max(received), max(seconds), changed)


def _missing(shape: tuple[int, ...], old: Layout, new: Layout, mesh: Mesh, rank: int) -> int:
    """Elements of `rank`'s block under `new` that its block under `old` does not hold."""
    block, overlap = 1, 1
    for dim, size in enumerate(shape):
        wanted, had = (_indices(layout, dim, size, mesh, rank) for layout in (new, old))
        block *= len(wanted)
        overlap *= len(wanted & had)
    return block - overlap


@functools.lru_cache(maxsize=4096)
def _indices(layout: Layout, dim: int, size: int, mesh: Mesh, rank: int) -> frozenset[int]:
    """The indices of `dim` (of `size`) that `rank`'s block under `layout` holds."""
    placements = [Shard(0, p.groups) if isinstance(p, Shard) and p.dim == dim else Replicate()
                  for p in layout.placements]
    return frozenset(local_block(torch.arange(size), Layout(*placements), mesh, rank).tolist())


def _slowest_link(old: Layout, new: Layout, mesh: Mesh, cluster: Cluster):
    """The link of least bandwidth among the axes (of more than one rank) whose placement changes."""
    links = [cluster.link(mesh, axis) for axis in AXES if mesh.size(axis) > 1 and old.on(axis) != new.on(axis)]
    if not links:  # the same blocks under another name (a split moved to another axis of one rank)
        links = [cluster.link(mesh, axis) for axis in AXES if mesh.size(axis) > 1] or [cluster.link(mesh, AXES[0])]
    return min(links, key=lambda link: (link.bandwidth, -link.latency))


def pays_back_after(conversion_s: float, saved_s_per_step: float, tokens_per_step: int) -> float:
    """Tokens generated before a conversion of `conversion_s` seconds is paid for by steps each
    `saved_s_per_step` faster, each of `tokens_per_step` tokens; inf where no step is faster."""
    if saved_s_per_step <= 0:
        return math.inf
    return math.ceil(conversion_s / saved_s_per_step) * tokens_per_step
