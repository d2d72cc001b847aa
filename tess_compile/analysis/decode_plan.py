"""A decode step priced on every mesh: tokens/s and bytes per token, for inference.

A decode step is the model's forward in eval mode on inputs of one new token
per sequence (an LM's `input_ids` of shape [batch, 1]; the factory gives them).
It moves little activation and uses every weight once, so the layout that
keeps the weights still and moves the activations wins (Pope et al. 2022,
`docs/generation.md`). `plan_decode` compiles the model for each mesh of
`gpus` ranks (`candidate_meshes`) in every batch split that divides
the batch (`CompileOptions.batch_split`: over depth and row, SUMMA; over depth
alone or not at all, weight-stationary), prices each forward with
`tess_compile.analysis.cost_model`, and keeps each mesh's fastest: its step
time, tokens/s (the batch over the step), the bytes one rank hands its
collectives per token, and sends on the wire (the ring volume,
`cost_model.ring_wire_bytes`), and the most bytes one rank holds in the step
(`memory.predict_memory`'s total with `MODULE_LOSS`: its forward alone, on fake tensors under
`MemTracker`). An LM's `input_ids` alone carry no KV cache, so neither does
that peak; `at_shapes` hands `predict_memory` a generation decode program
(whose inputs carry the cache) at a step's batch and cached length.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree

from tess_compile.analysis.cost_model import profile_program, ring_wire_bytes, step_time
from tess_compile.analysis.layout_conversion import Conversion, conversion_cost, pays_back_after
from tess_compile.analysis.memory import predict_memory
from tess_compile.analysis.planner import (
    DEFAULT_MODES,
    Progress,
    build_inputs,
    candidate_meshes,
    mesh_label,
    mesh_sides,
)
from tess_compile.analysis.schedule_choice import cheapest, compile_each
from tess_compile.analysis.step_tail import MODULE_LOSS
from tess_compile.core.cluster import CALIBRATED_CLUSTER, Cluster
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import GLOBAL_SHAPE
from tess_compile.core.options import AUTO, CompileOptions
from tess_compile.core.program import INPUT_ROLES, Program
from tess_compile.core.row_split import splits_of
from tess_compile.ops.recompute_region import outline_regions
from tess_compile.passes.driver import in_mode

__all__ = ["DecodeRow", "at_shapes", "format_decode_table", "plan_decode"]

MIB = 2**20

log = logging.getLogger("tess_compile")


@dataclass(frozen=True)
class DecodeRow:
    """One mesh's decode step, in its fastest batch split (`note`: why none compiled)."""

    mesh: Mesh
    batch_split: str = ""
    step_s: float = float("inf")
    tokens_per_s: float = 0.0
    bytes_per_token: float = 0.0  # handed to collectives by one rank, per generated token
    wire_bytes_per_token: float = 0.0  # sent by one rank on the links (ring volume), per token
    peak_bytes: int = 0  # the most one rank holds in the step: `predict_memory(program, MODULE_LOSS).total`
    note: str = ""
    # Where the fastest split lays the weights out otherwise than training (SUMMA's layout) does: the
    # decode step of the trained layout in its faster split, and the one-time cost of laying the weights
    # out for serving (`layout_conversion`); None and zeros where the layouts are the same.
    trained_step_s: float | None = None
    conversion: Conversion = field(default_factory=Conversion)

    def pays_back_tokens(self) -> float | None:
        """Tokens generated before the conversion to the serving layout pays for itself (inf: never);
        None where there is none to pay for."""
        if self.trained_step_s is None:
            return None
        return pays_back_after(self.conversion.seconds, self.trained_step_s - self.step_s,
                               round(self.tokens_per_s * self.step_s))

    def to_dict(self) -> dict:
        return {"mode": self.mesh.mode, "mesh": mesh_sides(self.mesh), "batch_split": self.batch_split,
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "bytes_per_token": self.bytes_per_token,
                "wire_bytes_per_token": self.wire_bytes_per_token, "peak_bytes": self.peak_bytes, "note": self.note,
                "trained_step_s": self.trained_step_s, "conversion_bytes": self.conversion.bytes,
                "conversion_s": self.conversion.seconds, "pays_back_tokens": self.pays_back_tokens()}


def plan_decode(factory_or_model, gpus: int, *, example_inputs=None, modes: Sequence[str] = DEFAULT_MODES,
                cluster: Cluster | None = None, summa: str = AUTO,
                progress: Progress | None = None) -> list[DecodeRow]:
    """The decode step of the model on every mesh of `gpus` ranks in `modes`, fastest first (those that
    did not compile last); see the module docstring. `factory_or_model` as `planner.plan` takes it."""
    model, inputs = build_inputs(factory_or_model, example_inputs)
    cluster = CALIBRATED_CLUSTER if cluster is None else cluster
    batch = _batch(inputs)
    meshes = candidate_meshes(gpus, modes)
    rows = []
    for done, mesh in enumerate(meshes):
        if progress is not None:
            progress(done, len(meshes), f"{mesh.mode} {mesh_label(mesh)}")
        rows.append(_fastest(model, inputs, mesh, cluster, summa, batch))
    if progress is not None:
        progress(len(meshes), len(meshes), "")
    return sorted(rows, key=lambda row: (row.note.startswith("does not compile"), row.step_s))


def _batch(inputs) -> int:
    """Sequences in the step: dim 0 of the first tensor input (one new token each)."""
    first = next((x for x in pytree.tree_leaves(inputs) if hasattr(x, "shape") and len(x.shape)), None)
    if first is None:
        raise ValueError("plan_decode: the example inputs hold no tensor with a batch dim: pass input_ids [batch, 1]")
    return int(first.shape[0])


def _fastest(model: nn.Module, inputs, mesh: Mesh, cluster: Cluster, summa: str, batch: int) -> DecodeRow:
    """`mesh`'s row: each batch split that divides the batch, compiled in eval mode and priced; the fastest,
    with its peak memory (`schedule_choice`'s loop of compiling the candidates and keeping the cheapest)."""
    splits = splits_of(batch, mesh)
    tried = [CompileOptions(mode=mesh.mode, summa=summa, batch_split=split if mesh.mode != "1d" else AUTO)
             for split in splits]

    def price(options: CompileOptions, program: Program) -> DecodeRow:
        return _priced(program, mesh, cluster, options.batch_split, batch)

    with in_mode(model, False):  # the losing splits' repeated work is not shown: the table says what wins
        results = compile_each(model, mesh, inputs, tried, price, cluster, quiet=True)
    errors = [f"{split}: {result}" for split, result in zip(splits, results) if isinstance(result, Exception)]
    if len(errors) == len(results):
        log.info("plan_decode: %s %s does not compile: %s", mesh.mode, mesh_label(mesh), errors)
        return DecodeRow(mesh, note=f"does not compile: {'; '.join(errors)}")
    row, program, _ = cheapest(results, lambda row: row.step_s)
    row = dataclasses.replace(row, peak_bytes=predict_memory(program, MODULE_LOSS).total)
    trained = next((result for options, result in zip(tried, results)
                    if options.batch_split == "depth_row" and not isinstance(result, Exception)), None)
    if trained is None or row.batch_split == "depth_row" or mesh.mode == "1d":
        return row
    options = next(options for options in tried if options.batch_split == row.batch_split)
    return _with_conversion(row, program, trained, model, inputs, options, cluster, price)


def _with_conversion(row: DecodeRow, program: Program, trained: tuple, model: nn.Module, inputs,
                     options: CompileOptions, cluster: Cluster, price) -> DecodeRow:
    """`row` (compiled with `options`, a split that lays the weights out otherwise than SUMMA's, training's,
    `trained`) with the trained layout's decode step in its faster split (SUMMA's, or `options`' on the
    trained weights) and the cost of laying the weights out as `program` does."""
    trained_row, trained_program = trained
    layouts = {slot.name: slot.layout for slot in trained_program.params}
    mesh = program.mesh
    with in_mode(model, False):
        (kept,) = compile_each(model, mesh, inputs, [options], price, cluster, quiet=True, state_layouts=layouts)
    trained_s = min(trained_row.step_s, kept[0].step_s if not isinstance(kept, Exception) else math.inf)
    return dataclasses.replace(row, trained_step_s=trained_s,
                               conversion=conversion_cost(trained_program, program, cluster))


def _priced(program, mesh: Mesh, cluster: Cluster, split: str, batch: int) -> DecodeRow:
    profile = profile_program(program)
    seconds = step_time(profile, cluster).forward_s
    payload = sum(cost.forward_bytes or 0 for cost in profile.costs)
    wire = ring_wire_bytes(profile.costs, mesh)["forward"]
    return DecodeRow(mesh, split if mesh.mode != "1d" else "", seconds, batch / seconds, payload / batch,
                     wire / batch)


def at_shapes(program: Program, shapes: Sequence[Sequence[int]]) -> Program:
    """A dynamic `program` with its inputs at `shapes`, one global shape per input in the flat order it
    takes them (a carried cache tensor's whole shape, not a rank's block): a copy of its graph whose
    placeholders `predict_memory` makes at those shapes, e.g. a decode program at a step's batch and
    cached length. ValueError for shapes it does not take (`Program.call_output_shapes`)."""
    slots = {int(slot.name): slot for slot in program.slots if slot.role in INPUT_ROLES}
    if program.dynamic is None or len(shapes) != len(slots):
        raise ValueError(f"at_shapes: {len(shapes)} shapes for the {len(slots)} inputs of a program compiled with "
                         f"dynamic={program.dynamic is not None} on mesh {program.mesh}: pass one shape per input "
                         "of a program compiled with dynamic=True")
    held = [slots[i].layout.local_shape(shape, program.mesh) if slots[i].role == "local input" else shape
            for i, shape in enumerate(shapes)]  # as a call hands them: a carried input as this rank's block
    program.call_output_shapes([torch.empty(shape, device="meta") for shape in held])
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(program.graph.graph, {}))  # each node's meta a copy
    for node, slot in zip(graph.find_nodes(op="placeholder"), program.slots):
        if slot.role in INPUT_ROLES:
            GLOBAL_SHAPE.set(node, tuple(shapes[int(slot.name)]))
    module = torch.fx.GraphModule(program.graph, graph)
    module.meta.update(program.graph.meta)
    return dataclasses.replace(program, graph=module, runnable=outline_regions(module))


def format_decode_table(rows: Sequence[DecodeRow]) -> str:
    """The rows as a text table: one line per mesh. Where the fastest split lays the weights out otherwise
    than training does, "trained s" is the decode step of the trained layout, "convert MiB" what one
    rank receives to lay the weights out for serving, and "pays back" the tokens generated before the
    faster steps have paid for that conversion."""
    lines = [(f"{'mode':5} {'mesh':11} {'batch split':11} {'step s':>10} {'tokens/s':>10} {'bytes/token':>12} "
              f"{'wire B/token':>12} {'peak MiB':>9} {'trained s':>10} {'convert MiB':>11} {'pays back':>10}  note")]
    for row in rows:
        trained = ("-", "-", "-") if row.trained_step_s is None else (
            f"{row.trained_step_s:.4g}", f"{row.conversion.bytes / MIB:.4g}", _tokens(row.pays_back_tokens()))
        lines.append(f"{row.mesh.mode:5} {mesh_label(row.mesh):11} {row.batch_split or '-':11} {row.step_s:10.4g} "
                     f"{row.tokens_per_s:10.4g} {row.bytes_per_token:12.4g} {row.wire_bytes_per_token:12.4g} "
                     f"{row.peak_bytes / MIB:9.4g} {trained[0]:>10} {trained[1]:>11} {trained[2]:>10}  "
                     f"{row.note}".rstrip())
    return "\n".join(lines)


def _tokens(count: float) -> str:
    return "never" if math.isinf(count) else f"{count:.0f} tok"
