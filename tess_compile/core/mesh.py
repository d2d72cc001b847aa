"""The device mesh: sizes, coordinates, ranks and peers, per parallel mode.

Coordinates are `(k, i, j)`: depth `k`, row `i`, column `j`; the global rank
is `k*rows*cols + i*cols + j`, exactly the rank order of a DeviceMesh of
shape `(depth, rows, cols)` named `("depth", "row", "col")`. A collective
*along* an axis spans the ranks that differ only in that axis's coordinate.

Modes (`MODES`) share the three axes:

- `"2.5d"` (Tesseract, the default): shape `(d, q, q)`, `1 <= d <= q`;
- `"2d"` (Optimus): the `d = 1` case; `"3d"`: the `d = q` case;
- `"1d"` (Megatron-LM): all `p = q*q*d` ranks on the col axis, shape
  `(1, 1, p)`, so a 1-D plan uses as many ranks as the `[q, q, d]` one;
  `d` may exceed `q` here, so `q=1, d=p` gives any `p`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AXES", "MODES", "Mesh", "check_mesh", "check_mode", "check_rank"]

AXES = ("depth", "row", "col")


MODES = ("1d", "2d", "2.5d", "3d")


def check_mode(mode: str) -> None:
    """Raise ValueError unless `mode` is one of `MODES`."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(map(repr, MODES))}: use mode='2.5d' (Tesseract), "
                         "'2d' (Optimus, d=1), '3d' (d=q) or '1d' (Megatron-LM over q*q*d ranks)")


def check_mesh(q: int, d: int, mode: str = "2.5d") -> None:
    """Raise ValueError unless `q >= 1` and `1 <= d <= q` are integers that `mode` allows."""
    check_mode(mode)
    if not isinstance(q, int) or not isinstance(d, int) or q < 1 or d < 1:
        raise ValueError(
            f"mesh [q={q!r}, q={q!r}, d={d!r}] is not valid: q and d must be "
            "positive integers, e.g. q=2, d=2 for 8 ranks"
        )
    if d > q and mode != "1d":
        raise ValueError(
            f"mesh [q={q}, q={q}, d={d}] has depth d={d} > q={q}: Tesseract "
            f"needs 1 <= d <= q; use d <= {q}, or q >= {d}"
        )
    if mode == "2d" and d != 1:
        raise ValueError(f"mode '2d' (Optimus) is the d=1 case, got [q={q}, q={q}, d={d}]: use d=1, or mode='2.5d'")
    if mode == "3d" and d != q:
        raise ValueError(f"mode '3d' is the d=q case, got [q={q}, q={q}, d={d}]: use d={q}, or mode='2.5d'")


@dataclass(frozen=True)
class Mesh:
    """Sizes and rank arithmetic of a `[q, q, d]` mesh in one of the `MODES`."""

    q: int
    d: int
    mode: str = "2.5d"

    def __post_init__(self) -> None:
        check_mesh(self.q, self.d, self.mode)

    @property
    def num_ranks(self) -> int:
        return self.q * self.q * self.d

    @property
    def shape(self) -> tuple[int, int, int]:
        """Sizes in DeviceMesh order (depth, row, col)."""
        if self.mode == "1d":
            return (1, 1, self.num_ranks)
        return (self.d, self.q, self.q)

    def size(self, axis: str) -> int:
        return self.shape[AXES.index(axis)]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """`(k, i, j)` of a global rank."""
        _, rows, cols = self.shape
        return (rank // (rows * cols), (rank // cols) % rows, rank % cols)

    def rank(self, k: int, i: int, j: int) -> int:
        _, rows, cols = self.shape
        return k * rows * cols + i * cols + j

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
        if self.mode == "1d":
            return f"1-D [p={self.num_ranks}]"
        return f"[q={self.q}, q={self.q}, d={self.d}]"


def check_rank(rank: int, mesh: Mesh) -> None:
    """ValueError unless `rank` is a rank of `mesh`."""
    if not isinstance(rank, int) or not 0 <= rank < mesh.num_ranks:
        raise ValueError(
            f"rank {rank!r} is not a rank of mesh {mesh}: choose one of 0..{mesh.num_ranks - 1}"
        )
