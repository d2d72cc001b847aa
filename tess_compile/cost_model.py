"""An alpha-beta cost model of a compiled program: step time and memory per rank.

An analysis of the rewritten graph, like `tess_compile.accounting`, whose
byte counts it prices; it runs nothing between ranks. A collective of `n`
bytes over a group of `g` ranks on a link of latency `alpha` (seconds) and
bandwidth `B` (bytes/s) takes `steps(g) * alpha + factor(g) * n / B`, with
`steps` and `factor` from `COLLECTIVE_RULES`. A group is on the intra-node
link if all its ranks share a node (ranks packed onto nodes in order:
`node = rank // gpus_per_node`), else on the inter-node link.

Compute is the matmul-like FLOPs of `accounting.forward_flops` at the
cluster's sustained throughput; backward runs twice the forward FLOPs (one
matmul for the input's gradient and one for the weight's, per forward
matmul). Collectives run synchronously today, so compute and communication
add; `overlap=True` takes `max(compute, comm)` per phase, the bound of a
perfectly overlapped schedule, and `overlap="forward"` in forward only (the
`summa="overlap"` schedule overlaps forward broadcasts; backward runs its
collectives synchronously). Memory per rank: parameters, gradients,
AdamW state and the activations autograd saves for backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tess_compile.accounting import PHASES, CollectiveCost, collective_costs, fake_run, forward_flops, tensor_bytes, transfers
from tess_compile.collectives import broadcast_start
from tess_compile.compiler import Program
from tess_compile.mesh import AXES, Mesh
from tess_compile.products import fetched_product

__all__ = [
    "ALGORITHMS",
    "BACKWARD_FLOPS_FACTOR",
    "COLLECTIVE_RULES",
    "OPTIMIZER_BYTES_PER_PARAM",
    "PAPER_CLUSTER",
    "Cluster",
    "Link",
    "MemoryEstimate",
    "StepTime",
    "activation_bytes",
    "collective_time",
    "comm_seconds",
    "predict_memory",
    "predict_time",
    "ring_wire_bytes",
]

ALGORITHMS = ("ring", "tree")
BACKWARD_FLOPS_FACTOR = 2  # backward FLOPs per forward FLOP: grad of the input and grad of the weight
OPTIMIZER_BYTES_PER_PARAM = 8  # AdamW: exp_avg and exp_avg_sq, fp32 each


def _log2(g: int) -> int:
    """Rounds of a binomial tree (recursive doubling) over `g` ranks: ceil(log2 g)."""
    return math.ceil(math.log2(g))


# (algorithm, op) -> g -> (latency steps, bandwidth factor): the collective of `n`
# bytes over `g` ranks takes `steps * alpha + factor * n / B`. `n` is the bytes
# each rank passes to the op (as `accounting` reports them): broadcast, reduce
# and all_reduce: the whole tensor; all_gather: the local input (the output is
# g * n); reduce_scatter: the full input (the output is n / g).
#
# ring (NCCL's default for large messages; broadcast and reduce pipelined along a
# chain in many chunks, so one message time, as NCCL's bus bandwidth says):
#   broadcast, reduce   (g-1) alpha + n/B
#   all_reduce          2(g-1) alpha + 2(g-1)/g n/B   (reduce-scatter + all-gather)
#   all_gather          (g-1) alpha + (g-1) n/B
#   reduce_scatter      (g-1) alpha + (g-1)/g n/B
# tree (binomial tree and recursive doubling/halving; Thakur, Rabenseifner and
# Gropp 2005; L = ceil(log2 g); exact for g a power of two):
#   broadcast, reduce   L alpha + L n/B
#   all_reduce          L alpha + L n/B               (recursive doubling)
#   all_gather          L alpha + (g-1) n/B           (recursive doubling)
#   reduce_scatter      L alpha + (g-1)/g n/B         (recursive halving)
COLLECTIVE_RULES: dict[tuple[str, str], Callable[[int], tuple[float, float]]] = {
    ("ring", "broadcast"): lambda g: (g - 1, 1),
    ("ring", "reduce"): lambda g: (g - 1, 1),
    ("ring", "all_reduce"): lambda g: (2 * (g - 1), 2 * (g - 1) / g),
    ("ring", "all_gather"): lambda g: (g - 1, g - 1),
    ("ring", "reduce_scatter"): lambda g: (g - 1, (g - 1) / g),
    ("tree", "broadcast"): lambda g: (_log2(g), _log2(g)),
    ("tree", "reduce"): lambda g: (_log2(g), _log2(g)),
    ("tree", "all_reduce"): lambda g: (_log2(g), _log2(g)),
    ("tree", "all_gather"): lambda g: (_log2(g), g - 1),
    ("tree", "reduce_scatter"): lambda g: (_log2(g), (g - 1) / g),
}


@dataclass(frozen=True)
class Link:
    """A link's bandwidth (bytes/s) and latency (seconds per message step)."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Cluster:
    """The machine a plan is for: nodes of `gpus_per_node` GPUs, two links, one GPU's figures.

    Bandwidths are bytes/s one rank sends or receives on the link, latencies
    seconds per message step, `flops` the sustained matmul FLOP/s of one GPU,
    `memory` its bytes, `algorithm` the collectives' family ("ring" or "tree").
    """

    gpus_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    flops: float
    memory: float
    algorithm: str = "ring"

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node!r}: use a positive integer, e.g. 4 or 8")
        for name in ("intra_bandwidth", "inter_bandwidth", "flops", "memory"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Cluster {name}={getattr(self, name)!r}: use a number > 0")
        for name in ("intra_latency", "inter_latency"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Cluster {name}={getattr(self, name)!r}: use a number >= 0 (seconds)")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"collective algorithm {self.algorithm!r} is not one of "
                             f"{', '.join(map(repr, ALGORITHMS))}: use 'ring' (NCCL's default) or 'tree'")

    def is_intra_node(self, mesh: Mesh, axis: str) -> bool:
        """Whether every group along `axis` lies within one node."""
        return all(len({rank // self.gpus_per_node for rank in group}) == 1 for group in mesh.groups(axis))

    def link(self, mesh: Mesh, axis: str) -> Link:
        """The link the collectives along `axis` run on."""
        if self.is_intra_node(mesh, axis):
            return Link(self.intra_bandwidth, self.intra_latency)
        return Link(self.inter_bandwidth, self.inter_latency)


# The paper's cluster (Tesseract, section 4: MeluXina): 4 A100 per node, NVLink
# 200 GB/s inside a node, InfiniBand 200 Gb/s (25 GB/s) between nodes. The A100s
# of MeluXina's GPU nodes are the 40 GB SXM4 model. Throughput: half the 312
# TFLOP/s bf16/fp16 dense tensor-core peak (TF32's dense peak is 156 TFLOP/s),
# the sustained rate large-model training reaches on A100s (Megatron-LM reports
# 138-163 TFLOP/s per GPU, 44-52 % of peak). Latencies, which the paper does not
# give: 2 us per step over NVLink and 5 us over InfiniBand, typical of NCCL.
PAPER_CLUSTER = Cluster(
    gpus_per_node=4,
    intra_bandwidth=200e9,
    intra_latency=2e-6,
    inter_bandwidth=25e9,
    inter_latency=5e-6,
    flops=156e12,
    memory=40e9,
    algorithm="ring",
)


def collective_time(op: str, group_size: int, num_bytes: int, link: Link, algorithm: str = "ring") -> float:
    """Seconds of `op` on `num_bytes` (as `accounting` counts them) over `group_size` ranks."""
    rule = COLLECTIVE_RULES.get((algorithm, op))
    if rule is None:
        known = list(dict.fromkeys(name for _, name in COLLECTIVE_RULES))
        raise ValueError(f"no cost rule for {op!r} with algorithm {algorithm!r}: ops are {', '.join(known)}, "
                         f"algorithms {', '.join(ALGORITHMS)}")
    if group_size <= 1 or num_bytes == 0:
        return 0.0
    steps, factor = rule(group_size)
    return steps * link.latency + factor * num_bytes / link.bandwidth


def ring_wire_bytes(costs: Iterable[CollectiveCost], mesh: Mesh) -> dict[str, float]:
    """`{"forward": bytes, "backward": bytes}` one rank sends (and as many it receives) on
    the links when the collectives run as rings: each payload times its ring bandwidth
    factor (`2(g-1)/g` for an all-reduce, `1` for a pipelined broadcast, ...). Unlike the
    payloads, these compare across collectives and modes."""
    wire = dict.fromkeys(PHASES, 0.0)
    for phase, op, axis, num_bytes in transfers(costs):
        if mesh.size(axis) > 1:
            wire[phase] += COLLECTIVE_RULES[("ring", op)](mesh.size(axis))[1] * num_bytes
    return wire


def comm_seconds(costs: Iterable[CollectiveCost], mesh: Mesh, cluster: Cluster) -> dict[str, float]:
    """`{"forward": s, "backward": s}`: the time of the collectives in `costs`, one after another."""
    links = {axis: cluster.link(mesh, axis) for axis in AXES}
    seconds = dict.fromkeys(PHASES, 0.0)
    for phase, op, axis, num_bytes in transfers(costs):
        seconds[phase] += collective_time(op, mesh.size(axis), num_bytes, links[axis], cluster.algorithm)
    return seconds


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one training step on one rank, and the bytes it passes to collectives."""

    forward_compute_s: float
    forward_comm_s: float
    backward_compute_s: float
    backward_comm_s: float
    forward_bytes: int
    backward_bytes: int
    overlap: tuple[str, ...] = ()  # the phases whose compute and communication overlap

    def _phase(self, phase: str, compute: float, comm: float) -> float:
        return max(compute, comm) if phase in self.overlap else compute + comm

    @property
    def forward_s(self) -> float:
        return self._phase("forward", self.forward_compute_s, self.forward_comm_s)

    @property
    def backward_s(self) -> float:
        return self._phase("backward", self.backward_compute_s, self.backward_comm_s)

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def comm_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


# predict_time's `overlap` -> the phases whose compute and communication overlap.
_OVERLAPPED_PHASES = {False: (), True: ("forward", "backward"), "forward": ("forward",)}


def predict_time(program: Program, cluster: Cluster, *, overlap: bool | str = False,
                 inputs_require_grad: bool = False) -> StepTime:
    """Forward and backward seconds of one step of `program` on `cluster` (see the module docstring)."""
    costs = collective_costs(program.graph, program.mesh, inputs_require_grad=inputs_require_grad)
    comm = comm_seconds(costs, program.mesh, cluster)
    compute = forward_flops(program) / cluster.flops
    return StepTime(
        forward_compute_s=compute,
        forward_comm_s=comm["forward"],
        backward_compute_s=BACKWARD_FLOPS_FACTOR * compute,
        backward_comm_s=comm["backward"],
        forward_bytes=sum(c.forward_bytes for c in costs if c.forward_bytes is not None),
        backward_bytes=sum(c.backward_bytes for c in costs if c.backward_bytes is not None),
        overlap=_OVERLAPPED_PHASES[overlap],
    )


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


def _local_numel(program: Program) -> list[tuple[int, int]]:
    """(elements, bytes per element) of each parameter shard of a rank."""
    out = []
    for slot in program.params:
        shape = slot.layout.local_shape(slot.shape, program.mesh)
        out.append((math.prod(shape), slot.dtype.itemsize))
    return out


def _is_weight(node) -> bool:
    """A placeholder of a parameter, a tied parameter's second name, or a weight given as an input."""
    if node.op != "placeholder":
        return False
    return node.meta["role"][0] in ("param", "alias") or "weight_input" in node.meta


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
    shards = _local_numel(program)
    param_bytes = sum(numel * size for numel, size in shards)
    return MemoryEstimate(
        params=param_bytes,
        grads=param_bytes,
        optimizer=OPTIMIZER_BYTES_PER_PARAM * sum(numel for numel, _ in shards),
        activations=activation_bytes(program),
        transient=collective_buffer_bytes(program),
    )
