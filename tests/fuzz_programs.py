"""Random programs for the differential fuzzer of op compositions (no tests here).

A `Program` is a small description: a mesh, a few sizes, a start, a list of `Step`s (an op
name from `OPS` and a few small integers) and an end. `build_source` resolves it against the
shapes it flows through into the Python source of one `nn.Module` (`Fuzzed`): each step
reads the running value `h` of a known shape and picks its dims, offsets, sizes and variant
from its integers, taken modulo the choices that fit (a step that fits nowhere is left out).
Any list of steps is thus a valid program, so hypothesis shrinks a failure by deleting steps
and lowering integers (0 is each step's simplest choice). `source(program)` prints the
module with the lines that reproduce the run, ready to paste into a test.

`check(program)` runs the module unsharded and through `tess_compile.simulate` on the
program's mesh, in float64, and returns an `Outcome`: "pass" (forward outputs and every
parameter gradient within 1e-12 of the model's scale), "value_error" (the compiler refused at
compile time with a ValueError that names the mesh), "fail" (a compiler defect) or "invalid"
(the unsharded model failed: the grammar's own defect), with a `kind` that groups alike
outcomes. `Shrinking` and `polish` bound and finish hypothesis's shrinking of a failure.
docs/fuzzing.md says what the grammar draws.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import random
import re
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from conftest import assert_close_rel
from hypothesis import strategies as st
from torch import nn

import tess_compile
from tess_compile.core.mesh import Mesh

__all__ = [
    "FAILING", "MESHES", "OPS", "Outcome", "Program", "Shrinking", "Step", "build_model", "build_source", "check",
    "compare", "describe", "example_inputs", "polish", "programs", "random_program", "signature", "simpler", "source",
]

# (q, d, mode): 2.5-D with d > 1 and d = 1, 1-D over q*q*d ranks (p=4 and p=2).
MESHES = ((2, 2, "2.5d"), (2, 1, "2.5d"), (2, 1, "1d"), (1, 2, "1d"))
NUM_ARGS = 5
ARG_MAX = 63
MAX_STEPS = 6
SEQ, FEATURES, VOCAB, BLOCKS = (1, 6), (1, 12), (2, 17), (1, 2)
MAX_DIM, MAX_NUMEL, MIN_RANK, MAX_RANK = 40, 6000, 2, 5
RTOL = 1e-12
# The least scale a comparison is measured on: the programs' weights, inputs and projections are O(1),
# so rounding noise is ~1e-16 of O(1) terms even where their exact sum cancels to 0 (a gradient
# that is zero in exact arithmetic, a centred value of equal entries).
SCALE_FLOOR = 1.0


@dataclass(frozen=True)
class Step:
    """One op of the grammar (`OPS[op]`) and the integers it picks its choices with."""

    op: str
    args: tuple[int, ...] = (0,) * NUM_ARGS


@dataclass(frozen=True)
class Program:
    """A mesh `(q, d, mode)`, sizes, and the ops from the inputs to the outputs.

    The batch is `blocks` times the ranks that split it (`d*q` in 2.5-D, 1 in 1-D), or with
    `unsplit` just `blocks`, which d*q does not divide: the rows then stay whole over row and the
    products run weight-stationary (`batch_split="auto"`); `features` is the width of the float input `x` `[batch, seq, features]`; `vocab` bounds
    the integer input `ids` `[batch, seq]` and the loss's classes. `tokens` "split" splits each sequence's
    tokens over one axis (row in 2.5-D, col in 1-D: `token_split`), evenly or not; "auto" as the compile
    picks (tokens over the axes a batch leaves, where they divide)."""

    mesh: tuple[int, int, str]
    blocks: int = 1
    seq: int = 1
    features: int = 1
    vocab: int = 2
    start: int = 0
    steps: tuple[Step, ...] = ()
    end: int = 0
    unsplit: bool = False
    tokens: str = "auto"

    @property
    def batch(self) -> int:
        q, d, mode = self.mesh
        return self.blocks * (d * q if mode != "1d" and not self.unsplit else 1)


class Skip(Exception):
    """A step's op does not fit the value it would read: the step is left out."""


class Args:
    """A step's integers, taken one at a time (0 once they run out)."""

    def __init__(self, values: tuple[int, ...]):
        self.values, self.index = values, 0

    def next(self) -> int:
        value = self.values[self.index] if self.index < len(self.values) else 0
        self.index += 1
        return value

    def pick(self, options):
        options = list(options)
        if not options:
            raise Skip
        return options[self.next() % len(options)]

    def int(self, low: int, high: int) -> int:
        if high < low:
            raise Skip
        return low + self.next() % (high - low + 1)


@dataclass
class Builder:
    """The module's source as it is resolved: `__init__` lines, `forward` lines, the shape of `h`."""

    program: Program
    shape: list[int] = field(default_factory=list)
    init: list[str] = field(default_factory=list)
    forward: list[str] = field(default_factory=list)
    inputs: set = field(default_factory=set)
    tag: str = ""
    saved: list = field(default_factory=list)  # (expression, shape) of values kept for later steps
    embeddings: list = field(default_factory=list)  # (attribute, rows, width) of the nn.Embeddings
    kept: list = field(default_factory=list)  # the op names of the steps resolved

    @property
    def rank(self) -> int:
        return len(self.shape)

    def name(self, stem: str) -> str:
        return f"{stem}{self.tag}"

    def emit(self, *lines: str) -> None:
        self.forward.extend(lines)

    def attr(self, stem: str, code: str) -> str:
        """`self.<stem><step> = code` in `__init__`; returns the attribute's expression."""
        name = self.name(stem)
        self.init.append(f"self.{name} = {code}")
        return f"self.{name}"

    def buffer(self, stem: str, code: str) -> str:
        """A non-persistent buffer made by `code` in `__init__` (through a local where the line, indented,
        would pass 100 columns); returns the attribute's expression."""
        name = self.name(stem)
        line = f"self.register_buffer({name!r}, {code}, persistent=False)"
        if len(line) > 100:
            self.init.append(f"{name} = {code}")
            line = f"self.register_buffer({name!r}, {name}, persistent=False)"
        self.init.append(line)
        return f"self.{name}"

    def use(self, name: str) -> str:
        self.inputs.add(name)
        return name

    def generator(self) -> str:
        """A fresh seeded generator's source (seeded by the count of `__init__` lines so far)."""
        return f"torch.Generator().manual_seed({len(self.init)})"

    def ids_fit(self) -> bool:
        """The leading dims of `h` are the inputs' `[batch, seq]`."""
        return self.rank >= 2 and self.shape[:2] == [self.program.batch, self.program.seq]

    def set_shape(self, shape) -> None:
        shape = [int(s) for s in shape]
        if not MIN_RANK <= len(shape) <= MAX_RANK or min(shape) < 1 or max(shape) > MAX_DIM:
            raise Skip
        if math.prod(shape) > MAX_NUMEL:
            raise Skip
        self.shape = shape


# Rendering helpers.


def _tuple(values) -> str:
    values = list(values)
    return f"({values[0]},)" if len(values) == 1 else "(" + ", ".join(str(v) for v in values) + ")"


def _index(rank: int, dim: int, item: str) -> str:
    """`[:, :, item]` (or `[..., item]` at the last dim) selecting `item` along `dim`."""
    if dim == rank - 1 and dim > 0:
        return f"[..., {item}]"
    return "[" + ", ".join([":"] * dim + [item]) + "]"


def _dims_last_first(b: Builder, low: int = 0) -> list[int]:
    return list(range(b.rank - 1, low - 1, -1))


def _divisors(n: int) -> list[int]:
    """Divisors of n, the proper ones first."""
    inner = [k for k in range(2, n) if n % k == 0]
    return inner + ([n, 1] if n > 1 else [1])


def _chunk_sizes(size: int, chunks: int) -> list[int]:
    each = -(-size // chunks)
    return [min(each, size - start) for start in range(0, size, each)]


def _seeded_randn(b: Builder, shape, scale: float = 1.0) -> str:
    factor = "" if scale == 1.0 else f" * {scale}"
    return f"torch.randn({_tuple(shape)}, generator={b.generator()}){factor}"


# Products and embeddings.


def op_linear(b: Builder, a: Args) -> None:
    """nn.Linear over the last dim, with or without bias."""
    h = b.shape[-1]
    out, bias = a.pick([h, 2 * h, h + 1, max(1, h // 2), 3, 8]), a.pick([True, False])
    lin = b.attr("lin", f"nn.Linear({h}, {out}, bias={bias})")
    b.emit(f"h = {lin}(h)")
    b.set_shape(b.shape[:-1] + [out])


def op_matmul(b: Builder, a: Args) -> None:
    """`h @ W` with W a parameter [in, out], `F.linear` / `@ W.t()` with W stored [out, in], or
    GPT-2's Conv1D: `addmm(bias, h.view(-1, in), W).view(.., out)`."""
    h = b.shape[-1]
    out, variant = a.pick([h, 2 * h, 5, 1]), a.next() % 4
    if variant == 3:
        w = b.attr("w", f"nn.Parameter({_seeded_randn(b, (h, out), h ** -0.5)})")
        bias = b.attr("bias", f"nn.Parameter(torch.zeros({out}))")
        shape = ", ".join(str(s) for s in b.shape[:-1] + [out])
        b.emit(f"h = torch.addmm({bias}, h.reshape(-1, {h}), {w}).view({shape})")
    elif variant == 0:
        w = b.attr("w", f"nn.Parameter({_seeded_randn(b, (h, out), h ** -0.5)})")
        b.emit(f"h = h @ {w}")
    else:
        w = b.attr("w", f"nn.Parameter({_seeded_randn(b, (out, h), h ** -0.5)})")
        b.emit(f"h = F.linear(h, {w})" if variant == 1 else f"h = torch.matmul(h, {w}.t())")
    b.set_shape(b.shape[:-1] + [out])


def op_table(b: Builder, a: Args) -> None:
    """A learned table times (or plus) the activations: scaled by trailing dims, or mixing dim -2."""
    variant = a.next() % 3
    if variant == 2:
        rows = a.pick([b.shape[-2], b.shape[-2] + 1, 2, 1])
        t = b.attr("table", f"nn.Parameter({_seeded_randn(b, (rows, b.shape[-2]), 0.5)})")
        b.emit(f"h = {t} @ h")
        b.set_shape(b.shape[:-2] + [rows, b.shape[-1]])
        return
    first = a.int(1, b.rank - 1)
    ones = a.next()  # its bits put size-1 (broadcast) dims in the table
    shape = [1 if ones >> k & 1 else size for k, size in enumerate(b.shape[first:])]
    t = b.attr("table", f"nn.Parameter({_seeded_randn(b, shape)})")
    b.emit(f"h = h * {t}" if variant == 0 else f"h = h + {t}")


def op_embed(b: Builder, a: Args) -> None:
    """An nn.Embedding: of the input ids (added or multiplied), of ids derived from them, of the
    argmax of the last dim, or of positions made in forward (added)."""
    h, variant = b.shape[-1], a.next() % 5
    if variant < 2 and b.rank == 3 and b.ids_fit():
        vocab = b.program.vocab
        padding = ", padding_idx=0" if variant == 1 else ""
        emb = b.attr("emb", f"nn.Embedding({vocab}, {h}{padding})")
        b.embeddings.append((emb, vocab, h))
        b.emit(f"h = h + {emb}({b.use('ids')})" if variant == 0 else f"h = h * {emb}({b.use('ids')})")
        return
    if variant == 2 and b.rank == 3 and b.ids_fit():
        _embed_derived_ids(b, a)
        return
    if variant == 3:  # ids computed in forward: the argmax of the last dim
        width = a.pick([h, 4, 1])
        emb = b.attr("emb", f"nn.Embedding({h}, {width})")
        b.emit(f"h = {emb}(h.argmax(-1))")
        b.set_shape(b.shape[:-1] + [width])
        return
    positions = b.shape[-2]
    emb = b.attr("pos", f"nn.Embedding({positions + a.int(0, 2)}, {h})")
    b.emit(f"h = h + {emb}(torch.arange({positions}, device=h.device))")


def _embed_derived_ids(b: Builder, a: Args) -> None:
    """An embedding of ids made from the input ids: shifted right as T5 and BART shift labels
    (in-place writes into a new tensor), or RoBERTa's positions (a cumsum of the non-padding)."""
    p, ids = b.program, b.use("ids")
    emb = b.attr("emb", f"nn.Embedding({p.vocab + p.seq + 1}, {b.shape[-1]})")
    if a.next() % 2:
        b.emit(f"shifted = {ids}.new_zeros({ids}.shape)", f"shifted[:, 1:] = {ids}[:, :-1].clone()",
               "shifted[:, 0] = 1", "shifted = shifted.masked_fill(shifted == 2, 0)", f"h = h + {emb}(shifted)")
    else:
        b.emit(f"keep = ({ids} != 0).int()", "positions = torch.cumsum(keep, dim=1).type_as(keep) * keep + 1",
               f"h = h + {emb}(positions.long())")


def op_inplace(b: Builder, a: Args) -> None:
    """In-place ops on a value made in forward: through a slice (`y[:, :k] *= 2`, `narrow(..).add_`),
    a masked_fill_, an index_fill_, or a zero_ of a selected row."""
    dim = a.pick(_dims_last_first(b))
    size, variant = b.shape[dim], a.next() % 5
    k = a.int(1, size)
    if variant == 0:
        b.emit("y = h.clone()", f"y{_index(b.rank, dim, f':{k}')} *= 2")
    elif variant == 1:
        bias = b.attr("delta", f"nn.Parameter({_seeded_randn(b, b.shape[dim + 1:] or [1])})")
        b.emit("y = h * 1.0", f"y.narrow({dim}, {size - k}, {k}).add_({bias})")
    elif variant == 2:
        b.emit("y = h + 0.0", f"y.masked_fill_({_mask(b, a)}, 0.25)")
    elif variant == 3:
        b.emit("y = h.clone()", f"y.index_fill_({dim}, torch.tensor([{k - 1}]), -0.5)")
    else:
        b.emit("y = h.clone()", f"y.select({dim}, {k - 1}).zero_()")
    b.emit("h = y")


# Slices, joins and splits.


def op_narrow(b: Builder, a: Args) -> None:
    dim = a.pick(_dims_last_first(b))
    size = b.shape[dim]
    start = a.int(0, size - 1)
    length = a.int(1, size - start)
    b.emit(f"h = h.narrow({dim}, {start}, {length})")
    b.set_shape(b.shape[:dim] + [length] + b.shape[dim + 1:])


def op_slice(b: Builder, a: Args) -> None:
    """Python slicing along one dim: `[1:]`, `[:-1]`, `[a:b]`, `[::2]`, `[a::3]`."""
    dim = a.pick(_dims_last_first(b))
    size = b.shape[dim]
    variant = a.next() % 5
    if variant in (0, 1):
        if size < 2:
            raise Skip
        item, length = ("1:", size - 1) if variant == 0 else (":-1", size - 1)
    elif variant == 2:
        start = a.int(0, size - 1)
        stop = a.int(start + 1, size)
        item, length = f"{start}:{stop}", stop - start
    else:
        start, step = (0, 2) if variant == 3 else (a.int(0, size - 1), 3)
        item, length = (f"::{step}" if start == 0 else f"{start}::{step}"), len(range(start, size, step))
    b.emit(f"h = h{_index(b.rank, dim, item)}")
    b.set_shape(b.shape[:dim] + [length] + b.shape[dim + 1:])


def op_select(b: Builder, a: Args) -> None:
    """One index along a dim past the batch (`h[:, 0]`, `h[..., -1]`, `h.select`)."""
    if b.rank < 3:
        raise Skip
    dim = a.pick(_dims_last_first(b, 1))
    index = a.pick([0, -1, b.shape[dim] // 2])
    code = f"h.select({dim}, {index})" if a.next() % 2 else f"h{_index(b.rank, dim, str(index))}"
    b.emit(f"h = {code}")
    b.set_shape(b.shape[:dim] + b.shape[dim + 1:])


def op_cat(b: Builder, a: Args) -> None:
    """cat along a dim: rotated pieces, a grown copy, or (last dim) beside a projection."""
    dim = a.pick(_dims_last_first(b))
    size, variant = b.shape[dim], a.next() % 3
    if variant == 0:
        if size < 2:
            raise Skip
        k = a.int(1, size - 1)
        b.emit(f"h = torch.cat([h.narrow({dim}, {k}, {size - k}), h.narrow({dim}, 0, {k})], {dim})")
        return
    if variant == 1:
        k = a.int(1, size)
        b.emit(f"h = torch.cat([h, h.narrow({dim}, 0, {k}) * 2], dim={dim})")
        b.set_shape(b.shape[:dim] + [size + k] + b.shape[dim + 1:])
        return
    width = a.pick([b.shape[-1], 3, 1])
    lin = b.attr("lin", f"nn.Linear({b.shape[-1]}, {width})")
    b.emit(f"h = torch.cat([h, {lin}(h)], -1)")
    b.set_shape(b.shape[:-1] + [b.shape[-1] + width])


def op_stack(b: Builder, a: Args) -> None:
    """stack of the value and a function of it at a new dim."""
    dim = a.pick(range(b.rank, -1, -1))
    other = a.pick(["F.silu(h)", "h * 2", "h.flip(0)"])
    b.emit(f"h = torch.stack([h, {other}], {dim})")
    b.set_shape(b.shape[:dim] + [2] + b.shape[dim:])


def op_split(b: Builder, a: Args) -> None:
    """split at an uneven offset: swapped and rejoined, one piece kept, or equal halves multiplied."""
    dim = a.pick(_dims_last_first(b))
    size = b.shape[dim]
    if size < 2:
        raise Skip
    k, variant = a.int(1, size - 1), a.next() % 3
    if variant == 0:
        b.emit(f"first, rest = h.split([{k}, {size - k}], {dim})", f"h = torch.cat([rest, first * 2], {dim})")
        return
    if variant == 1:
        pieces = [k] * (size // k) + ([size % k] if size % k else [])
        which = a.int(0, len(pieces) - 1)
        b.emit(f"h = h.split({k}, dim={dim})[{which}]")
        b.set_shape(b.shape[:dim] + [pieces[which]] + b.shape[dim + 1:])
        return
    if size % 2:
        raise Skip
    b.emit(f"first, rest = torch.split(h, {size // 2}, {dim})", "h = first * torch.sigmoid(rest)")
    b.set_shape(b.shape[:dim] + [size // 2] + b.shape[dim + 1:])


def op_chunk(b: Builder, a: Args) -> None:
    """chunk in 2 to 4 (uneven last piece): rejoined in reverse, or one piece kept."""
    dim = a.pick(_dims_last_first(b))
    size = b.shape[dim]
    if size < 2:
        raise Skip
    sizes = _chunk_sizes(size, a.int(2, 4))
    if a.next() % 2 == 0:
        b.emit(f"h = torch.cat(h.chunk({len(sizes)}, {dim})[::-1], {dim})")
        return
    which = a.int(0, len(sizes) - 1)
    b.emit(f"h = h.chunk({len(sizes)}, dim={dim})[{which}]")
    b.set_shape(b.shape[:dim] + [sizes[which]] + b.shape[dim + 1:])


def op_tensor_split(b: Builder, a: Args) -> None:
    """tensor_split at an index (swapped and rejoined; or at a tensor of indices), or into 2 to 4 sections
    (uneven first pieces), one kept."""
    dim = a.pick(_dims_last_first(b))
    size = b.shape[dim]
    if size < 2:
        raise Skip
    k, variant = a.int(1, size - 1), a.next() % 3
    if variant in (0, 1):
        at = f"[{k}]" if variant == 0 else f"torch.tensor([{k}])"
        b.emit(f"first, rest = torch.tensor_split(h, {at}, {dim})", f"h = torch.cat([rest, first * 2], {dim})")
        return
    sections = a.int(2, min(size, 4))
    sizes = [size // sections + (i < size % sections) for i in range(sections)]
    which = a.int(0, sections - 1)
    b.emit(f"h = h.tensor_split({sections}, dim={dim})[{which}]")
    b.set_shape(b.shape[:dim] + [sizes[which]] + b.shape[dim + 1:])


def op_as(b: Builder, a: Args) -> None:
    """The `*_as` views: the value flattened to rows, and back by `reshape_as` or `view_as`; or a mean
    along a dim subtracted by `expand_as`."""
    variant = a.next() % 3
    if variant == 2:
        dim = a.pick(_dims_last_first(b))
        b.emit(f"h = h - h.mean({dim}, keepdim=True).expand_as(h)")
        return
    b.emit(f"h = F.silu(h.reshape(-1, {b.shape[-1]})).{'reshape_as' if variant == 0 else 'view_as'}(h)")


def op_unbind(b: Builder, a: Args) -> None:
    """unbind a small dim: restacked in reverse, summed, one kept, or cat along another dim."""
    dims = [dim for dim in _dims_last_first(b) if b.shape[dim] <= 6]
    dim = a.pick(dims)
    variant = a.next() % 4
    if variant == 0:
        b.emit(f"h = torch.stack(h.unbind({dim})[::-1], {dim})")
        return
    if b.rank < 3:
        raise Skip
    rest = b.shape[:dim] + b.shape[dim + 1:]
    if variant == 1:
        b.emit(f"h = sum(h.unbind({dim}))")
    elif variant == 2:
        b.emit(f"h = h.unbind({dim})[{a.int(0, b.shape[dim] - 1)}]")
    else:
        other = a.pick(range(len(rest) - 1, -1, -1))
        b.emit(f"h = torch.cat(torch.unbind(h, {dim}), {other})")
        rest[other] *= b.shape[dim]
    b.set_shape(rest)


# Views.


def op_heads(b: Builder, a: Args) -> None:
    """`[.., s, h] -> [.., n, s, h/n]`: view (or unflatten) into heads, then transpose."""
    n = a.pick(_divisors(b.shape[-1]))
    lead, width = b.shape[:-1], b.shape[-1] // n
    variant = a.next() % 3
    if variant == 0:
        view = f"h.view({', '.join(str(s) for s in lead + [n, width])})"
    elif variant == 1:
        view = f"h.unflatten(-1, ({n}, {width}))"
    else:
        view = f"h.reshape(*h.shape[:-1], {n}, {width})"
    new_rank = b.rank + 1
    b.emit(f"h = {view}.transpose({new_rank - 3}, {new_rank - 2})")
    b.set_shape(lead[:-1] + [n, lead[-1], width])


def op_merge(b: Builder, a: Args) -> None:
    """`[.., n, s, d] -> [.., s, n*d]`: transpose back and reshape, view or flatten."""
    if b.rank < 3:
        raise Skip
    n, s, width = b.shape[-3:]
    lead = b.shape[:-3] + [s, n * width]
    variant = a.next() % 3
    shape = ", ".join(str(v) for v in lead)
    tail = [f".reshape({shape})", f".contiguous().view({shape})", ".flatten(-2)"][variant]
    b.emit(f"h = h.transpose(-3, -2){tail}")
    b.set_shape(lead)


def op_flatten(b: Builder, a: Args) -> None:
    if b.rank < 3:
        raise Skip
    start = a.pick(range(b.rank - 2, -1, -1))
    b.emit(f"h = h.flatten({start}, {start + 1})")
    b.set_shape(b.shape[:start] + [b.shape[start] * b.shape[start + 1]] + b.shape[start + 2:])


def op_unflatten(b: Builder, a: Args) -> None:
    dims = [dim for dim in _dims_last_first(b) if len(_divisors(b.shape[dim])) > 2]
    dim = a.pick(dims)
    outer = a.pick(_divisors(b.shape[dim])[:-2])
    inner = b.shape[dim] // outer
    b.emit(f"h = h.unflatten({dim}, ({outer}, {inner}))")
    b.set_shape(b.shape[:dim] + [outer, inner] + b.shape[dim + 1:])


def op_permute(b: Builder, a: Args) -> None:
    """permute (the orders that keep the batch first come first) or transpose two dims."""
    if a.next() % 2:
        i, j = a.pick(range(b.rank)), a.pick(range(b.rank - 1, -1, -1))
        b.emit(f"h = h.transpose({i}, {j})")
        order = list(range(b.rank))
        order[i], order[j] = j, i
    else:
        orders = sorted(itertools.permutations(range(b.rank)), key=lambda p: (p[0] != 0, p))
        order = list(a.pick(orders[1:] or orders))
        b.emit(f"h = h.permute({', '.join(str(o) for o in order)})")
    b.set_shape([b.shape[o] for o in order])


def op_expand(b: Builder, a: Args) -> None:
    """A new dim expanded: kept, or merged into its neighbour as Llama's repeat_kv does."""
    dim = a.pick(range(b.rank, 0, -1))
    times = a.int(2, 3)
    shape = b.shape[:dim] + [times] + b.shape[dim:]
    index = _index(b.rank + 1, dim, "None") if dim < b.rank else "[..., None]"
    b.emit(f"h = h{index}.expand({', '.join(str(s) for s in shape)})")
    if a.next() % 2 and dim > 0:
        merged = shape[:dim - 1] + [shape[dim - 1] * times] + shape[dim + 1:]
        b.emit(f"h = h.reshape({', '.join(str(s) for s in merged)})")
        shape = merged
    b.set_shape(shape)


def op_repeat(b: Builder, a: Args) -> None:
    dim = a.pick(_dims_last_first(b))
    times = a.int(2, 3)
    if a.next() % 2:
        reps = [1] * b.rank
        reps[dim] = times
        b.emit(f"h = h.repeat({', '.join(str(r) for r in reps)})")
    else:
        b.emit(f"h = h.repeat_interleave({times}, dim={dim})")
    b.set_shape(b.shape[:dim] + [b.shape[dim] * times] + b.shape[dim + 1:])


def op_squeeze(b: Builder, a: Args) -> None:
    """unsqueeze at any dim, or squeeze a size-1 dim."""
    ones = [dim for dim in _dims_last_first(b) if b.shape[dim] == 1]
    if a.next() % 2 and ones:
        dim = a.pick(ones)
        b.emit(f"h = h.squeeze({dim})")
        b.set_shape(b.shape[:dim] + b.shape[dim + 1:])
        return
    dim = a.pick(range(b.rank, -1, -1))
    b.emit(f"h = h.unsqueeze({dim})")
    b.set_shape(b.shape[:dim] + [1] + b.shape[dim:])


def op_gram(b: Builder, a: Args) -> None:
    """A product of two activations: `h @ h^T` over the last dim (einsum, bmm or @)."""
    if b.rank < 3:
        raise Skip
    form = a.pick(["h @ h.transpose(-1, -2)", "torch.einsum('...sh,...th->...st', h, F.silu(h))"] +
                  (["torch.bmm(h, h.transpose(1, 2))"] if b.rank == 3 else []))
    b.emit(f"h = {form} * {b.shape[-1] ** -0.5!r}")
    b.set_shape(b.shape[:-1] + [b.shape[-2]])


def op_topk(b: Builder, a: Args) -> None:
    """topk or sort along a dim (values kept, or indices that gather from the value: a router)."""
    dim = a.pick(_dims_last_first(b))
    size = b.shape[dim]
    k = a.int(1, size)
    variant = a.next() % 3
    if variant == 0:
        b.emit(f"h = h.topk({k}, dim={dim}).values")
    elif variant == 1:
        b.emit(f"h = torch.sort(h, dim={dim}, descending=True)[0].narrow({dim}, 0, {k})")
    else:
        b.emit(f"weights, chosen = torch.topk(torch.softmax(h, {dim}), {k}, dim={dim})",
               f"h = h.gather({dim}, chosen) * weights")
    b.set_shape(b.shape[:dim] + [k] + b.shape[dim + 1:])


def op_save(b: Builder, a: Args) -> None:
    """Keep the value for a later `combine` (a residual, a second path)."""
    name = b.name("saved")
    b.emit(f"{name} = h")
    b.saved.append((name, list(b.shape)))


def op_combine(b: Builder, a: Args) -> None:
    """The value joined with a kept one (or the input x) of a fitting shape: a sum, a product, or a cat
    along the one dim where they differ."""
    p = b.program
    kept = b.saved + [("x", [p.batch, p.seq, p.features])]
    fits = [(name, shape) for name, shape in kept if len(shape) == b.rank
            and sum(x != y for x, y in zip(shape, b.shape)) <= 1]
    name, shape = a.pick(fits)
    if name == "x":
        b.use("x")
    differ = [dim for dim in range(b.rank) if shape[dim] != b.shape[dim]]
    if differ:
        dim = differ[0]
        b.emit(f"h = torch.cat([h, {name}], {dim})")
        b.set_shape(b.shape[:dim] + [b.shape[dim] + shape[dim]] + b.shape[dim + 1:])
        return
    variant = a.next() % 3
    if variant == 2:
        b.emit(f"h = torch.cat([{name}, h], -1)")
        b.set_shape(b.shape[:-1] + [2 * b.shape[-1]])
        return
    b.emit(f"h = h + {name}" if variant == 0 else f"h = h * torch.tanh({name})")


# Rotary embeddings.


def _rotary_tables(b: Builder, stem: str, positions: int, width: int, style: str) -> tuple[str, str]:
    """cos and sin buffers [positions, width] of rotary angles, in `style`'s order of pairs."""
    b.init.append(f"angles = torch.outer(torch.arange({positions}.0), 10.0 ** -torch.arange({width // 2}.0))")
    spread = "torch.cat([angles.{0}()] * 2, -1)" if style == "half" else "angles.{0}().repeat_interleave(2, -1)"
    return b.buffer(f"{stem}cos", spread.format("cos")), b.buffer(f"{stem}sin", spread.format("sin"))


def _rotate(b: Builder, var: str, shape: list[int], style: str, stem: str = "") -> None:
    """Emit `var = var * cos + rotate(var) * sin` for a value of `shape` (last dim even)."""
    width = shape[-1]
    cos, sin = _rotary_tables(b, stem, shape[-2], width, "interleaved" if style == "interleaved" else "half")
    if style == "half":
        b.emit(f"{var}1, {var}2 = {var}.chunk(2, -1)", f"rotated = torch.cat([-{var}2, {var}1], -1)")
    elif style == "sliced":
        half = width // 2
        b.emit(f"rotated = torch.cat([-{var}[..., {half}:], {var}[..., :{half}]], dim=-1)")
    else:
        b.emit(f"pairs = {var}.view({', '.join(str(s) for s in shape[:-1])}, {width // 2}, 2)",
               "rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)")
    b.emit(f"{var} = {var} * {cos} + rotated * {sin}")


def op_rope(b: Builder, a: Args) -> None:
    """Rotary embedding of the last dim (half-split, sliced or interleaved pairs), or of its
    "rope" part only, concatenated back to the "nope" part (DeepSeek's decoupled rotary)."""
    width = b.shape[-1]
    style = a.pick(["half", "interleaved", "sliced"])
    if a.next() % 2 == 0:
        if width % 2:
            raise Skip
        _rotate(b, "h", b.shape, style, "rope")
        return
    rope = 2 * a.int(1, (width - 1) // 2)
    nope = width - rope
    b.emit(f"nope, rope = h.split([{nope}, {rope}], -1)")
    _rotate(b, "rope", b.shape[:-1] + [rope], style, "rope")
    b.emit("h = torch.cat([nope, rope], dim=-1)")


# Shifts and writes.


def op_pad(b: Builder, a: Args) -> None:
    """F.pad along one dim: a shift (RWKV's time shift `(1, -1)`), a crop, or a padding."""
    dim = a.pick(_dims_last_first(b))
    size = b.shape[dim]
    left, right = a.pick([(1, -1), (-1, 1), (0, -1), (2, 0), (1, 1)])
    if size + left + right < 1 or min(left, right) < -size + 1:
        raise Skip
    pad = (0, 0) * (b.rank - 1 - dim) + (left, right)
    value = a.pick(["", ", value=0.5"])
    b.emit(f"h = F.pad(h, {_tuple(pad)}{value})")
    b.set_shape(b.shape[:dim] + [size + left + right] + b.shape[dim + 1:])


def op_roll(b: Builder, a: Args) -> None:
    dim = a.pick(_dims_last_first(b))
    shift = a.pick([1, -1, 2, -3])
    if a.next() % 2:
        other = a.pick([d for d in range(b.rank) if d != dim])
        b.emit(f"h = h.roll(({shift}, 1), dims=({dim}, {other}))")
    else:
        b.emit(f"h = torch.roll(h, {shift}, {dim})")


def op_shift_copy(b: Builder, a: Args) -> None:
    """Shift right into a new tensor as T5/BART shift their labels: `y[:, 1:] = h[:, :-1];
    y[:, 0] = start` (a constant or a learned start), by indexing or `narrow(...).copy_`."""
    dim = a.pick(_dims_last_first(b, 1))
    size, variant = b.shape[dim], a.next() % 4
    if size < 2:
        raise Skip
    rank = b.rank
    if variant == 2:
        b.emit("y = h.new_zeros(h.shape)", f"y.narrow({dim}, 1, {size - 1}).copy_(h.narrow({dim}, 0, {size - 1}))")
    elif variant == 3:
        b.emit("y = h.clone()", f"y{_index(rank, dim, '0')} = 0.0",
               f"y{_index(rank, dim, ':-1')} = h{_index(rank, dim, '1:')}")
    else:
        b.emit("y = h.new_zeros(h.shape)", f"y{_index(rank, dim, '1:')} = h{_index(rank, dim, ':-1')}")
        start = "0.5"
        if variant == 1:
            start = b.attr("start", f"nn.Parameter({_seeded_randn(b, b.shape[dim + 1:] or [1])})")
        b.emit(f"y{_index(rank, dim, '0')} = {start}")
    b.emit("h = y")


def op_index_put(b: Builder, a: Args) -> None:
    """Writes at distinct positions of a dim: `y[:, idx] = ...`, index_add, index_copy,
    or index_select to read them."""
    dim = a.pick(_dims_last_first(b))
    size = b.shape[dim]
    count = a.int(1, size)
    idx = b.buffer("idx", f"torch.randperm({size}, generator={b.generator()})[:{count}]")
    variant = a.next() % 4
    if variant == 0:
        item = _index(b.rank, dim, idx)
        b.emit("y = h.clone()", f"y{item} = h{item} * 2", "h = y")
    elif variant == 1:
        b.emit(f"h = h.index_add({dim}, {idx}, h.narrow({dim}, 0, {count}), alpha=0.5)")
    elif variant == 2:
        b.emit(f"h = h.index_copy({dim}, {idx}, h.narrow({dim}, {size - count}, {count}) * 3)")
    else:
        b.emit(f"h = h.index_select({dim}, {idx})")
        b.set_shape(b.shape[:dim] + [count] + b.shape[dim + 1:])


def _mask(b: Builder, a: Args) -> str:
    """A boolean mask that broadcasts to `h`: from its values, from the ids, or a buffer."""
    variant = a.next() % 4
    if variant == 1 and b.ids_fit():
        return f"({b.use('ids')} % 3 == 0){'[..., None]' * (b.rank - 2)}"
    if variant == 2:
        trailing = b.shape[-2:]
        return b.buffer("mask", f"torch.rand({_tuple(trailing)}, generator={b.generator()}) > 0.5")
    if variant == 3:  # a causal mask made in forward
        return f"(torch.arange({b.shape[-1]})[None, :] > torch.arange({b.shape[-2]})[:, None])"
    return "(h > 0.3)"


def op_masked_fill(b: Builder, a: Args) -> None:
    mask = _mask(b, a)
    b.emit(f"h = h.masked_fill({mask}, {a.pick(['0.0', '-1.0', '2.5'])})")


def op_where(b: Builder, a: Args) -> None:
    mask = _mask(b, a)
    if a.next() % 2:
        p = b.attr("alt", f"nn.Parameter({_seeded_randn(b, [b.shape[-1]])})")
        b.emit(f"h = torch.where({mask}, h, h * {p})")
    else:
        b.emit(f"h = torch.where({mask}, h, 0.0)")


def op_gather(b: Builder, a: Args) -> None:
    """gather along a dim with an index laid out like the values, or expanded from one row."""
    dim = a.pick(_dims_last_first(b))
    size = b.shape[dim]
    count = a.pick([size, 1, size + 1, max(1, size // 2)])
    shape = b.shape[:dim] + [count] + b.shape[dim + 1:]
    if a.next() % 2:
        small = [1] * dim + shape[dim:]
        idx = b.buffer("idx", f"torch.randint(0, {size}, {_tuple(small)}, generator={b.generator()})")
        b.emit(f"h = h.gather({dim}, {idx}.expand({', '.join(str(s) for s in shape)}))")
    else:
        idx = b.buffer("idx", f"torch.randint(0, {size}, {_tuple(shape)}, generator={b.generator()})")
        fn = a.pick(["h.gather({dim}, {idx})", "torch.take_along_dim(h, {idx}, {dim})"])
        b.emit("h = " + fn.format(dim=dim, idx=idx))
    b.set_shape(shape)


def op_scatter(b: Builder, a: Args) -> None:
    """scatter of distinct positions (of a slice of the value, or a constant), or scatter_add."""
    dim = a.pick(_dims_last_first(b))
    size = b.shape[dim]
    count = a.int(1, size)
    shape = b.shape[:dim] + [count] + b.shape[dim + 1:]
    distinct = f"torch.rand({_tuple(b.shape)}, generator={b.generator()}).argsort({dim}).narrow({dim}, 0, {count})"
    source = f"h.narrow({dim}, 0, {count}) * 2"
    variant = a.next() % 3
    if variant == 0:
        idx = b.buffer("idx", distinct)
        b.emit(f"h = h.scatter({dim}, {idx}, {source})")
    elif variant == 1:
        idx = b.buffer("idx", distinct)
        b.emit(f"h = h.scatter({dim}, {idx}, 0.5)")
    else:
        idx = b.buffer("idx", f"torch.randint(0, {size}, {_tuple(shape)}, generator={b.generator()})")
        b.emit(f"h = h.scatter_add({dim}, {idx}, {source})")


def op_cumsum(b: Builder, a: Args) -> None:
    dim = a.pick(_dims_last_first(b))
    b.emit(a.pick([f"h = h.cumsum({dim})", f"h = torch.cumsum(h, dim={dim}).flip({dim})"]))


def op_causal_conv(b: Builder, a: Args) -> None:
    """Mamba's causal conv along dim 1 of a `[batch, tokens, channels]` activation: `nn.Conv1d` padded by
    k-1 (dilated: by its reach) and its first outputs, depthwise or over every channel."""
    if b.rank != 3:
        raise Skip
    _, length, channels = b.shape
    kernel, depthwise, dilation = a.pick([2, 3, 4]), a.pick([True, False]), a.pick([1, 1, 2])
    out = channels if depthwise else a.pick([channels, 2 * channels])
    groups = channels if depthwise else 1
    conv = b.attr("conv", f"nn.Conv1d({channels}, {out}, {kernel}, groups={groups}, dilation={dilation}, "
                          f"padding={dilation * (kernel - 1)}, bias={a.pick([True, False])})")
    b.emit(f"h = {conv}(h.transpose(1, 2))[..., :{length}].transpose(1, 2)")
    b.set_shape([b.shape[0], length, out])


# Reductions, norms, activations.


WHOLE_REDUCTIONS = {
    "center": "h = h - h.mean({dim}, keepdim=True)",
    "global": "h = h / (h.pow(2).sum() + 1.0).sqrt()",
    "onehot": "h = h * F.one_hot(h.argmax({dim}), {size}).movedim(-1, {dim}).to(h.dtype)",
    "var": "h = h * h.var({dim}, keepdim=True, correction=0)",
}


def op_reduce(b: Builder, a: Args) -> None:
    """sum, mean, amax, amin, logsumexp over one dim (keepdim or not); centring by the mean, a
    variance, the norm over every dim, a one-hot of the argmax."""
    dim = a.pick(_dims_last_first(b))
    kind = a.pick(["sum", "mean", "amax", "logsumexp", "amin", *WHOLE_REDUCTIONS])
    if kind in WHOLE_REDUCTIONS:
        b.emit(WHOLE_REDUCTIONS[kind].format(dim=dim, size=b.shape[dim]))
        return
    keep = a.pick([True, False]) or b.rank < 3
    b.emit(f"h = h.{kind}({dim}{', keepdim=True' if keep else ''})")
    b.set_shape(b.shape[:dim] + ([1] if keep else []) + b.shape[dim + 1:])


def op_norm(b: Builder, a: Args) -> None:
    """LayerNorm (affine, no bias, none; over the last one or two dims), nn.RMSNorm, RMSNorm by hand."""
    h, variant = b.shape[-1], a.next() % 5
    if variant == 0:
        b.emit(f"h = {b.attr('norm', f'nn.LayerNorm({h})')}(h)")
    elif variant == 1:
        affine = a.pick(["bias=False", "elementwise_affine=False"])
        b.emit(f"h = {b.attr('norm', f'nn.LayerNorm({h}, {affine})')}(h)")
    elif variant == 2:
        b.emit(f"h = {b.attr('norm', f'nn.RMSNorm({h}, eps=1e-6)')}(h)")
    elif variant == 3:
        w = b.attr("scale", f"nn.Parameter(torch.ones({h}))")
        b.emit(f"h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * {w}")
    else:
        if b.rank < 3:
            raise Skip
        b.emit(f"h = {b.attr('norm', f'nn.LayerNorm({_tuple(b.shape[-2:])})')}(h)")


def op_softmax(b: Builder, a: Args) -> None:
    dim = a.pick(_dims_last_first(b))
    b.emit(a.pick([f"h = torch.softmax(h, {dim})", f"h = F.log_softmax(h, dim={dim})",
                   f"h = h.softmax(dim={dim}, dtype=torch.float64)"]))


ACTIVATIONS = ("F.gelu(h)", "F.silu(h)", "torch.tanh(h)", "torch.relu(h)", "torch.sigmoid(h)", "F.softplus(h)",
               "F.gelu(h, approximate='tanh')", "torch.relu(h).pow(2)", "h * torch.sigmoid(1.702 * h)",
               "h.clamp(-0.5, 0.5)", "h.abs()")


def op_act(b: Builder, a: Args) -> None:
    """An activation, or a gate of the last dim's halves (GLU, SwiGLU without its products)."""
    variant = a.next() % 3
    if variant < 2 or b.shape[-1] % 2:
        b.emit(f"h = {a.pick(ACTIVATIONS)}")
        return
    b.emit(a.pick(["h = F.glu(h, -1)", "gate, up = h.chunk(2, -1)\nh = F.silu(gate) * up"]))
    b.set_shape(b.shape[:-1] + [b.shape[-1] // 2])


def op_mlp(b: Builder, a: Args) -> None:
    """A residual MLP (GELU, or SwiGLU with a gate), its width uneven or not."""
    h = b.shape[-1]
    inner = a.pick([2 * h, 3, h + 1, 5])
    up = b.attr("up", f"nn.Linear({h}, {inner})")
    down = b.attr("down", f"nn.Linear({inner}, {h}, bias={a.pick([True, False])})")
    if a.next() % 2:
        gate = b.attr("gate", f"nn.Linear({h}, {inner}, bias=False)")
        b.emit(f"h = h + {down}(F.silu({gate}(h)) * {up}(h))")
    else:
        b.emit(f"h = h + {down}(F.gelu({up}(h)))")


# Attention on [batch, seq, hidden].


def _project_heads(b: Builder, a: Args, heads: int, width: int) -> None:
    """q, k, v as [b, n, s, width] from one fused projection or three; or grouped-query: k and v
    of fewer heads, repeated to the query heads (repeat_interleave, or expand and reshape)."""
    batch, seq, hidden = b.shape
    variant = a.next() % 3
    if variant == 0:
        qkv = b.attr("qkv", f"nn.Linear({hidden}, {3 * heads * width}, bias={a.pick([True, False])})")
        b.emit(f"q, k, v = {qkv}(h).split({heads * width}, -1)")
    elif variant == 1 or heads == 1:
        names = [b.attr(n, f"nn.Linear({hidden}, {heads * width}, bias={n != 'k'})") for n in "qkv"]
        b.emit(f"q, k, v = {names[0]}(h), {names[1]}(h), {names[2]}(h)")
    else:
        _project_grouped(b, a, heads, width)
        return
    b.emit(f"q, k, v = (t.view({batch}, {seq}, {heads}, {width}).transpose(1, 2) for t in (q, k, v))")


def _project_grouped(b: Builder, a: Args, heads: int, width: int) -> None:
    """Grouped-query projections: q of `heads` heads, k and v of fewer from one fused projection."""
    batch, seq, hidden = b.shape
    groups = a.pick(_divisors(heads)[:-1] or [1])
    kv_heads, repeats = heads // groups, groups
    q = b.attr("q", f"nn.Linear({hidden}, {heads * width}, bias=False)")
    kv = b.attr("kv", f"nn.Linear({hidden}, {2 * kv_heads * width}, bias=False)")
    b.emit(f"q = {q}(h).view({batch}, {seq}, {heads}, {width}).transpose(1, 2)",
           f"k, v = {kv}(h).view({batch}, {seq}, {2 * kv_heads}, {width}).transpose(1, 2).chunk(2, dim=1)")
    if a.next() % 2:
        b.emit(f"k, v = k.repeat_interleave({repeats}, 1), v.repeat_interleave({repeats}, 1)")
    else:
        shape = f"{batch}, {kv_heads}, {repeats}, {seq}, {width}"
        b.emit(f"k, v = (t[:, :, None].expand({shape}).reshape({batch}, {heads}, {seq}, {width}) for t in (k, v))")


def _sdpa_mask(b: Builder, a: Args) -> str:
    """SDPA's mask keyword: causal, a boolean mask, an additive one, key padding from the ids, none."""
    seq = b.shape[1]
    variant = a.next() % 5
    if variant == 0:
        return ", is_causal=True"
    if variant == 1:
        mask = b.buffer("mask", f"(torch.rand({seq}, {seq}, generator={b.generator()}) > 0.5) | torch.eye({seq}, "
                                "dtype=torch.bool)")
        return f", attn_mask={mask}"
    if variant == 2:
        return f", attn_mask={b.buffer('bias', _seeded_randn(b, (seq, seq)))}"
    if variant == 3 and b.ids_fit():
        b.emit(f"mask = ({b.use('ids')} != 0)[:, None, None, :] | torch.eye({seq}, dtype=torch.bool)")
        return ", attn_mask=mask"
    return ""


def _score_bias(b: Builder, a: Args, heads: int) -> str:
    """An additive score bias [n, s, s] read from a learned table: T5's relative buckets, a parameter."""
    seq, variant = b.shape[1], a.next() % 3
    if variant == 0:
        buckets = a.pick([2 * seq - 1, 3, 2])
        half = buckets // 2
        rel = b.attr("rel", f"nn.Embedding({buckets}, {heads})")
        bucket = b.buffer("bucket", f"(torch.arange({seq})[None, :] - torch.arange({seq})[:, None])"
                                    f".clamp({-half}, {buckets - 1 - half}) + {half}")
        return f" + {rel}({bucket}).permute(2, 0, 1)"
    if variant == 1:
        return f" + {b.attr('bias', f'nn.Parameter({_seeded_randn(b, (heads, seq, seq), 0.1)})')}"
    return ""


def op_attention(b: Builder, a: Args) -> None:
    """Multi-head attention: SDPA with a mask, or written out with a learned score bias, causal or not."""
    if b.rank != 3:
        raise Skip
    batch, seq, hidden = b.shape
    heads = a.pick(_divisors(hidden))
    width = hidden // heads
    _project_heads(b, a, heads, width)
    if a.next() % 2:
        b.emit(f"o = F.scaled_dot_product_attention(q, k, v{_sdpa_mask(b, a)})")
    else:
        bias = _score_bias(b, a, heads)
        b.emit(f"scores = q @ k.transpose(-1, -2) * {width ** -0.5!r}{bias}")
        if a.next() % 2:
            causal = b.buffer("causal", f"torch.ones({seq}, {seq}, dtype=torch.bool).triu(1)")
            b.emit(f"scores = scores.masked_fill({causal}, float('-inf'))")
        b.emit("o = torch.softmax(scores, dim=-1) @ v")
    out = b.attr("out", f"nn.Linear({hidden}, {hidden})")
    b.emit(f"h = h + {out}(o.transpose(1, 2).reshape({batch}, {seq}, {hidden}))")


def op_latent_attention(b: Builder, a: Args) -> None:
    """DeepSeek's latent attention in small: keys and values from a normed low-rank latent, each
    head's q and k split into a "nope" and a rotated "rope" part, one rope key shared by the heads."""
    if b.rank != 3:
        raise Skip
    batch, seq, hidden = b.shape
    heads, nope, rope, value = a.pick([2, 1, 4, 3]), a.int(1, 4), a.pick([2, 4]), a.int(1, 4)
    latent = a.pick([4, 3, hidden])
    q = b.attr("q", f"nn.Linear({hidden}, {heads * (nope + rope)}, bias=False)")
    down = b.attr("kv_down", f"nn.Linear({hidden}, {latent + rope}, bias=False)")
    norm = b.attr("kv_norm", f"nn.RMSNorm({latent})")
    up = b.attr("kv_up", f"nn.Linear({latent}, {heads * (nope + value)}, bias=False)")
    out = b.attr("out", f"nn.Linear({heads * value}, {hidden})")
    b.emit(f"q_nope, q_rope = {q}(h).view({batch}, {seq}, {heads}, {nope + rope}).transpose(1, 2)"
           f".split([{nope}, {rope}], -1)",
           f"latent, k_rope = {down}(h).split([{latent}, {rope}], -1)",
           f"kv = {up}({norm}(latent)).view({batch}, {seq}, {heads}, {nope + value}).transpose(1, 2)",
           f"k_nope, v = kv.split([{nope}, {value}], -1)",
           f"k_rope = k_rope.view({batch}, 1, {seq}, {rope})")
    style = a.pick(["interleaved", "half"])
    _rotate(b, "q_rope", [batch, heads, seq, rope], style, "q")
    _rotate(b, "k_rope", [batch, 1, seq, rope], style, "k")
    b.emit("q = torch.cat([q_nope, q_rope], -1)",
           f"k = torch.cat([k_nope, k_rope.expand({batch}, {heads}, {seq}, {rope})], -1)",
           f"o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale={(nope + rope) ** -0.5!r})",
           f"h = h + {out}(o.transpose(1, 2).reshape({batch}, {seq}, {heads * value}))")


# Starts and ends.


def start_program(b: Builder, a: Args) -> None:
    """h from the inputs: x itself, an embedding of the ids, a projection of x, or both summed."""
    p = b.program
    variant = a.next() % 4
    if variant == 0:
        b.emit(f"h = {b.use('x')}")
    elif variant == 1:
        b.emit(f"h = {b.attr('embed', f'nn.Embedding({p.vocab}, {p.features})')}({b.use('ids')})")
        b.embeddings.append(("self.embed0", p.vocab, p.features))
    elif variant == 2:
        width = a.pick([p.features, 8, 6])
        b.emit(f"h = {b.attr('proj', f'nn.Linear({p.features}, {width})')}({b.use('x')})")
        b.set_shape([p.batch, p.seq, width])
        return
    else:
        embed = b.attr("embed", f"nn.Embedding({p.vocab}, {p.features})")
        b.embeddings.append((embed, p.vocab, p.features))
        b.emit(f"h = {embed}({b.use('ids')}) + {b.use('x')}")
    b.set_shape([p.batch, p.seq, p.features])


def _loss(b: Builder, a: Args) -> str:
    """Cross-entropy over a vocab head: by torch's losses (ignored targets, label smoothing, sums,
    the class dim second) or written out; the targets are the ids where `h` is `[b, s, ..]`."""
    lead = b.shape[:-1]
    tied = [(emb, rows) for emb, rows, width in b.embeddings if width == b.shape[-1]]
    if tied and a.next() % 2:  # the head tied to an embedding's table
        emb, vocab = tied[0]
        b.emit(f"logits = h @ {emb}.weight.t()")
    else:
        vocab = b.program.vocab
        head = b.attr("head", f"nn.Linear({b.shape[-1]}, {vocab}, bias={a.pick([False, True])})")
        b.emit(f"logits = {head}(h)")
    if b.rank == 3 and b.ids_fit():
        target = b.use("ids")
    else:
        target = b.buffer("target", f"torch.randint(0, {vocab}, {_tuple(lead)}, generator={b.generator()})")
    variant = a.next() % 7
    if variant == 6 and b.rank == 3 and b.shape[1] > 1:  # a causal LM's: logits of token t, target t + 1
        return f"F.cross_entropy(logits[:, :-1].reshape(-1, {vocab}), {target}[:, 1:].reshape(-1))"
    flat = f"logits.reshape(-1, {vocab}), {target}.reshape(-1)"
    if variant == 0:
        return f"F.cross_entropy({flat})"
    if variant == 1:  # every other target ignored (never all of them)
        b.emit(f"labels = {target}.reshape(-1).masked_fill(torch.arange({math.prod(lead)}) % 2 == 1, -100)")
        return f"F.cross_entropy(logits.reshape(-1, {vocab}), labels)"
    if variant == 2:
        return f"F.cross_entropy({flat}, label_smoothing=0.1, reduction='sum')"
    if variant == 3 and b.rank == 3:
        return f"F.cross_entropy(logits.transpose(1, 2), {target})"
    if variant == 4:
        return f"F.nll_loss(F.log_softmax(logits, -1).reshape(-1, {vocab}), {target}.reshape(-1))"
    return f"-F.log_softmax(logits, dim=-1).gather(-1, {target}[..., None]).mean()"


def end_program(b: Builder, a: Args) -> None:
    """Return h, a loss of it, or both; or h and a value kept by `save`."""
    variant = a.next() % 4
    if variant == 3 and b.saved:
        b.emit(f"return h, {b.saved[-1][0]}")
        return
    if variant in (0, 3):
        b.emit("return h")
        return
    b.emit(f"loss = {_loss(b, a)}")
    b.emit("return loss" if variant == 1 else "return h, loss")


# The grammar's table: the op name of a Step -> the function that resolves it. The simplest first:
# hypothesis shrinks an op name towards the start of this table.
OPS = {
    "linear": op_linear, "act": op_act, "norm": op_norm, "softmax": op_softmax, "reduce": op_reduce,
    "narrow": op_narrow, "slice": op_slice, "select": op_select, "cat": op_cat, "stack": op_stack,
    "split": op_split, "chunk": op_chunk, "tensor_split": op_tensor_split, "as": op_as, "unbind": op_unbind,
    "heads": op_heads, "merge": op_merge,
    "flatten": op_flatten, "unflatten": op_unflatten, "permute": op_permute, "expand": op_expand,
    "repeat": op_repeat, "matmul": op_matmul, "table": op_table, "embed": op_embed, "mlp": op_mlp,
    "rope": op_rope, "pad": op_pad, "roll": op_roll, "shift_copy": op_shift_copy, "index_put": op_index_put,
    "masked_fill": op_masked_fill, "where": op_where, "gather": op_gather, "scatter": op_scatter,
    "cumsum": op_cumsum, "causal_conv": op_causal_conv, "attention": op_attention, "latent_attention": op_latent_attention,
    "squeeze": op_squeeze, "gram": op_gram, "topk": op_topk, "save": op_save, "combine": op_combine,
    "inplace": op_inplace,
}


def _apply(b: Builder, op, args: tuple[int, ...]) -> bool:
    """Resolve one step of `op` into `b`; on Skip leave `b` as it was. Returns whether the step was kept."""
    saved = (list(b.shape), len(b.init), len(b.forward), set(b.inputs), len(b.saved), len(b.embeddings))
    try:
        op(b, Args(args))
        b.kept.append(op.__name__.removeprefix("op_"))
        return True
    except Skip:
        b.shape, b.inputs = saved[0], saved[3]
        del b.init[saved[1]:], b.forward[saved[2]:], b.saved[saved[4]:], b.embeddings[saved[5]:]
        return False


def resolve(program: Program) -> Builder:
    """The program's module, resolved step by step (steps that fit nowhere left out)."""
    b = Builder(program)
    b.tag = "0"
    start_program(b, Args((program.start, program.start // 4)))
    for index, step in enumerate(program.steps, 1):
        b.tag = str(index)
        _apply(b, OPS[step.op], step.args)
    b.tag = ""
    end_program(b, Args((program.end, program.end // 3, program.end // 18)))
    return b


def signature(program: Program) -> frozenset:
    """The ops a program's steps resolved to, its mode, and whether it ends in a loss: what a
    campaign compares to tell a failure already explained by a known minimal program."""
    b = resolve(program)
    ends = "end:loss" if any(line.startswith("loss = ") for line in b.forward) else "end:value"
    return frozenset([*b.kept, f"mode:{program.mesh[2]}", ends])


def _input_names(b: Builder) -> list[str]:
    return [name for name in ("x", "ids") if name in b.inputs]


def build_source(program: Program) -> str:
    """The source of the program's `Fuzzed(nn.Module)` class."""
    b = resolve(program)
    lines = ["class Fuzzed(nn.Module):", "    def __init__(self):", "        super().__init__()"]
    lines += [f"        {line}" for line in b.init]
    lines += ["", f"    def forward(self, {', '.join(_input_names(b))}):"]
    lines += [f"        {part}" for line in b.forward for part in line.split("\n")]
    return "\n".join(lines) + "\n"


NAMESPACE = {"torch": torch, "nn": nn, "F": F, "math": math}


def build_model(program: Program) -> nn.Module:
    """The program's module in float64, its weights drawn after `torch.manual_seed(0)`."""
    namespace = dict(NAMESPACE)
    exec(compile(build_source(program), "<fuzzed program>", "exec"), namespace)  # noqa: S102  (our own source)
    torch.manual_seed(0)
    return namespace["Fuzzed"]().double()


def example_inputs(program: Program) -> tuple[torch.Tensor, ...]:
    """The module's inputs, in its forward's order: x `[b, s, features]` float64, ids `[b, s]`."""
    x = torch.randn(program.batch, program.seq, program.features, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, program.vocab, (program.batch, program.seq), generator=torch.Generator().manual_seed(2))
    given = {"x": x, "ids": ids}
    return tuple(given[name] for name in _input_names(resolve(program)))


def describe(program: Program) -> str:
    """The program's description as Python, one step a line (`Program(...)` rebuilds it)."""
    head = ", ".join(f"{name}={getattr(program, name)!r}" for name in
                     ("mesh", "blocks", "seq", "features", "vocab", "start", "end", "unsplit", "tokens"))
    steps = [f"    Step({step.op!r}, {step.args!r})," for step in program.steps]
    return "\n".join([f"Program({head}, steps=(", *steps, "))"])


def source(program: Program) -> str:
    """Readable, runnable Python of the program: imports, the module, its inputs, the compile."""
    q, d, mode = program.mesh
    names = _input_names(resolve(program))
    make = {
        "x": f"x = torch.randn({program.batch}, {program.seq}, {program.features}, dtype=torch.float64, "
             "generator=torch.Generator().manual_seed(1))",
        "ids": f"ids = torch.randint(0, {program.vocab}, ({program.batch}, {program.seq}), "
               "generator=torch.Generator().manual_seed(2))",
    }
    inputs = ", ".join(names) + ("," if len(names) == 1 else "")
    return "\n".join([
        "import copy", "", "import torch", "import torch.nn.functional as F", "from torch import nn", "",
        "import tess_compile", "", "", build_source(program), "",
        *[f"# {line}" for line in describe(program).splitlines()],
        "torch.manual_seed(0)", "model = Fuzzed().double()", *[make[name] for name in names],
        f"sim = tess_compile.simulate(copy.deepcopy(model), {q}, {d}, mode={mode!r}, example_inputs=({inputs}), "
        f"token_split={_token_split(program)!r})",
        f"out, expected = sim({', '.join(names)}), model({', '.join(names)})",
    ]) + "\n"


# Drawing programs.


def steps(ops=tuple(OPS)):
    """One `Step` of `ops` (hypothesis shrinks its op towards `linear` and its integers towards 0)."""
    return st.builds(Step, st.sampled_from(ops), st.tuples(*[st.integers(0, ARG_MAX)] * NUM_ARGS))


@st.composite
def programs(draw, meshes=MESHES, max_steps: int = MAX_STEPS, ops=tuple(OPS)):
    """Programs on `meshes` of up to `max_steps` steps of `ops`: see the module docstring."""
    return Program(
        mesh=tuple(draw(st.sampled_from(list(meshes)))),
        blocks=draw(st.integers(*BLOCKS)),
        seq=draw(st.integers(*SEQ)),
        features=draw(st.integers(*FEATURES)),
        vocab=draw(st.integers(*VOCAB)),
        start=draw(st.integers(0, ARG_MAX)),
        steps=tuple(draw(st.lists(steps(ops), min_size=1, max_size=max_steps))),
        end=draw(st.integers(0, ARG_MAX)),
        unsplit=draw(st.booleans()),
        tokens=draw(st.sampled_from(["auto", "split"])),
    )


def simpler(program: Program):
    """Programs one step simpler than `program`, simplest first: a step (or two) left out, a step's
    integers or the start and end at 0, smaller sizes. Hypothesis's shrinker can stop at a local
    minimum (a step it could have deleted); trying these until none fails alike finishes it."""
    ops = program.steps
    for width in (1, 2):  # two at once: a pair of products may be needed to keep a layout
        for index in reversed(range(len(ops) - width + 1)):
            if len(ops) > width:
                yield dataclasses.replace(program, steps=ops[:index] + ops[index + width:])
    for index, step in enumerate(ops):
        for position, value in enumerate(step.args):
            if value:
                args = step.args[:position] + (0,) + step.args[position + 1:]
                yield dataclasses.replace(program, steps=ops[:index] + (Step(step.op, args),) + ops[index + 1:])
    if program.unsplit:
        yield dataclasses.replace(program, unsplit=False)
    if program.tokens != "auto":
        yield dataclasses.replace(program, tokens="auto")
    for name, low in (("start", 0), ("end", 0), ("blocks", BLOCKS[0]), ("seq", SEQ[0]), ("features", FEATURES[0]),
                      ("vocab", VOCAB[0])):
        value = getattr(program, name)
        for smaller in sorted({low, value - 1}):
            if low <= smaller < value:
                yield dataclasses.replace(program, **{name: smaller})


def random_program(seed: int, meshes=MESHES, max_steps: int = MAX_STEPS) -> Program:
    """A program drawn from `random.Random(seed)` over the same space as `programs`."""
    rng = random.Random(seed)

    def arg() -> int:
        return rng.randint(0, ARG_MAX)

    num_steps = rng.randint(1, max_steps)
    return Program(
        mesh=tuple(rng.choice(list(meshes))),
        blocks=rng.randint(*BLOCKS),
        seq=rng.randint(*SEQ),
        features=rng.randint(*FEATURES),
        vocab=rng.randint(*VOCAB),
        start=arg(),
        steps=tuple(Step(rng.choice(list(OPS)), tuple(arg() for _ in range(NUM_ARGS))) for _ in range(num_steps)),
        end=arg(),
        unsplit=rng.random() < 0.3,  # drawn last: the other draws of a seed stay as they were
        tokens="split" if rng.random() < 0.3 else "auto",
    )


# Running and checking.


@dataclass
class Outcome:
    """What one program did: status "pass", "value_error", "fail" (a compiler defect) or "invalid"
    (the unsharded model itself failed: a defect of this grammar); `kind` groups messages alike."""

    status: str
    kind: str = ""
    message: str = ""


def message_kind(text: str) -> str:
    """A message with its particulars (names, numbers, shapes, source lines) blanked, to group alike."""
    text = text.strip().splitlines()[0] if text.strip() else ""
    text = re.sub(r" at (<[^>]*>|[^ ]+):\d+", " at <line>", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'_'", text)
    text = re.sub(r"\[[^\[\]]*\]", "[_]", text)
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)
    text = re.sub(r" \(\w+\)", "", text).replace("N-D [_]", "[_]")  # node names; the 1-D mesh
    return text[:160]


def _outputs(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def compare(sim, reference, inputs) -> None:
    """AssertionError unless every output and parameter gradient of `sim` matches `reference`'s."""
    outs, expected = _outputs(sim(*inputs)), _outputs(reference(*inputs))
    assert len(outs) == len(expected), f"{len(outs)} outputs, expected {len(expected)}"
    loss, reference_loss = 0.0, 0.0
    for index, (out, exp) in enumerate(zip(outs, expected)):
        assert_close_rel(out, exp, _rtol(_largest(exp)), f"output {index}")
        target = torch.randn(exp.shape, generator=torch.Generator().manual_seed(7 + index), dtype=exp.dtype)
        loss, reference_loss = loss + (out * target).sum(), reference_loss + (exp * target).sum()
    if not torch.is_tensor(reference_loss) or not reference_loss.requires_grad:
        return
    loss.backward()
    reference_loss.backward()
    _compare_grads(sim.full_grads(), reference)


def _largest(t: torch.Tensor) -> float:
    finite = t.detach()[torch.isfinite(t.detach())]
    return finite.abs().max().item() if finite.numel() else 0.0


def _rtol(own: float, scale: float = 0.0) -> float:
    """assert_close_rel's rtol (which it applies to the tensor's own largest element `own`) that
    measures on `max(own, scale, SCALE_FLOOR)` instead."""
    return RTOL * max(1.0, max(scale, SCALE_FLOOR) / max(own, 1e-12))


def _compare_grads(grads: dict, reference: nn.Module) -> None:
    """Each parameter's gradient within RTOL of the largest gradient of the model (a gradient that is
    zero in exact arithmetic is rounding noise on both sides)."""
    scale = max((_largest(p.grad) for p in reference.parameters() if p.grad is not None), default=0.0)
    for name, param in reference.named_parameters():
        got = grads.get(name)
        if param.grad is None:
            assert got is None or not got.abs().max().item(), f"grad {name}: expected none, got nonzero"
            continue
        assert_close_rel(got, param.grad, _rtol(_largest(param.grad), scale), f"grad {name}")


def _fail(stage: str, err: BaseException) -> Outcome:
    text = f"{type(err).__name__}: {err}"
    return Outcome("fail", f"{stage} {type(err).__name__}: {message_kind(str(err))}", text)


def check(program: Program) -> Outcome:
    """Run `program` unsharded and simulated on its mesh: see the module docstring."""
    model, inputs = build_model(program), example_inputs(program)
    reference = copy.deepcopy(model)
    try:
        expected = _outputs(copy.deepcopy(model)(*inputs))
    except Exception as err:  # noqa: BLE001  (the grammar drew a program torch itself cannot run)
        return Outcome("invalid", f"{type(err).__name__}: {message_kind(str(err))}", f"{type(err).__name__}: {err}")
    if not all(torch.isfinite(value).all() for value in expected):  # nothing to compare NaNs' gradients with
        return Outcome("invalid", "non-finite output of the unsharded model", "non-finite output")
    sim, refused = _compiled(program, model, inputs)
    if sim is None:
        return refused
    return _compared(lambda: compare(sim, reference, inputs), "mismatch", "run")


def _token_split(program: Program) -> str:
    """The compile's `token_split` for `program.tokens`: one axis, or "auto"."""
    return "auto" if program.tokens == "auto" else "col" if program.mesh[2] == "1d" else "row"


def _compiled(program: Program, model: nn.Module, inputs: tuple) -> tuple[object, Outcome | None]:
    """The simulated module of `program`'s mesh, or None and the outcome of its compile: a ValueError
    that names the mesh is a refusal; one without it, a verifier's, or any other error a defect."""
    q, d, mode = program.mesh
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tess_compile.simulate(model, q, d, mode=mode, example_inputs=inputs, verify=True,
                                         token_split=_token_split(program)), None
    except ValueError as err:
        if str(Mesh(q, d, mode)) not in str(err):
            return None, Outcome("fail", f"ValueError without the mesh: {message_kind(str(err))}", str(err))
        if "as a bug" in str(err):  # a verifier's finding, worded for the user: a defect all the same
            return None, Outcome("fail", f"ValueError of a verifier: {message_kind(str(err))}", str(err))
        return None, Outcome("value_error", message_kind(str(err)), str(err))
    except Exception as err:  # noqa: BLE001  (any other exception is a compiler defect)
        return None, _fail("compile", err)


def _compared(run_comparison, mismatch: str, stage: str) -> Outcome:
    """The outcome of `run_comparison()`: its AssertionError a `mismatch`, another error a defect of `stage`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run_comparison()
    except AssertionError as err:
        return Outcome("fail", f"{mismatch}: {_mismatch_kind(str(err))}", str(err))
    except Exception as err:  # noqa: BLE001
        return _fail(stage, err)
    return Outcome("pass")


def _mismatch_kind(text: str) -> str:
    """'output', 'grad' or the assertion's gist (dtype, shape, non-finite values)."""
    what = "output" if text.startswith("output") else "grad" if text.startswith("grad") else "other"
    for gist in ("shape", "dtype", "non-finite", "got None", "expected none", "outputs"):
        if gist in text.split(":", 1)[-1][:60]:
            return f"{what} {gist}"
    return f"{what} values"


# Shrinking within a time budget.

FAILING = ("fail", "invalid")


class Shrinking:
    """`check` for the body of a hypothesis test: outcomes cached by program, and shrinking bounded in
    time. Once `seconds` have passed since the first failure (the first that `starts(program,
    outcome)`, if given), a program not checked before counts as passing without running, so
    hypothesis settles on the smallest failure so far (and its final replay, of a program checked
    before, fails as it did). `runs` counts the programs checked since the clock started."""

    def __init__(self, seconds: float, starts=None):
        self.seconds, self.starts = seconds, starts or (lambda program, outcome: outcome.status in FAILING)
        self.outcomes: dict[str, Outcome] = {}
        self.started, self.runs = None, 0

    def check(self, program: Program) -> Outcome:
        key = repr(program)
        if key not in self.outcomes:
            if self.started is not None:
                if time.monotonic() - self.started > self.seconds:
                    return Outcome("pass", "not run: out of shrinking time")
                self.runs += 1
            self.outcomes[key] = check(program)
            if self.started is None and self.starts(program, self.outcomes[key]):
                self.started = time.monotonic()
        return self.outcomes[key]


def polish(program: Program, outcome: Outcome, seconds: float, alike=None) -> tuple[Program, Outcome]:
    """Finish a shrink: take `simpler` programs that fail alike (the same kind, and `alike(program,
    outcome)` if given) while any does and `seconds` last."""
    deadline, improved = time.monotonic() + seconds, True
    while improved and time.monotonic() < deadline:
        improved = False
        for candidate in simpler(program):
            result = check(candidate)
            if result.kind == outcome.kind and (alike is None or alike(candidate, result)):
                program, outcome, improved = candidate, result, True
                break
    return program, outcome


def check_autocast(program: Program) -> Outcome:
    """`program` in float32, compiled outside autocast and called under bfloat16 autocast (which
    compiles that state's program), against the unsharded float32 model under the same autocast:
    every output and parameter gradient has its dtype, and is finite where the unsharded model's is.
    Values are not compared: in bfloat16 a value near a kink (abs, relu, topk, a mask) falls on
    either side with the order of a sum, and its gradient with it; tests/test_autocast.py checks
    values on models without kinks. "invalid" where the unsharded run fails or is not finite."""
    model = build_model(program).float()
    inputs = tuple(x.float() if x.is_floating_point() else x for x in example_inputs(program))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reference = _outputs(copy.deepcopy(model)(*inputs))
    except Exception as err:  # noqa: BLE001  (the grammar drew a program torch itself cannot run)
        return Outcome("invalid", f"{type(err).__name__}: {message_kind(str(err))}", f"{type(err).__name__}: {err}")
    if not all(torch.isfinite(value).all() for value in reference):
        return Outcome("invalid", "non-finite output of the unsharded model", "non-finite output")
    sim, refused = _compiled(program, copy.deepcopy(model), inputs)
    if sim is None:
        return refused
    return _compared(lambda: _compare_autocast_dtypes(sim, model, inputs), "autocast mismatch", "run under autocast")


def _compare_autocast_dtypes(sim, model: nn.Module, inputs: tuple) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs, expected = _outputs(sim(*inputs)), _outputs(model(*inputs))
    assert len(outs) == len(expected), f"{len(outs)} outputs, expected {len(expected)}"
    loss, reference_loss = 0.0, 0.0
    for index, (out, exp) in enumerate(zip(outs, expected)):
        _assert_like(out, exp, f"output {index}")
        target = torch.randn(exp.shape, generator=torch.Generator().manual_seed(7 + index), dtype=torch.float64)
        loss, reference_loss = loss + (out.double() * target).sum(), reference_loss + (exp.double() * target).sum()
    if not torch.is_tensor(reference_loss) or not reference_loss.requires_grad:
        return
    loss.backward()
    reference_loss.backward()
    grads = sim.full_grads()
    for name, param in model.named_parameters():
        if param.grad is not None:
            _assert_like(grads[name], param.grad, f"grad {name}")


def _assert_like(got: torch.Tensor | None, unsharded: torch.Tensor, name: str) -> None:
    """`got` has the dtype and shape of `unsharded`, and is finite where it is."""
    assert got is not None, f"{name}: none"
    assert got.dtype == unsharded.dtype, f"{name}: dtype {got.dtype}, unsharded {unsharded.dtype}"
    assert got.shape == unsharded.shape, f"{name}: shape {list(got.shape)}, unsharded {list(unsharded.shape)}"
    assert torch.isfinite(got[torch.isfinite(unsharded)]).all(), f"{name}: not finite where the unsharded is"
