"""The planner's search (`tess_compile.analysis.plan_search`): each mesh's largest microbatch
is compiled first, and a configuration whose step is bounded below by more than the fastest's
is not compiled. Fast: the bound and the order. Slow: on a stack of GPT blocks over 8 GPUs
with data and pipeline parallelism, every configuration skipped, compiled after all, is
slower than the plan's pick (the bound is a lower bound)."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import GPTStack

from tess_compile.analysis.cost_model import StepTime
from tess_compile.analysis.plan_search import bound_time, search_order
from tess_compile.analysis.planner import plan, pick


def test_the_bound_scales_what_grows_with_the_rows():
    time = StepTime(forward_compute_s=4.0, forward_comm_s=2.0, backward_compute_s=8.0, backward_comm_s=6.0,
                    forward_bytes=100, backward_bytes=200, optimizer_s=1.0, forward_ahead_s=1.0, call_s=0.5)
    half = bound_time(time, 2, 4)
    assert (half.forward_compute_s, half.forward_comm_s, half.backward_compute_s, half.backward_comm_s) == (2, 1, 4, 3)
    assert (half.optimizer_s, half.call_s, half.forward_ahead_s) == (1.0, 0.5, 0.5)
    assert half.step_s < time.step_s


def test_each_mesh_compiles_its_largest_microbatch_first():
    configs = [("a", 2), ("b", 4), ("a", 8), ("b", 1), ("c", None)]
    first, rest = search_order(configs, key=lambda config: config)
    assert first == [("b", 4), ("a", 8), ("c", None)] and rest == [("a", 2), ("b", 1)]


def make_stack():
    return GPTStack(64, 4, 4), torch.randn(16, 8, 64)


@pytest.mark.slow
def test_what_is_skipped_cannot_win():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = plan(make_stack, 8, modes=("1d",), dp="auto", pp="auto")
        skipped = [row for row in rows if row.note.startswith("not compiled")]
        assert skipped, [row.note for row in rows]
        best = pick(rows).time.step_s
        for row in skipped[:1]:
            (again,) = [other for other in plan(make_stack, 8, modes=(row.mode,), dp=row.outer.dp, pp=row.outer.pp,
                                                zero=row.outer.zero) if other.mesh == row.mesh]
            assert again.time.step_s >= best
