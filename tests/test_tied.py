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


def test_a_tied_head_saves_its_own_block_of_the_gathered_weight():
    """At a batch of one the tokens split, and the tied weight reaches the head in another layout (gathered
    over col, then sliced): the head's product keeps this rank's block of it for backward, not the whole
    gathered tensor that a view of the block would keep alive (`fetched_product`'s `_compact`)."""
    torch.manual_seed(5)
    vocab, hidden = 64, 32
    model, ids = TiedLM(vocab, hidden).double(), torch.randint(0, vocab, (1, 8))
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(ids,))
    sizes = []

    def pack(tensor):
        if tensor.is_floating_point():  # (the ids' views hold the input's storage: the caller's)
            sizes.append(tensor.untyped_storage().nbytes() / (tensor.numel() * tensor.element_size()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = sim(ids)
    assert max(sizes) <= 1, sizes  # no saved block holds a larger storage
    assert_close_rel(out.full_tensor() if hasattr(out, "full_tensor") else out, model(ids), 1e-12)
