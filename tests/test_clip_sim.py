"""Global gradient clipping in the simulator: `SimulatedModule.clip_grad_norm_` equals
`torch.nn.utils.clip_grad_norm_` on the unsharded model.

float64, at [2, 2, 2], [2, 2, 1] and mode "1d" (p = 4): the returned total
norm, every rank's clipped local gradient (replicas included) and the
weights after an AdamW step are within 1e-12 of the unsharded model's.

The model has no key bias: its gradient is zero in exact arithmetic and
rounding noise otherwise, which AdamW turns into steps far above 1e-12
(see tests/test_training.py).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import assert_close_rel
from models import LlamaBlock
from torch import nn

import tess_compile
from tess_compile.core.layout import local_block

RTOL = 1e-12
MESHES = [
    pytest.param(2, 2, "2.5d", id="q2d2"),
    pytest.param(2, 1, "2.5d", id="q2d1"),
    pytest.param(2, 1, "1d", id="1d-p4"),
]


class TinyLM(nn.Module):
    """Token and position embeddings, a Llama block, LayerNorm, vocab head."""

    def __init__(self, vocab: int, hidden: int, heads: int, seq: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)
        self.block = LlamaBlock(hidden, heads)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return self.head(self.norm(self.block(x)))


def backward_both(q: int, d: int, mode: str):
    """A float64 model, its simulation, and one backward of the same loss on both."""
    torch.manual_seed(21)
    model = TinyLM(16, 8, 4, 4).to(torch.float64)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 16, (4, 4))
    sim = tess_compile.simulate(model, q, d, example_inputs=(ids,), mode=mode, strict=True)
    target = torch.randn(4, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    (sim(ids) * target).sum().backward()
    (reference(ids) * target).sum().backward()
    return sim, reference


@pytest.mark.parametrize("q, d, mode", MESHES)
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("clips", [True, False], ids=["clipped", "unclipped"])
def test_clip_then_adamw_matches_unsharded(q, d, mode, norm_type, clips):
    sim, reference = backward_both(q, d, mode)
    expected_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type)
    max_norm = expected_norm.item() / 3 if clips else expected_norm.item() * 3

    norm = sim.clip_grad_norm_(max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type=norm_type)
    assert_close_rel(norm, expected, RTOL, "total norm")

    # Every rank's local gradient is the clipped full gradient's block, replicas included.
    params = dict(reference.named_parameters())
    for slot in sim.program.params:
        for rank in range(sim.mesh.num_ranks):
            block = local_block(params[slot.name].grad, slot.layout, sim.mesh, rank)
            assert_close_rel(sim.rank_tensor(slot.name, rank).grad, block, RTOL, f"grad {slot.name} on rank {rank}")

    opt_sim = torch.optim.AdamW(sim.parameters(), lr=1e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt_sim.step()
    opt_ref.step()
    state = sim.full_state_dict()
    for name, value in reference.state_dict().items():
        assert_close_rel(state[name], value, RTOL, f"{name} after the step")


def test_torch_clip_on_every_rank_shard_is_not_the_norm():
    """Why the method exists: `sim.parameters()` holds every rank's shards, replicas
    included, so torch's function over them measures another norm."""
    sim, reference = backward_both(2, 2, "2.5d")
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    over_shards = torch.nn.utils.get_total_norm([p.grad for p in sim.parameters()])
    assert abs(over_shards.item() - expected.item()) > 1e-3 * expected.item()


def test_nonfinite_norm_raises_like_torch():
    sim, reference = backward_both(2, 1, "2.5d")
    for module in (sim, reference):
        next(module.parameters()).grad[0, 0] = float("inf")
    with pytest.raises(RuntimeError) as expected:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as got:
        sim.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert str(got.value) == str(expected.value)
