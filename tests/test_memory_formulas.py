"""Per-rank memory and FLOPs against the Tesseract paper (papers/tesseract-2.5d.md).

For one product C = A @ B, A [a, b] and B [b, c], eq. 7-8 give the elements
one rank holds under Tesseract, a*b/p + b*c*d/p + a*c/p, and eq. 9-10 under
Megatron-LM, a*b + b*c/p + a*c/p. Both are checked on the per-rank graph of
a bias-free nn.Linear (which stores B^T as its weight [c, b]): numerically
from a fake run, and as formulas (`tess_compile.analysis.symbolic`) that equal the
paper's. What autograd saves for backward is A's share, a*b/p (Megatron: a*b). FLOPs: no rank repeats another's matmul work in any mode.
"""

from __future__ import annotations

import math

import pytest
import sympy
import torch
from models import make_block
from torch import nn

from tess_compile.passes.driver import compile_model
from tess_compile.analysis.accounting import forward_flops
from tess_compile.analysis.memory import activation_bytes
from tess_compile.analysis.symbolic import symbolic_parameter_bytes, symbolic_shapes
from tess_compile.core.fake_run import fake_run
from tess_compile.core.flops import flop_counter
from tess_compile.core.mesh import Mesh
from tess_compile.ops.collectives import COLLECTIVE_OPS

a, b, c, q, d, p = sympy.symbols("a b c q d p", positive=True, integer=True)
batch, seq = sympy.symbols("batch seq", positive=True, integer=True)
FP32 = 4

# (mode, q, d)
MEMORY_MESHES = [
    ("2.5d", 2, 1), ("2.5d", 2, 2), ("2.5d", 3, 3), ("2.5d", 4, 2), ("1d", 1, 2), ("1d", 2, 1), ("1d", 2, 2),
]


def mesh_id(mode: str, qq: int, dd: int) -> str:
    return f"{mode}-q{qq}d{dd}"


def paper_elements(mode: str, rows, inner, outer):
    """Eq. 8 (Tesseract) or eq. 10 (Megatron-LM): A, B and C elements one rank holds."""
    if mode == "1d":
        return rows * inner + inner * outer / p + rows * outer / p
    return rows * inner / p + inner * outer * d / p + rows * outer / p


def eq7(rows, inner, outer, qq, dd):
    """Eq. 7, Tesseract's blocks [a/(d*q), b/q], [b/q, c/q], [a/(d*q), c/q]."""
    return rows // (dd * qq) * (inner // qq) + inner // qq * (outer // qq) + rows // (dd * qq) * (outer // qq)


def linear_sizes(mesh: Mesh, three_dims: bool) -> dict[str, int]:
    """Sizes that split evenly on `mesh` and read one way only."""
    parts, rows = mesh.size("col"), mesh.size("depth") * mesh.size("row")
    inner, outer = 5 * mesh.q if mesh.mode != "1d" else 5, 7 * parts
    if three_dims:
        return {"batch": 2 * rows, "seq": 3, "b": inner, "c": outer}
    return {"a": 11 * rows, "b": inner, "c": outer}


def per_rank_operands(program) -> tuple:
    """The per-rank nodes of A (the input once sliced), B (the weight) and C (the output)."""
    nodes = list(program.graph.graph.nodes)
    x = next(n for n in nodes if n.op == "placeholder" and n.meta["role"][0] == "input")
    while len(x.users) == 1 and COLLECTIVE_OPS.get(next(iter(x.users)).target) == "shard_slice":
        x = next(iter(x.users))
    weight = next(n for n in nodes if n.op == "placeholder" and n.meta["role"][0] == "param")
    output = next(n for n in nodes if n.op == "output").args[0][0]
    return x, weight, output


@pytest.mark.parametrize("three_dims", [False, True], ids=["a-b", "batch-seq-b"])
@pytest.mark.parametrize("mode, qq, dd", MEMORY_MESHES, ids=[mesh_id(*m) for m in MEMORY_MESHES])
def test_memory_of_one_product(mode, qq, dd, three_dims):
    mesh = Mesh(qq, dd, mode)
    sizes = linear_sizes(mesh, three_dims)
    rows = sizes["a"] if not three_dims else sizes["batch"] * sizes["seq"]
    shape = (sizes["a"],) if not three_dims else (sizes["batch"], sizes["seq"])
    program = compile_model(nn.Linear(sizes["b"], sizes["c"], bias=False), mesh, (torch.randn(*shape, sizes["b"]),))
    operands = per_rank_operands(program)

    values = fake_run(program.graph, mesh)
    held = sum(values[n].numel() for n in operands)
    numbers = {p: mesh.num_ranks, d: mesh.d, a: rows, b: sizes["b"], c: sizes["c"]}
    assert held == paper_elements(mode, a, b, c).subs(numbers)
    if mode != "1d":
        assert held == eq7(rows, sizes["b"], sizes["c"], qq, dd)

    shapes = symbolic_shapes(program, sizes, list(operands))
    formula = sum(math.prod(shapes[n], start=sympy.Integer(1)) for n in operands)
    rows_symbol = a if not three_dims else batch * seq
    paper = paper_elements(mode, rows_symbol, b, c)
    if mode != "1d":
        paper = paper.subs(p, q**2 * d)
    assert sympy.simplify(formula - paper) == 0, (formula, paper)
    weight_bytes = symbolic_parameter_bytes(program, sizes).bytes
    weight_elements = b * c / p if mode == "1d" else (b * c * d / p).subs(p, q**2 * d)
    assert sympy.simplify(weight_bytes - FP32 * weight_elements) == 0

    # Saved for backward (dW = A^T dC): this rank's own block of A, a*b/p elements under
    # Tesseract (no fetched block kept), the whole A under Megatron's column parallelism.
    saved = activation_bytes(program)
    saved_elements = rows * sizes["b"] if mode == "1d" else rows * sizes["b"] // mesh.num_ranks
    assert saved == FP32 * saved_elements


# (mode, q, d): every mode; 1-D over p = 2, 4, 8 ranks.
FLOP_MESHES = [
    ("1d", 1, 2), ("1d", 2, 1), ("1d", 2, 2), ("2d", 2, 1), ("2d", 3, 1), ("2.5d", 2, 2), ("2.5d", 4, 2), ("3d", 2, 2),
]


@pytest.mark.parametrize("mode, qq, dd", FLOP_MESHES, ids=[mesh_id(*m) for m in FLOP_MESHES])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_per_rank_flops_times_p_equal_the_model(kind, mode, qq, dd):
    torch.manual_seed(0)
    mesh = Mesh(qq, dd, mode)
    parts, rows = mesh.size("col"), mesh.size("depth") * mesh.size("row")
    model = make_block(kind, 8 * parts, 2 * parts)
    x = torch.randn(2 * rows, 8, 8 * parts)
    program = compile_model(model, mesh, (x,))
    with flop_counter() as counter:
        model(x)
    total = counter.get_total_flops()
    per_rank = forward_flops(program)
    assert abs(per_rank * mesh.num_ranks - total) <= 0.01 * total, (per_rank, mesh.num_ranks, total)
