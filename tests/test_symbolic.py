"""Bytes moved as formulas (`tess_compile.analysis.symbolic`).

Derived from one compile, the formulas are exact there (they equal the
graph's prediction and the runtime's records) and true formulas: at other
meshes and sizes of the same model family they give those compiles' bytes
exactly. Also the closed forms of Megatron-LM and of one Tesseract product,
the naming of sizes and its errors, and the dump's formula lines.
"""

from __future__ import annotations

import functools

import pytest
import sympy
import torch
from models import make_block
from torch import nn

import tess_compile
from tess_compile.passes.driver import compile_model
from tess_compile.analysis.accounting import bytes_from_records, predict_bytes
from tess_compile.analysis.graph_dump import dump
from tess_compile.analysis.symbolic import evaluate_bytes, format_symbolic, symbolic_bytes
from tess_compile.analysis.symbolic_shapes import mesh_values, name_dim
from tess_compile.core.mesh import Mesh

b, s, h, q, d, p = sympy.symbols("b s h q d p", positive=True, integer=True)
FP32 = 4

# Where the formulas are derived: every mesh axis of size > 1, sizes that read one way only.
DERIVE = {
    "2.5d": (Mesh(2, 2), {"b": 8, "s": 6, "h": 40, "n": 4}),
    "1d": (Mesh(2, 2, "1d"), {"b": 8, "s": 6, "h": 40, "n": 8}),
}
# (mode, q, d, scale): meshes of other shapes (d = 1 included) and sizes scaled by 2; the fast tier checks
# FAST_CHECKS (another mesh for each family of formulas, sizes scaled in one), the slow tier the others.
FAST_CHECKS = (("2.5d", 2, 1, 1), ("1d", 1, 4, 2))
CHECKS = [
    ("2.5d", 3, 3, 1),
    ("2.5d", 2, 1, 1),
    ("2.5d", 4, 2, 1),
    ("2.5d", 3, 1, 2),
    ("2.5d", 2, 2, 2),
    ("2d", 3, 1, 1),
    ("3d", 3, 3, 1),
    ("1d", 1, 2, 1),
    ("1d", 2, 1, 1),
    ("1d", 3, 1, 1),
    ("1d", 1, 4, 2),
    ("1d", 2, 2, 2),
]


def check_id(mode: str, qq: int, dd: int, scale: int) -> str:
    return f"{mode}-q{qq}d{dd}" + ("-x2" if scale > 1 else "")


def family_sizes(mesh: Mesh, scale: int) -> dict[str, int]:
    """Sizes that split evenly on `mesh`; b, s and h times `scale`."""
    if mesh.mode == "1d":
        base = {"b": 3, "s": 5, "h": 8 * mesh.num_ranks, "n": 2 * mesh.num_ranks}
    else:
        base = {"b": 2 * mesh.d * mesh.q, "s": 5, "h": 8 * mesh.q, "n": 2 * mesh.q}
    return {k: v * scale if k in "bsh" else v for k, v in base.items()}


def compile_block(kind: str, mesh: Mesh, sizes: dict[str, int], summa: str = "broadcast"):
    torch.manual_seed(0)
    model = make_block(kind, sizes["h"], sizes["n"])
    x = torch.randn(sizes["b"], sizes["s"], sizes["h"])
    return compile_model(model, mesh, (x,), summa=summa)


def named(sizes: dict[str, int]) -> dict[str, int]:
    """The sizes the formulas use (the head count moves no bytes of its own)."""
    return {k: v for k, v in sizes.items() if k != "n"}


@functools.cache
def derived(kind: str, family: str, summa: str = "broadcast"):
    """The program and formulas at DERIVE[family] ("2.5d" serves 2d and 3d too)."""
    mesh, sizes = DERIVE[family]
    program = compile_block(kind, mesh, sizes, summa)
    return program, symbolic_bytes(program, named(sizes))


@pytest.mark.parametrize("mode, qq, dd, scale", [
    pytest.param(*check, id=check_id(*check), marks=() if check in FAST_CHECKS else (pytest.mark.slow,))
    for check in CHECKS])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_formulas_hold_on_other_meshes_and_sizes(kind, mode, qq, dd, scale):
    _, formulas = derived(kind, "1d" if mode == "1d" else "2.5d")
    mesh = Mesh(qq, dd, mode)
    sizes = family_sizes(mesh, scale)
    program = compile_block(kind, mesh, sizes)
    assert evaluate_bytes(formulas, mesh, named(sizes)) == predict_bytes(program)


@pytest.mark.parametrize("mode", ["2.5d", "1d"])
def test_exact_where_derived_and_equal_to_the_records(mode):
    program, formulas = derived("gpt", mode)
    mesh, sizes = DERIVE[mode]
    assert evaluate_bytes(formulas, mesh, named(sizes)) == predict_bytes(program)
    sim = tess_compile.simulate(make_block("gpt", sizes["h"], sizes["n"]), mesh.q, mesh.d, mode=mode,
                                example_inputs=(torch.randn(sizes["b"], sizes["s"], sizes["h"]),), summa="broadcast")
    x = torch.randn(sizes["b"], sizes["s"], sizes["h"])
    sim(x).square().sum().backward()
    assert evaluate_bytes(formulas, mesh, named(sizes)) == bytes_from_records(sim.comm.records)


@pytest.mark.parametrize("summa", ["overlap", "gather"])
def test_formulas_of_other_schedules(summa):
    _, formulas = derived("gpt", "2.5d", summa)
    for qq, dd, scale in [(3, 1, 1), (2, 2, 2)]:
        mesh = Mesh(qq, dd)
        sizes = family_sizes(mesh, scale)
        assert evaluate_bytes(formulas, mesh, named(sizes)) == predict_bytes(compile_block("gpt", mesh, sizes, summa))


@pytest.mark.parametrize("kind, replicated_params", [("gpt", 6), ("llama", 2)])
def test_megatron_closed_form(kind, replicated_params):
    """Megatron-LM: two all-reduces of [b, s, h] a layer in forward, 2*b*s*h*elem bytes a
    rank; in backward their adjoints (the same bytes) plus the gradients of the
    parameters every rank holds whole (norm weights and biases, row-parallel biases)."""
    _, formulas = derived(kind, "1d")
    assert set(formulas["forward"]) == {("all_reduce", "col")}
    assert sympy.simplify(formulas["forward"][("all_reduce", "col")].bytes - 2 * b * s * h * FP32) == 0
    backward = formulas["backward"][("all_reduce", "col")].bytes
    assert sympy.simplify(backward - (2 * b * s * h + replicated_params * h) * FP32) == 0


def test_tesseract_closed_form_of_one_product():
    """C = X @ W^T, X [b, s, h] and W [f, h], on [q, q, d]: q broadcasts of X's block
    [b/(d*q), s, h/q] along col and of W's block [f/q, h/q] along row; backward
    the same broadcasts again (the fetched blocks are not kept), their reduces,
    and W's gradient all-reduced along depth."""
    f = sympy.Symbol("f", positive=True, integer=True)
    sizes = {"b": 8, "s": 5, "h": 6, "f": 14}
    x = torch.randn(sizes["b"], sizes["s"], sizes["h"])
    program = compile_model(nn.Linear(6, 14, bias=False), Mesh(2, 2), (x,), summa="broadcast")
    formulas = symbolic_bytes(program, sizes, inputs_require_grad=True)
    expected = {
        "forward": {("broadcast", "col"): b * s * h / (d * q), ("broadcast", "row"): f * h / q},
        "backward": {("reduce", "col"): b * s * h / (d * q), ("reduce", "row"): f * h / q,
                     ("broadcast", "col"): b * s * h / (d * q), ("broadcast", "row"): f * h / q,
                     ("all_reduce", "depth"): f * h / q**2},
    }
    for phase, by_key in expected.items():
        assert set(formulas[phase]) == set(by_key)
        for key, elements in by_key.items():
            assert sympy.simplify(formulas[phase][key].bytes - FP32 * elements) == 0, (phase, key)


def test_format_lines():
    _, formulas = derived("gpt", "2.5d")
    mesh, sizes = DERIVE["2.5d"]
    lines = format_symbolic(formulas, {**named(sizes), **mesh_values(mesh)})
    assert "forward broadcast along col: 7*b*h*s/(d*q) * 4 bytes = 13440" in lines
    assert "backward all_reduce along depth: h*(12*h + 13*q)/q**2 * 4 bytes = 20240" in lines
    assert len(lines) == sum(len(by_key) for by_key in formulas.values())


def test_dump_prints_formulas_only_when_asked():
    model, x = nn.Linear(6, 14, bias=False), torch.randn(8, 5, 6)
    plain = dump(model, 2, 2, example_inputs=(x,), summa="broadcast")
    text = dump(model, 2, 2, example_inputs=(x,), summa="broadcast", sizes={"b": 8, "s": 5, "h": 6, "f": 14})
    assert "formulas" not in plain
    assert text.startswith(plain.split("\np_weight")[0])
    assert "# bytes moved as formulas (b=8, s=5, h=6, f=14, q=2, d=2, p=8):" in text
    assert "#   forward broadcast along row: f*h/q * 4 bytes = 168" in text
    with pytest.raises(ValueError, match="only the rewritten stage"):
        dump(model, 2, 2, example_inputs=(x,), stage="placed", sizes={"b": 8})


def test_naming_of_dims():
    sizes = {"b": 8, "s": 6, "h": 40}
    assert name_dim(1, sizes) == 1
    assert name_dim(120, sizes) == 3 * h
    assert name_dim(48, sizes) == b * s
    with pytest.raises(ValueError, match=r"reads as b or as s.*tell them apart"):
        name_dim(8, {"b": 8, "s": 8})
    with pytest.raises(ValueError, match=r"reads as 4\*h or as h\*n"):
        name_dim(160, {"h": 40, "n": 4})
    with pytest.raises(ValueError, match=r"none of the sizes .* sizes\['f'\] = 7"):
        name_dim(7, sizes)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ({"q": 4}, "mesh symbol"),
        ({"b": 1}, "integer > 1"),
        ({}, "names no size"),
    ],
)
def test_bad_sizes(sizes, message):
    program, _ = derived("gpt", "2.5d")
    with pytest.raises(ValueError, match=message):
        symbolic_bytes(program, sizes)


def test_ambiguous_sizes_name_the_value():
    """Batch equal to sequence: the error names the value, its readings and the fix."""
    program = compile_block("gpt", Mesh(2, 2), {"b": 8, "s": 8, "h": 40, "n": 4})
    with pytest.raises(ValueError, match=r"global shape \[8, 8, 40\].*reads as b or as s"):
        symbolic_bytes(program, {"b": 8, "s": 8, "h": 40})
