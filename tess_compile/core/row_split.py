"""How the rows of the inputs split: the batch, the tokens of each sequence, or both.

Every token-wise op (a product, a norm, a pointwise op, an embedding, the loss)
works on rows: the batch times the tokens. Tesseract splits rows over depth
and row (`CompileOptions.batch_split`, the batch); a sequence's tokens may take
the axes the batch leaves (`CompileOptions.token_split`: sequence parallelism,
and context parallelism in attention). In mode "1d" the batch stays whole on
every rank (Megatron-LM) and the tokens may split over col between the
column- and row-parallel products (Megatron-LM's sequence parallelism).

An input's token dim is dim 1 of an integer input of two or more dims (ids,
labels, masks, positions) and of a float input of three or more (`[b, s, h]`),
where it has the example's token count: a float `[b, h]` has features there,
an image channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tess_compile.core.mesh import Mesh
from tess_compile.core.options import AUTO, BATCH_SPLITS, TOKEN_SPLITS

__all__ = ["RowSplit", "batch_parts", "resolve_batch_split", "resolve_row_split", "splits_of", "stripe_count",
           "token_dim", "token_parts"]

_AXES_OF = {"depth_row": ("depth", "row"), "depth": ("depth",), "row": ("row",), "col": ("col",), "none": ()}


@dataclass(frozen=True)
class RowSplit:
    """The axes that split the batch (`batch`, a `BATCH_SPLITS` name) and the tokens (`tokens`, a
    `TOKEN_SPLITS` name) of the inputs, the example's token count (`length`, None: no token dim), and
    the stripes of a striped token order (`stripes`, 1: each rank holds one contiguous block).

    In `stripes` g > 1 the sequence is g equal parts, each split over the n ranks of the token axes
    as a contiguous order splits the whole: rank m holds block m of every part, blocks m, n + m,
    2n + m, ... of g*n (the grouped split `S(dim, groups=g)` of `tess_compile.core.layout`). A causal
    attention's queries of part j see the keys of parts 0 to j alone, on every rank alike: each rank
    computes (g + 1) / (2g) of its queries' scores against every key, where a contiguous order leaves
    the last rank all of them."""

    batch: str = "depth_row"
    tokens: str = "none"
    length: int | None = None
    stripes: int = 1

    def batch_axes(self) -> tuple[str, ...]:
        return _AXES_OF[self.batch]

    def token_axes(self) -> tuple[str, ...]:
        return _AXES_OF[self.tokens]

    def splits_rows(self, axis: str) -> bool:
        """Whether `axis` splits the inputs' rows (their batch or their tokens)."""
        return axis in self.batch_axes() or axis in self.token_axes()

    def __str__(self) -> str:
        stripes = f" in {self.stripes} stripes" if self.stripes > 1 else ""
        return f"batch over {self.batch}, tokens over {self.tokens}{stripes}"


def stripe_count(length: int | None, parts: int) -> int:
    """The stripes of a striped order of `length` tokens over `parts` ranks: the most of 8, 4 and 2 that
    splits them evenly (blocks of one token at least); 1 where none does."""
    if length is None or parts < 2:
        return 1
    return next((g for g in _STRIPES if length % (g * parts) == 0), 1)


_STRIPES = (8, 4, 2)  # past 8 stripes a rank's share of the scores gains little: (g + 1) / (2g)


def batch_parts(batch_split: str, mesh: Mesh) -> int:
    """How many blocks `batch_split` cuts the batch in on `mesh`."""
    return _parts(_AXES_OF[batch_split], mesh)


def token_parts(token_split: str, mesh: Mesh) -> int:
    """How many blocks `token_split` cuts a sequence in on `mesh`."""
    return _parts(_AXES_OF[token_split], mesh)


def _parts(axes: tuple[str, ...], mesh: Mesh) -> int:
    parts = 1
    for axis in axes:
        parts *= mesh.size(axis)
    return parts


def token_dim(val, length: int | None) -> int | None:
    """The token dim of an input value (see the module docstring), or None."""
    if length is None or not isinstance(val, torch.Tensor) or val.dim() < 2 or val.shape[1] != length:
        return None
    if val.is_floating_point() and val.dim() < 3:
        return None
    return 1


def splits_of(batch: int | None, mesh: Mesh) -> list[str]:
    """The batch splits that divide `batch` (None: every one) on `mesh`, in `BATCH_SPLITS`' order; "depth"
    only where depth has more than one rank (else it is "none")."""
    if mesh.mode == "1d":
        return ["none"]
    return [s for s in BATCH_SPLITS if (s != "depth" or mesh.size("depth") > 1)
            and (batch is None or batch % batch_parts(s, mesh) == 0)]


def resolve_batch_split(batch_split: str, batch: int | None, mesh: Mesh) -> str:
    """`batch_split` for an example `batch` (None: no batch): "auto" is the first split that divides
    it (so a batch of one stays whole); another is checked against it (ValueError naming the fix)."""
    if mesh.mode == "1d":
        return "none"
    if batch_split == AUTO:
        return splits_of(batch, mesh)[0]
    if batch is not None and batch % batch_parts(batch_split, mesh):
        parts = batch_parts(batch_split, mesh)
        raise ValueError(f"batch_split={batch_split!r}: the inputs' batch {batch} is not divisible by the {parts} "
                         f"ranks that split it on mesh {mesh}: use a batch that is a multiple of {parts}, or "
                         "batch_split='auto'")
    return batch_split


def _token_splits(mesh: Mesh) -> tuple[str, ...]:
    """The token splits of `mesh`'s mode, widest first: over col in 1-D, over depth and row, or row, in the
    others (col splits the features there)."""
    return ("col",) if mesh.mode == "1d" else ("depth_row", "row")


def resolve_row_split(batch_split: str, token_split: str, batch: int | None, length: int | None, mesh: Mesh,
                      dynamic: bool = False) -> RowSplit:
    """The row split of inputs with an example `batch` and token count `length` (None: none).

    "auto" tokens take the row axes that the batch leaves whole, where the tokens divide them (more
    than one token a rank): the batch first (SUMMA over the batch), then the tokens. A dynamic compile
    splits tokens only where asked (its token count is a symbol). Splits that share an axis, or that do
    cannot split unevenly (over two axes), are a ValueError naming the fix; so is a token split of a
    dynamic compile, whose token count is a symbol (not supported yet). A split over one axis that the
    tokens do not divide is uneven: its last blocks padded (`tess_compile.core.layout`)."""
    if token_split not in (*TOKEN_SPLITS, AUTO):
        raise ValueError(f"token_split={token_split!r} is not a token split: use one of "
                         f"{', '.join(map(repr, (*TOKEN_SPLITS, AUTO)))}")
    if token_split not in ("none", AUTO) and token_split not in _token_splits(mesh):
        raise ValueError(f"token_split={token_split!r} does not fit mode {mesh.mode!r} on mesh {mesh}: use one of "
                         f"{', '.join(map(repr, ('none', *_token_splits(mesh), AUTO)))}")
    if dynamic and token_split not in ("none", AUTO):
        raise ValueError(f"token_split={token_split!r} with dynamic=True: a dynamic program's token count is a "
                         "symbol, which a token split does not take yet; compile with dynamic=False for a token "
                         "split, or token_split='none'")
    if batch_split == AUTO and token_split not in ("none", AUTO):
        batch_split = next(s for s in splits_of(batch, mesh) if not set(_AXES_OF[s]) & set(_AXES_OF[token_split]))
    batch_split = resolve_batch_split(batch_split, batch, mesh)
    if token_split == AUTO:
        token_split = "none" if dynamic else _auto_tokens(batch_split, length, mesh)
    taken = set(_AXES_OF[batch_split]) & set(_AXES_OF[token_split])
    if taken:
        raise ValueError(f"batch_split={batch_split!r} and token_split={token_split!r} both split over "
                         f"{' and '.join(sorted(taken))} on mesh {mesh}: split the tokens over the axes the batch "
                         "leaves, or token_split='auto'")
    parts = token_parts(token_split, mesh)
    stacked = sum(mesh.size(axis) > 1 for axis in _AXES_OF[token_split]) > 1  # an uneven split cannot be nested
    if token_split != "none" and (length is None or (not dynamic and stacked and length % parts)):
        what = "no token dim" if length is None else f"{length} tokens, not divisible by {parts}"
        raise ValueError(f"token_split={token_split!r} on mesh {mesh}: the inputs have {what}; use a sequence "
                         f"length that is a multiple of {parts}, or token_split='auto'")
    return RowSplit(batch_split, token_split, length)


def _auto_tokens(batch_split: str, length: int | None, mesh: Mesh) -> str:
    """The widest token split over axes the batch leaves whole that the tokens divide, else "none"."""
    if length is None:
        return "none"
    for split in _token_splits(mesh):
        parts = token_parts(split, mesh)
        if parts > 1 and not set(_AXES_OF[split]) & set(_AXES_OF[batch_split]) and length % parts == 0:
            return split
    return "none"
