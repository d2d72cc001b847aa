"""Predicted memory per rank of a compiled program: the peak of a training step, and what a
rank holds at the start of backward: parameters, gradients, AdamW state, the activations
autograd saves for backward, and the collectives' largest buffers.

An analysis of the rewritten graph. The peak comes from a step run on fake tensors under
torch's `MemTracker` without its module hooks (`analysis.step_record.step_tracker`), which counts
every tensor for as long as autograd, the recompute regions and the optimizer keep it; the
breakdown prices the saved tensors by storage, as `tess_compile.analysis.accounting.saved_bytes`
measures them.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tess_compile.analysis.accounting import forward_values
from tess_compile.analysis.block_reuse import extended, extended_peak
from tess_compile.analysis.step_record import (
    StepRecord,
    fake_training_step,
    is_weight,
    recorded,
    short_record,
    step_tracker,
)
from tess_compile.analysis.step_tail import README_STEP, StepTail
from tess_compile.core.fake_run import fake_run, placeholder_values, tensor_bytes, tensor_leaves
from tess_compile.core.program import Program
from tess_compile.ops.collectives import broadcast_start
from tess_compile.ops.fetched_product import fetched_product

__all__ = [
    "ADAMW_STATES",
    "MemoryEstimate",
    "activation_bytes",
    "collective_buffer_bytes",
    "param_shards",
    "predict_memory",
    "step_peak",
    "step_working",
]

ADAMW_STATES = 2  # torch.optim.AdamW: exp_avg and exp_avg_sq, each of its parameter's shape and dtype


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the start of backward, by kind, and the largest transient
    buffers of its collectives (fetched blocks in flight); `peak`, the most it holds at once
    in a training step (None where not predicted); `working`, the most it holds in forward,
    the tail and backward besides the parameters, their gradients and the AdamW state (saved
    activations, inputs, temporaries, buffers); `update`, the most it holds in the optimizer's
    step (`step_working`; None where not predicted)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int = 0
    peak: int | None = None
    working: int | None = None
    update: int | None = None

    @property
    def at_backward(self) -> int:
        """What the rank holds at the start of backward: the breakdown's sum."""
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    @property
    def total(self) -> int:
        """The bytes a rank needs: the step's peak, or the breakdown's sum where no peak was predicted."""
        return self.at_backward if self.peak is None else self.peak


def param_shards(program: Program) -> list[tuple[int, int]]:
    """(elements, bytes per element) of each parameter shard of a rank (its local block)."""
    out = []
    for slot in program.params:
        shape = slot.layout.local_shape(slot.shape, program.mesh)
        out.append((math.prod(shape), slot.dtype.itemsize))
    return out


def activation_bytes(program: Program) -> int:
    """Bytes of the tensors autograd saves for backward in one rank's forward.

    Counted by storage (views of one tensor count once) from a fake run (with block reuse: of the
    short programs, `tess_compile.analysis.block_reuse`);
    the weights' own storages are left out (they count as parameters).
    Collective results saved by a matmul (a broadcast weight block, with
    `keep_blocks`) count, and so does a saved model input; a recompute
    region counts its inputs only.
    """
    if program.repeats is not None:
        return extended(program, lambda short: short_record(program, short).saved)
    saved: list[torch.Tensor] = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    graph = program.runnable  # recompute regions save their inputs only
    values = fake_run(graph, program.mesh, within=hooks)
    # `_cdata` is the address of the storage itself: the same for every view of it
    weights = {values[node].untyped_storage()._cdata for node in graph.graph.nodes if is_weight(node)}
    storages: dict[int, int] = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage._cdata not in weights:
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def collective_buffer_bytes(program: Program) -> int:
    """The largest bytes of fetched blocks one product holds at once: its operands
    fetched from other ranks, twice when the next step's are in flight (overlap)."""
    if program.repeats is not None:  # the middle blocks' products are alike
        return collective_buffer_bytes(program.repeats.short(2))
    gm = program.graph
    values = forward_values(gm, program.mesh)[0]
    in_flight = 2 if any(n.target is broadcast_start for n in gm.graph.nodes) else 1
    largest = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is fetched_product:
            a_used, w_used, _, _, _, a_fetch, w_fetch = node.args
            fetched = [value for value, fetch in ((a_used, a_fetch), (w_used, w_fetch)) if fetch is not None]
            largest = max(largest, in_flight * sum(tensor_bytes(values[v]) for v in fetched))
    return largest


def step_peak(program: Program, tail: StepTail = README_STEP) -> int:
    """The most bytes rank 0 holds at once in a step of `program`, from two steps on fake tensors
    under torch's `MemTracker` without its module hooks (`step_tracker`; the second step's AdamW state
    exists from its start).

    A training program's step: its forward, the step's `tail` (`tess_compile.analysis.step_tail`:
    README's loop by default: the output gathered whole, a loss of it outside the module), backward
    from the loss (with `MODULE_LOSS`, from every output that requires grad, each output's gradient
    a tensor of its size), and `torch.optim.AdamW`'s step with its defaults, then `zero_grad` in
    the tail's mode; every collective's output a new tensor (`ShapeComm`). An eval program's step:
    its forward and the tail's gather and loss under no_grad. Counted: the parameter
    shards, inputs, saved activations, gradients, temporaries and optimizer state while they
    live; not counted: the allocator's rounding and cached blocks, and a collective
    implementation's own buffers. Cached per program graph. A program compiled with block reuse:
    from the steps of its short forms (`tess_compile.analysis.block_reuse.extended_peak`).
    """
    peaks = _PEAKS.setdefault(program.graph, {})
    if tail not in peaks:
        peak = None if program.repeats is None else extended_peak(
            program, lambda short: short_record(program, short, tail).moments)
        peaks[tail] = _step_peak(program, tail) if peak is None else peak
    return peaks[tail]


_PEAKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per-rank graph -> {tail: its step's peak}


def _step_peak(program: Program, tail: StepTail) -> int:
    graph = program.runnable
    with FakeTensorMode(allow_non_fake_inputs=True):
        values = placeholder_values(graph, program.mesh)
        params = [v for v in tensor_leaves(values) if v.requires_grad] if program.training else []
        optimizer = torch.optim.AdamW(params) if params else None
        tracker = step_tracker()
        tracker.track_external(*tensor_leaves(values), *([optimizer] if optimizer else []))
        with tracker:
            for _ in range(2 if optimizer else 1):
                tracker.reset_mod_stats()  # the tracker refuses a module's second call otherwise
                fake_training_step(program, values, optimizer, tail)
        peak = tracker.get_tracker_snapshot("peak")
    return max((device["Total"] for device in peak.values()), default=0)


def step_working(program: Program, tail: StepTail = README_STEP) -> tuple[int, int] | None:
    """`(working, update)` of a step of `program` with `tail` around its call (`MemoryEstimate`): the most
    bytes rank 0 holds in forward, the tail and backward less its parameters, their gradients and the
    AdamW state at that moment; and the most it holds in the optimizer's step (`zero_grad` included).
    From the step `record_step` runs (with block reuse: of the short programs, `extended_peak`); None
    where the short programs' steps do not line up."""
    if program.repeats is None:
        record = recorded(program, tail, dict)
        return max(held for _, held in _working(record)), max(held for _, held in _update(record))
    working = extended_peak(program, lambda short: _working(short_record(program, short, tail)))
    update = extended_peak(program, lambda short: _update(short_record(program, short, tail)))
    return None if working is None or update is None else (working, update)


def _working(record: StepRecord) -> list[tuple[object, int]]:
    """The moments of forward, the tail and backward, each less what the parameters, gradients and AdamW state hold."""
    return [(label, held - static) for (label, held), static, updating in
            zip(record.moments, record.static, record.updating) if not updating] or [(None, 0)]


def _update(record: StepRecord) -> list[tuple[object, int]]:
    """The moments of the optimizer's step."""
    return [moment for moment, updating in zip(record.moments, record.updating) if updating] or [(None, 0)]


def predict_memory(program: Program, tail: StepTail = README_STEP) -> MemoryEstimate:
    """Per-rank bytes: parameter shards, their gradients (same dtype), AdamW state
    (`ADAMW_STATES` tensors of each parameter's dtype, as torch.optim.AdamW keeps them) and
    `activation_bytes`, the peak of a step with `tail` around the call (`step_peak`; README's loop
    by default), which `total` gives, and, compiled with block reuse, its `working` and `update`
    parts (`step_working`, from the short programs' steps the peak ran; a whole program's would
    take one more step on fake tensors: None, which `parallel_plan` bounds by the peak).

    Not counted: the allocator's slack, and fp32 master weights of mixed-precision training.
    """
    param_bytes = sum(numel * size for numel, size in param_shards(program))
    working = step_working(program, tail) if program.training and program.repeats is not None else None
    return MemoryEstimate(
        params=param_bytes,
        grads=param_bytes,
        optimizer=ADAMW_STATES * param_bytes,
        activations=activation_bytes(program),
        transient=collective_buffer_bytes(program),
        peak=step_peak(program, tail),
        working=None if working is None else working[0],
        update=None if working is None else working[1],
    )
