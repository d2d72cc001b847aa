"""The compile driver: the passes in order as plain calls, each reported to the observers
(how stage dumps see them; tests/test_imports.py checks that the compiler imports no
analysis), a failing pass named."""

from __future__ import annotations

import pytest
import torch
from models import GPTBlock

import tess_compile.passes.driver as driver
from tess_compile.passes.driver import compile_model
from tess_compile.passes.observers import add_pass_observer, remove_pass_observer
from tess_compile.core.mesh import Mesh


def compile_and_watch(**options) -> list:
    torch.manual_seed(0)
    seen = []

    def observer(result):
        seen.append((result, len(result.graph.graph.nodes)))  # passes may change a graph in place later

    add_pass_observer(observer)
    try:
        compile_model(GPTBlock(8, 2, bias=True), Mesh(2, 2), (torch.randn(4, 3, 8),), **options)
    finally:
        remove_pass_observer(observer)
    return seen


def test_observers_see_every_pass_in_order():
    seen = compile_and_watch()
    results, nodes = [r for r, _ in seen], [n for _, n in seen]
    assert [r.name for r in results] == ["capture", "place", "rewrite", "merge products", "alike regions",
                                           "bucket gradients", "verify rewritten", "report repeated work"]
    assert [r.index for r in results] == list(range(8))
    assert results[0].nodes_before is None
    assert [r.nodes_before for r in results[1:]] == nodes[:-1]
    assert all(r.mesh == Mesh(2, 2) and r.seconds >= 0 for r in results)


@pytest.mark.parametrize("options, extra", [
    ({"verify": True}, "verify placed"),
    ({"recompute": "blocks"}, "recompute blocks"),
    ({"recompute": "selective"}, "recompute selective"),
])
def test_options_add_their_passes(options, extra):
    assert extra in [r.name for r, _ in compile_and_watch(**options)]


def test_a_failing_pass_is_named(monkeypatch):
    def broken(gm, mesh, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(driver, "rewrite", broken)
    with pytest.raises(RuntimeError, match=r"tess-compile pass 'rewrite' failed on mesh \[q=2, q=2, d=2\]: 'a bug'"):
        compile_and_watch()


def test_a_pass_must_give_a_graph(monkeypatch):
    monkeypatch.setattr(driver, "bucket_gradients", lambda gm, mesh: None)
    with pytest.raises(AssertionError, match="pass 'bucket gradients' returned NoneType, not a GraphModule"):
        compile_and_watch()

