"""Profiling the machine (`profile_cluster`), the cluster's JSON round trip, the profiled
collective lines and optimizer term in the cost model, and the planner on a profiled cluster."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist

import tess_compile
from tess_compile.analysis.cost_model import lone_axis, optimizer_seconds, predict_time, profile_program
from tess_compile.analysis.memory import predict_memory
from tess_compile.analysis.parallel_plan import Outer, boundary_bytes, price
from tess_compile.analysis.profiling import MESSAGE_BYTES, _group_layouts, _payload_elements, profile_cluster
from tess_compile.cli import main
from tess_compile.core.cluster import CALIBRATED_CLUSTER, Cluster
from tess_compile.ops.collectives import COMMUNICATING
from tess_compile.runtime.launch import run_local
from tests.models import GPTStack

# A cluster as `profile_cluster` returns one: measured lines for groups of 2 and 4.
PROFILED = dataclasses.replace(
    CALIBRATED_CLUSTER, gpus_per_node=4, flops=2e10, matmul_half_size=20.0, memory_bandwidth=5e9,
    kernel_overhead=1e-5, optimizer_overhead=2e-4, optimizer_bandwidth=5e8,
    collectives=tuple((op, size, "intra", 1e-3 * size, 1e-9) for op in COMMUNICATING for size in (2, 4)))


def make_stack():
    torch.manual_seed(0)
    return GPTStack(16, 8, 2).double(), torch.randn(8, 4, 16, dtype=torch.float64)


def test_cluster_json_round_trip(tmp_path):
    path = tmp_path / "cluster.json"
    PROFILED.save(path)
    assert Cluster.load(path) == PROFILED
    assert Cluster.load(path).collectives == PROFILED.collectives  # tuples again, not lists
    CALIBRATED_CLUSTER.save(path)  # infinite optimizer bandwidth written as "inf"
    assert json.loads(path.read_text())["optimizer_bandwidth"] == "inf"
    assert Cluster.load(path) == CALIBRATED_CLUSTER


@pytest.mark.parametrize("text, words", [
    ("[1, 2]", ["holds a list"]),
    ("{not json", ["is not JSON"]),
    ('{"gpus_per_node": 4, "flops": 1}', ["intra_bandwidth", "missing"]),
    (json.dumps({**PROFILED.to_dict(), "bogus": 1}), ["unknown Cluster field 'bogus'"]),
])
def test_cluster_file_errors_name_the_file_and_the_fix(tmp_path, text, words):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        Cluster.load(path)
    assert all(word in str(info.value) for word in words + ["bad.json"]), str(info.value)
    with pytest.raises(ValueError, match="tess-compile profile"):
        Cluster.load(tmp_path / "missing.json")


# As a profile measures them on a CPU: flat while the buffers stay in the caches, then steeper.
POINTS = ((4096, 1e-3), (65536, 1e-3), (524288, 2e-3), (4194304, 10e-3))
MEASURED = dataclasses.replace(PROFILED, collectives=(("all_reduce", 2, "intra", POINTS),))


@pytest.mark.parametrize("entry", [
    ("all_to_all", 2, "intra", 1e-3, 1e-9),
    ("all_reduce", 2, "intra", ((4096, 1e-3), (1024, 2e-3))),  # bytes not ascending
    ("all_reduce", 2, "intra", ((4096, 1e-3),)),  # one point
    ("all_reduce", 2, "intra", ((4096, -1e-3), (8192, 1e-3))),
])
def test_bad_collective_entry_is_refused(entry):
    with pytest.raises(ValueError, match="collectives entry"):
        dataclasses.replace(PROFILED, collectives=(entry,))


def test_measured_points_price_on_straight_segments(tmp_path):
    def seconds(num_bytes):
        return MEASURED.collective_seconds("all_reduce", 2, num_bytes, intra=True)

    assert seconds(100) == seconds(4096) == 1e-3  # below the first point: its seconds
    assert seconds(65536) == 1e-3 and seconds(294912) == pytest.approx(1.5e-3)  # on a segment
    slope = 8e-3 / (4194304 - 524288)
    assert seconds(8388608) == pytest.approx(10e-3 + slope * 4194304)  # beyond: the last segment's slope
    path = tmp_path / "cluster.json"
    MEASURED.save(path)
    assert Cluster.load(path) == MEASURED


def test_measured_lines_price_their_collectives_and_rules_the_rest():
    # a measured line: seconds + seconds per byte * bytes
    assert PROFILED.collective_seconds("all_reduce", 4, 1000, intra=True) == pytest.approx(4e-3 + 1e-6)
    assert PROFILED.collective_seconds("all_reduce", 4, 0, intra=True) == 0.0
    # no line for 8 ranks, or inter-node: the ring rule on the link's figures
    ring = 2 * 7 * PROFILED.intra_latency + 2 * 7 / 8 * 1000 / PROFILED.intra_bandwidth
    assert PROFILED.collective_seconds("all_reduce", 8, 1000, intra=True) == pytest.approx(ring)


def test_optimizer_term_prices_every_parameter_shard():
    model, x = make_stack()
    program = tess_compile.simulate(model, 2, 2, example_inputs=(x,)).program
    shards = [(math.prod(s.layout.local_shape(s.shape, program.mesh)), s.dtype.itemsize) for s in program.params]
    expected = len(shards) * 2e-4 + sum(n * size for n, size in shards) / 5e8
    assert optimizer_seconds(program, PROFILED) == pytest.approx(expected)
    time = predict_time(program, PROFILED)
    assert time.optimizer_s == pytest.approx(expected)
    assert time.step_s == pytest.approx(time.forward_s + time.backward_s + expected)
    assert predict_time(program, CALIBRATED_CLUSTER).optimizer_s == 0.0  # no optimizer figures: left out


def test_plan_rows_on_a_profiled_cluster_include_the_optimizer_and_dp_sync():
    model, x = make_stack()
    (single,), (replicated,) = (
        tess_compile.plan(model, 8, example_inputs=(x,), cluster=PROFILED, modes=(mode,), dp=dp, summa="broadcast",
                          keep_blocks=False, zero=False) for mode, dp in (("1d", 1), ("2d", 2)))
    assert single.time.optimizer_s > 0 and replicated.time.optimizer_s > 0
    assert (single.outer.dp, single.mesh.mode, replicated.outer.dp, replicated.mesh.mode) == (1, "1d", 2, "2d")
    # each data-parallel replica's gradients are all-reduced: one measured all-reduce per parameter
    assert replicated.time.backward_comm_s > 0 and single.time.step_s > 0


def test_group_layouts_cut_the_ranks_as_mesh_axes_and_find_their_link():
    layouts = {(size, link): partitions for size, link, partitions in _group_layouts(8, 8)}
    assert sorted(layouts) == [(2, "intra"), (4, "intra"), (8, "intra")]
    assert layouts[(2, "intra")] == [[[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]],
                                     [[0, 4], [1, 5], [2, 6], [3, 7]]]  # the axes of [2, 2, 2]
    # 6 ranks a node: consecutive groups of 4 ([4..7]) cross a node, so they are inter-node
    layouts = {(size, link): partitions for size, link, partitions in _group_layouts(12, 6)}
    assert [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] in layouts[(4, "inter")]
    assert [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]] in layouts[(3, "intra")]


def test_payloads_split_evenly_over_the_group():
    assert _payload_elements(4096, 2) == 1024
    assert _payload_elements(4096, 3) == 1023 and _payload_elements(4096, 6) == 1020


def test_data_parallel_sync_is_one_measured_all_reduce_per_parameter_shard():
    model, x = make_stack()
    program = tess_compile.simulate(model, 2, 1, example_inputs=(x,)).program
    node = dataclasses.replace(PROFILED, gpus_per_node=8)  # both replicas in one node: the measured line
    time, memory = predict_time(program, node), predict_memory(program)
    replicated, _ = price(time, memory, Outer(dp=2), program.mesh.num_ranks, node)
    tensors = len(program.params)
    def line(num_bytes):  # PROFILED's line for all_reduce over 2
        return 2e-3 + 1e-9 * num_bytes

    expected = tensors * line(memory.grads // tensors)
    assert time.grad_tensors == tensors > 1
    assert replicated.backward_comm_s - time.backward_comm_s == pytest.approx(expected)
    zero, _ = price(time, memory, Outer(dp=2, zero=True), program.mesh.num_ranks, node)
    assert zero.backward_comm_s - time.backward_comm_s == pytest.approx(line(memory.grads))
    assert zero.optimizer_s == pytest.approx(time.optimizer_s / 2)


def test_host_time_prices_every_op_and_each_call():
    """`op_overhead` per op dispatched (kernels, views and the runtime's own ops; collectives priced
    apart) and `call_overhead` once a call; a pipeline calls its stage's program once a slot."""
    model, x = make_stack()
    program = tess_compile.simulate(model, 2, 2, example_inputs=(x,)).program
    base = predict_time(program, PROFILED)
    host = predict_time(program, dataclasses.replace(PROFILED, op_overhead=1e-5, call_overhead=3e-3))
    profile = profile_program(program)
    for phase in ("forward", "backward"):
        kernels = profile.phase(phase)
        assert kernels.num_ops >= kernels.num_kernels > 0  # the runtime's own ops too (views not counted)
        added = getattr(host, f"{phase}_compute_s") - getattr(base, f"{phase}_compute_s")
        assert added == pytest.approx(1e-5 * kernels.num_ops)
    assert host.call_s == 3e-3 and base.call_s == 0.0
    assert host.step_s == pytest.approx(host.forward_s + host.backward_s + host.optimizer_s + 3e-3)
    piped, _ = price(host, predict_memory(program), Outer(pp=2, microbatches=4), program.mesh.num_ranks, PROFILED)
    assert piped.call_s == pytest.approx(5 * 3e-3)  # 4 microbatches + 1 slot of bubble


def test_pipeline_sends_its_boundary_block_each_slot_both_ways():
    model, x = make_stack()
    program = tess_compile.simulate(model, 2, 1, example_inputs=(x,)).program
    time, memory = predict_time(program, PROFILED), predict_memory(program)
    assert boundary_bytes(model, (x,)) == x.numel() * x.element_size()  # a block's output: the hidden state
    outer = Outer(pp=2, microbatches=4)
    plain, _ = price(time, memory, outer, 4, PROFILED)
    sent, _ = price(time, memory, outer, 4, PROFILED, block_bytes=1000)
    # stages 4 ranks apart: on two nodes of PROFILED's 4 GPUs
    one = PROFILED.collective_seconds("broadcast", 2, 1000, False)
    assert sent.step_s - plain.step_s == pytest.approx(2 * (4 + 2 - 2) * one)
    assert price(time, memory, Outer(dp=2), 4, PROFILED, block_bytes=1000)[0] == price(
        time, memory, Outer(dp=2), 4, PROFILED)[0]  # no stages, no sends


def test_lone_points_price_an_axis_no_other_of_its_size_alternates_with():
    """A 1-D program's axis and the data-parallel gradient sync (after the tensor-parallel backward,
    one all-reduce after another) run their groups alone: `Cluster.lone_collectives`; the axes of
    [2, 2, 2] alternate: `Cluster.collectives`."""
    lone = tuple((op, size, "intra", 1e-4 * size, 1e-10) for op in COMMUNICATING for size in (2, 4))
    cluster = dataclasses.replace(PROFILED, lone_collectives=lone)
    assert lone_axis(tess_compile.Mesh(1, 4, "1d"), "col") and not lone_axis(tess_compile.Mesh(2, 2), "row")
    model, x = make_stack()
    one_d = tess_compile.simulate(model, 1, 4, example_inputs=(x,), mode="1d").program
    cube = tess_compile.simulate(model, 2, 2, example_inputs=(x,)).program
    assert predict_time(one_d, cluster).forward_comm_s < predict_time(one_d, PROFILED).forward_comm_s
    assert predict_time(cube, cluster) == predict_time(cube, PROFILED)
    time, memory = predict_time(one_d, cluster), predict_memory(one_d)
    node = dataclasses.replace(cluster, gpus_per_node=8)
    alone, _ = price(time, memory, Outer(dp=2), 4, node)
    alternating, _ = price(time, memory, Outer(dp=2), 4, dataclasses.replace(node, lone_collectives=()))
    tensors = len(one_d.params)
    assert alternating.backward_comm_s - alone.backward_comm_s == pytest.approx(
        tensors * ((2e-3 + 1e-9 * (memory.grads // tensors)) - (2e-4 + 1e-10 * (memory.grads // tensors))))


def _init_world_of_one(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)


def test_profile_cluster_on_a_world_of_one(tmp_path):
    _init_world_of_one(tmp_path)
    try:
        cluster = profile_cluster(repeats=1, memory=1e9)
    finally:
        dist.destroy_process_group()
    assert cluster.gpus_per_node == 1 and cluster.memory == 1e9
    assert cluster.flops > 1e8 and cluster.memory_bandwidth > 1e8 and cluster.kernel_overhead > 0
    assert cluster.optimizer_overhead >= 0 and cluster.collectives == ()  # no group of two ranks
    assert cluster.op_overhead >= 0 and cluster.call_overhead >= 0  # the reference programs' host time
    path = tmp_path / "one.json"
    cluster.save(path)
    assert Cluster.load(path) == cluster


def test_profile_cluster_refuses_without_a_process_group():
    with pytest.raises(ValueError, match="init_process_group"):
        profile_cluster()


def _profile_worker(rank, world):
    return profile_cluster(repeats=1)


@pytest.mark.slow
def test_profile_over_four_processes_is_the_same_on_every_rank(tmp_path):
    clusters = run_local(_profile_worker, 4, timeout_s=300)
    assert all(cluster == clusters[0] for cluster in clusters)
    cluster = clusters[0]
    assert cluster.gpus_per_node == 4
    measured = {(op, size) for op, size, link, *_ in cluster.collectives}
    assert measured == {(op, size) for op in COMMUNICATING for size in (2, 4)}
    # pairs cut 4 ranks two ways (a [2, 2] mesh's axes): also timed on one layout alone
    assert {(op, size) for op, size, *_ in cluster.lone_collectives} == {(op, 2) for op in COMMUNICATING}
    assert all(link == "intra" for _, _, link, *_ in cluster.collectives)
    sizes = {tuple(num_bytes for num_bytes, _ in points) for *_, points in cluster.collectives}
    assert {len(s) for s in sizes} == {len(MESSAGE_BYTES)}  # a point per message size
    assert cluster.optimizer_overhead > 0


@pytest.mark.slow
def test_profile_command_writes_a_cluster_plan_reads(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    assert main(["profile", "--processes", "2", "--repeats", "1", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert "all_reduce over 2" in out and str(path) in out
    assert "self-check: predicted step times" in out and "(1 configuration)" in out, out
    cluster = Cluster.load(path)
    assert cluster.gpus_per_node == 2 and cluster.time_error >= 0
