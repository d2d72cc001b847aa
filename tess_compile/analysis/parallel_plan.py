"""Data and pipeline parallelism around a tensor-parallel program, priced for the planner.

A configuration is `dp x pp x [q, q, d]` (the Tesseract paper's Figure 6):
ranks fill a tensor-parallel group first, then the pipeline stages, then the
data-parallel replicas, so a data-parallel group's ranks are `pp * q*q*d`
apart. The tensor-parallel program is compiled for one microbatch,
`batch / (dp * microbatches)` rows, and priced by the cost model; then:

- pipeline: the model's repeated blocks split evenly over `pp` stages, so a
  stage runs `1/pp` of the program per microbatch, and a GPipe or 1F1B
  schedule takes `microbatches + pp - 1` stage slots (the bubble is
  `pp - 1` of them), each slot one call of the stage's program
  (`Cluster.call_overhead`); in each slot but the last a stage sends the
  microbatch's activation at a stage boundary forward and receives its
  gradient (`boundary_bytes`, this rank's block of it, priced as a
  broadcast over two ranks on the link between stages);
- data parallel: each stage's gradients are all-reduced over the `dp`
  replicas in backward, one all-reduce per parameter shard as the runtime
  runs them, on the intra-node link if the replicas share a node, else the
  inter-node one, at the cluster's lone points: the sync runs after the
  tensor-parallel backward, its all-reduces one after another on the
  data-parallel group alone (autograd runs the parameters' reduce nodes
  last: they were made first, before the program's); the optimizer steps the
  stage's parameters (ZeRO: their share);
- ZeRO-3 without a pipeline: FSDP2's gathers and reduce-scatters per unit,
  one unit per repeated block, overlapped with the neighbouring units'
  compute (`fsdp_comm`, `tess_compile.analysis.zero_units`); HSDP
  (`zero_shard`) shards over neighbouring replicas and all-reduces across
  the groups; with a pipeline each stage is one unit, priced as its
  gradients' all-reduce (the same bytes on a ring) after its backward;
- memory per rank: the program's peak (`analysis.memory.step_peak`, one
  microbatch, which comes in backward before its gradients are complete)
  moved by what the worst rank holds there instead:
  - a data-parallel replica: the program's peak (the gradient mean over dp
    adds one gradient at a time);
  - a pipeline stage: 1/pp of the parameters, gradients and AdamW state; the
    saved activations of the microbatches in flight, min(pp, microbatches) on
    the first stage with 1F1B (`Outer.schedule`; the planner prices 1F1B),
    all of them with GPipe; and the boundary blocks the schedule keeps
    (`block_bytes` each): a receive buffer per microbatch (two on a middle
    stage) and the outputs in flight. A backward after the first runs over
    the gradients the earlier microbatches accumulated; with every forward
    before the first backward (GPipe) it has one microbatch fewer in flight,
    so the peak is the larger of the two (a program whose own peak comes
    with its gradients, after backward, gets them counted twice: too high);
  - ZeRO per unit (`units > 1`): the shards (1/dp, HSDP 1/zero_shard) of
    the parameters, gradients and AdamW state, and two units whole of the
    parameters and of the gradients (the one running, the one prefetched);
    in forward and backward those beside the program's working bytes (its
    step's most there less its parameters, gradients and AdamW state,
    `MemoryEstimate.working`: saved activations, inputs, temporaries), or,
    where lower, the program's peak sharded and its working bytes whole
    beside the units (`_unit_peak`); the peak is the larger of that and the
    optimizer's step on the shards (`update` / dp). Not the program's peak
    moved: where that comes after backward it holds all the gradients, where
    before, few of them;
  - ZeRO in one unit (`runtime.zero`; a pipeline stage): from forward to
    the end of backward a rank holds its whole tensor-parallel parameters
    (gathered over dp) beside their 1/dp shards, and the whole gradients
    until FSDP reduce-scatters them: the parameters 1 + 1/dp times, the
    gradients whole, the AdamW state 1/dp (the reduce-scatter's input, a copy
    of the gradients made after the gathered parameters are freed, stays
    below that). Until the forward ends FSDP also keeps its all-gather's
    output, from which it copied the parameters: at the end of forward a rank
    holds what it holds at the start of backward, less the gradients, and the
    parameters once more; the peak is the larger of the two.
  The first stage also holds the step's whole inputs (`input_bytes` a
  microbatch), where the program counts one microbatch's.
  Not counted: a collective implementation's own buffers (gloo's
  reduce-scatter copies its input).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from tess_compile.analysis.cost_model import StepTime
from tess_compile.analysis.memory import MemoryEstimate
from tess_compile.analysis.zero_units import ZeroComm, zero_comm
from tess_compile.core.cluster import Cluster
from tess_compile.core.fake_run import tensor_bytes, tensor_leaves
from tess_compile.core.program import split_example_inputs

__all__ = [
    "Outer",
    "batch_size",
    "boundary_bytes",
    "default_microbatches",
    "dp_link_is_intra",
    "fsdp_comm",
    "microbatch_inputs",
    "num_blocks",
    "outer_options",
    "price",
    "repeated_blocks",
    "replicas_per_node",
    "zero_note",
]

log = logging.getLogger("tess_compile")


@dataclass(frozen=True)
class Outer:
    """The parallelism around a tensor-parallel group: data-parallel replicas, pipeline
    stages, microbatches per step, whether the optimizer state is sharded (ZeRO), and the
    pipeline's schedule, "1f1b" or "gpipe" (the microbatches a stage holds; the same time);
    `zero_shard` (ZeRO only; 0: all dp): HSDP, sharded over groups of that many neighbouring
    replicas, replicated over the groups."""

    dp: int = 1
    pp: int = 1
    microbatches: int = 1
    zero: bool = False
    schedule: str = "1f1b"
    zero_shard: int = 0

    def __post_init__(self):
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule={self.schedule!r}: use '1f1b' or 'gpipe'")

    @property
    def shards(self) -> int:
        """The replicas a parameter is sharded over: 1 without ZeRO, `zero_shard` with HSDP, else dp."""
        return (self.zero_shard or self.dp) if self.zero else 1


def repeated_blocks(model: nn.Module) -> nn.Module | None:
    """The blocks a pipeline can split: the longest ModuleList or Sequential of one class, if any."""
    best = None
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 1:
            if len({type(child) for child in module}) == 1 and (best is None or len(module) > len(best)):
                best = module
    return best


def num_blocks(model: nn.Module) -> int:
    """The number of repeated blocks a pipeline can split (1 if the model has none)."""
    blocks = repeated_blocks(model)
    return 1 if blocks is None else len(blocks)


def boundary_bytes(model: nn.Module, inputs) -> int:
    """Bytes of the activation that crosses a stage boundary for `inputs`: the output of the
    first repeated block, from a forward on fake tensors (0 if the model has no repeated
    blocks or the fake forward fails)."""
    blocks = repeated_blocks(model)
    if blocks is None:
        return 0
    seen = []
    handle = next(iter(blocks.children())).register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake, torch.no_grad():
            args, kwargs = split_example_inputs(pytree.tree_map_only(torch.Tensor, fake.from_tensor, inputs))
            model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a model fake tensors cannot run: its sends go unpriced
        log.info("plan: the stage boundary's activation is not priced (a fake forward failed: %s)", exc)
    finally:
        handle.remove()
    return sum(tensor_bytes(t) for t in tensor_leaves(seen[:1]))


def batch_size(inputs) -> int | None:
    """The batch (dim 0) of the tensor inputs, if they agree."""
    sizes = {t.shape[0] for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def microbatch_inputs(inputs, batch: int, rows: int):
    """`inputs` with every tensor of batch `batch` cut to its first `rows` rows."""
    return pytree.tree_map(
        lambda t: t[:rows] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch else t, inputs
    )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def default_microbatches(rows: int, pp: int) -> int:
    """Microbatches per step: 1 without a pipeline, else the most up to 4*pp that divide `rows`."""
    if pp == 1:
        return 1
    return max(m for m in range(1, 4 * pp + 1) if rows % m == 0)


def outer_options(gpus: int, dp: int | str, pp: int | str, blocks: int, batch: int | None) -> list[tuple[int, int]]:
    """The (dp, pp) pairs to price for `gpus` ranks: `dp` and `pp` as given, or every value
    ("auto") with dp dividing the batch, pp the number of blocks, and dp*pp the GPUs."""
    for name, value in (("dp", dp), ("pp", pp)):
        if value != "auto" and not (isinstance(value, int) and value >= 1 and gpus % value == 0):
            raise ValueError(f"{name}={value!r} does not divide {gpus} GPUs: use a divisor of {gpus}, or 'auto'")
    if pp != "auto" and blocks % pp:
        raise ValueError(f"pp={pp} stages do not split the model's {blocks} repeated blocks evenly: "
                         f"use a divisor of {blocks}, or 'auto'")
    if dp != "auto" and batch is not None and batch % dp:
        raise ValueError(f"dp={dp} replicas do not split the batch of {batch} evenly: use a divisor of {batch}")
    pairs = []
    for d_ in ([dp] if dp != "auto" else _divisors(gpus)):
        for p_ in ([pp] if pp != "auto" else _divisors(gpus // d_)):
            if gpus % (d_ * p_) or blocks % p_ or (batch is not None and batch % d_):
                continue
            pairs.append((d_, p_))
    return pairs


def dp_link_is_intra(cluster: Cluster, outer: Outer, tp: int) -> bool:
    """Whether a data-parallel group (ranks `tp * pp` apart) lies within one node."""
    return outer.dp * tp * outer.pp <= cluster.gpus_per_node


def _dp_sync_seconds(cluster: Cluster, outer: Outer, tp: int, grad_bytes: int, tensors: int) -> float:
    """The data-parallel gradient sync: one all-reduce per parameter shard, as the runtime
    reduces each gradient in backward (ZeRO: FSDP2's reduce-scatter and all-gather, bucketed: one),
    each on the data-parallel group alone (`Cluster.lone_collectives`; see the module docstring)."""
    intra = dp_link_is_intra(cluster, outer, tp)
    if outer.zero:
        return cluster.collective_seconds("all_reduce", outer.dp, grad_bytes, intra, alone=True)
    return tensors * cluster.collective_seconds("all_reduce", outer.dp, grad_bytes // tensors, intra, alone=True)


def _sends_seconds(cluster: Cluster, outer: Outer, tp: int, block_bytes: int) -> float:
    """The sends at stage boundaries on a step's critical path: in each stage slot but the last,
    a microbatch's activation forward and its gradient back, `block_bytes` each, between ranks
    `tp` apart (a broadcast over two ranks)."""
    if outer.pp == 1 or block_bytes == 0:
        return 0.0
    intra = 2 * tp <= cluster.gpus_per_node
    one = cluster.collective_seconds("broadcast", 2, block_bytes, intra, alone=True)  # between two fixed ranks
    return 2 * (outer.microbatches + outer.pp - 2) * one


def price(time: StepTime, memory: MemoryEstimate, outer: Outer, tp: int, cluster: Cluster,
          block_bytes: int = 0, input_bytes: int = 0, units: int = 1) -> tuple[StepTime, MemoryEstimate]:
    """The step time and per-rank memory of `outer` around a tensor-parallel program whose one
    microbatch costs `time` and `memory` (see the module docstring); `block_bytes`: this rank's
    block of the activation at a stage boundary, for one microbatch; `input_bytes`: the inputs of
    one microbatch, as the program takes them (a pipeline's first stage holds the step's); `units`:
    the model's repeated blocks, ZeRO-3's FSDP2 units without a pipeline (`zero_units`)."""
    slots = (outer.microbatches + outer.pp - 1) / outer.pp  # stage slots, each 1/pp of the program
    sends = _sends_seconds(cluster, outer, tp, block_bytes)
    grad_bytes = memory.grads // outer.pp
    zero = fsdp_comm(time, memory, outer, tp, cluster, units)
    if zero is None:
        forward_dp_s, forward_dp_bytes = 0.0, 0
        reduce_s = _dp_sync_seconds(cluster, outer, tp, grad_bytes, max(1, time.grad_tensors // outer.pp))
        dp_bytes = grad_bytes if outer.dp > 1 else 0
    else:  # per microbatch: the gathers of every unit (again in backward, unless one unit), the reductions
        forward_dp_s, reduce_s = zero.forward_s * outer.microbatches, zero.backward_s * outer.microbatches
        forward_dp_bytes = zero.units * zero.gather_bytes * outer.microbatches
        dp_bytes = (grad_bytes + (forward_dp_bytes if zero.units > 1 else 0)
                    + (forward_dp_bytes if outer.zero_shard else 0)) * outer.microbatches
    step = StepTime(
        forward_compute_s=time.forward_compute_s * slots,
        forward_comm_s=time.forward_comm_s * slots + sends / 2 + forward_dp_s,
        backward_compute_s=time.backward_compute_s * slots,
        backward_comm_s=time.backward_comm_s * slots + sends / 2 + reduce_s,
        forward_bytes=int(time.forward_bytes * outer.microbatches / outer.pp) + forward_dp_bytes,
        backward_bytes=int(time.backward_bytes * outer.microbatches / outer.pp) + dp_bytes,
        overlap=time.overlap,
        optimizer_s=time.optimizer_s / (outer.pp * outer.shards),
        grad_tensors=time.grad_tensors // outer.pp,
        forward_ahead_s=time.forward_ahead_s * slots,
        call_s=time.call_s * (outer.microbatches + outer.pp - 1),  # a stage's program, called once a slot
    )
    return step, _held(memory, outer, block_bytes, input_bytes, units if zero is not None else 1)


def fsdp_comm(time: StepTime, memory: MemoryEstimate, outer: Outer, tp: int, cluster: Cluster,
              units: int) -> ZeroComm | None:
    """ZeRO-3's communication per microbatch as FSDP2 runs it without a pipeline (`zero_units`): the
    shards on neighbouring replicas (intra-node if they fit in one), HSDP's replicas across them;
    None without ZeRO or with a pipeline (one unit a stage, priced as one gradient all-reduce)."""
    if not outer.zero or outer.pp > 1:
        return None
    shard_intra = outer.shards * tp <= cluster.gpus_per_node
    return zero_comm(cluster, param_bytes=memory.params, units=units, shards=outer.shards,
                     replicas=outer.dp // outer.shards, shard_intra=shard_intra,
                     replica_intra=dp_link_is_intra(cluster, outer, tp), forward_compute_s=time.forward_compute_s,
                     backward_compute_s=time.backward_compute_s)


def _held(memory: MemoryEstimate, outer: Outer, block_bytes: int, input_bytes: int = 0,
          units: int = 1) -> MemoryEstimate:
    """What the worst rank of `outer` holds at the start of a backward, by kind, and its step's
    peak, from one microbatch's `memory` (see the module docstring)."""
    shards = outer.shards
    in_flight = outer.microbatches if outer.schedule == "gpipe" else min(outer.pp, outer.microbatches)
    buffers = 0 if outer.pp == 1 else ((2 if outer.pp > 2 else 1) * outer.microbatches + in_flight) * block_bytes
    if outer.pp > 1:  # the first stage: the step's inputs, of which the program counts one microbatch's
        buffers += (outer.microbatches - 1) * input_bytes
    params, grads = memory.params // outer.pp, memory.grads // outer.pp
    if units > 1:  # ZeRO per unit: the shards, and two units whole (the one running, the one prefetched)
        params, grads = params // shards + min(params, 2 * params // units), grads // shards + min(grads, 2 * grads // units)
    elif outer.zero:  # one unit: gathered, and the shards; the gradients whole until the reduce-scatter
        params += params // shards
    held = MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=memory.optimizer // (outer.pp * shards),
        activations=memory.activations * in_flight // outer.pp + buffers,
        transient=memory.transient,
    )
    return held if memory.peak is None else replace(held, peak=_peak(memory, held, outer, in_flight, units))


def _peak(memory: MemoryEstimate, held: MemoryEstimate, outer: Outer, in_flight: int, units: int = 1) -> int:
    """The peak of a rank that holds `held`: the program's, which comes in backward before its
    gradients are complete, moved by what the other parts move, plus the gradients a backward
    after the first runs over; ZeRO in one unit: at least the end of forward; ZeRO per unit:
    `_unit_peak` (see the module docstring)."""
    accumulated = 0 if outer.microbatches == 1 else memory.grads // (outer.pp * outer.shards)
    if in_flight == outer.microbatches:  # every microbatch in flight at the first backward: one fewer at the next
        accumulated = max(0, accumulated - memory.activations // outer.pp)
    if units > 1:
        return _unit_peak(memory, held, outer.shards)
    peak = memory.peak + held.at_backward - held.grads - (memory.at_backward - memory.grads) + accumulated
    if outer.zero:  # FSDP keeps its all-gather's output beside the parameters copied out of it
        peak = max(peak, held.at_backward - held.grads + accumulated + memory.params // outer.pp)
    return peak


def _unit_peak(memory: MemoryEstimate, held: MemoryEstimate, shards: int) -> int:
    """The peak of a rank of ZeRO per unit (see the module docstring): the larger of forward and
    backward's and the optimizer's step on the shards (the program's `update` / shards).

    In forward and backward the program holds at each moment `w`, its working bytes, beside `s`, its
    parameters, AdamW state and the gradients made so far; the rank holds `w + s / shards` beside the
    units whole. Its most is at most both of: `held`'s parameters, gradients and AdamW state beside the
    program's most `w` (`working`); and, as that most is convex in `1 / shards`, the program's peak
    (`w + s` at its most) over shards plus `working` over the rest, beside the units whole. Where the
    program's step was not split so (`working` None), `working` is bounded by its peak less its
    parameters and AdamW state, which the step holds throughout."""
    working = memory.peak - memory.params - memory.optimizer if memory.working is None else memory.working
    update = memory.peak if memory.update is None else memory.update
    units = held.params + held.grads - (memory.params + memory.grads) // shards
    through_backward = min(held.params + held.grads + held.optimizer + working,
                           (memory.peak - working) // shards + working + units)
    return max(through_backward, update // shards)


def zero_note(time: StepTime, memory: MemoryEstimate, outer: Outer, tp: int, cluster: Cluster, units: int) -> str:
    """`" (ZeRO-3, 32 units: 0.012 s of gathers exposed)"`: how ZeRO runs around a program of one
    microbatch's `time` and `memory`, and the step's forward gathers priced exposed (`fsdp_comm`)."""
    kind = f"HSDP {outer.dp // outer.zero_shard} x {outer.zero_shard}" if outer.zero_shard else "ZeRO-3"
    zero = fsdp_comm(time, memory, outer, tp, cluster, units)
    if zero is None:
        return f" ({kind})"
    units = f"{zero.units} units" if zero.units > 1 else "1 unit"
    return f" ({kind}, {units}: {zero.forward_s * outer.microbatches:.3g} s of gathers exposed)"


def replicas_per_node(cluster: Cluster, tp: int, pp: int) -> int:
    """The data-parallel replicas of `tp` x `pp` ranks one node holds; 0 with a pipeline (no HSDP rows)."""
    return cluster.gpus_per_node // (tp * pp) if pp == 1 else 0
