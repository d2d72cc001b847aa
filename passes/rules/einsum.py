"""Placement rule of einsum: each mesh axis keeps a split of one subscript.

`torch.einsum(equation, *operands)` is linear in each operand, so a split of
one subscript (letter) over a mesh axis can stay where every operand that has
that letter is split alike on it (the operands without it used whole): a
letter of the output keeps its split there, and a letter summed over makes
the output a partial sum over that axis, which its consumers reduce. Per axis
the first operand's split of a letter decides; a split that cannot stay (a
letter an operand repeats, of other sizes in two operands, a grouped split,
or one that would not split its dim evenly, whose padding would enter the
sum) is gathered. An axis that splits no operand (whole values, weights not
laid out yet) splits a letter of them, so that its ranks share the work:
slicing a whole value moves nothing. Every operand arrives without partial sums.
The op runs as it is on the local blocks: the equation does not change.
"""

from __future__ import annotations

import string

from torch.fx import Node

from tess_compile.passes.rules.common import P, R, aten, layout_of, shape_of, without_partial
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import AXES

__all__ = ["FAMILY", "PLACEMENT", "place_einsum", "subscripts"]


def subscripts(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """The letters of each operand and of the output, one a dim, `...` expanded (into upper-case
    letters the equation does not use, right-aligned as broadcasting aligns them)."""
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    unused = [c for c in string.ascii_uppercase if c not in equation]
    ellipsis = max((rank - len(term.replace("...", "")) for term, rank in zip(terms, ranks) if "..." in term),
                   default=0)
    spread = unused[:ellipsis]

    def expand(term: str, rank: int | None = None) -> str:
        count = ellipsis if rank is None else rank - len(term.replace("...", ""))
        return term.replace("...", "".join(spread[len(spread) - count:]))

    letters = [expand(term, rank) for term, rank in zip(terms, ranks)]
    if not arrow:  # implicit: the ellipsis, then the letters used once, in order
        once = sorted(c for c in set("".join(terms).replace(".", "")) if "".join(terms).count(c) == 1)
        output = "..." * bool(ellipsis) + "".join(once)
    return letters, expand(output)


def place_einsum(node: Node, ctx) -> Decision:
    """einsum(equation, operands): see the module docstring."""
    equation, operands = node.args[0], list(node.args[1])
    shapes = [shape_of(t) for t in operands]
    letters, out_letters = subscripts(equation, [len(shape) for shape in shapes])
    layouts = [without_partial(layout_of(ctx, t)) for t in operands]
    local = [list(shape) for shape in shapes]
    needed: list[list] = [[] for _ in operands]
    out = []
    for axis in AXES:
        parts = ctx.mesh.size(axis)
        letter = _kept_letter(axis, layouts, letters, local, parts)
        if letter is None and not any(isinstance(layout.on(axis), Shard) for layout in layouts):
            letter = _fresh_letter(out_letters, letters, local, parts)
        for index, term in enumerate(letters):
            if letter is not None and letter in term:
                dim = term.index(letter)
                needed[index].append(Shard(dim))
                local[index][dim] //= ctx.mesh.size(axis)
            else:
                needed[index].append(R)
        out.append(R if letter is None else Shard(out_letters.index(letter)) if letter in out_letters else P)
    required = {}
    for t, placements in zip(operands, needed):  # an operand given twice needs one layout
        required.setdefault(t, Layout(*placements))
    return Decision(required, Layout(*out))


def _kept_letter(axis: str, layouts: list[Layout], letters: list[str], local: list[list[int]], parts: int):
    """The letter whose split over `axis` stays (see the module docstring), or None."""
    if parts == 1:
        return None
    for layout, term in zip(layouts, letters):
        placement = layout.on(axis)
        if isinstance(placement, Shard) and placement.groups == 1:
            letter = term[placement.dim]
            return letter if _splits(letter, letters, local, parts) else None
    return None


def _fresh_letter(out_letters: str, letters: list[str], local: list[list[int]], parts: int):
    """Where no operand is split over an axis (whole values, free weights): a letter to split, so that
    the axis's ranks share the work instead of repeating it; the output's last letters first (no sum
    to reduce after; a weight's out features, as Megatron's column-parallel layers split them), then
    the summed ones. None if none splits."""
    summed = [letter for term in letters for letter in reversed(term) if letter not in out_letters]
    for letter in [*reversed(out_letters), *summed]:
        if _splits(letter, letters, local, parts):
            return letter
    return None


def _splits(letter: str, letters: list[str], local: list[list[int]], parts: int) -> bool:
    """Whether `letter` can be split in `parts` in every operand that has it: once in each, of one size,
    which the parts divide (no padding enters the sum)."""
    sizes = {size[term.index(letter)] for size, term in zip(local, letters) if letter in term}
    return parts > 1 and all(term.count(letter) <= 1 for term in letters) and len(sizes) == 1 \
        and next(iter(sizes)) % parts == 0


PLACEMENT = {aten.einsum.default: place_einsum}

FAMILY = Family("einsum", PLACEMENT)
