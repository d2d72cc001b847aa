"""The docs cite code that exists: every file path of the repository (`passes/place.py`,
`tess_compile/runtime/simulator.py`, `benchmarks/coverage.py`) and every dotted name of the
package in backticks (`tess_compile.passes.driver.compile_model`) in README.md and docs/*.md
names a file, a module or a module's attribute that is there. Each package's docstring names
every module and package it holds."""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:passes|tess_compile|benchmarks|tests|examples|docs)/[\w/.-]*\w)")
DOTTED = re.compile(r"`(tess_compile(?:\.\w+)+)")


def _resolves(name: str) -> bool:
    """Whether `name` is a module of ours, or an attribute of one (a function, a class, a constant)."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the old module paths (tess_compile.moved)
                value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=[doc.name for doc in DOCS])
def test_the_doc_cites_code_that_exists(doc):
    text = doc.read_text()
    paths = {match for match in PATH.findall(text) if "<" not in match and "*" not in match}
    missing = sorted(path for path in paths if not (ROOT / path).exists())
    missing += sorted({name for name in DOTTED.findall(text) if not _resolves(name)})
    assert not missing, f"{doc.name} cites what is not there: {missing}"


PACKAGES = sorted(path.parent for folder in ("tess_compile", "passes") for path in (ROOT / folder).rglob("__init__.py"))


@pytest.mark.parametrize("package", PACKAGES, ids=[str(path.relative_to(ROOT)) for path in PACKAGES])
def test_the_package_docstring_names_its_modules(package):
    """A newcomer reads a package's `__init__` first: its docstring says what each module (and each
    package) in it holds, by name."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    held = [path.stem for path in package.glob("*.py") if path.stem not in ("__init__", "__main__")]
    held += [path.name for path in package.iterdir() if (path / "__init__.py").exists()]
    missing = sorted(name for name in held if not re.search(rf"\b{name}\b", doc))
    assert not missing, f"{package.relative_to(ROOT)}/__init__.py's docstring does not name {missing}: say what each holds"
