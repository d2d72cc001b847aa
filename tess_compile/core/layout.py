"""Layouts: how one tensor is spread over the (depth, row, col) mesh axes.

A layout holds one placement per mesh axis, in DTensor's notation:
`R` (replicated), `S(dim)` (split along a tensor dim) or `P` (partial sums).
Splits apply left to right, as DTensor's do: with `S(0)S(0)S(2)` the batch
block of rank `(k, i, j)` is block `k*q + i`.

`S(dim)` may carry `groups`: the dim is viewed as `[groups, parts, rest]`
and the `parts` factor is split. A fused QKV output `[.., 3h]` laid out
`S(2, groups=3)` over `col` gives column `j` the heads of q, k and v alike.

A plain split of a dim that its parts do not divide (GPT-2's vocabulary of
50257 over 2) is uneven, as torch.chunk and DTensor split: blocks of
`split_size(size, parts) = ceil(size / parts)`, the last ones short or empty.
Rank `t`'s true block (`local_block`, what the runtimes store) is its chunk;
in the per-rank program every block has the full size, the short ones padded
at the end (`pad_block`, `unpad_block`), so that every rank runs the same
shapes. Gathering the padded blocks gives the tensor with its padding at the
end of the dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

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
    "chunk",
    "in_rank_order",
    "local_block",
    "ordering",
    "pad_block",
    "placing",
    "put_blocks",
    "put_in_place",
    "rank_ordered",
    "split_dim",
    "split_size",
    "take_block",
    "unpad_block",
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
        """The shape each rank's block of a tensor of global `shape` has in the per-rank program
        (an uneven split's blocks padded to the full block size)."""
        local = list(shape)
        for axis in AXES:
            placement = self.on(axis)
            if isinstance(placement, Shard):
                local[placement.dim] = split_size(local[placement.dim], mesh.size(axis))
        return local

    def uneven_dims(self, shape: Sequence[int], mesh: Mesh) -> list[int]:
        """The dims of a tensor of global `shape` that this layout splits unevenly."""
        local, dims = list(shape), []
        for axis in AXES:
            placement = self.on(axis)
            if isinstance(placement, Shard) and local[placement.dim] % mesh.size(axis):
                dims.append(placement.dim)
            if isinstance(placement, Shard):
                local[placement.dim] = split_size(local[placement.dim], mesh.size(axis))
        return dims

    def unfit_axes(self, shape: Sequence[int], mesh: Mesh) -> list[str]:
        """The axes whose split does not fit a tensor of global `shape`: a split of a dim it lacks, or
        an uneven one (its blocks padded) that is grouped or shares its dim with another split."""
        local, unfit = list(shape), []
        for axis in AXES:
            placement = self.on(axis)
            if not isinstance(placement, Shard):
                continue
            if placement.dim >= len(local):
                unfit.append(axis)
                continue
            parts = mesh.size(axis)
            stacked = sum(isinstance(p, Shard) and p.dim == placement.dim for p in self.placements) > 1
            if local[placement.dim] % (parts * placement.groups) and (placement.groups > 1 or stacked):
                unfit.append(axis)
            local[placement.dim] = split_size(local[placement.dim], parts)
        return unfit

    def chunk_shape(self, shape: Sequence[int], mesh: Mesh, rank: int) -> list[int]:
        """The shape of `rank`'s true block of a tensor of global `shape` (`local_block`'s)."""
        local = list(shape)
        for axis in AXES:
            placement = self.on(axis)
            if isinstance(placement, Shard) and mesh.size(axis) > 1:
                size, parts, index = local[placement.dim], mesh.size(axis), mesh.coord(rank, axis)
                block = split_size(size, parts)
                local[placement.dim] = max(0, min(block, size - index * block))
        return local

    def __str__(self) -> str:
        return "".join(str(p) for p in self.placements)


def split_size(size: int, parts: int) -> int:
    """The block size of a dim of `size` split in `parts`: ceil(size / parts), as torch.chunk's."""
    return -(-size // parts)


def chunk(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Chunk `index` of `parts` along `dim`, as torch.chunk cuts it (the last short or empty)."""
    size = t.shape[dim]
    block = split_size(size, parts)
    start = min(index * block, size)
    return t.narrow(dim, start, min(block, size - start))


def take_block(t: torch.Tensor, dim: int, groups: int, parts: int, index: int) -> torch.Tensor:
    """Block `index` of `parts` along `dim`, viewed as `[groups, parts, rest]` (even splits: the
    collectives' blocks, of padded tensors)."""
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


def in_rank_order(shape: torch.Size, dim: int, groups: int) -> bool:
    """Whether a contiguous tensor of `shape` is its blocks along `dim` (`take_block`) concatenated in
    index order: no groups, and every dim before `dim` of size 1. Then the flat buffer of an
    all-gather is its result and a reduce-scatter sends the tensor as it is."""
    return groups == 1 and math.prod(shape[:dim]) == 1


def split_dim(shape: torch.Size, dim: int, *sizes: int) -> list[int]:
    """`shape` with `sizes` in place of its size along `dim`."""
    return [*shape[:dim], *sizes, *shape[dim + 1:]]


def put_in_place(gathered: torch.Tensor, block_shape, parts: int, dim: int, groups: int,
                 in_order: bool) -> torch.Tensor:
    """`parts` blocks of `block_shape`, one after another in rank order in the flat `gathered`, put in
    place along `dim` as `put_blocks` puts them; no copy where they are in that order already
    (`in_order`). Rank t's block [.., groups, n, ..] goes to [.., groups, t, n, ..]; the result is
    contiguous, as the all-gather's fake kernel says (where the reshape is a view, it is not)."""
    shape, move = _placed(block_shape, parts, dim, groups)
    return gathered.view(shape) if in_order else move(gathered).reshape(shape).contiguous()


def placing(block_shape, parts: int, dim: int, groups: int, in_order: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """`put_in_place` of blocks of concrete `block_shape` made once, for a collective called many
    times on one shape: a function of a contiguous `gathered`, one strided view of it (found here
    on a meta tensor) copied."""
    shape, move = _placed(block_shape, parts, dim, groups)
    if in_order:
        return lambda gathered: gathered.view(shape)
    return _strided_copy(move, math.prod(shape), shape)


def _placed(block_shape, parts: int, dim: int, groups: int) -> tuple[tuple, Callable[[torch.Tensor], torch.Tensor]]:
    """The shape `put_in_place` gives, and the view of the gathered blocks that puts each in its place
    (rank t's block [.., groups, n, ..] at [.., groups, t, n, ..])."""
    blocks = (parts, *split_dim(block_shape, dim, groups, block_shape[dim] // groups))
    return split_dim(block_shape, dim, parts * block_shape[dim]), lambda t: t.view(blocks).movedim(0, dim + 1)


def rank_ordered(x: torch.Tensor, parts: int, dim: int, groups: int, in_order: bool) -> torch.Tensor:
    """The blocks of contiguous `x` along `dim` (`take_block`'s), flattened one after another in rank
    order; no copy where they are in that order already (`in_order`)."""
    return x.reshape(-1) if in_order else _ordered(x.shape, parts, dim, groups)(x).reshape(-1)


def ordering(shape, parts: int, dim: int, groups: int, in_order: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """`rank_ordered` of contiguous tensors of concrete `shape` made once: a function of `x`, one
    strided view of it (found here on a meta tensor) copied."""
    if in_order:
        return lambda x: x.reshape(-1)
    return _strided_copy(_ordered(shape, parts, dim, groups), math.prod(shape), (-1,))


def _ordered(shape, parts: int, dim: int, groups: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The view of a contiguous tensor of `shape` with its blocks along `dim` first, in rank order."""
    split = split_dim(shape, dim, groups, parts, shape[dim] // (groups * parts))
    return lambda x: x.view(split).movedim(dim + 1, 0)


def _strided_copy(move: Callable, numel: int, shape) -> Callable[[torch.Tensor], torch.Tensor]:
    """`move(t).reshape(shape).contiguous()` for a contiguous `t` of `numel` elements, as one strided
    view of `t` (the one `move` makes, found here on a meta tensor) copied: fewer dispatches a call."""
    moved = move(torch.empty(numel, device="meta"))
    size, stride = tuple(moved.shape), moved.stride()
    return lambda t: torch.as_strided(t, size, stride).reshape(shape).contiguous()


def local_block(full: torch.Tensor, layout: Layout, mesh: Mesh, rank: int) -> torch.Tensor:
    """The part of `full` that `rank` holds under `layout` (a view where possible); of an uneven
    split, the rank's true chunk."""
    out = full
    for axis in AXES:
        placement = layout.on(axis)
        if isinstance(placement, Partial):
            raise ValueError(f"a full tensor cannot be split into partial sums ({layout})")
        if isinstance(placement, Shard) and mesh.size(axis) > 1:
            parts, index = mesh.size(axis), mesh.coord(rank, axis)
            if placement.groups == 1:
                out = chunk(out, placement.dim, parts, index)
            else:
                out = take_block(out, placement.dim, placement.groups, parts, index)
    return out


def pad_block(block: torch.Tensor, layout: Layout, shape: Sequence[int], mesh: Mesh) -> torch.Tensor:
    """A rank's true block padded with zeros at the end of each uneven dim to the block size of the
    per-rank program (differentiable: the gradient is the true part's); the block itself if even."""
    full = layout.local_shape(shape, mesh)
    if list(block.shape) == full:
        return block
    pad = []
    for dim in reversed(range(block.dim())):
        pad += [0, full[dim] - block.shape[dim]]
    return torch.nn.functional.pad(block, pad)


def unpad_block(block: torch.Tensor, layout: Layout, shape: Sequence[int], mesh: Mesh, rank: int) -> torch.Tensor:
    """A per-rank program's block without its padding: `rank`'s true block (inverse of `pad_block`)."""
    true = layout.chunk_shape(shape, mesh, rank)
    for dim, size in enumerate(true):
        if block.shape[dim] != size:
            block = block.narrow(dim, 0, size)
    return block


def assemble(locals_by_rank: Sequence[torch.Tensor], layout: Layout, mesh: Mesh) -> torch.Tensor:
    """The global tensor from every rank's local tensor (inverse of `local_block`).

    Replicated axes take the copy at coordinate 0; partial axes are summed.
    Differentiable: each replica along a replicated axis gets the whole gradient, as each rank
    of a distributed run seeds its own copy (an output's `seed_once` then keeps one seed).
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
            elif torch.is_grad_enabled() and any(m.requires_grad for m in members):
                merged[rank] = _FirstReplica.apply(*members)
            else:
                merged[rank] = members[0]
        current = merged
    return current[0]


class _FirstReplica(torch.autograd.Function):
    """The first of a replicated axis's copies; its gradient goes to every copy whole."""

    @staticmethod
    def forward(ctx, *members):
        ctx.copies = len(members)
        return members[0].view_as(members[0])

    @staticmethod
    def backward(ctx, grad):
        return (grad,) * ctx.copies
