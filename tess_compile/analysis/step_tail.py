"""The tail of a training step: what the user's loop does around a sharded module's call.

README's loop gathers the output whole on every rank (`tess_compile.full_tensor`), computes the
loss from it outside the module, and after the optimizer's step calls `zero_grad()` (gradients
set to None by default; `tess_compile.train_step`, which keeps them in one flat buffer from step
to step, holds what `StepTail(set_to_none=False)` prices). `StepTail` says which of these a step does; `predict_memory`, the
step-peak tracker (`tess_compile.analysis.memory`) and the planner take it, `README_STEP` by
default. On fake tensors the tail runs as the runtime runs it: the gather is `GatherFull`, the
runtime's own autograd function, over a `ShapeWorld` whose all-gather makes its blocks as
torch's does (one tensor per rank, no data), and the loss is the user's function.

`tail_time` prices its time on a cluster: the gather's all-gather over every rank (the local
output's bytes) and the kernels of the gather's assembly, the loss forward and backward, and
the gradient's block cut out of the whole (`KernelRecorder`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import map_arg
from torch.utils import _pytree as pytree

from tess_compile.analysis.accounting import forward_values
from tess_compile.analysis.kernels import KernelRecorder, PhaseProfile
from tess_compile.core.cluster import Cluster
from tess_compile.core.fake_run import tensor_bytes
from tess_compile.core.mesh import Mesh
from tess_compile.core.program import Program
from tess_compile.ops.collectives import ShapeComm, use_comm
from tess_compile.runtime.dtensors import GatherFull

__all__ = ["MODULE_LOSS", "README_STEP", "ShapeWorld", "StepTail", "TailTime", "square_mean", "tail_time",
           "tail_tops"]


def square_mean(output) -> torch.Tensor:
    """The default loss outside the module: the mean square of each tensor of the output, summed
    (it saves its input for backward, as most losses do)."""
    return sum(t.square().mean() for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class StepTail:
    """The step around the module's call: `gather`, the output gathered whole on every rank
    (`full_tensor`); `loss`, a function of the (gathered) output computed outside the module,
    whose backward the step runs (None: the module's output is the loss, each tensor of it
    seeded with a gradient of its size); `set_to_none`, `zero_grad`'s mode after the optimizer's
    step (False: the gradients are zeroed and stay allocated into the next step)."""

    gather: bool = True
    loss: Callable | None = square_mean
    set_to_none: bool = True


README_STEP = StepTail()  # README's loop: gathered, the loss outside, zero_grad() to None
MODULE_LOSS = StepTail(gather=False, loss=None)  # backward from the local outputs, as a loss inside the module


class ShapeWorld:
    """The `World` `GatherFull` gathers over, on fake tensors: rank 0 of `mesh`, its all-gather's
    blocks made as the runtime's (`runtime.groups.World.all_gather`), without data."""

    def __init__(self, mesh: Mesh):
        self.mesh, self.rank = mesh, 0

    def all_gather(self, x: torch.Tensor, op: str) -> list[torch.Tensor]:
        return [torch.empty_like(x) for _ in range(self.mesh.num_ranks)]


def tail_tops(program: Program, outputs, tail: StepTail) -> tuple[list, list, list | None]:
    """`(roots, tops, seeds)`: the local outputs that require grad, the tensors the step's backward
    starts from (the loss; the gathered outputs without one; `roots` themselves without either)
    and their gradients (None: a loss's 1)."""
    flat = pytree.tree_leaves(outputs)
    roots = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tail.gather and tail.loss is None:
        return roots, roots, [torch.empty_like(t) for t in roots]
    if tail.gather:
        world = ShapeWorld(program.mesh)
        flat = [GatherFull.apply(t, world, layout, shape) if isinstance(t, torch.Tensor) and layout is not None else t
                for t, layout, shape in zip(flat, program.output_layouts, program.output_shapes, strict=True)]
    if tail.loss is None:
        tops = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        return roots, tops, [torch.empty_like(t) for t in tops]
    return roots, [tail.loss(pytree.tree_unflatten(flat, program.out_spec))], None


@dataclass(frozen=True)
class TailTime:
    """Seconds the tail adds to a step on one rank: forward's (the gather's all-gather `comm_s`
    and its assembly and the loss, `forward_s`) and backward's (`backward_s`); `comm_bytes`, the
    bytes it passes to the all-gather."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_s: float = 0.0
    comm_bytes: int = 0


_TAILS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per-rank graph -> {tail: (profiles, bytes)}


def tail_time(program: Program, cluster: Cluster, tail: StepTail) -> TailTime:
    """What `tail` adds to a step of `program` on `cluster` (see the module docstring)."""
    if not program.training or (not tail.gather and tail.loss is None):
        return TailTime()
    cached = _TAILS.setdefault(program.graph, {})
    if tail not in cached:
        cached[tail] = _tail_kernels(program, tail)
    (forward, backward), local_bytes = cached[tail]
    intra = program.mesh.num_ranks <= cluster.gpus_per_node
    comm_s = cluster.collective_seconds("all_gather", program.mesh.num_ranks, local_bytes, intra, alone=True) \
        if tail.gather else 0.0
    return TailTime(cluster.compute_seconds(forward.compute_terms()), cluster.compute_seconds(backward.compute_terms()),
                    comm_s, local_bytes if tail.gather else 0)


def _tail_kernels(program: Program, tail: StepTail) -> tuple[tuple[PhaseProfile, PhaseProfile], int]:
    """The kernels of `tail`'s forward and backward on fake outputs of `program` (a program compiled with
    block reuse: of its shortest form, whose outputs are the same), and its local outputs' bytes."""
    short = program if program.repeats is None else program.repeats.short(2)
    values = forward_values(short.graph, short.mesh)[0]  # the run that the program's costs read
    (output,) = short.graph.graph.find_nodes(op="output")
    recorder = KernelRecorder()
    with FakeTensorMode(allow_non_fake_inputs=True), use_comm(ShapeComm()):
        outputs = pytree.tree_map_only(  # leaves of the tail's own graph, laid out as the program's outputs
            torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            .requires_grad_(t.requires_grad),
            map_arg(output.args[0], values.__getitem__))
        local_bytes = sum(tensor_bytes(t) for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor))
        with recorder:
            roots, tops, seeds = tail_tops(short, outputs, tail)
            recorder.phase = "backward"
            torch.autograd.grad(tops, roots, seeds)
    return (PhaseProfile(**recorder.totals["forward"]), PhaseProfile(**recorder.totals["backward"])), local_bytes
