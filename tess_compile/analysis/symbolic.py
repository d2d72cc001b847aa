"""Bytes moved as formulas: `accounting.predict_bytes` in the model's sizes and the mesh.

An analysis of the rewritten graph (stage 3's output), as `accounting` is;
it writes nothing. The user names the model's sizes, e.g.
`sizes={"b": 8, "s": 12, "h": 40}`, and each collective's bytes become a
sympy expression in those names and the mesh symbols `q`, `d`, `p`:

- the local shape of the value a collective moves is derived symbolically.
  A node that holds one of the model's values carries its global shape and
  layout (`GLOBAL_SHAPE`, `LAYOUT` of `tess_compile.core.meta_keys`, written by the rewrite):
  each local dim is a global dim, named by `name_dim`, over the sizes of the
  mesh axes that split it. Other nodes (the inner nodes of a lowering:
  partial products, norm statistics, collective chains) take their shape
  from their arguments' by `SHAPE_RULES`;
- a mesh axis has size `d` (depth) or `q` (row, col); in mode "1d" the col
  axis has size `p = q*q*d` and the others size 1 (`AXIS_SYMBOLS`);
- the q steps of a SUMMA loop (`SUMMA_STEP`, written by
  `tess_compile.passes.summa`) move equal bytes: step 0 counts q times, the others not.

Each node's formula is checked against its numeric cost at the compiled
sizes and mesh, and the totals against `bytes_by_phase`, so evaluated there
the formulas equal `predict_bytes` (and the runtime's records) exactly.
A collective along an axis of size 1 is never emitted: derive on a mesh
whose axes all have size > 1 to see every term; `evaluate_bytes` counts 0
for an axis of size 1. Reads `LAYOUT`, `GLOBAL_SHAPE`, `SUMMA_STEP`, `ROLE` and `DTYPE`. See
docs/accounting.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import sympy
from torch.fx import GraphModule, Node

from tess_compile.analysis.accounting import PHASES, CollectiveCost, bytes_by_phase, collective_costs
from tess_compile.analysis.symbolic_shapes import ByteFormula, Shape, SymbolicShapes, mesh_values, q, size_symbols
from tess_compile.core.fake_run import fake_run
from tess_compile.core.layout import Layout
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import DTYPE, GLOBAL_SHAPE, LAYOUT, ROLE, SUMMA_STEP
from tess_compile.core.program import Program

__all__ = [
    "Formulas",
    "NodeFormula",
    "evaluate_bytes",
    "format_symbolic",
    "formulas_by_phase",
    "symbolic_bytes",
    "symbolic_costs",
    "symbolic_parameter_bytes",
    "symbolic_shapes",
]


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
    _check_even(gm, mesh)
    if costs is None:
        costs = collective_costs(gm, mesh, inputs_require_grad=inputs_require_grad)
    shapes = SymbolicShapes(mesh, sizes, fake_run(gm, mesh, inputs_require_grad=inputs_require_grad))
    formulas = []
    for cost in costs:
        step = SUMMA_STEP.get(cost.node)
        repeat = sympy.Integer(1) if step is None else q if step == 0 else sympy.Integer(0)  # loops run q steps
        forward = shapes.bytes_of(cost.node.args[0], cost.forward_bytes, repeat)
        backward = shapes.bytes_of(cost.backward_value, cost.backward_bytes, repeat)
        if forward is not None or backward is not None:
            formulas.append(NodeFormula(cost, forward, backward))
    _check_totals(formulas, costs, mesh, sizes)
    return formulas


def _check_even(gm: GraphModule, mesh: Mesh) -> None:
    """ValueError if a value is split unevenly: its blocks are a ceiling, which no formula here says."""
    for node in gm.graph.nodes:
        layout, shape = LAYOUT.get(node), GLOBAL_SHAPE.get(node)
        if isinstance(layout, Layout) and shape is not None and layout.uneven_dims(shape, mesh):
            raise ValueError(
                f"{node.name} of shape {list(shape)} is split unevenly ({layout}) on mesh {mesh}: its blocks are "
                "padded to ceil(size / parts), which the byte formulas do not express; leave sizes out, or use "
                "sizes the mesh divides"
            )


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
    shapes = SymbolicShapes(program.mesh, sizes, fake_run(program.graph, program.mesh))
    return {node: shapes.of(node) for node in nodes}


def symbolic_parameter_bytes(program: Program, sizes: Mapping[str, int]) -> ByteFormula:
    """The bytes of the parameter shards one rank holds, as a formula."""
    params = [n for n in program.graph.graph.nodes if n.op == "placeholder" and ROLE.of(n)[0] == "param"]
    parts: dict[int, sympy.Expr] = {}
    for node, shape in symbolic_shapes(program, sizes, params).items():
        size = DTYPE.of(node).itemsize
        parts[size] = parts.get(size, 0) + math.prod(shape, start=sympy.Integer(1))
    return _formula(parts)
