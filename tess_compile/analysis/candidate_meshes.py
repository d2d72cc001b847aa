"""The meshes a planner prices: every mesh of a GPU count in the modes asked for, and their labels.

`candidate_meshes(gpus, modes)` lists the 1-D, 2-D, 2.5-D and 3-D meshes of exactly `gpus`
ranks (a 2.5-D mesh that equals a 2-D or 3-D one is left out when that mode is asked for);
`mesh_label` and `mesh_sides` give a mesh in the paper's notation (`[64]`, `[q, q, d]`).
`tess_compile.analysis.planner` prices them and re-exports these names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tess_compile.core.mesh import MODES, Mesh

__all__ = ["DEFAULT_MODES", "candidate_meshes", "mesh_label", "mesh_sides"]

DEFAULT_MODES = ("1d", "2d", "2.5d")


def mesh_label(mesh: Mesh) -> str:
    """The paper's notation: `[64]` for 1-D, `[q, q, d]` otherwise."""
    return str(mesh_sides(mesh))


def mesh_sides(mesh: Mesh) -> list[int]:
    """The sides in the paper's notation: `[64]` for 1-D, `[q, q, d]` otherwise."""
    if mesh.mode == "1d":
        return [mesh.num_ranks]
    return [mesh.q, mesh.q, mesh.d]


def candidate_meshes(gpus: int, modes: Sequence[str] = DEFAULT_MODES) -> list[Mesh]:
    """Every mesh of exactly `gpus` ranks in `modes`, in the order of `modes`.

    1d: `Mesh(1, gpus, "1d")`; 2d: `q*q == gpus`; 3d: `q**3 == gpus`;
    2.5d: `q*q*d == gpus`, `1 <= d <= q`, leaving out `d == 1` when "2d" is
    in `modes` and `d == q` when "3d" is (the same programs).
    """
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r}: use a positive integer number of GPUs, e.g. 64")
    if isinstance(modes, str) or not modes:
        raise ValueError(f"modes={modes!r}: pass a non-empty sequence of modes, e.g. ('1d', '2d', '2.5d')")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(map(repr, MODES))}: "
                             "pick modes from those, e.g. ('1d', '2d', '2.5d')")
    meshes = []
    for mode in dict.fromkeys(modes):  # each mode once, in order
        meshes.extend(_meshes_of(mode, gpus, modes))
    if not meshes:
        raise ValueError(f"no mesh of {gpus} GPUs in modes {', '.join(modes)}: 2d needs a square number "
                         f"(q*q), 3d a cube, 2.5d q*q*d with d <= q; use {_near(gpus, modes)} GPUs, or add mode '1d'")
    return meshes


def _meshes_of(mode: str, gpus: int, modes: Sequence[str]) -> list[Mesh]:
    if mode == "1d":
        return [Mesh(1, gpus, "1d")]
    out = []
    for q in range(1, math.isqrt(gpus) + 1):
        d, rest = divmod(gpus, q * q)
        if rest or d > q:
            continue
        if mode == "2d" and d != 1 or mode == "3d" and d != q:
            continue
        if mode == "2.5d" and (d == 1 and "2d" in modes or d == q and "3d" in modes):
            continue
        out.append(Mesh(q, d, mode))
    return out


def _near(gpus: int, modes: Sequence[str]) -> str:
    """The nearest GPU counts below and above `gpus` that some mesh of `modes` takes, as text."""
    def fits(n: int) -> bool:
        return any(_meshes_of(mode, n, modes) for mode in modes)

    below = next((n for n in range(gpus, 0, -1) if fits(n)), None)
    above = next(n for n in range(gpus, 8 * gpus + 1) if fits(n))  # a cube lies in [g, 8g]
    return str(above) if below is None or below == above else f"{below} or {above}"
