"""train() and eval() after compiling: the mode at call time decides, as in PyTorch.

Each mode runs its own program (`tess_compile.runtime.programs_by_mode`); the other mode's
is compiled on first use. Dropout drops in train mode only; BatchNorm uses
and updates batch statistics in train mode and its running ones in eval mode.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close_rel
from torch import nn

import tess_compile


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.drop, self.outer = nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8)

    def forward(self, x):
        return self.outer(self.drop(torch.relu(self.inner(x))))


class BatchNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.norm, self.outer = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 8)

    def forward(self, x):
        return self.outer(self.norm(self.inner(x)))


MESHES = [(2, 2), (2, 1)]


@pytest.mark.parametrize("q, d", MESHES, ids=["q2d2", "q2d1"])
@pytest.mark.parametrize("compiled_in", ["train", "eval"])
def test_dropout_follows_the_mode(q, d, compiled_in):
    model = DropoutMLP().double().train(compiled_in == "train")
    oracle = copy.deepcopy(model).eval()
    x = torch.randn(8, 8, dtype=torch.float64)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,))
    assert sim.training == (compiled_in == "train")
    sim.eval()
    assert_close_rel(sim(x), oracle(x), 1e-12, "eval output")
    sim.train()
    dropped = sim(x)
    assert (dropped - oracle(x)).abs().max() > 1e-3, "train mode did not drop"
    sim.eval()
    assert_close_rel(sim(x), oracle(x), 1e-12, "eval output after training mode")


@pytest.mark.parametrize("q, d", MESHES, ids=["q2d2", "q2d1"])
@pytest.mark.parametrize("compiled_in", ["train", "eval"])
def test_batch_norm_follows_the_mode(q, d, compiled_in):
    model = BatchNormMLP().double().train(compiled_in == "train")
    oracle = copy.deepcopy(model)
    x = torch.randn(8, 8, dtype=torch.float64)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,))
    for training in (True, False, True, False):
        sim.train(training)
        oracle.train(training)
        assert_close_rel(sim(x + training), oracle(x + training), 1e-12, f"output, training={training}")
    state = sim.full_state_dict()
    for name in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
        assert_close_rel(state[name], oracle.state_dict()[name], 1e-12, name)


def _modes_worker(rank, world_size):
    """Over gloo at [2,2,2]: BatchNorm and dropout models switched between modes after
    compiling; returns the largest relative error against the oracle and whether dropout dropped."""
    torch.set_num_threads(1)
    errors, dropped = [], None
    for cls in (BatchNormMLP, DropoutMLP):
        torch.manual_seed(2)
        model = cls().double()
        oracle = copy.deepcopy(model)
        x = torch.randn(8, 8, dtype=torch.float64)
        sharded = tess_compile.shard(model, 2, 2, example_inputs=(x,), timeout=60)
        for training in ((True, False, True, False) if cls is BatchNormMLP else (False,)):
            sharded.train(training)
            oracle.train(training)
            got, expected = tess_compile.full_tensor(sharded(x + training)), oracle(x + training)
            errors.append(((got - expected).abs().max() / expected.abs().max()).item())
        if cls is DropoutMLP:
            sharded.train()
            dropped = (tess_compile.full_tensor(sharded(x)) - oracle.eval()(x)).abs().max().item() > 1e-3
    return max(errors), dropped


@pytest.mark.slow
def test_modes_over_gloo():
    from tess_compile.runtime.launch import run_local

    for error, dropped in run_local(_modes_worker, 8, timeout_s=300):
        assert error <= 1e-12 and dropped
