"""Pipeline stage boundaries: what crosses them, and the check that they match.

A stage before the last returns this rank's blocks of its outputs in the home
layout of their shapes (`S(0)S(0)S(2)` for hidden states `[b, s, h]`), and the
next stage takes exactly those blocks as its positional inputs: rank
`(k, i, j)` of stage `s` sends its block to rank `(k, i, j)` of stage `s + 1`.
`check_boundaries` raises a ValueError naming the stages, the shapes and the
fix unless each stage's outputs are the next stage's inputs (count, shapes,
dtypes, layouts; one microbatch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from tess_compile.core.fake_run import fake_run
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.program import INPUT_ROLES, Program

__all__ = ["BOUNDARY_FIX", "Port", "StagePorts", "check_boundaries", "example_blocks", "stage_ports"]


@dataclass(frozen=True)
class Port:
    """One tensor that crosses a stage boundary: its global shape (one microbatch),
    dtype and layout; each rank sends or takes its block."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout

    def local_shape(self, mesh: Mesh) -> list[int]:
        return self.layout.local_shape(self.shape, mesh)

    def describe(self, mesh: Mesh) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{list(self.shape)} {dtype} in layout {self.layout} (blocks {self.local_shape(mesh)})"


@dataclass(frozen=True)
class StagePorts:
    """What stage `stage` takes from the previous stage and gives to the next; `problem`
    says why its inputs or outputs cannot cross a boundary at all."""

    stage: int
    mesh: Mesh
    inputs: tuple[Port, ...]  # positional tensor inputs (stage 0: whole, not blocks)
    outputs: tuple[Port, ...]
    problem: str | None = None


def stage_ports(program: Program, stage_index: int, num_stages: int) -> StagePorts:
    """The ports of a compiled stage: its positional inputs and its outputs."""
    mesh = program.mesh
    num_positional = program.in_spec.child(0).num_leaves
    is_first, is_last = stage_index == 0, stage_index == num_stages - 1
    inputs, problems = [], []
    for slot in program.slots:
        if slot.role not in INPUT_ROLES or int(slot.name) >= num_positional:
            continue
        if slot.dtype is None:
            if not is_first:
                problems.append(f"its positional input {slot.name} is not a tensor (pass such values as keywords)")
            continue
        inputs.append(Port(slot.shape, slot.dtype, slot.layout if slot.role == "local input" else Layout.replicated()))
    out_spec = program.out_spec
    flat = out_spec.is_leaf() or (out_spec.type in (tuple, list) and all(c.is_leaf() for c in out_spec.children()))
    if not is_last and not flat:
        problems.append("it returns a nested structure, not a tensor or a flat tuple of tensors")
    outputs = []
    for value, layout in zip(_output_values(program), program.output_layouts):
        if not isinstance(value, torch.Tensor):
            if not is_last:
                problems.append(f"it returns {type(value).__name__} {value!r}, not a tensor")
            continue
        outputs.append(Port(_global_shape(value.shape, layout, mesh), value.dtype, layout))
    problem = "; ".join(problems) if problems else None
    return StagePorts(stage_index, mesh, tuple(inputs), tuple(outputs), problem)


def _output_values(program: Program) -> list:
    """Each output's local value on rank 0 (fake tensors from a fake run of the per-rank graph)."""

    values = fake_run(program.graph, program.mesh)
    output = next(n for n in program.graph.graph.nodes if n.op == "output")
    return pytree.tree_leaves(values[output])


def _global_shape(local: torch.Size, layout: Layout | None, mesh: Mesh) -> tuple[int, ...]:
    shape = list(local)
    for axis in AXES:
        placement = layout.on(axis) if layout is not None else None
        if isinstance(placement, Shard):
            shape[placement.dim] *= mesh.size(axis)
    return tuple(shape)


BOUNDARY_FIX = (
    "cut the model where stage {a}'s outputs are exactly stage {b}'s positional inputs (the same number, "
    "in order, of the same shapes and dtypes for one microbatch; values that are not activations go as "
    "keywords of step()), and compile stage {b} with example_inputs of those shapes"
)


def check_boundaries(stages: list[StagePorts]) -> None:
    """ValueError unless, for every stage s, stage s's outputs are stage s+1's inputs:
    the same count, shapes, dtypes, layouts and mesh, so that rank (k, i, j) of stage s
    sends exactly the blocks that rank (k, i, j) of stage s+1 takes."""
    stages = sorted(stages, key=lambda ports: ports.stage)
    for ports in stages:
        if ports.problem is not None:
            raise ValueError(
                f"pipeline stage {ports.stage} on mesh {ports.mesh} cannot be a stage: "
                f"{ports.problem}; a stage takes its activations as positional tensors and returns a tensor "
                "or a flat tuple of tensors"
            )
    for first, second in zip(stages, stages[1:]):
        a, b = first.stage, second.stage
        where = f"the pipeline split does not match the boundary of stage {a} and stage {b}"
        fix = BOUNDARY_FIX.format(a=a, b=b)
        if first.mesh != second.mesh:
            raise ValueError(
                f"{where}: stage {a} runs on mesh {first.mesh} and stage {b} on mesh {second.mesh}, so their "
                f"blocks differ: give every stage the same q, d and mode"
            )
        mesh = first.mesh
        if len(first.outputs) != len(second.inputs):
            raise ValueError(
                f"{where} on mesh {mesh}: stage {a} returns {len(first.outputs)} tensor(s) "
                f"({', '.join(p.describe(mesh) for p in first.outputs) or 'none'}) but stage {b} takes "
                f"{len(second.inputs)} positional input(s) ({', '.join(p.describe(mesh) for p in second.inputs) or 'none'}): "
                f"{fix}"
            )
        for index, (out, inp) in enumerate(zip(first.outputs, second.inputs)):
            if out != inp:
                raise ValueError(
                    f"{where} on mesh {mesh}: stage {a}'s output {index} is {out.describe(mesh)} but stage {b}'s "
                    f"input {index} is {inp.describe(mesh)}, so rank (k, i, j) of stage {a} would send a block that "
                    f"rank (k, i, j) of stage {b} cannot take: {fix}"
                )


def example_blocks(ports: StagePorts, device=None) -> tuple[torch.Tensor, ...]:
    """Empty tensors of this stage's outputs' global shapes: the next stage's example inputs."""
    return tuple(torch.zeros(p.shape, dtype=p.dtype, device=device) for p in ports.outputs)
