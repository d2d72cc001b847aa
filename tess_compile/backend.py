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

A graph with symbolic shapes (`torch.compile(..., dynamic=True)`,
`torch._dynamo.mark_dynamic`, or Dynamo's recompile after a shape changed)
is compiled once as a dynamic program, symbolic where Dynamo's graph is: its
size inputs are read from its tensors' shapes and its Python numbers become
constants (docs/backend.md, "Dynamic shapes").

Dynamo breaks the graph where the model reads the values in a tensor (`.item()`,
`nonzero`, `x[mask]`), which `shard` cannot capture (docs/data_dependent.md): each
piece is compiled on its own, a piece that takes no tensor runs as it is, a
table of batch 1 carried across a break arrives whole (as a weight does), and a
tensor input whose dim 0 the mesh does not split (rows picked by a boolean index)
is a ValueError that names the graph break that carries it in.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.node import map_aggregate
from torch.utils import _pytree as pytree

from tess_compile.passes.source_lines import source_line, with_code
from tess_compile.analysis.compile_entry import compile_for
from tess_compile.analysis.schedule_choice import load_cluster
from tess_compile.core.cluster import Cluster
from tess_compile.core.dynamic import has_symbols
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
    process. `inner="inductor"` compiles each per-rank program with inductor (docs/compiled.md).
    A graph with symbolic shapes is compiled as one dynamic program whatever `dynamic` says;
    `dynamic=True` warns of a static one (docs/backend.md)."""
    if inner not in _INNER:
        raise ValueError(
            f"backend 'tesseract' got inner={inner!r}: it runs each per-rank program as one of "
            f"{', '.join(map(repr, _INNER))}; pass inner='inductor' to compile it, or leave inner out"
        )
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
    """One program for Dynamo's graph: symbolic in the dims that are symbolic there (see docs/backend.md).
    A graph that takes no tensor (a mask made of constants after a graph break) has nothing to shard: it runs as
    it is."""
    if not any(isinstance(x, torch.Tensor) for x in example_inputs):
        return gm
    gm = _copy(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    symbolic = _symbolic(placeholders)
    if options.dynamic and not symbolic:
        _warn_static(placeholders)
    _check_no_data_read(gm, mesh)
    _check_no_size_outputs(gm, placeholders, mesh)
    kept, numbers = _tensors_only(gm, placeholders, example_inputs, mesh)
    weights = {
        position: _weight_name(placeholders[i].target)
        for position, i in enumerate(kept)
        if isinstance(example_inputs[i], nn.Parameter) or "_buffers_" in placeholders[i].target
        or _broadcast_over_batch(placeholders[i])
    }
    _check_batches(placeholders, example_inputs, kept, weights, mesh)
    _untag_checkpoints(gm)
    options = dataclasses.replace(options, dynamic=symbolic)
    # outside Dynamo's tracing context: export would otherwise trace in Dynamo's fake mode and leave the
    # guards of its own symbolic shapes among Dynamo's
    with torch._guards.tracing(None):
        examples = tuple(_example(example_inputs[i], placeholders[i]) for i in kept)
        program = compile_for(gm, mesh, examples, options, cluster, weight_inputs=weights,
                              replicate_outputs=True).program
    log.info("torch.compile backend: graph of %d nodes on mesh %s (%s shapes)", len(gm.graph.nodes), mesh,
             "symbolic" if symbolic else "static")
    if simulate:
        run = SimulatedModule(program, compile=compile)
    else:
        run = shard_program(program, timeout=timeout, wrap_outputs=False, compile=compile)
    return run if len(kept) == len(placeholders) else _DynamoCall(run, kept, numbers, mesh)


class _DynamoCall:
    """A call of Dynamo's graph on the program: the size inputs dropped (the program reads them from its
    tensors' shapes) and each Python number checked against the value it was compiled for."""

    def __init__(self, run: Callable, kept: list[int], numbers: dict[int, tuple[str, float]], mesh: Mesh):
        self.run, self.kept, self.numbers, self.mesh = run, kept, numbers, mesh

    def __call__(self, *args):
        for index, (name, compiled) in self.numbers.items():
            value = float(args[index])
            if value != compiled:
                raise ValueError(
                    f"graph input {name!r} is the Python number {value}, but the program on mesh {self.mesh} was "
                    f"compiled for {compiled} (Dynamo passes the number as a tensor and does not recompile for a "
                    "new value; tess-compile makes it a constant): set torch._dynamo.config.specialize_float = True "
                    "so that Dynamo compiles each value, or keep the number fixed"
                )
        return self.run(*[args[i] for i in self.kept])


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Dynamo's graph, copied to be rewritten: Dynamo passes the inputs that its own graph's placeholders
    name, read after the backend returns."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def _symbolic(placeholders: list[torch.fx.Node]) -> bool:
    """Whether Dynamo's graph has symbolic shapes: a size (SymInt) input, or a tensor input of symbolic dims."""
    values = [n.meta.get("example_value") for n in placeholders]
    return any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and has_symbols(v.shape)) for v in values)


def _warn_static(placeholders: list[torch.fx.Node]) -> None:
    log.warning("backend 'tesseract' got dynamic=True, but Dynamo handed it a graph of static shapes (inputs %s), "
                "whose code holds those sizes as constants: it is compiled for them, and Dynamo compiles again for a "
                "new shape; for one program for every batch and sequence length pass dynamic=True to torch.compile "
                "as well, or mark the dims with torch._dynamo.mark_dynamic", _describe(placeholders))


def _check_no_data_read(gm: torch.fx.GraphModule, mesh: Mesh) -> None:
    """Dynamo keeps a value read from a tensor in its graph only with torch._dynamo.config's
    capture_dynamic_output_shape_ops (`nonzero`, `x[mask]`) or capture_scalar_outputs (`.item()`) on. The program
    can neither split a tensor whose size was read so nor return such a value: a ValueError naming the line."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = [n for n in pytree.tree_leaves(output.args[0]) if isinstance(n, torch.fx.Node)]
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        shapes = [list(t.shape) for t in pytree.tree_leaves(value)
                  if isinstance(t, torch.Tensor) and free_unbacked_symbols(t.shape)]
        scalar = node in returned and isinstance(value, (torch.SymBool, torch.SymInt, torch.SymFloat)) \
            and free_unbacked_symbols(value)
        if shapes or scalar:
            what = f"a tensor of shape {shapes[0]}, a size" if shapes else f"{value}, returned by the graph, a value"
            raise ValueError(
                f"{node.name} at {with_code(source_line(node))} is {what} read from the data, which Dynamo's graph "
                "holds because torch._dynamo.config.capture_dynamic_output_shape_ops or capture_scalar_outputs is "
                f"on; the program on mesh {mesh} can neither split a tensor whose size depends on the data nor "
                "return such a value: set them False (the default), so that Dynamo breaks the graph there and each "
                "piece is sharded (docs/data_dependent.md)"
            )


def _check_no_size_outputs(gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node], mesh: Mesh) -> None:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for index, node in enumerate(pytree.tree_leaves(output.args[0])):
        value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise ValueError(
                f"graph output {index} ({node.name}) is {value}, a torch.{type(value).__name__} of Dynamo's "
                f"symbolic shapes (inputs {_describe(placeholders)}), which the program on mesh {mesh} cannot "
                "return (Dynamo returns the sizes that live across a graph break): read them from the tensors "
                "after the break (x.shape), remove the graph break, or use torch.compile(..., dynamic=False)"
            )


def _tensors_only(gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node], example_inputs: list,
                  mesh: Mesh) -> tuple[list[int], dict[int, tuple[str, float]]]:
    """Dynamo's graph rewritten to take tensors only, as export does: the indices of the inputs it keeps,
    and the Python numbers made constants (`_numbers_as_constants`, `_sizes_from_tensors`)."""
    numbers = _numbers_as_constants(gm, placeholders, example_inputs, mesh)
    sizes = _sizes_from_tensors(gm, placeholders, example_inputs, mesh)
    return [i for i in range(len(placeholders)) if i not in numbers and i not in sizes], numbers


def _numbers_as_constants(gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node], example_inputs: list,
                          mesh: Mesh) -> dict[int, tuple[str, float]]:
    """Python numbers that Dynamo passes as 0-d tensors (with `dynamic=True`, every float of the model, as a
    LayerNorm's eps) become constants: each `.item()` of one is its example's value. Returns their names and
    values by input index."""
    numbers = {}
    for index, node in enumerate(placeholders):
        if not _is_number(node):
            continue
        value = example_inputs[index].item()
        for user in [u for u in node.users if u.op == "call_method" and u.target == "item"]:
            _substitute(user, value)
        if node.users:
            raise ValueError(
                f"graph input {node.target!r} is a Python number that Dynamo passes as a tensor ({value}), used as "
                f"a tensor by {', '.join(u.name for u in node.users)}, which the program on mesh {mesh} cannot "
                "take: set torch._dynamo.config.specialize_float = True, or pass a tensor"
            )
        gm.graph.erase_node(node)
        numbers[index] = (node.target, value)
    gm.recompile()
    return numbers


def _is_number(node: torch.fx.Node) -> bool:
    """Whether a placeholder is a Python number that Dynamo passes as a 0-d tensor."""
    grapharg = node.meta.get("grapharg")
    return grapharg is not None and grapharg.pass_arg_as_tensor


def _substitute(node: torch.fx.Node, value) -> None:
    """Every use of `node` becomes the constant `value`, and `node` is erased."""

    def swap(arg):
        return value if arg is node else arg

    for reader in list(node.users):
        reader.args, reader.kwargs = map_aggregate((reader.args, reader.kwargs), swap)
    node.graph.erase_node(node)


def _sizes_from_tensors(gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node], example_inputs: list,
                        mesh: Mesh) -> list[int]:
    """Each size input (a SymInt of Dynamo's symbolic shapes) becomes `tensor.size(dim)` of a tensor input
    that has its symbol at that dim, since export takes tensors only. Returns their input indices."""
    sources = {}
    for node in placeholders:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    sources.setdefault(size.node.expr, (node, dim))
    sizes = []
    body = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for index, (node, example) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(example, torch.Tensor):
            continue
        value = node.meta.get("example_value")
        if not isinstance(value, torch.SymInt):
            raise ValueError(
                f"graph input {node.target!r} is {type(example).__name__} {example!r}, neither a tensor nor a size "
                f"of one, which the program on mesh {mesh} cannot take: pass it as a tensor, or use "
                "torch.compile(..., dynamic=False)"
            )
        if value.node.expr not in sources:
            raise ValueError(
                f"graph input {node.target!r} is the symbolic int {value}, which is no dim of the graph's tensor "
                f"inputs ({_describe(placeholders)}), so the program on mesh {mesh} cannot read it from their "
                "shapes (an int argument, or a size or a value read with .tolist() carried across a graph break): set "
                "torch._dynamo.config.specialize_int = True so that Dynamo compiles each value, pass it as a "
                "tensor, or use torch.compile(..., dynamic=False)"
            )
        tensor, dim = sources[value.node.expr]
        with gm.graph.inserting_before(body):
            size = gm.graph.call_method("size", (tensor, dim))
        node.replace_all_uses_with(size)
        gm.graph.erase_node(node)
        sizes.append(index)
    gm.recompile()
    return sizes


def _broadcast_over_batch(node: torch.fx.Node) -> bool:
    """Whether a tensor input has dim 0 of size 1 and fixed sizes: a table that broadcasts over the batch (position
    ids, a rotary table, a mask) carried across a graph break. The program cannot split its dim 0, so it arrives
    whole, as a weight does, and its consumers choose its layout (a weight input's sizes are fixed)."""
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 1 and not has_symbols(value.shape)


def _check_batches(placeholders: list[torch.fx.Node], example_inputs: list, kept: list[int], weights: dict[int, str],
                   mesh: Mesh) -> None:
    """The program splits dim 0 of each tensor input that is no weight over d*q ranks: one it does not divide is a
    ValueError naming the input, its line and the graph break it crosses (rows that `x[mask]` picked, say)."""
    if mesh.mode == "1d":  # inputs arrive whole
        return
    parts = mesh.d * mesh.q
    for position, index in enumerate(kept):
        value, node = example_inputs[index], placeholders[index]
        if position in weights or value.dim() == 0 or value.shape[0] % parts == 0:
            continue
        raise ValueError(
            f"graph input {node.target!r} of shape {list(value.shape)}{_where(node)} has dim 0 of size "
            f"{value.shape[0]}, which the program on mesh {mesh} splits over d*q = {parts} ranks: "
            f"{_batch_fix(value, parts)} (docs/data_dependent.md)"
        )


def _batch_fix(value: torch.Tensor, parts: int) -> str:
    """The fix for a tensor input of `value`'s dim 0, which `parts` does not divide."""
    if value.shape[0] == 1:  # of symbolic sizes: one of fixed sizes arrives whole (`_broadcast_over_batch`)
        return ("a tensor of dim 0 of size 1 that broadcasts over the batch crosses a graph break whole only in a "
                "graph of fixed sizes: pass dynamic=False to torch.compile, or remove the graph break")
    return (f"use a batch that is a multiple of {parts}; rows whose number depends on the data (picked by a boolean "
            f"index x[mask] or nonzero before a graph break) cannot be split: keep their number a fixed multiple of "
            f"{parts} (compute on every row and mask the result, or pad the picked rows), or remove the graph break")


def _where(node: torch.fx.Node) -> str:
    """`, carried across the graph break at file:line (`code`),` for an input of the code that Dynamo resumes after a
    graph break (named `torch_dynamo_resume_in_forward_at_42` in the node's stack trace), else the line that uses it."""
    trace = node.meta.get("stack_trace") or ""
    resumed = re.search(r'File "([^"]+)", line \d+, in torch_dynamo_resume_in_\w+_at_(\d+)', trace)
    if resumed:
        return f", carried across the graph break at {with_code(f'{resumed.group(1)}:{resumed.group(2)}')},"
    return f", used at {with_code(source_line(node))}," if trace else ""


def _example(value: torch.Tensor, node: torch.fx.Node) -> torch.Tensor:
    """A graph input's example for the compile: a new tensor on its storage (export sets and clears the dynamic-shape
    marks of the tensors it gets, which Dynamo guards on the user's own), each dim that Dynamo's graph holds fixed
    marked static, as `torch._dynamo.mark_static` marks it (which does nothing while Dynamo compiles): the graph's
    code may hold those sizes as constants, and capture keeps them fixed."""
    example = value.detach().requires_grad_(value.requires_grad)
    shape = node.meta["example_value"].shape
    example._dynamo_static_indices = {dim for dim, size in enumerate(shape) if not isinstance(size, torch.SymInt)}
    return example


def _describe(placeholders: list[torch.fx.Node]) -> str:
    """The tensor inputs that are no weights, with their (symbolic) shapes: `L_x_ [s0, s1, 8]`."""
    shapes = [f"{n.target} {list(n.meta['example_value'].shape)}" for n in placeholders
              if isinstance(n.meta.get("example_value"), torch.Tensor) and not _is_number(n)
              and not isinstance(n.meta["example_value"], nn.Parameter) and "_buffers_" not in n.target]
    return ", ".join(shapes) or "none"


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
