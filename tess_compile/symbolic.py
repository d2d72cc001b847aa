"""Bytes moved as formulas: `accounting.predict_bytes` in the model's sizes and the mesh.

An analysis of the rewritten graph (stage 3's output), as `accounting` is;
it writes nothing. The user names the model's sizes, e.g.
`sizes={"b": 8, "s": 12, "h": 40}`, and each collective's bytes become a
sympy expression in those names and the mesh symbols `q`, `d`, `p`:

- the local shape of the value a collective moves is derived symbolically.
  A node that holds one of the model's values carries its global shape and
  layout (`meta["global_shape"]`, `meta["layout"]`, written by the rewrite):
  each local dim is a global dim, named by `name_dim`, over the sizes of the
  mesh axes that split it. Other nodes (the inner nodes of a lowering:
  partial products, norm statistics, collective chains) take their shape
  from their arguments' by `SHAPE_RULES`;
- a mesh axis has size `d` (depth) or `q` (row, col); in mode "1d" the col
  axis has size `p = q*q*d` and the others size 1 (`AXIS_SYMBOLS`);
- the q steps of a SUMMA loop (`meta["summa_step"]`, written by
  `passes.summa`) move equal bytes: step 0 counts q times, the others not.

Each node's formula is checked against its numeric cost at the compiled
sizes and mesh, and the totals against `bytes_by_phase`, so evaluated there
the formulas equal `predict_bytes` (and the runtime's records) exactly.
A collective along an axis of size 1 is never emitted: derive on a mesh
whose axes all have size > 1 to see every term; `evaluate_bytes` counts 0
for an axis of size 1. Reads `meta["layout"]`, `meta["global_shape"]`,
`meta["summa_step"]`, `meta["role"]` and `meta["dtype"]`. See
docs/accounting.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import sympy
import torch
from torch.fx import GraphModule, Node

from passes.lowering_rules import arange_like
from tess_compile.accounting import PHASES, CollectiveCost, bytes_by_phase, collective_costs, fake_run
from tess_compile.collectives import COLLECTIVE_OPS
from tess_compile.compiler import Program
from tess_compile.layout import Layout, Shard
from tess_compile.mesh import AXES, Mesh

__all__ = [
    "AXIS_SYMBOLS",
    "MESH_SYMBOLS",
    "SHAPE_RULES",
    "ByteFormula",
    "NodeFormula",
    "evaluate_bytes",
    "format_symbolic",
    "formulas_by_phase",
    "mesh_values",
    "name_dim",
    "size_symbols",
    "symbolic_bytes",
    "symbolic_costs",
    "symbolic_parameter_bytes",
    "symbolic_shapes",
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


# ------------------------------------------------------------------ sizes


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


# --------------------------------------------------------------- formulas


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


def _formula(parts: dict[int, sympy.Expr]) -> ByteFormula:
    terms = [(size, sympy.factor(parts[size])) for size in sorted(parts)]
    return ByteFormula(tuple((size, e) for size, e in terms if e != 0))


@dataclass(frozen=True)
class NodeFormula:
    """The symbolic bytes of one collective node; None where `cost`'s are None."""

    cost: CollectiveCost
    forward: ByteFormula | None
    backward: ByteFormula | None


Formulas = dict[str, dict[tuple[str, str], ByteFormula]]


def symbolic_bytes(program: Program, sizes: Mapping[str, int], *, inputs_require_grad: bool = False) -> Formulas:
    """`{"forward": {(op, axis): ByteFormula}, "backward": {...}}`: `predict_bytes` as formulas.

    In the names of `sizes` (the sizes the model was compiled with) and the
    mesh symbols q, d, p; see the module docstring.
    """
    costs = symbolic_costs(program.graph, program.mesh, sizes, inputs_require_grad=inputs_require_grad)
    return formulas_by_phase(costs)


def formulas_by_phase(formulas: list[NodeFormula]) -> Formulas:
    """Node formulas summed per phase and (op, axis), as `accounting.bytes_by_phase` sums costs."""
    parts: dict[str, dict[tuple[str, str], dict[int, sympy.Expr]]] = {phase: {} for phase in PHASES}
    for f in formulas:
        for phase, op, formula in (("forward", f.cost.op, f.forward), ("backward", f.cost.backward_op, f.backward)):
            if formula is None:
                continue
            key = parts[phase].setdefault((op, f.cost.axis), {})
            for size, elements in formula.terms:
                key[size] = key.get(size, 0) + elements
    return {phase: {key: _formula(by_size) for key, by_size in sorted(parts[phase].items())} for phase in PHASES}


def symbolic_costs(
    gm: GraphModule,
    mesh: Mesh,
    sizes: Mapping[str, int],
    *,
    inputs_require_grad: bool = False,
    costs: list[CollectiveCost] | None = None,
) -> list[NodeFormula]:
    """The formula of every collective node of the per-rank `gm` that sends bytes, in graph order.

    `costs` (from `collective_costs` with the same options) saves a second
    fake run of the graph.
    """
    size_symbols(sizes)  # bad sizes fail before any work
    if costs is None:
        costs = collective_costs(gm, mesh, inputs_require_grad=inputs_require_grad)
    shapes = _Shapes(mesh, sizes, fake_run(gm, mesh, inputs_require_grad=inputs_require_grad))
    formulas = []
    for cost in costs:
        step = cost.node.meta.get("summa_step")
        repeat = sympy.Integer(1) if step is None else q if step == 0 else sympy.Integer(0)  # loops run q steps
        forward = shapes.bytes_of(cost.node.args[0], cost.forward_bytes, repeat)
        backward = shapes.bytes_of(cost.backward_value, cost.backward_bytes, repeat)
        if forward is not None or backward is not None:
            formulas.append(NodeFormula(cost, forward, backward))
    _check_totals(formulas, costs, mesh, sizes)
    return formulas


def _check_totals(formulas: list[NodeFormula], costs: list[CollectiveCost], mesh: Mesh, sizes) -> None:
    """The formulas at the compiled sizes and mesh equal the numeric bytes (an invariant)."""
    values = {**sizes, **mesh_values(mesh)}
    by_phase = formulas_by_phase(formulas)
    derived = {phase: {key: f.at(values) for key, f in by_key.items()} for phase, by_key in by_phase.items()}
    assert derived == bytes_by_phase(costs), (
        f"symbolic bytes {derived} differ from the graph's {bytes_by_phase(costs)} on mesh {mesh}: "
        "a SUMMA loop whose steps move unequal bytes, or a shape rule that is wrong"
    )


def evaluate_bytes(formulas: Formulas, mesh: Mesh, sizes: Mapping[str, int]) -> dict[str, dict[tuple[str, str], int]]:
    """The formulas' bytes on `mesh` with `sizes`, as `predict_bytes` gives them: an axis of
    size 1 has no collectives, so its keys are left out."""
    values = {**sizes, **mesh_values(mesh)}
    out: dict[str, dict[tuple[str, str], int]] = {}
    for phase, by_key in formulas.items():
        out[phase] = {key: f.at(values) for key, f in by_key.items() if mesh.size(key[1]) > 1}
    return out


def format_symbolic(formulas: Formulas, values: Mapping[str, int]) -> list[str]:
    """One line per phase and (op, axis): `forward broadcast along col: 7*b*h*s/(d*q) * 4 bytes = 26880`.

    `values` gives each symbol a value, e.g. `{**sizes, **mesh_values(mesh)}`.
    """
    lines = []
    for phase in PHASES:
        for (op, axis), formula in formulas.get(phase, {}).items():
            lines.append(f"{phase} {op} along {axis}: {formula} = {formula.at(values)}")
    return lines


def symbolic_shapes(program: Program, sizes: Mapping[str, int], nodes: list[Node]) -> dict[Node, Shape]:
    """The local shape of each of `nodes` (tensors of `program.graph`) in the names of
    `sizes` and the mesh symbols, checked against a fake run."""
    shapes = _Shapes(program.mesh, sizes, fake_run(program.graph, program.mesh))
    return {node: shapes.of(node) for node in nodes}


def symbolic_parameter_bytes(program: Program, sizes: Mapping[str, int]) -> ByteFormula:
    """The bytes of the parameter shards one rank holds, as a formula."""
    params = [n for n in program.graph.graph.nodes if n.op == "placeholder" and n.meta["role"][0] == "param"]
    parts: dict[int, sympy.Expr] = {}
    for node, shape in symbolic_shapes(program, sizes, params).items():
        size = node.meta["dtype"].itemsize
        parts[size] = parts.get(size, 0) + math.prod(shape, start=sympy.Integer(1))
    return _formula(parts)


# ----------------------------------------------------------------- shapes


class _Shapes:
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
        layout, global_shape = node.meta.get("layout"), node.meta.get("global_shape")
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
        name = COLLECTIVE_OPS.get(node.target)
        rule = SHAPE_RULES.get(name) if name is not None else SHAPE_RULES.get(node.target, _broadcast)
        shape = rule(self, node)
        if not self._matches(node, shape):
            raise ValueError(self._no_rule(node, f"its rule gives {shape}"))
        return shape

    def _no_rule(self, node: Node, why: str) -> str:
        return (
            f"cannot derive the local shape of {node.name} ({node.target}) symbolically: {why}; "
            "add a rule for the op to tess_compile.symbolic.SHAPE_RULES"
        )

    def tensor_args(self, node: Node) -> list[Node]:
        return [a for a in node.all_input_nodes if isinstance(self.values.get(a), torch.Tensor)]


# ------------------------------------------------------------ shape rules
# A rule is `rule(shapes, node) -> Shape | None`: the symbolic local shape of
# `node` from its arguments' (`shapes.of(arg)`). Its result is checked
# against the fake run's shape.


def _same(shapes: _Shapes, node: Node) -> Shape:
    return shapes.of(node.args[0])


def _scale_dim(factor_of):
    """A split-op rule: dim `node.args[3]` times `factor_of(axis size)`."""

    def rule(shapes: _Shapes, node: Node) -> Shape:
        dims = list(shapes.of(node.args[0]))
        axis, dim = node.args[1], node.args[3]
        dims[dim] = dims[dim] * factor_of(shapes.axis_sizes[axis])
        return tuple(dims)

    return rule


def _reduced(shapes: _Shapes, node: Node) -> Shape:
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


def _cat(shapes: _Shapes, node: Node) -> Shape:
    """Tensors joined along `args[1]` (default 0): that dim is the sum of theirs."""
    parts = [shapes.of(t) for t in node.args[0]]
    dims = list(parts[0])
    at = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(dims)
    dims[at] = sympy.Add(*(part[at] for part in parts))
    return tuple(dims)


def _slice(shapes: _Shapes, node: Node) -> Shape | None:
    """`x[start::step]` along `args[1]`: ceil((size - start) / step) elements. A slice that
    ends before the dim does, or counts from its end, has no rule."""
    dims = list(shapes.of(node.args[0]))
    at, start, end, step = (list(node.args[1:]) + [0, 0, None, 1][len(node.args) - 1:])[:4]
    at, start = at % len(dims), start or 0
    if start < 0 or (end is not None and end < int(dims[at].subs(shapes.at))):
        return None
    dims[at] = sympy.ceiling((dims[at] - start) / step)
    return tuple(dims)


def _scalar(shapes: _Shapes, node: Node) -> Shape:
    return ()


def _linear(shapes: _Shapes, node: Node) -> Shape:
    return shapes.of(node.args[0])[:-1] + shapes.of(node.args[1])[:1]


def _matmul(shapes: _Shapes, node: Node) -> Shape | None:
    a, b = shapes.of(node.args[0]), shapes.of(node.args[1])
    if len(a) < 2 or len(b) < 2:
        return None
    batch = _broadcast_shapes(shapes, [a[:-2], b[:-2]], shapes._numeric(node)[:-2])
    return None if batch is None else batch + (a[-2], b[-1])


def _embedding(shapes: _Shapes, node: Node) -> Shape:
    return shapes.of(node.args[1]) + shapes.of(node.args[0])[-1:]


def _arange_like(shapes: _Shapes, node: Node) -> Shape:
    return (name_dim(node.args[1], shapes.sizes, f"the length of {node.name}"),)


def _unsqueeze(shapes: _Shapes, node: Node) -> Shape:
    dims = list(shapes.of(node.args[0]))
    dim = node.args[1] % (len(dims) + 1)
    return tuple(dims[:dim] + [sympy.Integer(1)] + dims[dim:])


def _select(shapes: _Shapes, node: Node) -> Shape:
    dims = list(shapes.of(node.args[0]))
    del dims[node.args[1] % len(dims)]
    return tuple(dims)


def _transpose(shapes: _Shapes, node: Node) -> Shape:
    dims = list(shapes.of(node.args[0]))
    i, j = (a % len(dims) for a in node.args[1:3])
    dims[i], dims[j] = dims[j], dims[i]
    return tuple(dims)


def _permute(shapes: _Shapes, node: Node) -> Shape:
    dims = shapes.of(node.args[0])
    return tuple(dims[i % len(dims)] for i in node.args[1])


def _broadcast_shapes(shapes: _Shapes, operands: list[Shape], out: tuple[int, ...]) -> Shape | None:
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


def _broadcast(shapes: _Shapes, node: Node) -> Shape | None:
    """Elementwise ops and conversions: the broadcast of the tensor arguments."""
    operands = [shapes.of(a) for a in shapes.tensor_args(node)]
    return _broadcast_shapes(shapes, operands, shapes._numeric(node))


aten = torch.ops.aten

# By collective name (`COLLECTIVE_OPS`) or by graph target; anything else broadcasts.
SHAPE_RULES = {
    "broadcast": _same,
    "reduce": _same,
    "all_reduce": _same,
    "keep_first": _same,
    "grad_sync": _same,
    "seed_once": _same,
    "all_gather": _scale_dim(lambda size: size),
    "shard_pad": _scale_dim(lambda size: size),
    "reduce_scatter": _scale_dim(lambda size: 1 / size),
    "shard_slice": _scale_dim(lambda size: 1 / size),
    aten.sum.dim_IntList: _reduced,
    aten.mean.dim: _reduced,
    aten.logsumexp.default: _reduced,
    aten.amax.default: _reduced,
    aten.amin.default: _reduced,
    aten.cat.default: _cat,
    aten.slice.Tensor: _slice,
    aten.sum.default: _scalar,
    aten.mean.default: _scalar,
    aten.linear.default: _linear,
    aten.matmul.default: _matmul,
    aten.mm.default: _matmul,
    aten.bmm.default: _matmul,
    aten.embedding.default: _embedding,
    arange_like: _arange_like,
    aten.unsqueeze.default: _unsqueeze,
    aten.select.int: _select,
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
}
