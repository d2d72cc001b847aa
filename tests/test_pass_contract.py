"""The contract between the passes: every key our code reads or writes in `node.meta` and `gm.meta`
is a `MetaKey` of `tess_compile.core.meta_keys` (torch's own keys aside), used through its
accessors; the boundary pass writes the caller's boundary; and no rule family imports another's
file (a family that needs another's rule asks the table)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from models import GPTBlock

import tess_compile.core.meta_keys as meta_keys
from tess_compile.passes.boundary import mark_boundary
from tess_compile.passes.capture import capture
from tess_compile.passes.driver import compile_model
from tess_compile.passes.rules import FAMILIES
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import (
    CARRIED,
    CARRIED_OUTPUTS,
    KEYS,
    LAYOUT,
    LOCAL_INPUT,
    LOCAL_OUTPUTS,
    ROLE,
    SCHEDULE_COUNTS,
    TORCH_KEYS,
    MetaKey,
)

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "passes").rglob("*.py"), *(ROOT / "tess_compile").rglob("*.py")])

# Files that still spell some of our keys as strings, to be converted by their owners.
AWAITING_CONVERSION: set[str] = set()
# Torch's own keys of the same name as one of ours: AOTAutograd reads a `CheckpointPolicy` under "recompute".
TORCH_USES = {("tess_compile/runtime/inductor.py", "recompute")}


def _is_meta(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "meta"


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def meta_keys_used(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, key) of each string key used with a `.meta`: `x.meta["k"]`, `x.meta.get("k")` (pop,
    setdefault), `"k" in x.meta`, `x.meta.update(k=...)`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_meta(node.value) and _string(node.slice) is not None:
            found.append((node.lineno, _string(node.slice)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_meta(node.func.value):
            if node.func.attr in ("get", "pop", "setdefault") and node.args and _string(node.args[0]) is not None:
                found.append((node.lineno, _string(node.args[0])))
            elif node.func.attr == "update":
                found += [(node.lineno, kw.arg) for kw in node.keywords if kw.arg is not None]
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if _string(node.left) is not None and any(_is_meta(c) for c in node.comparators):
                found.append((node.lineno, _string(node.left)))
    return sorted(found)


def _uses() -> dict[str, list[tuple[int, str]]]:
    return {str(path.relative_to(ROOT)): meta_keys_used(ast.parse(path.read_text())) for path in SOURCES}


def test_the_scan_finds_every_form_of_use():
    code = 'a.meta["x"]; a.meta.get("y", 1); b.meta.pop("z"); "w" in c.meta; d.meta.update(v=1); e["u"]; f.get("t")'
    assert sorted(key for _, key in meta_keys_used(ast.parse(code))) == ["v", "w", "x", "y", "z"]


def test_every_key_our_code_uses_is_in_the_contract():
    unknown = [f"{path}:{line}: meta[{key!r}]" for path, uses in _uses().items() for line, key in uses
               if key not in KEYS and key not in TORCH_KEYS]
    assert not unknown, "keys that tess_compile.core.meta_keys does not define:\n" + "\n".join(unknown)


def test_our_keys_are_used_through_the_contract():
    spelled = [f"{path}:{line}: meta[{key!r}]" for path, uses in _uses().items() if path not in AWAITING_CONVERSION
               for line, key in uses if key in KEYS and (path, key) not in TORCH_USES]
    assert not spelled, "use the MetaKey of tess_compile.core.meta_keys:\n" + "\n".join(spelled)


def test_the_contract_documents_each_key():
    defined = {name: value for name, value in vars(meta_keys).items() if isinstance(value, MetaKey)}
    assert sorted(key.name for key in defined.values()) == sorted(KEYS)
    assert set(defined) <= set(meta_keys.__all__)
    for name, key in defined.items():
        assert KEYS[key.name] is key, name
        doc = key.__doc__.lower()
        assert "written" in doc and "read" in doc, f"{name}: say who writes and who reads it"
        assert key.__doc__.isascii(), name
    assert not set(KEYS) & set(TORCH_KEYS)


def test_the_accessors():
    key: MetaKey[int] = MetaKey("example", "Written by no pass; read by this test.")
    node = torch.fx.Graph().placeholder("x")
    assert not key.has(node) and key.get(node) is None and key.get(node, 3) == 3
    with pytest.raises(KeyError, match="example"):
        key.of(node)
    key.set(node, 1)
    assert key.has(node) and key.of(node) == 1 and node.meta["example"] == 1
    assert key.setdefault(node, 2) == 1
    assert key.pop(node) == 1 and not key.has(node) and key.pop(node, 5) == 5
    assert key.setdefault(node, 2) == 2 and key.of(node) == 2
    gm, meta = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), {}
    key.set(gm, 4)
    key.set(meta, 6)
    assert gm.meta == {"example": 4} and key.of(meta) == 6 and repr(key) == "MetaKey('example')"


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    return compile_model(GPTBlock(8, 2, bias=True), Mesh(2, 2), (torch.randn(4, 3, 8),))


def test_the_per_rank_graph_holds_only_contract_keys(program):
    found = {key for node in program.graph.graph.nodes for key in node.meta}
    assert found <= set(KEYS) | set(TORCH_KEYS), found - set(KEYS) - set(TORCH_KEYS)
    assert SCHEDULE_COUNTS.of(program.graph) == program.schedules
    placeholders = program.graph.graph.find_nodes(op="placeholder")
    assert [ROLE.of(n)[0] for n in placeholders].count("input") == 1
    assert all(LAYOUT.has(n) for n in placeholders)


class _TwoInputs(torch.nn.Module):
    def forward(self, x, cache, *, scale):
        return x * scale, cache + x


def test_the_boundary_pass_marks_the_callers_boundary():
    gm = capture(_TwoInputs(), (torch.randn(4, 8), torch.randn(4, 8)), {"scale": torch.randn(4, 8)})
    mark_boundary(gm, Mesh(2, 1), local_inputs=True, local_outputs=True, carried={1: 1})
    inputs = {ROLE.of(n)[1]: n for n in gm.graph.find_nodes(op="placeholder")}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert [LOCAL_INPUT.has(inputs[i]) for i in range(3)] == [True, True, False], "keyword inputs stay whole"
    assert [CARRIED.has(inputs[i]) for i in range(3)] == [False, True, False]
    assert LOCAL_OUTPUTS.of(output) and CARRIED_OUTPUTS.of(output) == {1: inputs[1]}


def test_no_rule_family_imports_another():
    families = {f"tess_compile.passes.rules.{family.name}" for family in FAMILIES}
    wrong = []
    for family in FAMILIES:
        path = ROOT / "passes" / "rules" / f"{family.name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
                wrong += [f"{family.name} imports {name}" for name in names if name in families]
    assert not wrong, "a family asks the table for another's rule (PlacementContext.rule):\n" + "\n".join(wrong)
