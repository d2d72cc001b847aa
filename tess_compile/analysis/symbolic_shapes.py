"""Local shapes of a per-rank graph as formulas in the model's sizes and the mesh.

The user names the model's sizes, e.g. `sizes={"b": 8, "s": 12, "h": 40}`;
`name_dim` reads a number as one of them (x, 2x, 3x, 4x, x*y or x/y), and
`SymbolicShapes` derives each tensor's local shape symbolically: a node that holds
one of the model's values carries its global shape and layout
(`GLOBAL_SHAPE` and `LAYOUT` of `tess_compile.core.meta_keys`, written by the rewrite), so each
local dim is a global dim over the sizes of the mesh axes that split it;
other nodes (the inner nodes of a lowering) take their shape from their
arguments': a collective by its record's `scale`
(`tess_compile.core.collective_table`), a product by its record's `shape`
(`tess_compile.core.product_table`), any other op by `SHAPE_RULES`. A
mesh axis has size `d` (depth) or `q` (row, col); in mode "1d" the col axis
has size `p = q*q*d` (`AXIS_SYMBOLS`). Every derived shape is checked
against a fake run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import sympy
import torch
from torch.fx import Node

from tess_compile.core.collective_table import COLLECTIVES
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.meta_keys import GLOBAL_SHAPE, LAYOUT
from tess_compile.core.product_table import product_kernel
from tess_compile.ops.collectives import COLLECTIVE_OPS
from tess_compile.ops.local import arange_like

__all__ = [
    "AXIS_SYMBOLS",
    "ByteFormula",
    "MESH_SYMBOLS",
    "SHAPE_RULES",
    "Shape",
    "SymbolicShapes",
    "d",
    "mesh_values",
    "name_dim",
    "p",
    "q",
    "size_symbols",
]

q, d, p = (sympy.Symbol(name, positive=True, integer=True) for name in ("q", "d", "p"))


MESH_SYMBOLS = {"q": q, "d": d, "p": p}


# The size of each mesh axis, per mode (mesh.py): Tesseract's [q, q, d]; 1-D puts
# all p = q*q*d ranks on col.
AXIS_SYMBOLS = {
    "1d": {"depth": sympy.Integer(1), "row": sympy.Integer(1), "col": p},
    "2d": {"depth": d, "row": q, "col": q},
    "2.5d": {"depth": d, "row": q, "col": q},
    "3d": {"depth": d, "row": q, "col": q},
}


# Multiples of one size that a dim may be (fused QKV 3h, an MLP's 4h).
_COEFFICIENTS = (2, 3, 4)


Shape = tuple[sympy.Expr, ...]


@dataclass(frozen=True)
class ByteFormula:
    """Bytes as elements times element size: `terms` are (element size, elements)."""

    terms: tuple[tuple[int, sympy.Expr], ...]

    @property
    def bytes(self) -> sympy.Expr:
        return sympy.Add(*(size * elements for size, elements in self.terms))

    def at(self, values: Mapping[str, int]) -> int:
        """The bytes with every symbol given a value (`values` by name)."""
        number = self.bytes.subs({sympy.Symbol(k, positive=True, integer=True): v for k, v in values.items()})
        if not number.is_Integer:
            raise ValueError(f"{self} is not a whole number at {dict(values)}: give every symbol a value")
        return int(number)

    def __str__(self) -> str:
        parts = []
        for size, elements in self.terms:
            text = str(elements)
            parts.append(f"({text}) * {size} bytes" if isinstance(elements, sympy.Add) else f"{text} * {size} bytes")
        return " + ".join(parts) if parts else "0 bytes"


def size_symbols(sizes: Mapping[str, int]) -> dict[str, sympy.Symbol]:
    """A positive integer symbol per name of `sizes`, after checking the names and values."""
    if not isinstance(sizes, Mapping) or not sizes:
        raise ValueError(f"sizes={sizes!r} names no size: pass a dict such as sizes={{'b': 8, 's': 12, 'h': 40}}")
    for name, value in sizes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"size name {name!r} is not an identifier: use names such as 'b', 's', 'h'")
        if name in MESH_SYMBOLS:
            raise ValueError(f"size name {name!r} is a mesh symbol (q, d, p): rename it, e.g. {name + '_'!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(
                f"size {name}={value!r} is not an integer > 1 (a size of 1 cannot be told from a "
                f"broadcast dim): compile the model with {name} > 1, or leave {name} out of sizes"
            )
    return {name: sympy.Symbol(name, positive=True, integer=True) for name in sizes}


def _readings(value: int, sizes: Mapping[str, int]) -> list[sympy.Expr]:
    """Every way `value` reads as x, 2x, 3x, 4x, x*y or x/y of the named sizes."""
    symbols = size_symbols(sizes)
    names = list(sizes)
    found = []
    for name in names:
        found += [c * symbols[name] for c in (1,) + _COEFFICIENTS if c * sizes[name] == value]
    for i, x in enumerate(names):
        found += [symbols[x] * symbols[y] for y in names[i:] if sizes[x] * sizes[y] == value]
        found += [symbols[x] / symbols[y] for y in names if y != x and sizes[x] == value * sizes[y]]
    return found


def name_dim(value: int, sizes: Mapping[str, int], what: str = "a dim") -> sympy.Expr:
    """`value` as a size of `sizes`: 1, x, 2x, 3x, 4x, x*y or x/y, exactly one of them.

    ValueError if `value` reads none of these ways (name it in `sizes`) or
    more than one (compile with sizes that tell the readings apart).
    """
    if value == 1:
        return sympy.Integer(1)
    readings = _readings(value, sizes)
    if len(readings) == 1:
        return readings[0]
    named = ", ".join(f"{k}={v}" for k, v in sizes.items())
    if not readings:
        raise ValueError(
            f"{what} is {value}, which is none of the sizes ({named}) nor 2x, 3x, 4x, x*y or x/y "
            f"of them: add a name for it to sizes, e.g. sizes['f'] = {value}"
        )
    raise ValueError(
        f"{what} is {value}, which reads as {' or as '.join(map(str, readings))} with sizes {named}: "
        "compile with sizes that tell them apart (distinct sizes, none 2, 3 or 4 times another "
        "nor a product of two others), or leave the unneeded names out of sizes"
    )


def mesh_values(mesh: Mesh) -> dict[str, int]:
    """Values of the mesh symbols on `mesh`: q, d and p = q*q*d."""
    return {"q": mesh.q, "d": mesh.d, "p": mesh.num_ranks}


class SymbolicShapes:
    """Symbolic local shapes of the per-rank graph's tensors, derived on demand."""

    def __init__(self, mesh: Mesh, sizes: Mapping[str, int], values: dict[Node, object]):
        self.mesh, self.sizes, self.values = mesh, dict(sizes), values
        self.symbols = size_symbols(sizes)
        self.at = {self.symbols[k]: v for k, v in sizes.items()}
        self.at.update({MESH_SYMBOLS[k]: v for k, v in mesh_values(mesh).items()})
        self.axis_sizes = AXIS_SYMBOLS[mesh.mode]
        self.known: dict[Node, Shape] = {}

    def bytes_of(self, nodes: Node | tuple[Node, ...], num_bytes: int | None, repeat: sympy.Expr) -> ByteFormula | None:
        """The formula of `num_bytes`, the bytes of the local tensor of `nodes` (one node or
        several, summed), `repeat` times."""
        if num_bytes is None:
            return None
        parts: dict[int, sympy.Expr] = {}
        for node in nodes if isinstance(nodes, tuple) else (nodes,):
            size = self.values[node].element_size()
            parts[size] = parts.get(size, 0) + math.prod(self.of(node), start=sympy.Integer(1))
        assert sum(int(e.subs(self.at)) * size for size, e in parts.items()) == num_bytes, (nodes, parts, num_bytes)
        return ByteFormula(tuple((size, repeat * parts[size]) for size in sorted(parts)))

    def of(self, node: Node) -> Shape:
        if node not in self.known:
            shape = self._annotated(node)
            if shape is None:
                shape = self._by_rule(node)
            self.known[node] = shape
        return self.known[node]

    def _numeric(self, node: Node) -> tuple[int, ...]:
        return tuple(self.values[node].shape)

    def _matches(self, node: Node, shape: Shape | None) -> bool:
        return shape is not None and tuple(int(e.subs(self.at)) for e in shape) == self._numeric(node)

    def _annotated(self, node: Node) -> Shape | None:
        """Global dims named by `sizes` over the sizes of the axes that split them."""
        layout, global_shape = LAYOUT.get(node), GLOBAL_SHAPE.get(node)
        if not isinstance(layout, Layout) or not isinstance(self.values.get(node), torch.Tensor):
            return None
        if not all(isinstance(n, int) for n in global_shape):
            return None
        dims = [
            name_dim(n, self.sizes, f"dim {i} of {node.name} (global shape {list(global_shape)}, layout {layout})")
            for i, n in enumerate(global_shape)
        ]
        for axis in AXES:
            placement = layout.on(axis)
            if isinstance(placement, Shard):
                dims[placement.dim] = dims[placement.dim] / self.axis_sizes[axis]
        shape = tuple(dims)
        return shape if self._matches(node, shape) else None

    def _by_rule(self, node: Node) -> Shape:
        if node.op != "call_function" or not isinstance(self.values.get(node), torch.Tensor):
            raise ValueError(self._no_rule(node, "it is not one tensor computed by a call"))
        if self._numeric(node) == ():
            return ()
        rule = _collective if node.target in COLLECTIVE_OPS else SHAPE_RULES.get(node.target, _product_or_broadcast)
        shape = rule(self, node)
        if not self._matches(node, shape):
            raise ValueError(self._no_rule(node, f"its rule gives {shape}"))
        return shape

    def _no_rule(self, node: Node, why: str) -> str:
        return (
            f"cannot derive the local shape of {node.name} ({node.target}) symbolically: {why}; "
            "add a rule for the op to tess_compile.analysis.symbolic_shapes.SHAPE_RULES (a product: its record's "
            "shape, tess_compile.core.product_table)"
        )

    def tensor_args(self, node: Node) -> list[Node]:
        return [a for a in node.all_input_nodes if isinstance(self.values.get(a), torch.Tensor)]


def _collective(shapes: SymbolicShapes, node: Node) -> Shape:
    """A collective `op(x, axis, ...)`: x's shape, or for a split op `op(x, axis, parts, dim, groups)`
    x's with `dim` times the axis size to the power of the op's `scale`."""
    scale = COLLECTIVES[COLLECTIVE_OPS[node.target]].scale
    if scale == 0:
        return shapes.of(node.args[0])
    dims = list(shapes.of(node.args[0]))
    axis, dim = node.args[1], node.args[3]
    dims[dim] = dims[dim] * shapes.axis_sizes[axis] ** scale
    return tuple(dims)


def _reduced(shapes: SymbolicShapes, node: Node) -> Shape:
    """sum/mean/logsumexp/amax over `args[1]` (all dims if empty), `keepdim` in `args[2]`."""
    dims = list(shapes.of(node.args[0]))
    reduce_dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if reduce_dims is None or reduce_dims == []:
        reduce_dims = list(range(len(dims)))
    if isinstance(reduce_dims, int):
        reduce_dims = [reduce_dims]
    chosen = {r % len(dims) for r in reduce_dims} if dims else set()
    if keepdim:
        return tuple(sympy.Integer(1) if i in chosen else e for i, e in enumerate(dims))
    return tuple(e for i, e in enumerate(dims) if i not in chosen)


def _cat(shapes: SymbolicShapes, node: Node) -> Shape:
    """Tensors joined along `args[1]` (default 0): that dim is the sum of theirs."""
    parts = [shapes.of(t) for t in node.args[0]]
    dims = list(parts[0])
    at = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(dims)
    dims[at] = sympy.Add(*(part[at] for part in parts))
    return tuple(dims)


def _slice(shapes: SymbolicShapes, node: Node) -> Shape | None:
    """`x[start::step]` along `args[1]`: ceil((size - start) / step) elements. A slice that
    ends before the dim does, or counts from its end, has no rule."""
    dims = list(shapes.of(node.args[0]))
    at, start, end, step = (list(node.args[1:]) + [0, 0, None, 1][len(node.args) - 1:])[:4]
    at, start = at % len(dims), start or 0
    if start < 0 or (end is not None and end < int(dims[at].subs(shapes.at))):
        return None
    dims[at] = sympy.ceiling((dims[at] - start) / step)
    return tuple(dims)


def _scalar(shapes: SymbolicShapes, node: Node) -> Shape:
    return ()


def _embedding(shapes: SymbolicShapes, node: Node) -> Shape:
    return shapes.of(node.args[1]) + shapes.of(node.args[0])[-1:]


def _arange_like(shapes: SymbolicShapes, node: Node) -> Shape:
    return (name_dim(node.args[1], shapes.sizes, f"the length of {node.name}"),)


def _unsqueeze(shapes: SymbolicShapes, node: Node) -> Shape:
    dims = list(shapes.of(node.args[0]))
    dim = node.args[1] % (len(dims) + 1)
    return tuple(dims[:dim] + [sympy.Integer(1)] + dims[dim:])


def _select(shapes: SymbolicShapes, node: Node) -> Shape:
    dims = list(shapes.of(node.args[0]))
    del dims[node.args[1] % len(dims)]
    return tuple(dims)


def _transpose(shapes: SymbolicShapes, node: Node) -> Shape:
    dims = list(shapes.of(node.args[0]))
    i, j = (a % len(dims) for a in node.args[1:3])
    dims[i], dims[j] = dims[j], dims[i]
    return tuple(dims)


def _permute(shapes: SymbolicShapes, node: Node) -> Shape:
    dims = shapes.of(node.args[0])
    return tuple(dims[i % len(dims)] for i in node.args[1])


def _broadcast_shapes(shapes: SymbolicShapes, operands: list[Shape], out: tuple[int, ...]) -> Shape | None:
    """Right-aligned broadcast of symbolic `operands` to the numeric `out`: each dim from an
    operand whose dim has that size, a dim that is not the literal 1 first."""
    result = []
    for position in range(1, len(out) + 1):
        found = [
            s[-position] for s in operands if len(s) >= position and int(s[-position].subs(shapes.at)) == out[-position]
        ]
        if not found:
            return None
        result.append(next((e for e in found if e != 1), found[0]))
    return tuple(reversed(result))


def _broadcast(shapes: SymbolicShapes, node: Node) -> Shape | None:
    """Elementwise ops and conversions: the broadcast of the tensor arguments."""
    operands = [shapes.of(a) for a in shapes.tensor_args(node)]
    return _broadcast_shapes(shapes, operands, shapes._numeric(node))


def _product_or_broadcast(shapes: SymbolicShapes, node: Node) -> Shape | None:
    """A product by its record's shape rule (`tess_compile.core.product_table`), of the shapes of its input
    and weight; any other op as `_broadcast`."""
    kernel = product_kernel(node.target)
    if kernel is None or kernel.shape is None:
        return _broadcast(shapes, node)
    a, w = (shapes.of(kernel.arg(node.args, role)) for role in ("input", "weight"))
    return kernel.shape(a, w, lambda batch: _broadcast_shapes(shapes, list(batch), shapes._numeric(node)[:-2]))


aten = torch.ops.aten


# By graph target, besides the collectives (`_collective`) and the products (`_product_or_broadcast`); anything
# else broadcasts.
SHAPE_RULES = {
    aten.sum.dim_IntList: _reduced,
    aten.mean.dim: _reduced,
    aten.logsumexp.default: _reduced,
    aten.amax.default: _reduced,
    aten.amin.default: _reduced,
    aten.cat.default: _cat,
    aten.slice.Tensor: _slice,
    aten.sum.default: _scalar,
    aten.mean.default: _scalar,
    aten.embedding.default: _embedding,
    arange_like: _arange_like,
    aten.unsqueeze.default: _unsqueeze,
    aten.select.int: _select,
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
}
