"""The import structure: no circles between modules or between packages (each package's
`__init__` included), layers that only import downwards, the packages pyproject.toml installs,
and every module importable first in a fresh interpreter. The compiler's folder `passes/` is the
package `tess_compile.passes` (pyproject.toml's package-dir)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Each package folder of the repository, by the name it is installed under.
FOLDERS = {"tess_compile": ROOT / "tess_compile", "tess_compile.passes": ROOT / "passes"}

# tess_compile's layers, lowest first: a module imports only from its own layer and those
# below it. The compiler (`passes`) sits on core and ops; the face on everything.
LAYERS = (
    ("tess_compile.core",),
    ("tess_compile.ops",),
    ("tess_compile.passes", "tess_compile.runtime"),
    ("tess_compile.analysis",),
    ("tess_compile.training", "tess_compile.scale_out", "tess_compile.generation"),
    ("tess_compile", "tess_compile.backend", "tess_compile.cli", "tess_compile.keep_float64", "tess_compile.moved",
     "tess_compile.validation"),
)


def _modules() -> dict[str, Path]:
    """Every module of ours by its dotted name (a package by its own name: its `__init__.py`)."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _known(name: str, modules) -> str | None:
    """`name`, or the innermost module of ours that holds it (`a.b.c` of a function c: `a.b`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules) -> set[str]:
    """The modules of ours that `module` imports, at any depth of its code (functions too).
    `from package import name` counts as an import of `package.name` where that is a module.
    A package's `__init__`, which Python runs before any of its submodules, is not counted
    for the submodules: each module imports its names from the module that defines them."""
    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(filter(None, (_known(alias.name, modules) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = _known(f"{base}.{alias.name}", modules)
                out.add(target if target == f"{base}.{alias.name}" else _known(base, modules))
    out.discard(None)
    out.discard(module)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str):
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_no_import_circles(graph):
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _layer(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (module.startswith(prefix + ".") and prefix != "tess_compile")
            if matches and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer of LAYERS: add it"
    return best[0]


def test_layers_import_only_downwards(graph):
    upward = [f"{module} -> {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
              if _layer(target) > _layer(module)]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_the_compiler_imports_only_core_and_ops(graph):
    wrong = [f"{module} -> {target}" for module, targets in sorted(graph.items())
             if module.startswith("tess_compile.passes") for target in sorted(targets)
             if not target.startswith(("tess_compile.core", "tess_compile.ops", "tess_compile.passes"))]
    assert not wrong, "\n".join(wrong)


def _package(module: str, modules) -> str:
    """The package a module belongs to: the subpackage of tess_compile (`tess_compile.passes.rules`
    counts as `tess_compile.passes`), or the face (`tess_compile`) for the modules at its top."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and ".".join(parts[:2]) in modules else parts[0]


def test_no_circles_among_packages(graph):
    """Packages, their `__init__` included, import one another without a circle: a package's
    `__init__` runs before any of its modules, so a circle between packages is one at import time."""
    modules = _modules()
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        own = _package(module, modules)
        packages.setdefault(own, set()).update(_package(t, modules) for t in targets if _package(t, modules) != own)
    cycle = _cycle(packages)
    assert cycle is None, "package circle: " + " -> ".join(cycle)


def _defined(path: Path) -> set[str]:
    """The names a module defines itself (functions, classes, assignments at its top)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_names_come_from_the_modules_that_define_them(graph):
    """A module imports a name from the module that defines it, never from a package's `__init__`
    that imports it from elsewhere: so any module may be imported first (see `test_import_first`)."""
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules and modules[node.module].name == "__init__.py":
                defined = _defined(modules[node.module])
                names = [a.name for a in node.names if f"{node.module}.{a.name}" not in modules and a.name not in defined]
                if names and not module.startswith(node.module):
                    wrong.append(f"{module}: from {node.module} import {', '.join(names)}")
    assert not wrong, "\n".join(wrong)


def test_pyproject_installs_every_package():
    """pyproject.toml's package list names every package folder, under the name it has here."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(tess_compile[\w.]*)"', text.split("[tool.setuptools.package-dir]")[0]))
    found = {module for module, path in _modules().items() if path.name == "__init__.py"}
    assert listed == found, f"missing from pyproject.toml: {sorted(found - listed)}; not a package: {sorted(listed - found)}"


# Each module imported first, in one interpreter: our modules are dropped from `sys.modules`
# between imports (torch stays loaded), so each import starts from nothing of ours.
_IMPORT_EACH_FIRST = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] == "tess_compile"]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
        import tess_compile
        assert all(callable(getattr(tess_compile, n)) for n in tess_compile.__all__)
    except Exception as err:
        failed.append(f"import {name} first: {type(err).__name__}: {err}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow  # a fresh interpreter per half of the modules: 13 s
def test_every_module_imports_first():
    modules = sorted(module for module in _modules() if not module.endswith("__main__"))
    halves = [subprocess.Popen([sys.executable, "-c", _IMPORT_EACH_FIRST, *modules[k::2]], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k in range(2)]  # two at once
    for run in halves:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, out + err[-3000:]
