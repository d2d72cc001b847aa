"""Graph dumps: one stage of the compiler as text that reads as Python, or Graphviz.

Not a pass: it reads what the passes leave and changes nothing. Stages:

- "captured": the ATen graph of `tess_compile.passes.capture`, global shapes;
- "placed": the same with the `LAYOUT` of `tess_compile.passes.place` (`tess_compile.core.meta_keys`),
  each value's local shape, and the conversion each argument needs (`ARG_LAYOUTS`);
- "rewritten": one rank's per-rank graph of `tess_compile.passes.rewrite`, local shapes
  from a fake run, collectives with their axis, peers and bytes, and a
  header with the rank's parameter bytes, memory, redundant work (forward
  FLOPs over all ranks / the unsharded model's) and bytes moved
  (`tess_compile.analysis.accounting`); with `sizes=`, also those bytes as formulas
  in the model's sizes and the mesh (`tess_compile.analysis.symbolic`); with
  `summa="auto"` or `keep_blocks="auto"`, the schedule auto chose and its
  alternatives (`tess_compile.analysis.schedule_choice`).

Text dumps have one node a line (`name = op(args)  # comment`); `#` lines
are the header and, in "placed", the conversions before the node needing
them. docs/dump.md says how to read one. Output is deterministic and ASCII.

The debug switch `TESS_COMPILE_DUMP=folder` writes every compile's stages
there, pass by pass (rank 0's view), with node counts in `passes.txt`: this
module registers the observer that does it with the compile driver
(`tess_compile.passes.observers`).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence

import torch
from torch.fx import GraphModule

from tess_compile.passes.capture import capture
from tess_compile.passes.capture_reuse import captures_reused
from tess_compile.passes.driver import row_split_for
from tess_compile.passes.token_order import with_token_order
from tess_compile.passes.observers import PassResult, add_pass_observer
from tess_compile.passes.place import place
from tess_compile.analysis.accounting import redundant_work, unsharded_forward_flops
from tess_compile.analysis.compile_entry import compile_for
from tess_compile.analysis.graph_views import (
    STAGE_VIEWS,
    redundant_work_text,
    render_dot,
    render_svg,
    render_text,
    rewritten_view,
)
from tess_compile.analysis.memory import predict_memory
from tess_compile.analysis.schedule_choice import load_cluster
from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import Mesh, check_rank
from tess_compile.core.options import CompileOptions, takes_compile_options
from tess_compile.core.program import Program, input_names, split_example_inputs

__all__ = ["FORMATS", "STAGES", "dump", "dump_graph", "dump_program"]

log = logging.getLogger("tess_compile")

STAGES = ("captured", "placed", "rewritten")
FORMATS = ("text", "dot", "svg")


@takes_compile_options
def dump(
    model: torch.nn.Module,
    q: int,
    d: int,
    *,
    example_inputs,
    options: CompileOptions | None = None,
    rank: int = 0,
    stage: str = "rewritten",
    format: str = "text",
    sizes: dict[str, int] | None = None,
    cluster: Cluster | str | os.PathLike | None = None,
) -> str:
    """Compile `model` for the `[q, q, d]` mesh with the compile options of `CompileOptions`
    (`mode`, `summa`, ...) and render `stage` for `rank` in `format`.

    `sizes` names the model's sizes (`{"b": 8, "s": 12, "h": 40}`, the sizes
    of `example_inputs` and the model); the rewritten stage's header then
    gives the bytes moved as formulas in them and in q, d, p. "auto" options
    are chosen on `cluster` as in `tess_compile.simulate`, and the rewritten
    stage's header says what they chose (the other stages do not depend on them).
    """
    mesh = options.mesh(q, d)
    _check_options(stage, format, rank, mesh, sizes)
    if stage == "rewritten":
        with captures_reused():  # the unsharded FLOPs count the captured graph the compile shards
            compiled = compile_for(model, mesh, example_inputs, options, cluster)
            unsharded_flops = unsharded_forward_flops(model, example_inputs)
        program, summary = compiled.program, compiled.summary
        return dump_program(program, rank=rank, format=format, sizes=sizes, unsharded_flops=unsharded_flops,
                            notes=[summary] if summary else [])
    load_cluster(cluster)  # unused by the other stages, checked all the same
    args, kwargs = split_example_inputs(example_inputs)
    gm = capture(model, args, kwargs)
    if stage == "placed":
        rows = with_token_order(gm, row_split_for(options, mesh, args, kwargs), options, mesh)
        gm = place(gm, mesh, strict=options.strict, rows=rows)
    return dump_graph(gm, mesh, stage=stage, rank=rank, format=format)


def dump_program(
    program: Program, *, rank: int = 0, format: str = "text", sizes: dict[str, int] | None = None,
    unsharded_flops: int | None = None, notes: Sequence[str] = (),
) -> str:
    """The rewritten stage of a compiled `Program`: rank `rank`'s per-rank graph, with `notes`
    and the rank's predicted memory in the header and, given the unsharded model's forward
    FLOPs (`accounting.unsharded_forward_flops`), the redundant work (`sizes`: see `dump`)."""
    _check_options("rewritten", format, rank, program.mesh, sizes)
    memory = predict_memory(program)
    notes = [
        *notes,
        *([f"rows: {program.rows}"] if program.rows is not None else []),
        f"memory per rank (bytes): peak of a step {memory.total}; at the start of backward parameters "
        f"{memory.params}, gradients {memory.grads}, AdamW state {memory.optimizer}, saved for backward "
        f"{memory.activations}, collective buffers {memory.transient}",
    ]
    if unsharded_flops is not None:
        notes.append(redundant_work_text(redundant_work(program, unsharded_flops)))
    if program.dynamic is not None:
        notes.append(f"dynamic shapes: {program.dynamic.describe(input_names(program.in_spec))} (every figure "
                     "and local shape here at the example's sizes)")
    return dump_graph(program.graph, program.mesh, stage="rewritten", rank=rank, format=format, sizes=sizes,
                      notes=notes)


def dump_graph(
    gm: GraphModule, mesh: Mesh, *, stage: str, rank: int = 0, format: str = "text",
    sizes: dict[str, int] | None = None, notes: list[str] = (),
) -> str:
    """Render `gm`, the output of `stage` ("captured", "placed" or "rewritten"; `sizes`: see `dump`);
    `notes` are more header lines."""
    _check_options(stage, format, rank, mesh, sizes)
    if sizes is None:
        header, lines = STAGE_VIEWS[stage](gm, mesh, rank)
    else:
        header, lines = rewritten_view(gm, mesh, rank, sizes)
    header = header[:3] + list(notes) + header[3:]
    if format == "text":
        return render_text(header, lines)
    dot = render_dot(stage, header, lines)
    return dot if format == "dot" else render_svg(dot)


def _check_options(stage: str, format: str, rank: int, mesh: Mesh, sizes=None) -> None:
    _check_choice("stage", stage, STAGES)
    _check_choice("format", format, FORMATS)
    check_rank(rank, mesh)
    if sizes is not None and stage != "rewritten":
        raise ValueError(
            f"sizes= gives the bytes moved as formulas, which only the rewritten stage has, "
            f"not stage {stage!r}: use stage='rewritten', or leave sizes out"
        )
    if format == "svg" and shutil.which("dot") is None:
        raise ValueError(
            "format='svg' needs Graphviz's `dot` executable, which is not installed: install it "
            "(`apt-get install graphviz`, `brew install graphviz` or `conda install graphviz`), "
            "or use format='dot' and render the text elsewhere"
        )


def _check_choice(what: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{what} {value!r} is not one of {valid}: pass one of them")


# ------------------------------------------------------------ stage dumps

# Passes whose graph is a stage a dump shows, by the stage's name.
_DUMPED = {"capture": "captured", "place": "placed", "rewrite": "rewritten"}


def _dump_stage(result: PassResult) -> None:
    """With `TESS_COMPILE_DUMP=folder`: the pass's line in `folder/passes.txt` and, for a stage,
    its graph in `folder/NN-pass.txt` (see the module docstring)."""
    folder = os.environ.get("TESS_COMPILE_DUMP")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    nodes, before = len(result.graph.graph.nodes), result.nodes_before
    change = "" if before is None else f" ({before} -> {nodes}, {nodes - before:+d})"
    with open(os.path.join(folder, "passes.txt"), "a", encoding="ascii") as summary:
        summary.write(f"{result.index:02d} {result.name}: {nodes} nodes{change}\n")
    if result.name in _DUMPED:
        text = dump_graph(result.graph, result.mesh, stage=_DUMPED[result.name])
        with open(os.path.join(folder, f"{result.index:02d}-{result.name}.txt"), "w", encoding="ascii") as out:
            out.write(text)
    log.info("pass %s: %d nodes%s", result.name, nodes, change)


add_pass_observer(_dump_stage)
