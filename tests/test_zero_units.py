"""ZeRO-3 priced as FSDP2 runs it (`tess_compile.analysis.zero_units`): one unit per repeated block,
gathers overlapped with the previous unit's compute. Fast: on a stack of 3 GPT blocks over 8 GPUs of
4 per node (dp 4 x 1-D 2), the plan's FSDP x TP and HSDP rows, each row's exposed forward and backward
time equal to the formula on its program's own compute and parameter bytes; the options searched."""

from __future__ import annotations

import pytest
import torch
from models import GPTStack

from tess_compile.analysis.parallel_plan import Outer
from tess_compile.analysis.plan_search import zero_options
from tess_compile.analysis.plan_table import format_table
from tess_compile.analysis.planner import plan
from tess_compile.analysis.zero_units import exposed_backward, exposed_forward
from tess_compile.core.cluster import CALIBRATED_CLUSTER

BLOCKS = 3


def make_stack():
    return GPTStack(16, 2, BLOCKS), torch.randn(8, 4, 16)


@pytest.fixture(scope="module")
def rows():
    return plan(make_stack, 8, gpus_per_node=4, modes=("1d",), dp=4, keep_blocks=False, summa="broadcast")


def test_fsdp_and_hsdp_rows_enter_the_search(rows):
    kinds = sorted((row.outer.zero, row.outer.zero_shard) for row in rows)
    assert kinds == [(False, 0), (True, 0), (True, 2)], kinds
    hsdp = next(row for row in rows if row.outer.zero_shard)
    assert hsdp.spec.zero == 3 and hsdp.spec.zero_shard == 2 and hsdp.spec.dp == 4
    assert "HSDP 2 x 2, 3 units:" in hsdp.note and "s of gathers exposed" in hsdp.note
    assert "(HSDP 2 x 2, 3 units: " in format_table(rows) and "(ZeRO-3, 3 units: " in format_table(rows)


@pytest.mark.parametrize("shard", [0, 2])
def test_the_exposed_time_is_the_formula(rows, shard):
    """The row's forward and backward communication over the plain row's (no ZeRO, its gradient
    all-reduce taken out) is the formula's exposed time on the program's compute and bytes."""
    plain = next(row for row in rows if not row.outer.zero)
    row = next(row for row in rows if row.outer.zero and row.outer.zero_shard == shard)
    cluster = CALIBRATED_CLUSTER
    shards, tp = row.outer.shards, row.mesh.num_ranks
    unit = plain.memory.params // BLOCKS
    seconds = cluster.collective_seconds
    gather = seconds("all_gather", shards, unit // shards, shards * tp <= 4, alone=True)
    reduce = seconds("reduce_scatter", shards, unit, shards * tp <= 4, alone=True)
    reduce += seconds("all_reduce", row.outer.dp // shards, unit // shards, False, alone=True)
    time = plain.time
    forward = exposed_forward(BLOCKS, gather, time.forward_compute_s / BLOCKS)
    assert forward == gather + 2 * max(0.0, gather - time.forward_compute_s / BLOCKS) > 0
    compute = time.backward_compute_s / BLOCKS
    backward = exposed_backward(BLOCKS, gather, reduce, compute)
    assert backward == (gather + max(0, gather - compute) + max(0, gather + reduce - compute)
                        + max(0, reduce - compute) + reduce)
    plain_sync = seconds("all_reduce", 4, plain.memory.grads // time.grad_tensors, False, alone=True) * time.grad_tensors
    assert row.time.forward_comm_s == pytest.approx(time.forward_comm_s + forward, rel=1e-12)
    assert row.time.backward_comm_s == pytest.approx(time.backward_comm_s - plain_sync + backward, rel=1e-12)
    assert f"{forward:.3g} s of gathers exposed" in row.note


def test_hsdp_is_searched_where_the_replicas_span_nodes():
    assert zero_options("auto", 8, per_node=4) == ((False, 0), (True, 0), (True, 4))
    assert zero_options("auto", 8, per_node=8) == ((False, 0), (True, 0))  # one node holds them all
    assert zero_options(True, 6, per_node=4) == ((True, 0), (True, 3))
    assert zero_options(False, 8, per_node=4) == ((False, 0),)
    assert zero_options("auto", 4, per_node=1) == ((False, 0), (True, 0))  # one replica a node: plain ZeRO
    assert Outer(8, zero=True).shards == 8 and Outer(8, zero=True, zero_shard=4).shards == 4
