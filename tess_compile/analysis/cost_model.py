"""A calibrated cost model of a compiled program: step time per rank.

An analysis of the rewritten graph, like `tess_compile.analysis.accounting`,
whose byte counts it prices; it runs nothing between ranks. `profile_program`
runs one rank's program forward and backward on fake tensors and records
every kernel it launches (`ProgramProfile`, `tess_compile.analysis.kernels`); `step_time` prices a profile
on a `Cluster` (`tess_compile.core.cluster`), and `predict_time` does
both. Per phase (forward, backward):

- matrix products (mm, addmm, bmm, baddbmm, fused attention): FLOPs at the
  achieved rate `flops * m / (m + matmul_half_size)`, `m` the smallest
  dimension of the product (small shards run below peak), by the price of a
  product that the schedule choice uses too (`core.cluster.product_terms`,
  `Cluster.compute_seconds`);
- every other kernel (elementwise ops, norms, softmax, copies): the bytes it
  reads and writes at `memory_bandwidth`; on a cluster whose products copy
  their bias term (`Cluster.bias_copy`: CPU BLAS), a product with one
  (`addmm`, `baddbmm`) also writes its output once more and reads it back;
- `kernel_overhead` seconds per kernel launched (views and allocations
  launch none; collectives are priced below, with the copies that pack a
  gradient bucket, `tess_compile.ops.grad_bucket`, as part of its all-reduce);
- `op_overhead` seconds of host time per kernel and per op of the runtime's
  own (`tess::keep_first`, ...; views, allocations and collectives not
  counted): what a program's runtime spends around its kernels;
- `call_overhead` seconds per call of the program, forward and backward
  (`StepTime.call_s`);
- each collective by `Cluster.collective_seconds` on the link of its axis
  (its profiled line, else `collective_time`'s rule; the lone line of an axis
  no other of its size alternates with, `lone_axis`);
- the optimizer step (AdamW) on the rank's parameter shards, where the
  cluster prices it (a profiled one does).

Backward is priced from the kernels autograd runs (recomputed regions and
the refetches of the memory-lean products included); compute and
communication add up, but for the broadcasts the overlap schedule starts
ahead (`broadcast_start`), which forward's compute hides, and unless
`overlap` says both overlap (the distributed backward runs its collectives
synchronously).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Interpreter

from tess_compile.analysis.accounting import PHASES, CollectiveCost, program_costs, transfers
from tess_compile.analysis.block_reuse import extended
from tess_compile.analysis.kernels import KernelRecorder, PhaseProfile
from tess_compile.analysis.memory import param_shards
from tess_compile.analysis.step_record import short_record
from tess_compile.core.cluster import COMPUTE_TERMS, Cluster, collective_rule
from tess_compile.core.fake_run import placeholder_values, tensor_leaves
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.program import Program
from tess_compile.ops.collectives import ShapeComm, broadcast_start, use_comm

__all__ = [
    "COMM_TERMS",
    "COMPUTE_TERMS",
    "TERMS",
    "ProgramProfile",
    "StepTime",
    "coefficients",
    "comm_seconds",
    "lone_axis",
    "optimizer_seconds",
    "predict_time",
    "profile_program",
    "ring_wire_bytes",
    "step_time",
    "time_terms",
]


def ring_wire_bytes(costs: Iterable[CollectiveCost], mesh: Mesh) -> dict[str, float]:
    """`{"forward": bytes, "backward": bytes}` one rank sends (and as many it receives) on
    the links when the collectives run as rings: each payload times its ring bandwidth
    factor (`2(g-1)/g` for an all-reduce, `1` for a pipelined broadcast, ...). Unlike the
    payloads, these compare across collectives and modes."""
    wire = dict.fromkeys(PHASES, 0.0)
    for phase, op, axis, num_bytes in transfers(costs):
        if mesh.size(axis) > 1:
            wire[phase] += collective_rule("ring", op)(mesh.size(axis))[1] * num_bytes
    return wire


def comm_seconds(costs: Iterable[CollectiveCost], mesh: Mesh, cluster: Cluster) -> dict[str, float]:
    """`{"forward": s, "backward": s}`: the time of the collectives in `costs`, one after another
    (`Cluster.collective_seconds`: profiled lines where the cluster has them; an axis that no
    other of its size alternates with, `lone_axis`, at its lone points)."""
    intra = {axis: cluster.is_intra_node(mesh, axis) for axis in AXES}
    seconds = dict.fromkeys(PHASES, 0.0)
    for phase, op, axis, num_bytes in transfers(costs):
        seconds[phase] += cluster.collective_seconds(op, mesh.size(axis), num_bytes, intra[axis],
                                                     lone_axis(mesh, axis))
    return seconds


def lone_axis(mesh: Mesh, axis: str) -> bool:
    """Whether no other axis of `mesh` has the size of `axis` (its collectives never alternate
    with those of another group layout of their size, `Cluster.lone_collectives`)."""
    return sum(mesh.size(other) == mesh.size(axis) for other in AXES) == 1


def _started_ahead(costs: Iterable[CollectiveCost]) -> list[CollectiveCost]:
    """The forward broadcasts that the overlap schedule starts ahead of their product."""
    return [cost for cost in costs if cost.node.target is broadcast_start]


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one training step on one rank, and the bytes it passes to collectives."""

    forward_compute_s: float
    forward_comm_s: float  # all of forward's collectives, `forward_ahead_s` included
    backward_compute_s: float
    backward_comm_s: float
    forward_bytes: int
    backward_bytes: int
    overlap: tuple[str, ...] = ()  # the phases whose compute and communication overlap
    optimizer_s: float = 0.0  # the optimizer step on this rank's parameters
    grad_tensors: int = 0  # parameter shards whose gradients this rank holds (a data-parallel all-reduce each)
    forward_ahead_s: float = 0.0  # forward's broadcasts started ahead, behind its compute (the overlap schedule)
    call_s: float = 0.0  # host time of the program's calls (forward and backward) beyond their ops

    def _phase(self, phase: str, compute: float, comm: float) -> float:
        return max(compute, comm) if phase in self.overlap else compute + comm

    @property
    def forward_s(self) -> float:
        if "forward" in self.overlap:
            return max(self.forward_compute_s, self.forward_comm_s)
        return max(self.forward_compute_s, self.forward_ahead_s) + self.forward_comm_s - self.forward_ahead_s

    @property
    def backward_s(self) -> float:
        return self._phase("backward", self.backward_compute_s, self.backward_comm_s)

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s + self.call_s

    @property
    def comm_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


# predict_time's `overlap` -> the phases whose compute and communication overlap.
_OVERLAPPED_PHASES = {False: (), True: ("forward", "backward"), "forward": ("forward",)}


@dataclass(frozen=True)
class ProgramProfile:
    """One rank's kernels per phase and its collectives (`accounting.collective_costs`)."""

    mesh: Mesh
    forward: PhaseProfile
    backward: PhaseProfile
    costs: tuple[CollectiveCost, ...]

    def phase(self, phase: str) -> PhaseProfile:
        return self.forward if phase == "forward" else self.backward


def _fake_step(program: Program, inputs_require_grad: bool) -> dict[str, PhaseProfile]:
    """Run one rank's program forward, then backward from every output that requires grad,
    on fake tensors, recording its kernels (recomputed regions count in backward)."""
    graph = program.runnable
    recorder = KernelRecorder()
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = placeholder_values(graph, program.mesh, inputs_require_grad)
        with use_comm(ShapeComm()), recorder:
            outputs = Interpreter(graph).run(*inputs)
            roots = [t for t in tensor_leaves(outputs) if t.requires_grad]
            del outputs
            recorder.phase = "backward"
            if roots:
                torch.autograd.backward(roots, [torch.empty_like(t) for t in roots])
    return {phase: PhaseProfile(**totals) for phase, totals in recorder.totals.items()}


_PROFILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per-rank graph -> {inputs_require_grad: profile}


def profile_program(program: Program, *, inputs_require_grad: bool = False) -> ProgramProfile:
    """The kernels and collectives of one training step of `program` on one rank
    (every output that requires grad is taken as part of the loss). Cached per program. A program
    compiled with block reuse: from its short forms (`tess_compile.analysis.block_reuse`)."""
    cached = _PROFILES.setdefault(program.graph, {})
    if inputs_require_grad not in cached:
        if program.repeats is None:
            phases = _fake_step(program, inputs_require_grad)
        elif not inputs_require_grad and not _has_regions(program.repeats.short(2)):
            # the kernels of the short programs' steps that `step_peak` records (`tess_compile.analysis.block_reuse`)
            phases = {phase: extended(program, lambda short, phase=phase: short_record(program, short).phases[phase])
                      for phase in PHASES}
        else:  # a recompute region is a module, whose tracking in `step_peak` adds ops of its own
            phases = {phase: extended(program, lambda short, phase=phase: profile_program(
                short, inputs_require_grad=inputs_require_grad).phase(phase)) for phase in PHASES}
        costs = program_costs(program, inputs_require_grad=inputs_require_grad)
        cached[inputs_require_grad] = ProgramProfile(program.mesh, phases["forward"], phases["backward"], tuple(costs))
    return cached[inputs_require_grad]


def _has_regions(program: Program) -> bool:
    """Whether the program's recompute regions are outlined as modules (`ops.recompute_region`)."""
    return program.runnable is not program.graph


# The terms of a phase's time, each priced by one constant of the cluster (`coefficients`):
# time = sum over terms of coefficient * term. The compute terms are `core.cluster.COMPUTE_TERMS`.
COMM_TERMS = ("intra_steps", "inter_steps", "intra_wire_bytes", "inter_wire_bytes")


TERMS = COMPUTE_TERMS + COMM_TERMS


def coefficients(cluster: Cluster) -> dict[str, float]:
    """Seconds per unit of each of `TERMS` on `cluster`. A product of `f` FLOPs and smallest
    dimension `m` takes `f / (flops * m / (m + h))` = `f / flops + (f / m) * h / flops`."""
    return {
        **cluster.compute_coefficients(),
        "intra_steps": cluster.intra_latency,
        "inter_steps": cluster.inter_latency,
        "intra_wire_bytes": 1 / cluster.intra_bandwidth,
        "inter_wire_bytes": 1 / cluster.inter_bandwidth,
    }


def _priced_costs(profile: ProgramProfile, grad_sync: bool) -> tuple[CollectiveCost, ...]:
    """The collectives to price: all of them, or without the gradient all-reduces of
    replicated parameters (`grad_sync`) when `grad_sync` is False."""
    return profile.costs if grad_sync else tuple(c for c in profile.costs if c.op != "grad_sync")


def time_terms(profile: ProgramProfile, cluster: Cluster, *, grad_sync: bool = True) -> dict[str, dict[str, float]]:
    """`{phase: {term: amount}}` of `profile` on `cluster`'s nodes: the compute terms from
    the kernels, and each collective's latency steps and wire bytes (`COLLECTIVE_RULES`
    for `cluster.algorithm`) on the link of its axis. `grad_sync=False` leaves out the
    gradient all-reduces of replicated parameters."""
    mesh = profile.mesh
    link = {axis: "intra" if cluster.is_intra_node(mesh, axis) else "inter" for axis in AXES}
    terms = {}
    for phase in PHASES:
        kernels = profile.phase(phase)
        terms[phase] = {**kernels.compute_terms(), **dict.fromkeys(COMM_TERMS, 0.0)}
    for phase, op, axis, num_bytes in transfers(_priced_costs(profile, grad_sync)):
        group = mesh.size(axis)
        steps, factor = collective_rule(cluster.algorithm, op)(group)
        if group > 1 and num_bytes > 0:
            terms[phase][f"{link[axis]}_steps"] += steps
            terms[phase][f"{link[axis]}_wire_bytes"] += factor * num_bytes
    return terms


def step_time(profile: ProgramProfile, cluster: Cluster, *, overlap: bool | str = False,
              grad_sync: bool = True, optimizer_s: float = 0.0, grad_tensors: int = 0) -> StepTime:
    """Forward and backward seconds of `profile` on `cluster` (see the module docstring),
    `optimizer_s` for the optimizer step, over `grad_tensors` parameter shards."""
    terms = time_terms(profile, cluster, grad_sync=grad_sync)

    def compute(phase: str) -> float:
        copies = profile.phase(phase).bias_bytes / cluster.memory_bandwidth if cluster.bias_copy else 0.0
        return cluster.compute_seconds(terms[phase]) + copies

    costs = _priced_costs(profile, grad_sync)
    comm = comm_seconds(costs, profile.mesh, cluster)
    ahead = comm_seconds(_started_ahead(costs), profile.mesh, cluster)["forward"]
    return StepTime(
        forward_compute_s=compute("forward"),
        forward_comm_s=comm["forward"],
        backward_compute_s=compute("backward"),
        backward_comm_s=comm["backward"],
        forward_bytes=sum(c.forward_bytes for c in costs if c.forward_bytes is not None),
        backward_bytes=sum(c.backward_bytes for c in costs if c.backward_bytes is not None),
        overlap=_OVERLAPPED_PHASES[overlap],
        optimizer_s=optimizer_s,
        grad_tensors=grad_tensors,
        forward_ahead_s=ahead,
        call_s=cluster.call_overhead,
    )


def optimizer_seconds(program: Program, cluster: Cluster) -> float:
    """Seconds of one AdamW step over this rank's parameter shards: `optimizer_overhead`
    per tensor plus their bytes at `optimizer_bandwidth` (0 on a cluster without them)."""
    shards = param_shards(program)
    num_bytes = sum(numel * itemsize for numel, itemsize in shards)
    return len(shards) * cluster.optimizer_overhead + num_bytes / cluster.optimizer_bandwidth


def predict_time(program: Program, cluster: Cluster, *, overlap: bool | str = False,
                 inputs_require_grad: bool = False, grad_sync: bool = True) -> StepTime:
    """Forward, backward and optimizer seconds of one step of `program` on `cluster`:
    `step_time(profile_program(program), cluster)` with `optimizer_seconds`."""
    profile = profile_program(program, inputs_require_grad=inputs_require_grad)
    return step_time(profile, cluster, overlap=overlap, grad_sync=grad_sync,
                     optimizer_s=optimizer_seconds(program, cluster), grad_tensors=len(program.params))
