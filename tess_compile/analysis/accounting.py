"""Bytes moved and FLOPs of a compiled program, predicted from its per-rank graph.

An analysis of the rewritten graph (stage 3's output); it runs nothing
between ranks. A fake run of the per-rank graph on local shapes gives every
value its shape, dtype and, through autograd itself, whether it requires
grad. Then, per collective that sends bytes:

- forward: the bytes of its input tensor on this rank;
- backward: its adjoint (its record's `adjoint` in
  `tess_compile.core.collective_table`) runs if autograd reaches the
  node from the outputs, that is if its input requires grad and its output
  feeds a graph output through differentiable ops; it sends the gradient of
  the node's output, so its bytes are the output tensor's bytes.

A `fetched_product` (`tess_compile.ops.fetched_product`) fetches its operands again in
backward: each fetch whose block the backward needs counts in backward, with
the bytes of the own block it sends; a `context_attention`
(`tess_compile.ops.context_attention`) fetches its keys and values again so. A `split_norm` (`tess_compile.ops.split_norm`)
all-reduces its backward statistics when x's gradient is needed. A
`grad_bucket` (`tess_compile.ops.grad_bucket`) all-reduces its members'
gradients in backward, a few per collective, counted as `grad_sync`.

A recompute region (`tess_compile.ops.recompute_region`) that backward reaches runs
again there: its collectives count in backward once more, with their
forward bytes.

Redundant work is the forward FLOPs of every rank over the unsharded
model's (`redundant_work`): 1.0 when no rank repeats another's matmul-like
work; ops that run replicated, or products whose weight stays whole, raise it.

`grad_sync` (identity forward, all-reduce backward) counts in backward only;
`shard_slice`, `seed_once` and their adjoints send nothing. Every output
that requires grad is assumed to be part of the loss. Reads `meta["role"]`,
`meta["layout"]`, `meta["global_shape"]` and `meta["dtype"]` of the
placeholders; writes nothing.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from tess_compile.passes.capture import capture
from tess_compile.passes.repeated_blocks import find_repeated_blocks, repeats_of, shorten
from tess_compile.passes.repeated_work import flops_by_node
from tess_compile.analysis.block_reuse import added_block, extended
from tess_compile.core.collective_table import COLLECTIVES
from tess_compile.core.fake_run import fake_run, global_placeholder, tensor_bytes
from tess_compile.core.flops import flop_counter
from tess_compile.core.mesh import Mesh, check_rank
from tess_compile.core.program import Program, split_example_inputs
from tess_compile.ops.collectives import COLLECTIVE_NAMES, COLLECTIVE_OPS, CommRecord
from tess_compile.ops.context_attention import context_attention
from tess_compile.ops.fetched_product import fetched_product
from tess_compile.ops.grad_bucket import bucket_groups, grad_bucket
from tess_compile.ops.recompute_region import region_runs
from tess_compile.ops.ring_attention import ring_attention
from tess_compile.ops.split_norm import split_norm

__all__ = [
    "BytesByKey",
    "CollectiveCost",
    "PHASES",
    "bytes_by_phase",
    "bytes_from_records",
    "captured_forward_flops",
    "collective_costs",
    "forward_flops",
    "forward_values",
    "predict_bytes",
    "program_costs",
    "redundant_work",
    "saved_bytes",
    "transfers",
    "unsharded_forward_flops",
]

PHASES = ("forward", "backward")


BytesByKey = dict[tuple[str, str], int]


def forward_flops(program: Program) -> int:
    """FLOPs of the matmul-like ops, attention and FFTs (`tess_compile.core.flops.flop_counter`) one
    rank runs in forward."""
    if program.repeats is not None:
        return extended(program, forward_flops)
    return forward_values(program.graph, program.mesh)[1]


_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per-rank graph -> {inputs_require_grad: run}


def forward_values(gm: GraphModule, mesh: Mesh, inputs_require_grad: bool = False) -> tuple[dict[Node, object], int]:
    """Every node's value from a fake run of the per-rank `gm` (`core.fake_run.fake_run`) and the run's
    matmul-like FLOPs; one run per graph serves the costs, the FLOPs and the fetched blocks' bytes."""
    runs = _FORWARDS.setdefault(gm, {})
    if inputs_require_grad not in runs:
        counter = flop_counter()
        values = fake_run(gm, mesh, inputs_require_grad=inputs_require_grad, within=counter)
        runs[inputs_require_grad] = (values, counter.get_total_flops())
    return runs[inputs_require_grad]


def unsharded_forward_flops(model: torch.nn.Module, example_inputs) -> int:
    """FLOPs of the matmul-like ops the unsharded model runs in forward: a fake run of its
    captured graph on global shapes (the graph the compiler shards, on the device of
    `fake_run`, so that the two counts compare)."""
    args, kwargs = split_example_inputs(example_inputs)
    return captured_forward_flops(capture(model, args, kwargs))


def captured_forward_flops(gm: GraphModule) -> int:
    """`unsharded_forward_flops` of a graph already captured: of a model whose layers repeat, its
    graph shortened to four of them, each op counted for the ops it stands for (`passes.repeated_blocks`)."""
    blocks = find_repeated_blocks(gm)
    if blocks is not None:
        gm = shorten(gm, blocks)
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = [global_placeholder(n) for n in gm.graph.nodes if n.op == "placeholder"]
    return sum(flops * repeats_of(gm, node) for node, flops in flops_by_node(gm, inputs).items())


def saved_bytes(run, parameters) -> int:
    """Bytes of the storages autograd saves for backward while `run()` runs, each storage
    once (its views too), the storages of `parameters` left out. A DTensor counts by its
    local tensor (its own storage is a placeholder of the global size)."""
    local = (lambda t: t.to_local() if isinstance(t, DTensor) else t)
    skip = {local(p).untyped_storage()._cdata for p in parameters}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = local(tensor).untyped_storage()
        if storage._cdata not in skip:  # `_cdata`: the storage itself, the same for all its views
            storages[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


def redundant_work(program: Program, unsharded_flops: int) -> float | None:
    """Forward FLOPs over all ranks (each rank runs the same local shapes) over the
    unsharded model's `unsharded_flops`; None if the model has no matmul-like FLOPs."""
    if not unsharded_flops:
        return None
    return program.mesh.num_ranks * forward_flops(program) / unsharded_flops


def _reached_by_backward(gm: GraphModule, values: dict[Node, object]) -> set:
    """The autograd nodes that a backward from every graph output runs."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(values[output])
    pending = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    reached = set()
    while pending:
        fn = pending.pop()
        if fn is None or fn in reached:
            continue
        reached.add(fn)
        pending.extend(next_fn for next_fn, _ in fn.next_functions)
    return reached


@dataclass(frozen=True)
class CollectiveCost:
    """Bytes one collective node of the per-rank graph sends, per phase (or one
    backward fetch of a `fetched_product` node)."""

    node: Node
    op: str
    axis: str
    forward_bytes: int | None  # its input's bytes; None if it sends nothing
    backward_op: str  # its adjoint
    backward_bytes: int | None  # its output's bytes; None if the adjoint sends nothing or does not run
    backward_of: Node | tuple[Node, ...] | None = None  # the node(s) whose local tensors backward sends, if not `node`

    @property
    def backward_value(self) -> Node | tuple[Node, ...]:
        return self.node if self.backward_of is None else self.backward_of


def program_costs(program: Program, *, inputs_require_grad: bool = False) -> list[CollectiveCost]:
    """`collective_costs` of the program's per-rank graph; of a program compiled with block reuse, from
    its short forms (`tess_compile.analysis.block_reuse`): the 2-block program's collectives, and those
    of the 3-block program's added copy (its gradient buckets too: they are its own) once more per
    further block."""
    if program.repeats is None:
        return collective_costs(program.graph, program.mesh, inputs_require_grad=inputs_require_grad)
    two, three = (program.repeats.short(m) for m in (2, 3))
    added = added_block(program)
    again = [cost for cost in collective_costs(three.graph, three.mesh, inputs_require_grad=inputs_require_grad)
             if cost.node in added]
    return (collective_costs(two.graph, two.mesh, inputs_require_grad=inputs_require_grad)
            + again * (program.repeats.middle - 2))


def collective_costs(gm: GraphModule, mesh: Mesh, *, inputs_require_grad: bool = False) -> list[CollectiveCost]:
    """The cost of every collective node of the per-rank `gm`, in graph order."""
    values = forward_values(gm, mesh, inputs_require_grad)[0]
    reached = _reached_by_backward(gm, values)
    costs = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _BACKWARD_COSTS:
            costs.extend(_BACKWARD_COSTS[node.target](node, values, reached))
        op = COLLECTIVE_OPS.get(node.target) if node.op == "call_function" else None
        if op is None:
            continue
        record = COLLECTIVES[COLLECTIVE_NAMES[node.target]]  # its own adjoint (`all_gather_alike`'s sends nothing)
        adjoint = record.adjoint
        forward = tensor_bytes(values[node.args[0]]) if record.sends else None
        runs = COLLECTIVES[adjoint].sends and values[node].grad_fn in reached
        backward = tensor_bytes(values[node]) if runs else None
        costs.append(CollectiveCost(node, op, node.args[1], forward, adjoint, backward))
    return costs + _recompute_costs(gm, values, reached, costs)


def _recompute_costs(gm: GraphModule, values: dict[Node, object], reached: set, costs: list[CollectiveCost]) -> list[CollectiveCost]:
    """The forward collectives of every recompute region that backward reaches, once more in backward."""
    forward = {cost.node: cost for cost in costs if cost.forward_bytes is not None}
    again = []
    for _, nodes in region_runs(gm.graph):
        grads = [fn for node in nodes for fn in _grad_fns(values[node])]
        if any(fn in reached for fn in grads):
            again += [CollectiveCost(n, forward[n].op, forward[n].axis, None, forward[n].op, forward[n].forward_bytes,
                                     backward_of=n.args[0]) for n in nodes if n in forward]
    return again


def _grad_fns(value) -> list:
    return [t.grad_fn for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _fetch_costs(node: Node, values: dict[Node, object], reached: set) -> list[CollectiveCost]:
    """The backward fetches of a `fetched_product` node, in the order it runs them:
    w's block when a's gradient is needed, then a's when w's is."""
    a_used, w_used, a, w, _, a_fetch, w_fetch = node.args
    if values[node].grad_fn not in reached:
        return []
    costs = []
    for needed, own, fetch in ((values[a_used].requires_grad, w, w_fetch), (values[w_used].requires_grad, a, a_fetch)):
        if needed and fetch is not None:
            op, axis = fetch[:2]
            pieces = own if isinstance(own, tuple) else (own,)  # a merged product's weights, joined to fetch
            num_bytes = sum(tensor_bytes(values[piece]) for piece in pieces)
            costs.append(CollectiveCost(node, op, axis, None, op, num_bytes, backward_of=own))
    return costs


def _norm_costs(node: Node, values: dict[Node, object], reached: set) -> list[CollectiveCost]:
    """The backward all-reduces of a `split_norm` node, one per axis when x's gradient is
    needed, of one (RMSNorm) or two (LayerNorm) statistics a row side by side."""
    x, mean, rstd, _, _, axes, _, _ = node.args
    if values[node].grad_fn not in reached or not values[x].requires_grad:
        return []
    statistics = (rstd,) if mean is None else (rstd, rstd)  # each of rstd's shape
    num_bytes = sum(tensor_bytes(values[s]) for s in statistics)
    return [CollectiveCost(node, "all_reduce", axis, None, "all_reduce", num_bytes, backward_of=statistics)
            for axis in axes]


def _bucket_costs(node: Node, values: dict[Node, object], reached: set) -> list[CollectiveCost]:
    """The backward all-reduces of a `grad_bucket` node (`tess_compile.ops.grad_bucket`): one per
    group of `bucket_groups`, of its members' bytes, when backward reaches the bucket."""
    members, axes = node.args
    if not any(fn in reached for fn in _grad_fns(values[node])):
        return []
    tensors = [values[member] for member in members]
    groups = bucket_groups(axes, [t.dtype for t in tensors], [t.requires_grad for t in tensors])
    return [CollectiveCost(node, "grad_sync", axis, None, "all_reduce", sum(tensor_bytes(tensors[m]) for m in group),
                           backward_of=tuple(members[m] for m in group)) for axis, group in groups]


def _attention_costs(node: Node, values: dict[Node, object], reached: set) -> list[CollectiveCost]:
    """The backward fetches of a `context_attention` node: its keys' steps, then its values'."""
    _, k_used, v_used, k_own, v_own, _, _, fetch = node.args[:8]
    if values[node].grad_fn not in reached:
        return []
    costs = []
    for own in (k_own, v_own):
        num_bytes = tensor_bytes(values[own])
        for op, axis, parts, *_ in fetch:
            costs.append(CollectiveCost(node, op, axis, None, op, num_bytes, backward_of=own))
            num_bytes *= parts
    return costs


def _ring_costs(node: Node, values: dict[Node, object], reached: set) -> list[CollectiveCost]:
    """The collectives a `ring_attention` node runs itself: per key block, the broadcasts of its keys and
    values along the token axes forward, and in backward the same broadcasts again and the reduces of
    their gradients to the block's owner."""
    _, k_own, v_own, _, _, axes = node.args[:6]
    runs = values[node].grad_fn in reached
    blocks = math.prod(size for _, size in axes)
    costs = []
    for own in (k_own, v_own):
        num_bytes = tensor_bytes(values[own])
        for _ in range(blocks):
            for axis, _ in reversed(axes):
                costs.append(CollectiveCost(node, "broadcast", axis, num_bytes, "broadcast", num_bytes if runs else None,
                                            backward_of=own))
                if runs:
                    costs.append(CollectiveCost(node, "reduce", axis, None, "reduce", num_bytes, backward_of=own))
    return costs


# Graph targets that run collectives of their own (in backward, and a ring's in forward too), by the
# function that gives those costs.
_BACKWARD_COSTS = {fetched_product: _fetch_costs, split_norm: _norm_costs, grad_bucket: _bucket_costs,
                   context_attention: _attention_costs, ring_attention: _ring_costs}


def transfers(costs: Iterable[CollectiveCost]) -> Iterator[tuple[str, str, str, int]]:
    """`(phase, op, axis, bytes)` of every collective of `costs` that sends, in each phase
    (a node's backward op is its adjoint)."""
    for cost in costs:
        if cost.forward_bytes is not None:
            yield "forward", cost.op, cost.axis, cost.forward_bytes
        if cost.backward_bytes is not None:
            yield "backward", cost.backward_op, cost.axis, cost.backward_bytes


def bytes_by_phase(costs: Iterable[CollectiveCost]) -> dict[str, BytesByKey]:
    """`{"forward": {(op, axis): bytes}, "backward": {...}}` summed over `costs`."""
    out: dict[str, BytesByKey] = {phase: {} for phase in PHASES}
    for phase, op, axis, num_bytes in transfers(costs):
        _add(out[phase], (op, axis), num_bytes)
    return out


def predict_bytes(program: Program, *, rank: int = 0, inputs_require_grad: bool = False) -> dict[str, BytesByKey]:
    """`{"forward": {(op, axis): bytes}, "backward": {...}}` that `rank` sends in one step.

    Splits are even, so every rank moves the same bytes; `rank` is checked
    against the mesh. Equals `bytes_from_records` of the records of one
    forward and one backward through every output.
    """
    check_rank(rank, program.mesh)
    return bytes_by_phase(program_costs(program, inputs_require_grad=inputs_require_grad))


def bytes_from_records(records: Iterable[CommRecord]) -> dict[str, BytesByKey]:
    """`{phase: {(op, axis): bytes}}` summed over `Comm.records` (forward, backward always present)."""
    out: dict[str, BytesByKey] = {phase: {} for phase in PHASES}
    for record in records:
        _add(out.setdefault(record.phase, {}), (record.op, record.axis), record.num_bytes)
    return out


def _add(totals: BytesByKey, key: tuple[str, str], num_bytes: int) -> None:
    totals[key] = totals.get(key, 0) + num_bytes
