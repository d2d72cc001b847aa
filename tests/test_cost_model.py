"""The cost model: collective formulas against hand-computed values, the placement of
mesh axes on nodes, the kernels a rank runs (profiles) counted by hand, step time on
the uncalibrated and calibrated clusters, and memory of compiled programs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from tess_compile.passes.driver import compile_model
from tess_compile.analysis.accounting import collective_costs, forward_flops, predict_bytes
from tess_compile.analysis.cost_model import comm_seconds, predict_time, profile_program, ring_wire_bytes, step_time
from tess_compile.analysis.kernels import PhaseProfile, kernel_profile
from tess_compile.analysis.memory import predict_memory
from tess_compile.core.cluster import CALIBRATED_CLUSTER, PAPER_CLUSTER, Link, collective_time
from tess_compile.core.mesh import Mesh

ALPHA, BANDWIDTH, N = 1e-6, 1e9, 1_000_000  # seconds, bytes/s, bytes
LINK = Link(BANDWIDTH, ALPHA)
NB = N / BANDWIDTH  # one message time: 1 ms


class MLP(nn.Module):
    def __init__(self, hidden: int = 8, inner: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def compiled(q: int, d: int, mode: str = "2.5d"):
    torch.manual_seed(0)
    return compile_model(MLP(), Mesh(q, d, mode), torch.randn(8, 3, 8))


# --------------------------------------------------------------------------- formulas


@pytest.mark.parametrize("algorithm, op, g, expected", [
    # ring: (g-1) alpha + n/B for broadcast and reduce; 2(g-1) alpha + 2(g-1)/g n/B for all-reduce;
    # all_gather of a local input n: (g-1) alpha + (g-1) n/B; reduce_scatter of a full input n: (g-1)/g n/B
    ("ring", "broadcast", 4, 3 * ALPHA + NB),
    ("ring", "reduce", 4, 3 * ALPHA + NB),
    ("ring", "all_reduce", 4, 6 * ALPHA + 1.5 * NB),
    ("ring", "all_reduce", 2, 2 * ALPHA + NB),
    ("ring", "all_gather", 4, 3 * ALPHA + 3 * NB),
    ("ring", "reduce_scatter", 4, 3 * ALPHA + 0.75 * NB),
    ("ring", "all_reduce", 64, 126 * ALPHA + 2 * 63 / 64 * NB),
    # tree: L = ceil(log2 g) rounds
    ("tree", "broadcast", 4, 2 * ALPHA + 2 * NB),
    ("tree", "reduce", 8, 3 * ALPHA + 3 * NB),
    ("tree", "all_reduce", 4, 2 * ALPHA + 2 * NB),
    ("tree", "all_reduce", 5, 3 * ALPHA + 3 * NB),
    ("tree", "all_gather", 4, 2 * ALPHA + 3 * NB),
    ("tree", "reduce_scatter", 4, 2 * ALPHA + 0.75 * NB),
])
def test_collective_formulas(algorithm, op, g, expected):
    assert collective_time(op, g, N, LINK, algorithm) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
@pytest.mark.parametrize("op", ["broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter"])
def test_one_rank_or_no_bytes_costs_nothing(algorithm, op):
    assert collective_time(op, 1, N, LINK, algorithm) == 0.0
    assert collective_time(op, 4, 0, LINK, algorithm) == 0.0


def test_unknown_op_or_algorithm_is_named():
    with pytest.raises(ValueError, match="no cost rule for 'all_to_all' with algorithm 'ring'"):
        collective_time("all_to_all", 4, N, LINK)
    with pytest.raises(ValueError, match="collective algorithm 'butterfly' is not one of 'ring', 'tree'"):
        replace(PAPER_CLUSTER, algorithm="butterfly")
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        replace(PAPER_CLUSTER, gpus_per_node=0)
    with pytest.raises(ValueError, match="inter_bandwidth=0"):
        replace(PAPER_CLUSTER, inter_bandwidth=0)
    with pytest.raises(ValueError, match="memory_bandwidth=0: use a number > 0"):
        replace(PAPER_CLUSTER, memory_bandwidth=0)
    with pytest.raises(ValueError, match="kernel_overhead=-1e-06: use a number >= 0"):
        replace(PAPER_CLUSTER, kernel_overhead=-1e-6)


def test_paper_cluster():
    """Tesseract section 4: 4 A100 per node, NVLink 200 GB/s, InfiniBand 200 Gb/s; A100 40 GB."""
    assert PAPER_CLUSTER.gpus_per_node == 4
    assert PAPER_CLUSTER.intra_bandwidth == 200e9
    assert PAPER_CLUSTER.inter_bandwidth == 200e9 / 8
    assert PAPER_CLUSTER.memory == 40e9
    assert PAPER_CLUSTER.flops == 312e12 / 2
    assert PAPER_CLUSTER.algorithm == "ring"
    # uncalibrated: every product at `flops`, memory-bound kernels and launches free
    assert (PAPER_CLUSTER.matmul_half_size, PAPER_CLUSTER.memory_bandwidth, PAPER_CLUSTER.kernel_overhead) == (
        0.0, math.inf, 0.0)


def test_calibrated_cluster_is_the_paper_machine():
    """The fitted cluster keeps the paper's machine: nodes of 4 A100 40 GB at the fp16 peak."""
    assert CALIBRATED_CLUSTER.gpus_per_node == 4
    assert CALIBRATED_CLUSTER.memory == 40e9
    assert CALIBRATED_CLUSTER.flops == 312e12
    assert CALIBRATED_CLUSTER.intra_latency <= CALIBRATED_CLUSTER.inter_latency
    assert CALIBRATED_CLUSTER.inter_bandwidth <= CALIBRATED_CLUSTER.intra_bandwidth <= 300e9
    assert CALIBRATED_CLUSTER.matmul_efficiency(CALIBRATED_CLUSTER.matmul_half_size) == 0.5
    assert PAPER_CLUSTER.matmul_efficiency(64) == 1.0


# --------------------------------------------------------------------------- axes on nodes


@pytest.mark.parametrize("mesh, gpus_per_node, intra", [
    (Mesh(4, 4), 4, {"col": True, "row": False, "depth": False}),  # the paper's [4, 4, 4]
    (Mesh(4, 4), 16, {"col": True, "row": True, "depth": False}),
    (Mesh(2, 2), 4, {"col": True, "row": True, "depth": False}),
    (Mesh(8, 1, "2d"), 4, {"col": False, "row": False, "depth": True}),
    (Mesh(1, 8, "1d"), 4, {"col": False, "row": True, "depth": True}),
    (Mesh(1, 8, "1d"), 8, {"col": True, "row": True, "depth": True}),
])
def test_axes_on_nodes(mesh, gpus_per_node, intra):
    cluster = replace(PAPER_CLUSTER, gpus_per_node=gpus_per_node)
    for axis, expected in intra.items():
        assert cluster.is_intra_node(mesh, axis) == expected, axis
        link = cluster.link(mesh, axis)
        if expected:
            assert link == Link(cluster.intra_bandwidth, cluster.intra_latency), axis
        else:
            assert link == Link(cluster.inter_bandwidth, cluster.inter_latency), axis


# --------------------------------------------------------------------------- step time


@pytest.mark.parametrize("q, d, mode", [(2, 2, "2.5d"), (2, 1, "2d"), (1, 4, "1d")])
def test_predict_time_adds_the_collectives_and_the_flops(q, d, mode):
    program = compiled(q, d, mode)
    cluster = replace(PAPER_CLUSTER, gpus_per_node=2)
    time = predict_time(program, cluster)
    costs = collective_costs(program.graph, program.mesh)
    forward = backward = 0.0
    for cost in costs:
        link = cluster.link(program.mesh, cost.axis)
        group = program.mesh.size(cost.axis)
        if cost.forward_bytes is not None:
            forward += collective_time(cost.op, group, cost.forward_bytes, link)
        if cost.backward_bytes is not None:
            backward += collective_time(cost.backward_op, group, cost.backward_bytes, link)
    assert forward + backward > 0
    assert time.forward_comm_s == pytest.approx(forward)
    assert time.backward_comm_s == pytest.approx(backward)
    assert comm_seconds(costs, program.mesh, cluster) == pytest.approx(
        {"forward": time.forward_comm_s, "backward": time.backward_comm_s})
    # uncalibrated: the products' FLOPs at `flops` (torch's FlopCounterMode counts the same forward)
    profile = profile_program(program)
    assert time.forward_compute_s == pytest.approx(forward_flops(program) / cluster.flops)
    assert time.forward_compute_s == pytest.approx(profile.forward.matmul_flops / cluster.flops)
    assert time.backward_compute_s == pytest.approx(profile.backward.matmul_flops / cluster.flops)
    assert time.forward_s == pytest.approx(time.forward_compute_s + time.forward_comm_s)
    assert time.step_s == pytest.approx(time.forward_s + time.backward_s)
    moved = predict_bytes(program)
    assert time.forward_bytes == sum(moved["forward"].values())
    assert time.backward_bytes == sum(moved["backward"].values())


def test_profile_of_one_rank_by_hand():
    """MLP 8 -> 16 -> 8 on one rank, x [8, 3, 8] fp32 (24 rows).

    Forward: two products of 2*24*8*16 = 6144 FLOPs (smallest dimension 8), each with its
    bias (`addmm`, as the unsharded model's `linear`: a CPU kernel copies the bias into its
    24x16, then 24x8, output and reads it back), and the ReLU (2 x 24x16): 3 kernels. Backward: fc2's input and weight gradients and fc1's weight gradient
    (x needs none), the ReLU's backward (3 x 24x16) and two bias sums (24x8 + 8,
    24x16 + 16): 6 kernels; 7 with x's gradient.
    """
    program = compiled(1, 1)
    profile = profile_program(program)
    assert profile.forward == PhaseProfile(matmul_flops=2 * 6144, matmul_flops_per_size=2 * 6144 / 8,
                                           memory_bytes=4 * 2 * 384, num_kernels=3, num_matmuls=2,
                                           bias_bytes=4 * 2 * (384 + 192), num_ops=3)
    assert profile.backward == PhaseProfile(matmul_flops=3 * 6144, matmul_flops_per_size=3 * 6144 / 8,
                                            memory_bytes=4 * (3 * 384 + 192 + 8 + 384 + 16),
                                            num_kernels=6, num_matmuls=3, num_ops=6)
    with_input = profile_program(program, inputs_require_grad=True)
    assert with_input.backward.matmul_flops == 4 * 6144 and with_input.backward.num_kernels == 7
    assert profile_program(program) is profile  # cached per program


def test_calibrated_compute_by_hand():
    """A product of f FLOPs and smallest dimension m at flops * m / (m + h); other kernels'
    bytes at the memory bandwidth; an overhead per kernel."""
    program = compiled(1, 1)
    cluster = replace(PAPER_CLUSTER, matmul_half_size=8.0, memory_bandwidth=1e9, kernel_overhead=1e-5)
    time = step_time(profile_program(program), cluster)
    flops = cluster.flops
    assert time.forward_compute_s == pytest.approx(2 * 6144 / (flops * 8 / (8 + 8)) + 4 * 768 / 1e9 + 3e-5)
    assert time.backward_compute_s == pytest.approx(3 * 6144 / (flops / 2) + 4 * 1752 / 1e9 + 6e-5)
    assert time.forward_comm_s == time.backward_comm_s == 0.0


class Attention(nn.Module):
    def __init__(self, hidden: int = 8, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in self.qkv(x).split(h, dim=-1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h)


def test_fused_attention_counts_as_two_products():
    """b=2, s=4, 2 heads of 4: scores and output 4*b*heads*s*s*d = 1024 FLOPs (smallest
    dimension 4) beside the projection's 2*8*8*24 = 3072; backward twice the attention."""
    torch.manual_seed(0)
    program = compile_model(Attention(), Mesh(1, 1), torch.randn(2, 4, 8))
    profile = profile_program(program)
    assert profile.forward.matmul_flops == 3072 + 1024
    assert profile.forward.num_matmuls == 2
    assert profile.forward.matmul_flops_per_size == 3072 / 8 + 1024 / 4
    assert profile.backward.matmul_flops == 3072 + 2 * 1024  # the weight's gradient and attention's backward


def test_grad_sync_false_leaves_out_the_gradient_all_reduces():
    """[2, 2, 2]: the weights' gradients are all-reduced along depth (grad_sync); without them
    backward sends less and forward is unchanged."""
    program = compiled(2, 2)
    profile = profile_program(program)
    synced = step_time(profile, PAPER_CLUSTER)
    unsynced = step_time(profile, PAPER_CLUSTER, grad_sync=False)
    grad_sync_bytes = sum(c.backward_bytes for c in profile.costs if c.op == "grad_sync")
    assert grad_sync_bytes > 0
    assert unsynced.backward_bytes == synced.backward_bytes - grad_sync_bytes
    assert unsynced.backward_comm_s < synced.backward_comm_s
    assert (unsynced.forward_s, unsynced.forward_bytes) == (synced.forward_s, synced.forward_bytes)
    assert unsynced.backward_compute_s == synced.backward_compute_s


def test_overlap_takes_the_larger_of_compute_and_comm():
    program = compiled(2, 2)
    serial = predict_time(program, PAPER_CLUSTER)
    overlapped = predict_time(program, PAPER_CLUSTER, overlap=True)
    assert overlapped.forward_s == max(serial.forward_compute_s, serial.forward_comm_s)
    assert overlapped.backward_s == max(serial.backward_compute_s, serial.backward_comm_s)
    assert overlapped.step_s < serial.step_s


def test_the_overlap_schedules_started_broadcasts_hide_behind_forward_compute():
    """summa="overlap" starts each step's broadcasts ahead (`broadcast_start`): forward is the
    longer of its compute and those broadcasts, then its other collectives."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 8)
    overlap = predict_time(compile_model(MLP(), Mesh(2, 2), x, summa="overlap"), PAPER_CLUSTER)
    plain = predict_time(compile_model(MLP(), Mesh(2, 2), x, summa="broadcast"), PAPER_CLUSTER)
    assert 0 < overlap.forward_ahead_s <= overlap.forward_comm_s
    rest = overlap.forward_comm_s - overlap.forward_ahead_s
    assert overlap.forward_s == pytest.approx(max(overlap.forward_compute_s, overlap.forward_ahead_s) + rest)
    assert overlap.forward_comm_s == pytest.approx(plain.forward_comm_s)  # the same broadcasts
    assert plain.forward_ahead_s == 0
    assert plain.forward_s == pytest.approx(plain.forward_compute_s + plain.forward_comm_s)


def test_a_product_with_a_bias_term_counts_the_bias_copy_where_the_cluster_makes_it():
    """CPU addmm copies the bias into its output before the product, which reads it back
    (`Cluster.bias_copy`); GPU kernels add it in the product."""
    x, w, b = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16)
    plain = kernel_profile(lambda: torch.mm(x, w))
    biased = kernel_profile(lambda: torch.addmm(b, x, w))
    assert plain.matmul_flops == biased.matmul_flops == 2 * 64 * 32 * 16
    assert (plain.bias_bytes, biased.bias_bytes) == (0, 2 * 64 * 16 * 4)
    assert plain.memory_bytes == biased.memory_bytes == 0
    program = compiled(2, 1, "1d")  # its linears: addmm
    profile = profile_program(program)
    copying = replace(PAPER_CLUSTER, bias_copy=True, memory_bandwidth=1e9)
    gpu, cpu = (step_time(profile, replace(copying, bias_copy=flag)) for flag in (False, True))
    assert profile.forward.bias_bytes > 0
    assert cpu.forward_compute_s - gpu.forward_compute_s == pytest.approx(profile.forward.bias_bytes / 1e9)


def test_faster_links_and_gpus_take_less_time():
    program = compiled(2, 2)
    cluster = replace(PAPER_CLUSTER, gpus_per_node=2)  # depth and row cross nodes, col does not
    base = predict_time(program, cluster)
    faster = {
        "intra_bandwidth": replace(cluster, intra_bandwidth=2 * cluster.intra_bandwidth),
        "inter_bandwidth": replace(cluster, inter_bandwidth=2 * cluster.inter_bandwidth),
        "inter_latency": replace(cluster, inter_latency=cluster.inter_latency / 2),
    }
    for name, better in faster.items():
        time = predict_time(program, better)
        assert time.step_s < base.step_s, name
        assert time.forward_compute_s == base.forward_compute_s, name
    more_flops = predict_time(program, replace(cluster, flops=2 * cluster.flops))
    assert more_flops.forward_compute_s == pytest.approx(base.forward_compute_s / 2)
    assert more_flops.step_s < base.step_s
    one_node = predict_time(program, replace(cluster, gpus_per_node=8))
    assert one_node.step_s < base.step_s


def test_comm_seconds_of_no_collectives_is_zero():
    assert comm_seconds([], Mesh(2, 2), PAPER_CLUSTER) == {"forward": 0.0, "backward": 0.0}


# --------------------------------------------------------------------------- memory


def test_memory_of_one_rank_by_hand():
    """MLP 8 -> 16 -> 8, fp32. Unsharded: 280 parameters. Input [8, 3, 8] (768 bytes) and the
    ReLU output [8, 3, 16] (1536 bytes) are saved for backward (the weights count as parameters)."""
    memory = predict_memory(compiled(1, 1))
    assert memory.params == 4 * (16 * 8 + 16 + 8 * 16 + 8)
    assert memory.grads == memory.params
    assert memory.optimizer == 2 * memory.params  # fp32 parameters: two fp32 states each
    assert memory.activations == 4 * (8 * 3 * 8 + 8 * 3 * 16)
    assert memory.at_backward == memory.params * 4 + memory.activations
    assert memory.total == memory.peak > memory.at_backward


@pytest.mark.parametrize("q, d, mode", [(2, 2, "2.5d"), (2, 1, "2d")])
def test_memory_of_sharded_parameters(q, d, mode):
    """2-D and 2.5-D: weights split q*q ways, biases q ways."""
    memory = predict_memory(compiled(q, d, mode))
    assert memory.params == 4 * ((16 * 8 + 8 * 16) // (q * q) + (16 + 8) // q)
    assert 0 < memory.activations < predict_memory(compiled(1, 1)).activations


def test_memory_of_megatron_parameters():
    """1-D over 4 ranks: fc1 column-parallel (weight and bias split), fc2 row-parallel (bias whole)."""
    memory = predict_memory(compiled(1, 4, "1d"))
    assert memory.params == 4 * (16 * 8 // 4 + 16 // 4 + 8 * 16 // 4 + 8)


def test_memory_in_bf16():
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    program = compile_model(model, Mesh(1, 1), torch.randn(8, 3, 8, dtype=torch.bfloat16))
    memory = predict_memory(program)
    assert memory.params == 2 * 280
    optimizer = torch.optim.AdamW(model.parameters())  # its state: two tensors of each parameter's dtype
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if t.dim())
    assert memory.optimizer == state == 4 * 280
    assert not math.isclose(memory.activations, 0)


def test_ring_wire_bytes_of_megatron_and_tesseract_layers():
    """1-D: the two all-reduces of [b, s, h] a phase send 2(p-1)/p of their payload
    (the paper's 2(p-1)bsh/p per all-reduce pair); SUMMA broadcasts send their payload."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 16, bias=False))
    x = torch.randn(4, 16)
    mesh = Mesh(1, 4, "1d")
    program = compile_model(model, mesh, (x,))
    wire = ring_wire_bytes(collective_costs(program.graph, mesh), mesh)
    assert wire["forward"] == 2 * 3 / 4 * x.numel() * 4  # one all-reduce of the [4, 16] output
    mesh = Mesh(2, 1)
    program = compile_model(model, mesh, (x,), summa="broadcast")
    costs = collective_costs(program.graph, mesh)
    payload = sum(c.forward_bytes for c in costs if c.forward_bytes is not None)
    assert all(c.op == "broadcast" for c in costs if c.forward_bytes is not None)
    assert ring_wire_bytes(costs, mesh)["forward"] == payload
