"""Observers of a compile: callables that see the graph after each pass.

The driver (`tess_compile.passes.driver`) reports every pass it runs to the observers
registered here and knows nothing else of them; whoever wants to look at the
stages registers one (the stage dumps of `TESS_COMPILE_DUMP`,
`tess_compile.analysis.graph_dump`, as inductor's `GraphTransformObserver`
serves its debug dumps). An observer must not change the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.fx import GraphModule

from tess_compile.core.mesh import Mesh

__all__ = ["PassResult", "add_pass_observer", "notify", "remove_pass_observer"]


@dataclass(frozen=True)
class PassResult:
    """One pass of one compile: its position in the compile (0: capture), its name, the graph
    it left, the mesh, the graph's node count before it (None for capture) and its seconds."""

    index: int
    name: str
    graph: GraphModule
    mesh: Mesh
    nodes_before: int | None
    seconds: float


_OBSERVERS: list[Callable[[PassResult], None]] = []


def add_pass_observer(observer: Callable[[PassResult], None]) -> Callable[[PassResult], None]:
    """Call `observer(result)` after every pass of every compile from now on; returns it."""
    if observer not in _OBSERVERS:
        _OBSERVERS.append(observer)
    return observer


def remove_pass_observer(observer: Callable[[PassResult], None]) -> None:
    if observer in _OBSERVERS:
        _OBSERVERS.remove(observer)


def notify(result: PassResult) -> None:
    """Give `result` to every observer, in the order they were added."""
    for observer in list(_OBSERVERS):
        observer(result)
