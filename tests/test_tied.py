"""Tied weights: one tensor under two names stays one tensor when sharded."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close_rel
from models import mesh_id
from torch import nn

import tess_compile

MESHES = [(2, 1), (2, 2)]


class TiedLM(nn.Module):
    """Token embedding and output head sharing one weight."""

    def __init__(self, vocab: int = 16, hidden: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


@pytest.mark.parametrize("q, d", MESHES, ids=[mesh_id(q, d) for q, d in MESHES])
def test_tied_weights_train_as_one(q, d):
    torch.manual_seed(5)
    model = TiedLM()
    oracle = copy.deepcopy(model)
    ids = torch.randint(0, 16, (2 * q * d, 3))
    sim = tess_compile.simulate(model, q, d, example_inputs=(ids,), verify=True)
    opt = torch.optim.AdamW(sim.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(oracle.parameters(), lr=1e-2)
    for step in range(3):
        for optimizer, module in ((opt, sim), (opt_ref, oracle)):
            optimizer.zero_grad()
            module(ids).logsumexp(-1).mean().backward()
        grads = sim.full_grads()
        for name, param in oracle.named_parameters():
            assert_close_rel(grads[name], param.grad, name=f"step {step} grad {name}")
        opt.step()
        opt_ref.step()
    state = sim.full_state_dict()
    assert list(state) == list(oracle.state_dict())
    for name, value in oracle.state_dict().items():
        assert_close_rel(state[name], value, name=name)
    for rank in range(sim.mesh.num_ranks):
        assert sim.rank_tensor("head.weight", rank) is sim.rank_tensor("embed.weight", rank)
