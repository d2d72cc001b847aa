"""The [q, q, d] device mesh: sizes, coordinates, ranks and peers.

Coordinates are `(k, i, j)`: depth `k`, row `i`, column `j`; the global rank
is `k*q*q + i*q + j`, exactly the rank order of a DeviceMesh of shape
`(d, q, q)` named `("depth", "row", "col")`. A collective *along* an axis
spans the ranks that differ only in that axis's coordinate.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AXES", "Mesh", "check_mesh"]

AXES = ("depth", "row", "col")


def check_mesh(q: int, d: int) -> None:
    """Raise ValueError unless `q >= 1` and `1 <= d <= q` are integers."""
    if not isinstance(q, int) or not isinstance(d, int) or q < 1 or d < 1:
        raise ValueError(
            f"mesh [q={q!r}, q={q!r}, d={d!r}] is not valid: q and d must be "
            "positive integers, e.g. q=2, d=2 for 8 ranks"
        )
    if d > q:
        raise ValueError(
            f"mesh [q={q}, q={q}, d={d}] has depth d={d} > q={q}: Tesseract "
            f"needs 1 <= d <= q; use d <= {q}, or q >= {d}"
        )


@dataclass(frozen=True)
class Mesh:
    """Sizes and rank arithmetic of a `[q, q, d]` mesh."""

    q: int
    d: int

    def __post_init__(self) -> None:
        check_mesh(self.q, self.d)

    @property
    def num_ranks(self) -> int:
        return self.q * self.q * self.d

    @property
    def shape(self) -> tuple[int, int, int]:
        """Sizes in DeviceMesh order (depth, row, col)."""
        return (self.d, self.q, self.q)

    def size(self, axis: str) -> int:
        return self.shape[AXES.index(axis)]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """`(k, i, j)` of a global rank."""
        q = self.q
        return (rank // (q * q), (rank // q) % q, rank % q)

    def rank(self, k: int, i: int, j: int) -> int:
        return k * self.q * self.q + i * self.q + j

    def coord(self, rank: int, axis: str) -> int:
        return self.coords(rank)[AXES.index(axis)]

    def peer(self, rank: int, axis: str, index: int) -> int:
        """The rank that differs from `rank` only in `axis`, where it is `index`."""
        coords = list(self.coords(rank))
        coords[AXES.index(axis)] = index
        return self.rank(*coords)

    def group(self, rank: int, axis: str) -> list[int]:
        """Ranks of the collective along `axis` through `rank`, by coordinate."""
        return [self.peer(rank, axis, t) for t in range(self.size(axis))]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, each ordered by coordinate."""
        return [self.group(r, axis) for r in range(self.num_ranks) if self.coord(r, axis) == 0]

    def __str__(self) -> str:
        return f"[q={self.q}, q={self.q}, d={self.d}]"
