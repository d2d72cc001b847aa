"""Training parity: AdamW steps on the simulated model track the unsharded model,
depth (and row) replicas stay bit-identical, and state dicts round-trip.

Precision note: a GPT block's key bias has a gradient that is exactly zero
in exact arithmetic (adding a constant to every key shifts each query's
scores by a constant, which softmax ignores). In fp32 that gradient is
rounding noise of about 1e-8, which Adam divides by sqrt(v) + eps ~ 1e-8
and turns into steps of size ~lr whose sign depends on the summation order.
So the block *with* biases trains in float64 (noise ~1e-17 << eps); the
blocks without that degenerate parameter train in fp32. The fast tier trains on
[2, 2, 2] (depth replicas); the other meshes run in the slow tier.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close_rel
from models import GPTBlock, LlamaBlock, make_block, mesh_id
from torch import nn

import tess_compile

TRAIN_MESHES = [(2, 1), (2, 2), (3, 3)]
MODELS = [
    ("gpt-bias-fp64", "gpt", True, torch.float64),
    ("gpt-nobias-fp32", "gpt", False, torch.float32),
    ("llama-fp32", "llama", False, torch.float32),
]
CASES = [
    pytest.param(kind, bias, dtype, q, d, id=f"{label}-{mesh_id(q, d)}",
                 marks=() if (q, d) == (2, 2) else (pytest.mark.slow,))
    for label, kind, bias, dtype in MODELS
    for q, d in TRAIN_MESHES
]


def replica_groups(sim, name: str) -> list[list[int]]:
    """Ranks that must hold identical copies of parameter `name`.

    Every parameter is replicated over depth; vectors (bias, norm weights,
    laid out R R S(0)) are replicated over row too.
    """
    mesh = sim.mesh
    vector = sim.rank_tensor(name, 0).dim() == 1
    groups: dict[tuple, list[int]] = {}
    for rank in range(mesh.num_ranks):
        k, i, j = mesh.coords(rank)
        key = (j,) if vector else (i, j)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


@pytest.mark.parametrize("kind, bias, dtype, q, d", CASES)
def test_adamw_steps_match(kind, bias, dtype, q, d):
    torch.manual_seed(3)
    hidden = 4 * q
    model = make_block(kind, hidden, q, bias=bias).to(dtype)
    reference = copy.deepcopy(model)
    x = torch.randn(2 * d * q, 4, hidden, dtype=dtype)
    target = torch.randn(2 * d * q, 4, hidden, dtype=dtype)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), strict=True, verify=True)

    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt_sim = torch.optim.AdamW(sim.parameters(), lr=1e-2, weight_decay=0.1)
    num_shards = len(list(sim.parameters()))
    assert num_shards == sim.mesh.num_ranks * len(list(reference.parameters()))

    for step in range(5):
        opt_ref.zero_grad()
        opt_sim.zero_grad()
        loss_ref = (reference(x) * target).sum()
        loss_sim = (sim(x) * target).sum()
        assert_close_rel(loss_sim.detach(), loss_ref.detach(), name=f"loss at step {step}")
        loss_ref.backward()
        loss_sim.backward()
        opt_ref.step()
        opt_sim.step()

    state = sim.full_state_dict()
    expected_state = reference.state_dict()
    assert list(state) == list(expected_state)
    changed = 0
    for name, value in expected_state.items():
        assert_close_rel(state[name], value, name=f"{name} after 5 steps")
        changed += not torch.equal(value, model.state_dict()[name])
    assert changed == len(expected_state), "some parameter did not move: the test would not see a wrong update"

    for name, _ in reference.named_parameters():
        for group in replica_groups(sim, name):
            first = sim.rank_tensor(name, group[0])
            for rank in group[1:]:
                assert torch.equal(sim.rank_tensor(name, rank), first), (
                    f"{name}: rank {rank} {sim.mesh.coords(rank)} differs from its replica "
                    f"rank {group[0]} {sim.mesh.coords(group[0])} after 5 AdamW steps"
                )


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("q, d", [(2, 2), (3, 1)], ids=[mesh_id(2, 2), mesh_id(3, 1)])
def test_state_dict_round_trip(kind, q, d):
    hidden = 4 * q
    torch.manual_seed(1)
    source = make_block(kind, hidden, q)
    with torch.no_grad():  # norm weights start at ones: make every tensor differ
        for param in source.parameters():
            param.add_(0.1 * torch.randn_like(param))
    torch.manual_seed(2)
    other = make_block(kind, hidden, q)
    snapshot = copy.deepcopy(other.state_dict())
    x = torch.randn(d * q, 4, hidden)
    sim = tess_compile.simulate(other, q, d, example_inputs=(x,), strict=True, verify=True)

    before = sim(x).detach()
    expected = source(x).detach()
    assert not torch.allclose(before, expected), "the two random models should differ"

    sim.load_full_state_dict(source.state_dict())
    assert_close_rel(sim(x).detach(), expected, name="output after load_full_state_dict")
    state = sim.full_state_dict()
    assert list(state) == list(source.state_dict())
    for name, value in source.state_dict().items():
        assert torch.equal(state[name], value), f"{name} does not round-trip bit-identically"
    # The unsharded model the simulator was compiled from is not touched by the load.
    for name, value in other.state_dict().items():
        assert torch.equal(value, snapshot[name]), f"loading into the simulator changed the original model's {name}"


def test_load_full_state_dict_rejects_wrong_dict():
    q, d = 2, 2
    model = GPTBlock(8, 2)
    sim = tess_compile.simulate(model, q, d, example_inputs=(torch.randn(4, 4, 8),))
    bad = model.state_dict()
    bad.pop("proj.bias")
    with pytest.raises(ValueError, match="proj.bias"):
        sim.load_full_state_dict(bad)
    wrong_shape = LlamaBlock(8, 2).state_dict()
    with pytest.raises(ValueError):
        sim.load_full_state_dict(wrong_shape)


class WithBuffers(nn.Module):
    """A persistent buffer registered before the submodule, and a non-persistent one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.linspace(-1, 1, 8))
        self.register_buffer("scale", torch.full((8,), 2.0), persistent=False)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * self.scale + self.shift


def test_full_state_dict_is_the_models_state_dict():
    """`full_state_dict` promises the state dict "as the unsharded model would give it":
    the same keys (persistent buffers yes, non-persistent no), in the same order,
    bit-identical values."""
    model = WithBuffers()
    sim = tess_compile.simulate(model, 2, 2, example_inputs=(torch.randn(4, 3, 8),), verify=True)
    expected = model.state_dict()
    state = sim.full_state_dict()
    assert set(state) == set(expected), (list(state), list(expected))
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    assert list(state) == list(expected), f"key order {list(state)} != model.state_dict() order {list(expected)}"


def test_a_frozen_parameter_stays_frozen():
    """A parameter the model froze (requires_grad=False) is frozen on every rank: no gradient, no step."""
    model = make_block("gpt", 8, 2, bias=True).double()
    model.ln1.weight.requires_grad_(False)
    oracle = copy.deepcopy(model)
    x = torch.randn(4, 4, 8, dtype=torch.float64)
    sim = tess_compile.simulate(model, 2, 2, example_inputs=(x,))
    frozen = [name for name, param in sim.named_parameters() if not param.requires_grad]
    assert frozen and all(name.endswith("ln1.weight") for name in frozen), frozen
    sim(x).sum().backward()
    oracle(x).sum().backward()
    grads = sim.full_grads()
    assert grads["ln1.weight"] is None
    for name, param in oracle.named_parameters():
        if param.requires_grad:
            assert_close_rel(grads[name], param.grad, 1e-12, f"grad {name}")
