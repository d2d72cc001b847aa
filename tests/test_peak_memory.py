"""The peak memory of a training step (`analysis.memory.step_peak`) against torch's `MemTracker`,
and the planner's (`parallel_plan.price`) for ZeRO and pipeline stages against a live-bytes count.

Fast tier: a world of one, where the program is the unsharded model's, against the unsharded
model's own step tracked in this process; how `price` moves the peak. Slow tier: 8 gloo processes
at [2,2,2] and 1-D p = 8, with and without recompute, each rank's tracked peak; ZeRO 2 x [2,2,1]
and 2 pipeline stages x [2,2,1] (1F1B, GPipe), the worst rank's (`benchmarks/peak_memory.py`).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tess_compile.analysis.cost_model import StepTime
from tess_compile.analysis.memory import MemoryEstimate, activation_bytes, predict_memory, step_peak, step_working
from tess_compile.analysis.parallel_plan import Outer, price
from tess_compile.analysis.step_tail import MODULE_LOSS
from tess_compile.core.cluster import CALIBRATED_CLUSTER
from tess_compile.core.mesh import Mesh
from tess_compile.passes.driver import compile_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.memory import Stack  # noqa: E402
from benchmarks.peak_memory import measure, measure_outer, tracked_peak  # noqa: E402

SIZE = {"layers": 2, "hidden": 32, "heads": 4, "batch": 4, "seq": 16}
OUTER_SIZE = {**SIZE, "layers": 4, "batch": 8}  # 2 blocks a stage; 4 microbatches of 2 rows
WITHIN = 0.10  # the goal: the predicted peak within 10% of the tracked one


def _model():
    torch.manual_seed(0)
    return Stack(SIZE["layers"], SIZE["hidden"], SIZE["heads"]), torch.randn(SIZE["batch"], SIZE["seq"], SIZE["hidden"])


def _tracked_unsharded_step(model, x) -> int:
    """The unsharded model's two training steps (backward from a gradient of ones, AdamW), tracked."""
    optimizer = torch.optim.AdamW(model.parameters())

    def step():
        out = model(x)
        out.backward(torch.ones_like(out))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return tracked_peak(step, model, optimizer, x)


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
    stack whose activations outweigh its weights: more blocks, longer sequences). The module's own
    step (`MODULE_LOSS`): README's tail would peak before backward, where recompute saves all it saves."""
    torch.manual_seed(0)
    model, x = Stack(4, 32, 4), torch.randn(8, 64, 32)
    plain, blocks = (predict_memory(compile_model(model, Mesh(2, 2), (x,), recompute=r), MODULE_LOSS)
                     for r in ("none", "blocks"))
    saved = plain.activations - blocks.activations
    assert 0 < plain.peak - blocks.peak < saved


def test_recomputed_blocks_free_their_weights_gradients_as_they_go():
    """1-D p=4, every block recomputed: two blocks more raise the working peak of a step (what a rank
    holds besides its parameters, gradients and AdamW state, `step_working`) by their saved inputs, not
    by their weights' size. torch's MemTracker with its module hooks held each region's weight
    gradients to the end of backward, waiting for a norm weight's (summed by the bucket there)."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    programs = [compile_model(Stack(layers, 64, 4), Mesh(2, 1, "1d"), (x,), recompute="blocks") for layers in (2, 4)]
    (two, _), (four, _) = (step_working(program, MODULE_LOSS) for program in programs)
    saved = activation_bytes(programs[1]) - activation_bytes(programs[0])
    block_weights = sum(p.numel() for p in Stack(1, 64, 4).parameters()) * 4 // 4  # fp32, over 4 ranks
    assert 0 < saved <= four - two < saved + block_weights // 8, (four - two, saved, block_weights)


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
    rows = measure(size, [("2.5d", "none", "module"), ("2.5d", "blocks", "module"), ("1d", "none", "module")])
    errors = {(r["mode"], r["recompute"]): r["predicted"] / r["tracked"] - 1 for r in rows}
    assert len(errors) == 3 and all(abs(e) <= WITHIN for e in errors.values()), errors


def test_price_moves_the_peak_by_what_a_zero_rank_and_a_stage_hold():
    """ZeRO: the parameters 1 + 1/dp times (at the end of forward once more), the gradients whole,
    AdamW 1/dp. A stage: 1/pp of the state, the activations in flight, the boundary blocks, the
    step's inputs beyond the microbatch the program counts, and the gradients accumulated before a
    later backward (GPipe: one microbatch fewer in flight then)."""
    memory = MemoryEstimate(params=400, grads=400, optimizer=800, activations=2000, transient=100, peak=4000)
    time = StepTime(0.0, 0.0, 0.0, 0.0, 0, 0, grad_tensors=4)

    def held(outer, block_bytes=0, memory=memory, input_bytes=0):
        return price(time, memory, outer, 4, CALIBRATED_CLUSTER, block_bytes, input_bytes)[1]

    assert held(Outer(dp=4)).peak == 4000
    zero = held(Outer(dp=4, zero=True))
    assert (zero.params, zero.grads, zero.optimizer) == (500, 400, 200) and zero.peak == 4000 + 100 - 600
    lean = held(Outer(dp=4, zero=True), memory=replace(memory, peak=3300))  # the end of forward is higher
    assert lean.peak == 500 + 200 + 2000 + 100 + 400
    one_f = held(Outer(pp=2, microbatches=4), block_bytes=10)  # 2 in flight, 4 receive buffers, 2 outputs
    assert one_f.peak == 4000 - (400 + 800 + 2000) // 2 + 1000 + 200 + (4 + 2) * 10
    assert held(Outer(pp=2, microbatches=4), block_bytes=10, input_bytes=7).peak == one_f.peak + 3 * 7
    assert held(Outer(dp=4), input_bytes=7).peak == 4000  # no stages: the program's inputs are the step's
    gpipe = held(Outer(pp=2, microbatches=4, schedule="gpipe"), block_bytes=10)  # gradients < a microbatch
    assert gpipe.peak == 4000 - (400 + 800 + 2000) // 2 + 3 * 1000 + (4 + 4) * 10
    with pytest.raises(ValueError, match="schedule='zb': use '1f1b' or 'gpipe'"):
        Outer(pp=2, schedule="zb")


def _worst_errors(names: list) -> dict:
    return {r["mode"]: r["predicted"] / r["tracked"] - 1 for r in measure_outer(OUTER_SIZE, names)}


@pytest.mark.slow
def test_zero_peak_within_ten_percent_of_the_worst_ranks():
    """ZeRO over dp = 2 of [2,2,1]: one FSDP2 unit, whose gathered parameters and whole gradients
    the old figure (AdamW and gradients / dp) left out: 25% low on this stack."""
    errors = _worst_errors(["zero"])
    assert abs(errors["zero"]) <= WITHIN, errors


@pytest.mark.slow
def test_pipeline_stage_peak_within_ten_percent_of_the_worst_ranks():
    """2 stages x [2,2,1], 4 microbatches: 1F1B's first stage holds 2 in flight and the gradients
    accumulated so far, GPipe's all 4 (the old figure: 30% and 41% low on this stack)."""
    errors = _worst_errors(["1f1b", "gpipe"])
    assert len(errors) == 2 and all(abs(e) <= WITHIN for e in errors.values()), errors
