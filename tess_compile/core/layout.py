"""Layouts: how one tensor is spread over the (depth, row, col) mesh axes.

A layout holds one placement per mesh axis, in DTensor's notation:
`R` (replicated), `S(dim)` (split along a tensor dim) or `P` (partial sums).
Splits apply left to right, as DTensor's do: with `S(0)S(0)S(2)` the batch
block of rank `(k, i, j)` is block `k*q + i`.

`S(dim)` may carry `groups`: the dim is viewed as `[groups, parts, rest]`
and the `parts` factor is split. A fused QKV output `[.., 3h]` laid out
`S(2, groups=3)` over `col` gives column `j` the heads of q, k and v alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed import tensor as dt

from tess_compile.core.mesh import AXES, Mesh

__all__ = [
    "Layout",
    "P",
    "Partial",
    "Placement",
    "R",
    "Replicate",
    "Shard",
    "assemble",
    "local_block",
    "put_blocks",
    "take_block",
]


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Each rank holds a summand; the value is the sum over the axis."""

    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class Shard:
    dim: int
    groups: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.groups == 1 else f"S({self.dim},g={self.groups})"


Placement = Replicate | Shard | Partial


R = Replicate()


P = Partial()


@dataclass(frozen=True)
class Layout:
    """One placement per mesh axis, in the order depth, row, col."""

    depth: Placement
    row: Placement
    col: Placement

    @staticmethod
    def replicated() -> Layout:
        return Layout(R, R, R)

    @property
    def placements(self) -> tuple[Placement, Placement, Placement]:
        return (self.depth, self.row, self.col)

    def on(self, axis: str) -> Placement:
        return self.placements[AXES.index(axis)]

    def with_axis(self, axis: str, placement: Placement) -> Layout:
        placements = list(self.placements)
        placements[AXES.index(axis)] = placement
        return Layout(*placements)

    def axes_where(self, kind: type, mesh: Mesh) -> list[str]:
        """Axes of size > 1 whose placement is of `kind`."""
        return [a for a in AXES if isinstance(self.on(a), kind) and mesh.size(a) > 1]

    def local_shape(self, shape: Sequence[int], mesh: Mesh) -> list[int]:
        """The shape each rank holds of a tensor of global `shape`."""
        local = list(shape)
        for axis in AXES:
            placement = self.on(axis)
            if isinstance(placement, Shard):
                local[placement.dim] //= mesh.size(axis)
        return local

    def to_dtensor(self) -> tuple:
        """The DTensor placements of a layout without groups."""

        def convert(p):
            if isinstance(p, Shard):
                if p.groups != 1:
                    raise ValueError(f"layout {self} has a grouped split, which DTensor cannot express")
                return dt.Shard(p.dim)
            return dt.Partial() if isinstance(p, Partial) else dt.Replicate()

        return tuple(convert(p) for p in self.placements)

    def __str__(self) -> str:
        return "".join(str(p) for p in self.placements)


def take_block(t: torch.Tensor, dim: int, groups: int, parts: int, index: int) -> torch.Tensor:
    """Block `index` of `parts` along `dim`, viewed as `[groups, parts, rest]`."""
    if groups == 1:
        size = t.shape[dim] // parts
        return t.narrow(dim, index * size, size)
    return t.unflatten(dim, (groups, parts, -1)).select(dim + 1, index).flatten(dim, dim + 1)


def put_blocks(blocks: Sequence[torch.Tensor], dim: int, groups: int) -> torch.Tensor:
    """Inverse of `take_block` over all indices: the blocks in index order."""
    if groups == 1:
        return torch.cat(list(blocks), dim=dim)
    grouped = [b.unflatten(dim, (groups, -1)) for b in blocks]
    return torch.stack(grouped, dim=dim + 1).flatten(dim, dim + 2)


def local_block(full: torch.Tensor, layout: Layout, mesh: Mesh, rank: int) -> torch.Tensor:
    """The part of `full` that `rank` holds under `layout` (a view where possible)."""
    out = full
    for axis in AXES:
        placement = layout.on(axis)
        if isinstance(placement, Partial):
            raise ValueError(f"a full tensor cannot be split into partial sums ({layout})")
        if isinstance(placement, Shard) and mesh.size(axis) > 1:
            out = take_block(out, placement.dim, placement.groups, mesh.size(axis), mesh.coord(rank, axis))
    return out


def assemble(locals_by_rank: Sequence[torch.Tensor], layout: Layout, mesh: Mesh) -> torch.Tensor:
    """The global tensor from every rank's local tensor (inverse of `local_block`).

    Replicated axes take the copy at coordinate 0; partial axes are summed.
    Differentiable: gradients flow back to the locals that were used.
    """
    current = dict(enumerate(locals_by_rank))
    for axis in reversed(AXES):
        placement, size = layout.on(axis), mesh.size(axis)
        merged = {}
        for rank in current:
            if mesh.coord(rank, axis) != 0:
                continue
            members = [current[mesh.peer(rank, axis, t)] for t in range(size)]
            if isinstance(placement, Shard):
                merged[rank] = put_blocks(members, placement.dim, placement.groups)
            elif isinstance(placement, Partial):
                merged[rank] = torch.stack(members).sum(0)
            else:
                merged[rank] = members[0]
        current = merged
    return current[0]
