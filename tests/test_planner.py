"""The planner: the meshes it enumerates, the order of its rows, the memory budget,
meshes that do not compile, and the table."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from models import GPTBlock
from torch import nn

import tess_compile
from tess_compile.analysis.plan_table import format_table
from tess_compile.analysis.planner import candidate_meshes, mesh_label, plan
from tess_compile.core.cluster import PAPER_CLUSTER
from tess_compile.core.mesh import Mesh
from tess_compile.core.program import describe_schedules


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_mlp():
    """Splits on every mesh of 8 and 64 ranks: batch 16 = d*q of [4, 4, 4], hidden 64 = p of [64]."""
    return MLP(64, 256), torch.randn(16, 4, 64)


def make_paper_block():
    """One GPT block of the paper's strong-scaling runs (hidden 3072, 64 heads, batch 16); sequence 512."""
    return GPTBlock(3072, 64), torch.randn(16, 512, 3072)


class LinearThenTensordot(nn.Module):
    """A linear, then a product with no sharding rule (it runs whole on every rank)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x):
        y = self.fc(x)
        return torch.tensordot(y, y, dims=([2], [2]))


def make_linear_then_tensordot():
    return LinearThenTensordot(64), torch.randn(16, 4, 64)


def make_odd_mlp():
    """Inner size 96, padded to 128 for a 1-D split over 64 ranks (redundant work 4/3)."""
    return MLP(64, 96), torch.randn(16, 4, 64)


def make_four_heads():
    """A GPT block with 4 heads: no 1-D split over 64 ranks (heads must divide p)."""
    return GPTBlock(64, 4), torch.randn(16, 4, 64)


# --------------------------------------------------------------------------- enumeration


def test_meshes_of_8_gpus():
    assert candidate_meshes(8) == [Mesh(1, 8, "1d"), Mesh(2, 2, "2.5d")]
    assert candidate_meshes(8, ("3d",)) == [Mesh(2, 2, "3d")]


def test_meshes_of_64_gpus():
    assert candidate_meshes(64) == [Mesh(1, 64, "1d"), Mesh(8, 1, "2d"), Mesh(4, 4, "2.5d")]
    assert candidate_meshes(64, ("2.5d",)) == [Mesh(4, 4, "2.5d"), Mesh(8, 1, "2.5d")]
    # the same program is listed once, under the narrower mode
    assert candidate_meshes(64, ("2d", "2.5d", "3d")) == [Mesh(8, 1, "2d"), Mesh(4, 4, "3d")]


def test_meshes_of_other_counts():
    assert candidate_meshes(32, ("2.5d",)) == [Mesh(4, 2, "2.5d")]
    assert candidate_meshes(1) == [Mesh(1, 1, "1d"), Mesh(1, 1, "2d")]
    assert candidate_meshes(6) == [Mesh(1, 6, "1d")]


@pytest.mark.parametrize("gpus, modes, expected", [
    (8, ("2d",), ("no mesh of 8 GPUs in modes 2d: 2d needs a square number (q*q), 3d a cube, "
                  "2.5d q*q*d with d <= q; use 4 or 9 GPUs, or add mode '1d'")),
    (2, ("3d",), "use 1 or 8 GPUs"),
    (8, ("4d",), "mode '4d' is not one of '1d', '2d', '2.5d', '3d'"),
    (0, ("1d",), "gpus=0: use a positive integer"),
    (8, (), "modes=(): pass a non-empty sequence of modes"),
    (8, "2d", "modes='2d': pass a non-empty sequence of modes"),
])
def test_bad_gpus_or_modes(gpus, modes, expected):
    with pytest.raises(ValueError) as info:
        candidate_meshes(gpus, modes)
    assert expected in str(info.value)


# --------------------------------------------------------------------------- plans


@pytest.mark.parametrize("gpus", [8, 64])
def test_plan_prices_every_mesh_fastest_first(gpus, caplog):
    with caplog.at_level(logging.INFO, logger="tess_compile"):
        rows = plan(make_mlp, gpus, gpus_per_node=4)
    assert sorted(map(mesh_label, (row.mesh for row in rows))) == sorted(map(mesh_label, candidate_meshes(gpus)))
    assert all(row.fits for row in rows), format_table(rows)
    times = [row.time.step_s for row in rows]
    assert times == sorted(times)
    assert all(row.time.comm_bytes > 0 and row.memory.total > 0 for row in rows)
    assert f"(1 of {len(rows)})" in caplog.text


def test_redundant_work_of_each_mesh():
    """Forward FLOPs over all ranks / unsharded: 1 when every product is split; a product run
    whole on each of 8 ranks counts 8 times: (linear + 8 * tensordot) / (linear + tensordot)."""
    assert [row.redundant_work for row in plan(make_mlp, 8)] == [pytest.approx(1.0)] * 2
    linear, tensordot = 2 * 16 * 4 * 64 * 64, 2 * (16 * 4) ** 2 * 64
    with pytest.warns(UserWarning, match="no sharding rule"):
        rows = plan(make_linear_then_tensordot, 8)
    expected = (linear + 8 * tensordot) / (linear + tensordot)
    assert [row.redundant_work for row in rows] == [pytest.approx(expected)] * 2, format_table(rows)


def test_the_paper_mesh_crosses_nodes_on_row_and_depth():
    rows = plan(make_mlp, 64, gpus_per_node=4, modes=("2.5d",), summa="broadcast", keep_blocks=False)
    notes = {mesh_label(row.mesh): row.note for row in rows}
    assert notes == {"[4, 4, 4]": "inter-node: depth, row", "[8, 8, 1]": "inter-node: row, col"}
    one_node = plan(make_mlp, 8, gpus_per_node=8, summa="broadcast", keep_blocks=False)
    assert {row.note for row in one_node} == {"within one node"}


def test_auto_is_no_slower_than_any_one_schedule():
    """summa="auto" (the default) gives each product its cheapest schedule: the row is priced no
    slower than the mesh with every product in any one schedule."""
    (row,) = plan(make_mlp, 8, gpus_per_node=4, modes=("2.5d",))  # summa="auto", plan's default
    assert row.summa == "auto" and row.schedules and row.note.startswith(describe_schedules(dict(row.schedules)))
    assert ("keep_blocks" in row.note) == row.keep_blocks
    for summa in ("broadcast", "overlap", "gather"):
        (fixed,) = plan(make_mlp, 8, gpus_per_node=4, modes=("2.5d",), summa=summa)
        assert row.time.step_s <= fixed.time.step_s * (1 + 1e-9), (summa, row.time.step_s, fixed.time.step_s)


def test_the_paper_ranking_on_64_gpus():
    """Tesseract Table 1, 64 A100s: [4, 4, 4] beats Megatron-LM [64] and Optimus [8, 8]."""
    rows = plan(make_paper_block, 64)
    assert [mesh_label(row.mesh) for row in rows][0] == "[4, 4, 4]", format_table(rows)
    assert all(row.fits for row in rows), format_table(rows)


def test_memory_budget_drops_the_meshes_over_it():
    rows = plan(make_mlp, 64, keep_blocks=False)
    totals = sorted(row.memory.total for row in rows)
    budget = (totals[0] + totals[1]) / 2  # only the leanest mesh fits, in any schedule (1d's needs 5% more)
    limited = plan(make_mlp, 64, memory_budget=budget, keep_blocks=False)
    assert [row.fits for row in limited] == [True, False, False]
    assert limited[0].memory.total == totals[0]
    for row in limited[1:]:
        assert row.memory.total > budget
        assert "over the budget of" in row.note
    assert limited[1].time.step_s <= limited[2].time.step_s
    # the cluster's memory is the default budget
    small = replace(PAPER_CLUSTER, memory=budget)
    assert [row.fits for row in plan(make_mlp, 64, cluster=small, keep_blocks=False)] == [True, False, False]


def test_keeping_blocks_is_chosen_only_where_memory_allows():
    """keep_blocks="auto": keeping the fetched blocks saves 2q backward broadcasts per
    product but holds q times the saved bytes; under a budget between the two the
    planner keeps the lean backward. (Sequence 64: the kept blocks raise the step's peak only where
    activations, not the weights' gradients and AdamW's step, make it.)"""
    def make_long_mlp():
        return MLP(64, 256), torch.randn(16, 64, 64)

    mesh_rows = {keep: plan(make_long_mlp, 8, modes=("2.5d",), summa="broadcast", keep_blocks=keep)[0]
                 for keep in (False, True)}
    lean, keeping = mesh_rows[False], mesh_rows[True]
    assert keeping.memory.activations > lean.memory.activations and keeping.memory.total > lean.memory.total
    assert keeping.time.step_s < lean.time.step_s
    assert plan(make_long_mlp, 8, modes=("2.5d",), summa="broadcast")[0].keep_blocks
    budget = (lean.memory.total + keeping.memory.total) / 2
    (row,) = plan(make_long_mlp, 8, modes=("2.5d",), summa="broadcast", memory_budget=budget)
    assert row.fits and not row.keep_blocks and row.memory == lean.memory


def test_a_mesh_that_does_not_compile_says_why():
    rows = plan(make_four_heads, 8, modes=("2.5d", "1d"))
    failed = rows[-1]
    assert failed.mesh == Mesh(1, 8, "1d")
    assert failed.time is None and not failed.fits
    assert failed.note.startswith("does not compile: ")
    assert "not divisible by 8" in failed.note
    assert rows[0].fits  # [2, 2, 2]: 4 heads over q = 2


def test_a_padded_size_shows_as_redundant_work():
    (row,) = plan(make_odd_mlp, 64, modes=("1d",))
    assert row.fits and row.redundant_work == pytest.approx(4 / 3)


def test_plan_of_a_model_needs_its_inputs():
    model, inputs = make_mlp()
    rows = plan(model, 8, example_inputs=inputs)
    assert [row.fits for row in rows] == [True, True]
    with pytest.raises(ValueError, match="without example_inputs: pass example_inputs="):
        plan(model, 8)
    with pytest.raises(ValueError, match="the factory returned MLP, not \\(model, example_inputs\\)"):
        plan(lambda: MLP(8, 8), 8)


def test_factory_runs_on_the_meta_device():
    built = []

    def factory():
        model, inputs = make_mlp()
        built.append(model.fc1.weight.device)
        return model, inputs

    plan(factory, 8)
    assert built == [torch.device("meta")]


def test_plan_with_the_gather_schedule():
    """summa="gather": one all-gather per operand instead of q broadcasts; the same meshes."""
    rows = plan(make_mlp, 8, summa="gather")
    assert [row.fits for row in rows] == [True, True]
    assert {mesh_label(row.mesh) for row in rows} == {"[8]", "[2, 2, 2]"}


def test_plan_is_exported():
    assert tess_compile.plan is plan


def test_format_table():
    rows = plan(make_four_heads, 8, modes=("2.5d", "1d"), memory_budget=1.0)
    text = format_table(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["mode", "dp", "pp", "mesh", "forward", "s", "backward", "s", "step", "s", "comm",
                                "MB/rank", "saved", "GB/rank", "memory", "GB/rank", "redundant", "work", "note"]
    assert len(lines) == 1 + len(rows)
    assert lines[-1].split()[:4] == ["1d", "1", "1", "[8]"]
    assert "does not compile" in lines[-1]
    assert text.isascii()


def test_data_and_pipeline_parallelism_priced_around_a_mesh():
    """dp replicas add one gradient all-reduce per step and split nothing else; pp stages run
    1/pp of the program per microbatch in microbatches + pp - 1 slots and hold 1/pp of the state."""
    from tess_compile.analysis.parallel_plan import Outer, price

    (row,) = plan(make_mlp, 8, modes=("2.5d",), summa="broadcast", keep_blocks=False)
    time, memory = row.time, row.memory
    piped, held = price(time, memory, Outer(dp=1, pp=2, microbatches=4), 8, PAPER_CLUSTER)
    assert piped.step_s == pytest.approx(time.step_s * (4 + 2 - 1) / 2)
    assert held.params == memory.params // 2 and held.activations == memory.activations * 2 // 2
    replicated, same = price(time, memory, Outer(dp=4), 8, PAPER_CLUSTER)
    assert replicated.forward_s == time.forward_s and replicated.backward_s > time.backward_s
    assert same.optimizer == memory.optimizer
    _, zero = price(time, memory, Outer(dp=4, zero=True), 8, PAPER_CLUSTER)  # one FSDP unit: gathered
    assert zero.optimizer == memory.optimizer // 4 and zero.grads == memory.grads
    assert zero.params == memory.params + memory.params // 4 and zero.peak < memory.peak


def test_fixed_dp_and_pp_are_checked():
    with pytest.raises(ValueError, match="dp=3 does not divide 64 GPUs: use a divisor of 64"):
        plan(make_mlp, 64, dp=3)
    with pytest.raises(ValueError, match="pp=2 stages do not split the model's 1 repeated blocks evenly"):
        plan(make_mlp, 64, pp=2)


def test_zero_rows_enter_the_search_by_default():
    """zero="auto" (the default): each configuration with dp > 1 is priced with ZeRO and without, from one
    compile of its mesh; never over one replica."""
    rows = plan(make_mlp, 8, modes=("1d",), dp=2, keep_blocks=False)
    assert sorted(row.outer.zero for row in rows) == [False, True]
    sharded, plain = sorted(rows, key=lambda row: not row.outer.zero)
    assert sharded.memory.optimizer == plain.memory.optimizer // 2 and "(ZeRO-3, 1 unit: " in sharded.note
    assert sharded.spec.zero == 3 and plain.spec.zero == 0
    assert [row.outer.zero for row in plan(make_mlp, 8, modes=("1d",), keep_blocks=False)] == [False]
    with pytest.raises(ValueError, match="zero='yes': use True, False or 'auto'"):
        plan(make_mlp, 8, zero="yes")
