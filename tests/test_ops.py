"""Ops beyond the transformer block: convolutions on images, factory-like ops."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_matches_model
from models import mesh_id
from torch import nn

import tess_compile

MESHES = [(2, 1), (2, 2)]


class PatchClassifier(nn.Module):
    """ViT-like: patch-embedding conv, flatten to tokens, LayerNorm, linear head, mean pool."""

    def __init__(self, hidden: int = 8, classes: int = 4):
        super().__init__()
        self.patch = nn.Conv2d(3, hidden, kernel_size=2, stride=2)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, images):
        tokens = self.patch(images).flatten(2).transpose(1, 2)
        ones = tokens.new_ones(tokens.shape[-1])
        return self.head(self.norm(tokens) * ones).mean(1)


@pytest.mark.parametrize("q, d", MESHES, ids=[mesh_id(q, d) for q, d in MESHES])
def test_patch_conv_parity_without_fallback(q, d):
    torch.manual_seed(2)
    model = PatchClassifier()
    images = torch.randn(2 * q * d, 3, 4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sim = tess_compile.simulate(model, q, d, example_inputs=(images,), verify=True)
    assert_matches_model(sim, model, images)
    assert str(sim.program.slots[0].layout) == "RRS(0)", "conv weight: out channels over col"


class Router(nn.Module):
    """A router that turns autocast off to score in float32 (as MoE routers do)."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.gate = nn.Linear(hidden, hidden)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            scores = self.gate(x).float().softmax(-1)
        return x * scores.to(x.dtype)


def test_a_region_without_autocast_is_inlined():
    torch.manual_seed(3)
    model = Router().double()
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sim = tess_compile.simulate(model, 2, 2, example_inputs=(x,))
    assert_matches_model(sim, model, x, rtol=1e-5)  # the scores are float32 by the model's own cast


class Projections(nn.Module):
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Parameter(torch.randn(2 * hidden, hidden))

    def forward(self, x):
        return self.up(x) @ self.down


def test_weights_cast_by_autocast_keep_their_layouts():
    """Autocast's cast of a weight stays free until its product fixes it, as a transpose does: the
    program under autocast splits the weights as the products' weights, as the program without."""
    torch.manual_seed(3)
    model = Projections()
    x = torch.randn(4, 2, 8)
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sim(x)
        program = sim.program
    casts = [n for n in program.graph.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    layouts = {slot.name: str(slot.layout) for slot in program.slots}
    assert casts and layouts["up.weight"] == "RS(1)S(0)" and layouts["down"] == "RS(0)S(1)", layouts


class Activations(nn.Module):
    """Elementwise activations of vision and language models, in place too."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x):
        y = self.fc(x)
        y = nn.functional.hardtanh(y, -0.5, 0.5) + nn.functional.hardswish(y) + nn.functional.hardsigmoid(y)
        y = y + nn.functional.leaky_relu(y, 0.1) + nn.functional.elu(y) + nn.functional.softplus(y)
        y = y + nn.functional.mish(y) + y.clamp_min(-0.2) + y.clamp_max(0.3) + y.abs().log1p() + y.expm1()
        return nn.functional.relu6(y, inplace=True) + nn.functional.relu(y.clone(), inplace=True)


@pytest.mark.parametrize("mode", ["2.5d", "1d"])
def test_activations_run_sharded(mode):
    torch.manual_seed(4)
    model = Activations().double()
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    sim = tess_compile.simulate(model, 2, 2 if mode == "2.5d" else 1, example_inputs=(x,), mode=mode, strict=True)
    assert_matches_model(sim, model, x, rtol=1e-12)
