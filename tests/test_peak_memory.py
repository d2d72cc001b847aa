"""The peak memory of a training step (`analysis.memory.step_peak`) against torch's `MemTracker`.

Fast tier: a world of one, where the program is the unsharded model's, against the unsharded
model's own step tracked in this process. Slow tier: 8 gloo processes at [2,2,2] and 1-D p = 8,
with and without recompute, each rank's tracked peak (`benchmarks/peak_memory.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from tess_compile.analysis.memory import predict_memory, step_peak
from tess_compile.core.mesh import Mesh
from tess_compile.passes.driver import compile_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.memory import Stack  # noqa: E402
from benchmarks.peak_memory import measure  # noqa: E402

SIZE = {"layers": 2, "hidden": 32, "heads": 4, "batch": 4, "seq": 16}
WITHIN = 0.10  # the goal: the predicted peak within 10% of the tracked one


def _model():
    torch.manual_seed(0)
    return Stack(SIZE["layers"], SIZE["hidden"], SIZE["heads"]), torch.randn(SIZE["batch"], SIZE["seq"], SIZE["hidden"])


def _tracked_unsharded_step(model, x) -> int:
    """The unsharded model's two training steps (backward from a gradient of ones, AdamW), tracked."""
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = MemTracker()
    tracker.track_external(model, optimizer, x)
    with tracker:
        for _ in range(2):
            tracker.reset_mod_stats()
            out = model(x)
            out.backward(torch.ones_like(out))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del out
    return max(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())


@pytest.mark.parametrize("recompute", ["none", "blocks"])
def test_world_of_one_peak_is_the_unsharded_steps(recompute):
    model, x = _model()
    program = compile_model(model, Mesh(1, 1), (x,), recompute=recompute)
    memory = predict_memory(program)
    assert memory.total == memory.peak == step_peak(program) > memory.params + memory.optimizer
    if recompute == "none":  # the unsharded model keeps what the program keeps
        tracked = _tracked_unsharded_step(model, x)
        assert abs(memory.peak / tracked - 1) <= WITHIN, (memory.peak, tracked)


def test_recompute_lowers_the_peak_less_than_the_saved_bytes():
    """Recompute frees the saved activations, but backward holds a recomputed block on top (a
    stack whose activations outweigh its weights: more blocks, longer sequences)."""
    torch.manual_seed(0)
    model, x = Stack(4, 32, 4), torch.randn(8, 64, 32)
    plain, blocks = (predict_memory(compile_model(model, Mesh(2, 2), (x,), recompute=r)) for r in ("none", "blocks"))
    saved = plain.activations - blocks.activations
    assert 0 < plain.peak - blocks.peak < saved


def test_an_eval_program_peaks_in_its_forward():
    """No gradient and no AdamW state: below the training step's peak, above the weights."""
    model, x = _model()
    training = predict_memory(compile_model(model, Mesh(2, 2), (x,)))
    model.eval()
    evaluating = predict_memory(compile_model(model, Mesh(2, 2), (x,)))
    assert evaluating.params < evaluating.peak < training.peak - training.optimizer


@pytest.mark.slow
def test_predicted_peak_within_ten_percent_of_each_ranks_tracked_peak():
    size = {**SIZE, "hidden": 64, "heads": 8}  # 1-D p=8 splits the heads 8 ways
    rows = measure(size, [("2.5d", "none"), ("2.5d", "blocks"), ("1d", "none")])
    errors = {(r["mode"], r["recompute"]): r["predicted"] / r["tracked"] - 1 for r in rows}
    assert len(errors) == 3 and all(abs(e) <= WITHIN for e in errors.values()), errors
