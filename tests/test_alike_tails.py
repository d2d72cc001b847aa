"""Alike tails (`passes/alike_tails.py`): a replicated output that every rank computes alike
from all-gathers seeds its gradient on every rank, and the all-gathers' adjoints take each
rank's own block instead of reduce-scattering shares. Oracle: the unsharded model in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import simulate_exact
from torch import nn

from tess_compile.ops import collectives as c
from tess_compile.passes import driver

VOCAB, HIDDEN, BATCH, SEQ = 16, 8, 8, 3


class TinyLM(nn.Module):
    """Embedding, LayerNorm, MLP and a vocabulary head under a cross-entropy; `twice` also
    returns twice the loss, a second output on the same tail."""

    def __init__(self, twice: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.twice = twice

    def forward(self, ids, targets):
        x = self.embed(ids)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        loss = F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())
        return (loss, 2 * loss) if self.twice else loss


def _inputs():
    generator = torch.Generator().manual_seed(3)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets[0, 0] = -100  # ignored
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator), targets


def _backward_ops(sim) -> list[tuple[str, str]]:
    sim.comm.records.clear()
    sim(*_inputs()).backward()
    return [(r.op, r.axis) for r in sim.comm.records if r.phase == "backward"]


@pytest.mark.parametrize("q, d, mode", [(2, 2, "2.5d"), (2, 2, "1d")], ids=["2.5d-q2d2", "1d-p8"])
def test_a_cross_entropy_tail_sends_no_gradient_back(q, d, mode, monkeypatch):
    sim, _ = simulate_exact(TinyLM, _inputs(), q, d, mode)
    assert c.all_gather_alike in [n.target for n in sim.program.runnable.graph.nodes]
    assert not any(n.target is c.seed_once and n.args[1] == "col" for n in sim.program.runnable.graph.nodes)
    monkeypatch.setattr(driver, "alike_tails", lambda gm, mesh: gm)
    before, _ = simulate_exact(TinyLM, _inputs(), q, d, mode)
    # before, the gathered log-sum-exps and target logits came back by a reduce-scatter along col
    ops, ops_before = _backward_ops(sim), _backward_ops(before)
    ops_before.remove(("reduce_scatter", "col"))
    assert sorted(ops) == sorted(ops_before)


def test_a_tail_that_another_output_shares_keeps_its_seed():
    sim, _ = simulate_exact(lambda: TinyLM(twice=True), _inputs(), 2, 2, "2.5d")
    targets = [n.target for n in sim.program.runnable.graph.nodes]
    assert c.all_gather_alike not in targets
    assert sum(t is c.seed_once for t in targets) >= 2
