"""A calibrated cost model of a compiled program: step time and memory per rank.

An analysis of the rewritten graph, like `tess_compile.accounting`, whose
byte counts it prices; it runs nothing between ranks. `profile_program`
runs one rank's program forward and backward on fake tensors and records
every kernel it launches (`ProgramProfile`); `step_time` prices a profile
on a `Cluster`, and `predict_time` does both. Per phase (forward, backward):

- matrix products (mm, addmm, bmm, baddbmm, fused attention): FLOPs at the
  achieved rate `flops * m / (m + matmul_half_size)`, `m` the smallest
  dimension of the product (small shards run below peak);
- every other kernel (elementwise ops, norms, softmax, copies): the bytes it
  reads and writes at `memory_bandwidth`;
- `kernel_overhead` seconds per kernel launched (views and allocations
  launch none; collectives are priced below, with the copies that pack a
  gradient bucket, `tess_compile.grad_buckets`, as part of its all-reduce);
- a collective of `n` bytes over a group of `g` ranks on a link of latency
  `alpha` (seconds) and bandwidth `B` (bytes/s): `steps(g) * alpha +
  factor(g) * n / B`, with `steps` and `factor` from `COLLECTIVE_RULES`. A
  group is on the intra-node link if all its ranks share a node (ranks
  packed onto nodes in order: `node = rank // gpus_per_node`), else on the
  inter-node link.

Backward is priced from the kernels autograd runs (recomputed regions and
the refetches of the memory-lean products included), not from a rule such
as "twice the forward FLOPs". Collectives run synchronously, so compute and
communication add; `overlap=True` takes `max(compute, comm)` per phase,
the bound of a perfectly overlapped schedule, and `overlap="forward"` in
forward only (the `summa="overlap"` schedule overlaps forward broadcasts;
backward runs its collectives synchronously).

`Cluster`'s defaults for the three compute constants (every matmul at
`flops`, memory-bound kernels and launches free) give the plain alpha-beta
model; `CALIBRATED_CLUSTER` holds the constants fitted to the Tesseract
paper's measurements (`tess_compile.calibration`, docs/planner.md), and
`PAPER_CLUSTER` the paper's cluster as specified, uncalibrated.

Memory per rank: parameters, gradients, AdamW state and the activations
autograd saves for backward.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Interpreter
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from passes.verify import local_placeholder
from tess_compile.accounting import (
    PHASES,
    CollectiveCost,
    collective_costs,
    fake_run,
    requires_grad,
    tensor_bytes,
    transfers,
)
from tess_compile.collectives import Comm, broadcast_start, output_like, use_comm
from tess_compile.compiler import Program
from tess_compile.grad_buckets import packing
from tess_compile.mesh import AXES, Mesh
from tess_compile.products import fetched_product

__all__ = [
    "ALGORITHMS",
    "CALIBRATED_CLUSTER",
    "COLLECTIVE_RULES",
    "OPTIMIZER_BYTES_PER_PARAM",
    "PAPER_CLUSTER",
    "TERMS",
    "Cluster",
    "Link",
    "MemoryEstimate",
    "COMM_TERMS",
    "COMPUTE_TERMS",
    "PhaseProfile",
    "ProgramProfile",
    "StepTime",
    "activation_bytes",
    "coefficients",
    "collective_time",
    "comm_seconds",
    "predict_memory",
    "predict_time",
    "profile_program",
    "ring_wire_bytes",
    "step_time",
    "time_terms",
]

ALGORITHMS = ("ring", "tree")
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
    seconds per message step, `flops` the matmul FLOP/s of one GPU (its peak
    when `matmul_half_size` is set, else a sustained rate), `memory` its
    bytes, `algorithm` the collectives' family ("ring" or "tree").

    The compute constants (see the module docstring): a matrix product whose
    smallest dimension is `m` runs at `flops * m / (m + matmul_half_size)`;
    other kernels move their bytes at `memory_bandwidth` (bytes/s); each
    kernel launch costs `kernel_overhead` seconds. The defaults (0, inf, 0)
    give the uncalibrated alpha-beta model.
    """

    gpus_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    flops: float
    memory: float
    algorithm: str = "ring"
    matmul_half_size: float = 0.0
    memory_bandwidth: float = math.inf
    kernel_overhead: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node!r}: use a positive integer, e.g. 4 or 8")
        for name in ("intra_bandwidth", "inter_bandwidth", "flops", "memory", "memory_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Cluster {name}={getattr(self, name)!r}: use a number > 0")
        for name in ("intra_latency", "inter_latency", "matmul_half_size", "kernel_overhead"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Cluster {name}={getattr(self, name)!r}: use a number >= 0")
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

    def matmul_efficiency(self, size: float) -> float:
        """The fraction of `flops` a matrix product whose smallest dimension is `size` reaches."""
        return size / (size + self.matmul_half_size)


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

# The paper's cluster with the constants fitted to its Table 1 (strong scaling) by
# `tess_compile.calibration.fit_cluster`, as `benchmarks/paper_times.py` runs it
# (one layer per row, fp16, checkpointed; docs/planner.md): `flops` fixed at the
# A100's 312 TFLOP/s fp16 dense peak, the rest fitted within `calibration.BOUNDS`.
# matmul_half_size and inter_bandwidth ended at an end of their range; the two
# latencies came out equal (the fit keeps intra <= inter). tests/test_calibration.py checks that
# the fit still gives these values.
CALIBRATED_CLUSTER = Cluster(
    gpus_per_node=4,
    intra_bandwidth=98.083e9,
    intra_latency=2.3065e-6,
    inter_bandwidth=25e9,
    inter_latency=2.3065e-6,
    flops=312e12,
    memory=40e9,
    algorithm="ring",
    matmul_half_size=1024.0,
    memory_bandwidth=727.25e9,
    kernel_overhead=15.114e-6,
)


def _rule(algorithm: str, op: str) -> Callable[[int], tuple[float, float]]:
    rule = COLLECTIVE_RULES.get((algorithm, op))
    if rule is None:
        known = list(dict.fromkeys(name for _, name in COLLECTIVE_RULES))
        raise ValueError(f"no cost rule for {op!r} with algorithm {algorithm!r}: ops are {', '.join(known)}, "
                         f"algorithms {', '.join(ALGORITHMS)}")
    return rule


def collective_time(op: str, group_size: int, num_bytes: int, link: Link, algorithm: str = "ring") -> float:
    """Seconds of `op` on `num_bytes` (as `accounting` counts them) over `group_size` ranks."""
    rule = _rule(algorithm, op)
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


# --------------------------------------------------------------------------- profiles

_MATMULS = ("mm", "addmm", "bmm", "baddbmm")
# Fused attention kernels (forward and backward): `_scaled_dot_product_flash_attention`,
# `..._efficient_attention`, `..._flash_attention_for_cpu`, ...
_ATTENTION_PREFIX = "_scaled_dot_product"
# Ops that launch no kernel: views, aliases, allocations.
_NO_KERNEL = ("detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
              "new_empty_strided", "_unsafe_view", "_reshape_alias", "split", "split_with_sizes", "unbind", "chunk")


@dataclass(frozen=True)
class PhaseProfile:
    """The kernels one rank launches in one phase, as the cost model prices them."""

    matmul_flops: float = 0.0  # FLOPs of the matrix products (fused attention included)
    matmul_flops_per_size: float = 0.0  # the sum over products of FLOPs / smallest dimension
    memory_bytes: float = 0.0  # bytes the other kernels read and write
    num_kernels: int = 0  # kernels launched (products and others; collectives not counted)
    num_matmuls: int = 0


@dataclass(frozen=True)
class ProgramProfile:
    """One rank's kernels per phase and its collectives (`accounting.collective_costs`)."""

    mesh: Mesh
    forward: PhaseProfile
    backward: PhaseProfile
    costs: tuple[CollectiveCost, ...]

    def phase(self, phase: str) -> PhaseProfile:
        return self.forward if phase == "forward" else self.backward


def _tensors(*values) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


def _product_shape(name: str, args) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of a matrix-product kernel."""
    a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
    batch = a.shape[0] if a.dim() == 3 else 1
    return batch, a.shape[-2], a.shape[-1], b.shape[-1]


class _KernelRecorder(TorchDispatchMode):
    """Sums, per phase, what `PhaseProfile` holds over every op dispatched below it."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.totals = {phase: {"matmul_flops": 0.0, "matmul_flops_per_size": 0.0, "memory_bytes": 0.0,
                               "num_kernels": 0, "num_matmuls": 0} for phase in PHASES}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.namespace != "aten" or func.is_view or name in _NO_KERNEL or packing():
            return out  # collectives (priced apart, a gradient bucket's copies with them), views and allocations
        totals = self.totals[self.phase]
        totals["num_kernels"] += 1
        if name in _MATMULS:
            batch, m, k, n = _product_shape(name, args)
            self._product(totals, 2 * batch * m * k * n, min(m, k, n))
        elif name.startswith(_ATTENTION_PREFIX):
            # forward (q, k, v, ...), backward (grad_out, q, k, v, ...); the full score
            # matrix's two products, twice as many in backward
            backward = name.endswith("_backward")
            query, key = args[1:3] if backward else args[0:2]
            batch, heads, length, head_dim = query.shape
            flops = 4 * batch * heads * length * key.shape[-2] * head_dim * (2 if backward else 1)
            self._product(totals, flops, min(length, key.shape[-2], head_dim))
        else:
            totals["memory_bytes"] += sum(tensor_bytes(t) for t in _tensors(args, kwargs, out))
        return out

    @staticmethod
    def _product(totals: dict, flops: int, size: int) -> None:
        totals["num_matmuls"] += 1
        totals["matmul_flops"] += flops
        totals["matmul_flops_per_size"] += flops / max(size, 1)


class _ShapeComm(Comm):
    """A communicator for fake runs: each collective returns an empty tensor of its output's shape."""

    def run(self, op: str, x: torch.Tensor, *args) -> torch.Tensor:
        return output_like(op, x, *args)


def _fake_step(program: Program, inputs_require_grad: bool) -> dict[str, PhaseProfile]:
    """Run one rank's program forward, then backward from every output that requires grad,
    on fake tensors, recording its kernels (recomputed regions count in backward)."""
    graph = program.runnable
    recorder = _KernelRecorder()
    with FakeTensorMode(allow_non_fake_inputs=True):
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        inputs = [local_placeholder(n, program.mesh, requires_grad(n, inputs_require_grad)) for n in placeholders]
        with use_comm(_ShapeComm()), recorder:
            outputs = Interpreter(graph).run(*inputs)
            roots = [t for t in _tensors(outputs) if t.requires_grad]
            del outputs
            recorder.phase = "backward"
            if roots:
                torch.autograd.backward(roots, [torch.empty_like(t) for t in roots])
    return {phase: PhaseProfile(**totals) for phase, totals in recorder.totals.items()}


_PROFILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per-rank graph -> {inputs_require_grad: profile}


def profile_program(program: Program, *, inputs_require_grad: bool = False) -> ProgramProfile:
    """The kernels and collectives of one training step of `program` on one rank
    (every output that requires grad is taken as part of the loss). Cached per program."""
    cached = _PROFILES.setdefault(program.graph, {})
    if inputs_require_grad not in cached:
        phases = _fake_step(program, inputs_require_grad)
        costs = collective_costs(program.graph, program.mesh, inputs_require_grad=inputs_require_grad)
        cached[inputs_require_grad] = ProgramProfile(program.mesh, phases["forward"], phases["backward"], tuple(costs))
    return cached[inputs_require_grad]


# --------------------------------------------------------------------------- pricing

# The terms of a phase's time, each priced by one constant of the cluster (`coefficients`):
# time = sum over terms of coefficient * term.
COMPUTE_TERMS = ("matmul_flops", "matmul_flops_per_size", "memory_bytes", "kernels")
COMM_TERMS = ("intra_steps", "inter_steps", "intra_wire_bytes", "inter_wire_bytes")
TERMS = COMPUTE_TERMS + COMM_TERMS


def coefficients(cluster: Cluster) -> dict[str, float]:
    """Seconds per unit of each of `TERMS` on `cluster`. A product of `f` FLOPs and smallest
    dimension `m` takes `f / (flops * m / (m + h))` = `f / flops + (f / m) * h / flops`."""
    return {
        "matmul_flops": 1 / cluster.flops,
        "matmul_flops_per_size": cluster.matmul_half_size / cluster.flops,
        "memory_bytes": 1 / cluster.memory_bandwidth,
        "kernels": cluster.kernel_overhead,
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
        terms[phase] = {"matmul_flops": kernels.matmul_flops, "matmul_flops_per_size": kernels.matmul_flops_per_size,
                        "memory_bytes": kernels.memory_bytes, "kernels": kernels.num_kernels,
                        **dict.fromkeys(COMM_TERMS, 0.0)}
    for phase, op, axis, num_bytes in transfers(_priced_costs(profile, grad_sync)):
        group = mesh.size(axis)
        steps, factor = _rule(cluster.algorithm, op)(group)
        if group > 1 and num_bytes > 0:
            terms[phase][f"{link[axis]}_steps"] += steps
            terms[phase][f"{link[axis]}_wire_bytes"] += factor * num_bytes
    return terms


def step_time(profile: ProgramProfile, cluster: Cluster, *, overlap: bool | str = False,
              grad_sync: bool = True) -> StepTime:
    """Forward and backward seconds of `profile` on `cluster` (see the module docstring)."""
    terms = time_terms(profile, cluster, grad_sync=grad_sync)
    price = coefficients(cluster)

    def seconds(phase: str, names: tuple[str, ...]) -> float:
        return sum(price[name] * terms[phase][name] for name in names)

    costs = _priced_costs(profile, grad_sync)
    return StepTime(
        forward_compute_s=seconds("forward", COMPUTE_TERMS),
        forward_comm_s=seconds("forward", COMM_TERMS),
        backward_compute_s=seconds("backward", COMPUTE_TERMS),
        backward_comm_s=seconds("backward", COMM_TERMS),
        forward_bytes=sum(c.forward_bytes for c in costs if c.forward_bytes is not None),
        backward_bytes=sum(c.backward_bytes for c in costs if c.backward_bytes is not None),
        overlap=_OVERLAPPED_PHASES[overlap],
    )


def predict_time(program: Program, cluster: Cluster, *, overlap: bool | str = False,
                 inputs_require_grad: bool = False, grad_sync: bool = True) -> StepTime:
    """Forward and backward seconds of one step of `program` on `cluster`:
    `step_time(profile_program(program), cluster)`."""
    profile = profile_program(program, inputs_require_grad=inputs_require_grad)
    return step_time(profile, cluster, overlap=overlap, grad_sync=grad_sync)


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
