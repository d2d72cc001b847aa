"""The alpha-beta cost model: collective formulas against hand-computed values, the
placement of mesh axes on nodes, step time and memory of compiled programs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from tess_compile.accounting import collective_costs, forward_flops, predict_bytes
from tess_compile.compiler import compile_model
from tess_compile.cost_model import (
    BACKWARD_FLOPS_FACTOR,
    PAPER_CLUSTER,
    Link,
    collective_time,
    comm_seconds,
    predict_memory,
    predict_time,
    ring_wire_bytes,
)
from tess_compile.mesh import Mesh

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


def test_paper_cluster():
    """Tesseract section 4: 4 A100 per node, NVLink 200 GB/s, InfiniBand 200 Gb/s; A100 40 GB."""
    assert PAPER_CLUSTER.gpus_per_node == 4
    assert PAPER_CLUSTER.intra_bandwidth == 200e9
    assert PAPER_CLUSTER.inter_bandwidth == 200e9 / 8
    assert PAPER_CLUSTER.memory == 40e9
    assert PAPER_CLUSTER.flops == 312e12 / 2
    assert PAPER_CLUSTER.algorithm == "ring"


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
    assert time.forward_compute_s == pytest.approx(forward_flops(program) / cluster.flops)
    assert time.backward_compute_s == pytest.approx(BACKWARD_FLOPS_FACTOR * time.forward_compute_s)
    assert time.forward_s == pytest.approx(time.forward_compute_s + time.forward_comm_s)
    assert time.step_s == pytest.approx(time.forward_s + time.backward_s)
    moved = predict_bytes(program)
    assert time.forward_bytes == sum(moved["forward"].values())
    assert time.backward_bytes == sum(moved["backward"].values())


def test_overlap_takes_the_larger_of_compute_and_comm():
    program = compiled(2, 2)
    serial = predict_time(program, PAPER_CLUSTER)
    overlapped = predict_time(program, PAPER_CLUSTER, overlap=True)
    assert overlapped.forward_s == max(serial.forward_compute_s, serial.forward_comm_s)
    assert overlapped.backward_s == max(serial.backward_compute_s, serial.backward_comm_s)
    assert overlapped.step_s < serial.step_s


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
    assert memory.total == memory.params * 4 + memory.activations


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
    assert memory.optimizer == 8 * 280
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
    program = compile_model(model, mesh, (x,))
    costs = collective_costs(program.graph, mesh)
    payload = sum(c.forward_bytes for c in costs if c.forward_bytes is not None)
    assert all(c.op == "broadcast" for c in costs if c.forward_bytes is not None)
    assert ring_wire_bytes(costs, mesh)["forward"] == payload
