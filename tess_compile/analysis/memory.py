"""Predicted memory per rank of a compiled program: parameters, gradients, AdamW state,
the activations autograd saves for backward, and the collectives' largest buffers.

An analysis of the rewritten graph: a fake run prices the saved tensors by
storage, as `tess_compile.analysis.accounting.saved_bytes` measures them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tess_compile.core.fake_run import fake_run, tensor_bytes
from tess_compile.core.meta_keys import ROLE, WEIGHT_INPUT
from tess_compile.core.program import Program
from tess_compile.ops.collectives import broadcast_start
from tess_compile.ops.fetched_product import fetched_product

__all__ = [
    "MemoryEstimate",
    "OPTIMIZER_BYTES_PER_PARAM",
    "activation_bytes",
    "collective_buffer_bytes",
    "param_shards",
    "predict_memory",
]

OPTIMIZER_BYTES_PER_PARAM = 8  # AdamW: exp_avg and exp_avg_sq, fp32 each


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the start of backward, by kind, and the largest
    transient buffers of its collectives (fetched blocks in flight)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.transient


def param_shards(program: Program) -> list[tuple[int, int]]:
    """(elements, bytes per element) of each parameter shard of a rank (its local block)."""
    out = []
    for slot in program.params:
        shape = slot.layout.local_shape(slot.shape, program.mesh)
        out.append((math.prod(shape), slot.dtype.itemsize))
    return out


def _is_weight(node) -> bool:
    """A placeholder of a parameter, a tied parameter's second name, or a weight given as an input."""
    if node.op != "placeholder":
        return False
    return ROLE.of(node)[0] in ("param", "alias") or WEIGHT_INPUT.has(node)


def activation_bytes(program: Program) -> int:
    """Bytes of the tensors autograd saves for backward in one rank's forward.

    Counted by storage (views of one tensor count once) from a fake run;
    the weights' own storages are left out (they count as parameters).
    Collective results saved by a matmul (a broadcast weight block, with
    `keep_blocks`) count, and so does a saved model input; a recompute
    region counts its inputs only.
    """
    saved: list[torch.Tensor] = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    graph = program.runnable  # recompute regions save their inputs only
    values = fake_run(graph, program.mesh, within=hooks)
    # `_cdata` is the address of the storage itself: the same for every view of it
    weights = {values[node].untyped_storage()._cdata for node in graph.graph.nodes if _is_weight(node)}
    storages: dict[int, int] = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage._cdata not in weights:
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def collective_buffer_bytes(program: Program) -> int:
    """The largest bytes of fetched blocks one product holds at once: its operands
    fetched from other ranks, twice when the next step's are in flight (overlap)."""
    gm = program.graph
    values = fake_run(gm, program.mesh)
    in_flight = 2 if any(n.target is broadcast_start for n in gm.graph.nodes) else 1
    largest = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is fetched_product:
            a_used, w_used, _, _, _, a_fetch, w_fetch = node.args
            fetched = [value for value, fetch in ((a_used, a_fetch), (w_used, w_fetch)) if fetch is not None]
            largest = max(largest, in_flight * sum(tensor_bytes(values[v]) for v in fetched))
    return largest


def predict_memory(program: Program) -> MemoryEstimate:
    """Per-rank bytes: parameter shards, their gradients (same dtype), AdamW state
    (`OPTIMIZER_BYTES_PER_PARAM` per element) and `activation_bytes`.

    Not counted: temporary buffers of single ops, the allocator's slack, and
    fp32 master weights of mixed-precision training.
    """
    shards = param_shards(program)
    param_bytes = sum(numel * size for numel, size in shards)
    return MemoryEstimate(
        params=param_bytes,
        grads=param_bytes,
        optimizer=OPTIMIZER_BYTES_PER_PARAM * sum(numel for numel, _ in shards),
        activations=activation_bytes(program),
        transient=collective_buffer_bytes(program),
    )
