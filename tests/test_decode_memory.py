"""The peak memory of a decode step: `plan_decode`'s column, and the prediction for a generation decode
program at a step's sizes (`decode_plan.at_shapes`) against torch's `MemTracker` on gloo processes
(`benchmarks/decode_memory.py`, slow tier). No test here depends on a wall-clock time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_decode_plan import BATCH, E, F, mlp

from tess_compile.analysis.decode_plan import at_shapes, plan_decode
from tess_compile.analysis.memory import predict_memory
from tess_compile.core.mesh import Mesh
from tess_compile.core.options import CompileOptions
from tess_compile.passes.driver import compile_model

WITHIN = 0.10  # the goal: the predicted peak within 10% of the worst rank's tracked one


def test_plan_decode_rows_carry_the_predicted_peak():
    for row in plan_decode(mlp, 4):
        assert row.peak_bytes > (E * F + F * E) * 4 / row.mesh.num_ranks, row  # above the weights' blocks
        assert row.to_dict()["peak_bytes"] == row.peak_bytes


def _dynamic(batch: int, seq: int):
    model, _ = mlp()
    return compile_model(model.eval(), Mesh(2, 1), (torch.randn(batch, seq, E),), options=CompileOptions(dynamic=True))


def test_at_shapes_prices_a_dynamic_program_as_compiled_at_those_sizes():
    program = _dynamic(BATCH, 4)
    for batch, seq in ((BATCH, 4), (BATCH, 16), (2 * BATCH, 16)):
        assert predict_memory(at_shapes(program, [(batch, seq, E)])).total == predict_memory(_dynamic(batch, seq)).total
    with pytest.raises(ValueError, match="fixed by the model's weights"):
        at_shapes(program, [(BATCH, 4, E // 2)])


@pytest.mark.slow
def test_decode_step_peak_within_ten_percent_of_the_tracked_peak():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.decode_memory import QUICK, measure  # imports transformers: only here

    rows = measure(QUICK["batch"], QUICK["cached"])
    errors = {row["mode"]: row["predicted"] / row["tracked"] - 1 for row in rows}
    assert set(errors) == {"2.5d", "1d"} and all(abs(e) <= WITHIN for e in errors.values()), errors
