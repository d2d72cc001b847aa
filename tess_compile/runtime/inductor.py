"""The compile=True runtime: a per-rank program through inductor, forward and backward.

`CompiledRank` hands the per-rank FX graph to inductor's `compile_fx`, the
function `torch.compile(backend="inductor")` runs on the graph Dynamo
captures; this graph is captured already, so Dynamo is skipped. AOTAutograd
traces forward and backward under `TracingComm`, a communicator that emits
every collective as its custom op (`tess::broadcast`, ...). So the
collectives' adjoints, the refetches of `fetched_product` (whose backward
still keeps only this rank's own blocks) and the all-reduces of
`split_norm`'s backward land in the compiled graphs as op calls beside
the local kernels, which inductor compiles, products and norms included:
no graph break anywhere. At run time each op calls the communicator in
force (`use_comm`); the compiled backward runs under `backward_comm()`,
phase "backward", as eager autograd does.

Recompute regions (`tess_compile.ops.recompute_region`) stay in force: their nodes carry
`CheckpointPolicy.MUST_RECOMPUTE`, one `ac_graph_id` per region, so the
partitioner saves a region's inputs and recomputes what backward needs of
it, collectives included, in the backward graph.

The ops are pure (no mutation, no effect tokens): every rank compiles the
same graph with the same passes, so whatever inductor reorders or drops,
it does alike on every rank, and the collectives still meet. (An effectful
op would also make the partitioner refuse checkpoint regions.)
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch.fx import GraphModule
from torch.utils.checkpoint import CheckpointPolicy

from tess_compile.core.program import Program
from tess_compile.ops.collectives import Comm, use_comm
from tess_compile.ops.recompute_region import region_runs

__all__ = ["CompiledRank", "TracingComm", "inductor_graph"]


class TracingComm(Comm):
    """Each collective as a call of its custom op (what the compiled graphs hold)."""

    def run(self, op: str, x: torch.Tensor, *args) -> torch.Tensor:
        return getattr(torch.ops.tess, op).default(x, *args)

    def wait(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tess.wait.default(x)


def inductor_graph(graph: GraphModule) -> GraphModule:
    """A copy of the per-rank `graph` whose recompute regions are tagged for AOTAutograd."""
    gm = copy.deepcopy(graph)
    runs = region_runs(gm.graph)
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)  # the region's name; AOTAutograd reads a policy there
    for region_id, (_, nodes) in enumerate(runs):
        for node in nodes:
            node.meta.update(recompute=CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=region_id)
    return gm


# Backward compiled with forward (threads share one compiled function); no common-subexpression
# elimination over the joint graph, which would merge a product's backward refetch with its
# forward fetch and so keep the fetched block for backward.
_COMPILE_CONFIG = dict(force_non_lazy_backward_lowering=True, cse=False)


class CompiledRank:
    """One rank's program compiled by inductor, once per grad mode, pattern of inputs that
    require grad and (a `dynamic=True` program's) input shapes, as Dynamo's guards would
    recompile: inductor compiles for the shapes it is given. `backward_comm()` gives the
    communicator the compiled backward runs under."""

    def __init__(self, program: Program, backward_comm: Callable[[], Comm]):
        self.graph = inductor_graph(program.graph)
        self.dynamic = program.dynamic is not None
        self.backward_comm = backward_comm
        self._compiled: dict[tuple, Callable] = {}
        self._lock = threading.Lock()

    def compiled_for(self, inputs: list) -> Callable:
        """The compiled function for `inputs` (compiled on first use, backward included)."""
        key = (torch.is_grad_enabled(), tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs),
               tuple(tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor)) if self.dynamic else ())
        with self._lock:
            if key not in self._compiled:
                with use_comm(TracingComm()), torch._functorch.config.patch(_COMPILE_CONFIG):
                    self._compiled[key] = compile_fx(copy.deepcopy(self.graph), list(inputs), inner_compile=self._inner)
            return self._compiled[key]

    def __call__(self, comm: Comm, inputs: list) -> list:
        """This rank's outputs, the forward's collectives carried by `comm`."""
        function = self.compiled_for(inputs)
        with use_comm(comm):
            return function(*inputs)

    def _inner(self, gm: GraphModule, example_inputs, **kwargs):
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        return _under_comm(compiled, self.backward_comm) if kwargs.get("is_backward") else compiled


def _under_comm(compiled, backward_comm: Callable[[], Comm]):
    """The compiled backward `compiled` (boxed), run with `backward_comm()`'s collectives."""

    def run(args):
        with use_comm(backward_comm(), phase="backward"):
            return compiled(args)

    run._boxed_call = True
    return run
