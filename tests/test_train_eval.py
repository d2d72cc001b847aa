"""train() and eval() after compiling: the mode at call time decides, as in PyTorch.

Each mode runs its own program (`tess_compile.train_eval`); the other mode's
is compiled on first use. Dropout drops in train mode only; BatchNorm uses
and updates batch statistics in train mode and its running ones in eval mode.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tess_compile
from conftest import assert_close_rel


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
