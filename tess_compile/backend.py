"""The torch.compile backend: Dynamo's graphs through the same passes.

`torch.compile(model, backend=tess_compile.backend(q=2, d=2))`, or by name,
`torch.compile(model, backend="tesseract", options={"q": 2, "d": 2})`.
Each graph Dynamo hands over (one per piece between graph breaks) is
exported to the ATen IR that `shard` uses, compiled for the mesh and run
on it: by the distributed runtime on every rank of an initialized world of
`q*q*d`, or with `simulate=True` by the simulator in this process. With
`inner="inductor"` each per-rank program runs through inductor, forward and
backward, as `shard(..., compile=True)` does (docs/compiled.md). With
`summa="auto"` or `keep_blocks="auto"` each graph gets the fastest candidate
on `cluster=` (`tess_compile.analysis.schedule_choice`).

Parameters arrive as graph inputs, whole. Each call slices this rank's
blocks out of them (a copy of the blocks, never of the whole model), and
outputs leave whole, as plain tensors, for the rest of the program. The
cost against `shard` is in docs/backend.md.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Sequence

import torch
from torch import nn

from tess_compile.analysis.cluster import Cluster
from tess_compile.analysis.schedule_choice import compile_auto, load_cluster
from tess_compile.core.mesh import Mesh
from tess_compile.core.options import RENAMED, CompileOptions, takes_compile_options
from tess_compile.runtime.sharded_module import shard_program
from tess_compile.runtime.simulator import SimulatedModule

__all__ = ["backend", "tesseract"]

log = logging.getLogger("tess_compile")

# How each per-rank program runs: its graph as it is, or compiled by inductor.
_INNER = ("eager", "inductor")


@takes_compile_options
def backend(
    q: int,
    d: int,
    *,
    options: CompileOptions | None = None,
    simulate: bool = False,
    timeout: float | None = None,
    inner: str = "eager",
    cluster: Cluster | str | os.PathLike | None = None,
) -> Callable:
    """A torch.compile backend that runs each graph on the `[q, q, d]` mesh with the compile
    options of `CompileOptions` (`mode`, the `summa` schedule of the matrix products,
    `keep_blocks` and `recompute` as in `tess_compile.simulate`, "auto" ones chosen per graph
    on `cluster`; docs/modes.md, docs/memory.md); `simulate=True` runs every rank in this
    process. `inner="inductor"` compiles each per-rank program with inductor (docs/compiled.md)."""
    if inner not in _INNER:
        raise ValueError(
            f"backend 'tesseract' got inner={inner!r}: it runs each per-rank program as one of "
            f"{', '.join(map(repr, _INNER))}; pass inner='inductor' to compile it, or leave inner out"
        )
    if options.dynamic:
        raise ValueError("backend 'tesseract' got dynamic=True: it compiles each graph Dynamo hands it for that "
                         "graph's shapes (Dynamo recompiles for new ones); for one program for every batch and "
                         "sequence length use tess_compile.shard or simulate with dynamic=True")
    mesh = options.mesh(q, d)
    load_cluster(cluster)  # a bad cluster= fails here, not inside Dynamo

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
        return _compile(gm, list(example_inputs), mesh, options, simulate=simulate, timeout=timeout,
                        compile=inner == "inductor", cluster=cluster)

    return compile_graph


def tesseract(gm: torch.fx.GraphModule, example_inputs: Sequence, options: dict | None = None) -> Callable:
    """The backend registered as "tesseract"; `options` holds q, d and backend's keywords."""
    options = dict(options or {})
    known = [name for name in inspect.signature(backend).parameters if name != "options"]
    unknown = sorted(set(options) - set(known) - set(RENAMED))
    if unknown or "q" not in options or "d" not in options:
        raise ValueError(
            f"backend 'tesseract' got options {sorted(options)}: it needs q and d and takes "
            f"{known}, e.g. torch.compile(model, backend='tesseract', options={{'q': 2, 'd': 2}})"
        )
    q, d = options.pop("q"), options.pop("d")
    return backend(q, d, **options)(gm, example_inputs)


def _compile(gm, example_inputs: list, mesh: Mesh, options: CompileOptions, *, simulate: bool, timeout,
             compile: bool, cluster) -> Callable:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"graph input {node.target!r} is {type(value).__name__} {value!r}, not a tensor: "
                "tess-compile specialises shapes; use torch.compile(..., dynamic=False)"
            )
    weights = {
        index: _weight_name(node.target)
        for index, (node, value) in enumerate(zip(placeholders, example_inputs))
        if isinstance(value, nn.Parameter) or "_buffers_" in node.target
    }
    _untag_checkpoints(gm)
    program, _ = compile_auto(gm, mesh, tuple(example_inputs), options, cluster, weight_inputs=weights,
                              replicate_outputs=True)
    log.info("torch.compile backend: graph of %d nodes on mesh %s", len(gm.graph.nodes), mesh)
    if simulate:
        return SimulatedModule(program, compile=compile)
    return shard_program(program, timeout=timeout, wrap_outputs=False, compile=compile)


def _checkpointed_body(body, *args):
    return torch.utils.checkpoint.checkpoint(body, *args, use_reentrant=False)


def _untag_checkpoints(gm: torch.fx.GraphModule) -> None:
    """Dynamo traces `torch.utils.checkpoint` into a `tag_activation_checkpoint` operator,
    which export cannot trace again: call the checkpoint itself on its body instead, so
    that capture marks the region as it does in a model's forward."""
    tagged = torch.ops.higher_order.tag_activation_checkpoint
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is tagged]
    for node in nodes:
        node.target, node.kwargs = _checkpointed_body, {}
    if nodes:
        gm.recompile()


def _weight_name(target: str) -> str:
    """`L_self_modules_attn_modules_qkv_parameters_weight_` -> `attn.qkv.weight`."""
    name = target.removeprefix("L_self_").removesuffix("_")
    for part in ("_modules_", "_parameters_", "_buffers_"):
        name = name.replace(part, ".")
    return name.removeprefix("modules.").removeprefix("parameters.").removeprefix("buffers.")
