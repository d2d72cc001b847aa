"""Alike regions (`passes/alike_regions.py`): values every rank of an axis computes alike hold
their whole gradient on every rank. A cross-entropy's tail seeds its gradient on every rank and
its all-gathers' adjoints take each rank's own block instead of reduce-scattering shares; mode
1d's residual stream sums the shares of the column-parallel products' input gradients
(`sum_shares`), so that its all-reduces pass the gradient on and its replicated parameters need
no bucket. Oracle: the unsharded model in float64."""

from __future__ import annotations

from collections import Counter

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


# What the regions save in backward: the tail's reduce-scatter of the gathered log-sum-exps and
# target logits; 2.5d: the all-reduces of the loss's mean over the batch (row, depth); 1d: the
# bucket of the replicated parameters' gradients (its residual stream's all-reduces pass the
# gradient on, and as many `sum_shares` sum it before the column-parallel products).
SAVED = {"2.5d": {("reduce_scatter", "col"): 1, ("all_reduce", "row"): 1, ("all_reduce", "depth"): 1},
         "1d": {("reduce_scatter", "col"): 1, ("all_reduce", "col"): 1}}


@pytest.mark.parametrize("q, d, mode", [(2, 2, "2.5d"), (2, 2, "1d")], ids=["2.5d-q2d2", "1d-p8"])
def test_a_cross_entropy_tail_sends_no_gradient_back(q, d, mode, monkeypatch):
    sim, _ = simulate_exact(TinyLM, _inputs(), q, d, mode)
    assert c.all_gather_alike in [n.target for n in sim.program.runnable.graph.nodes]
    assert not any(n.target is c.seed_once for n in sim.program.runnable.graph.nodes)
    monkeypatch.setattr(driver, "alike_regions", lambda gm, mesh: gm)
    before, _ = simulate_exact(TinyLM, _inputs(), q, d, mode)
    ops, ops_before = Counter(_backward_ops(sim)), Counter(_backward_ops(before))
    assert ops_before - ops == SAVED[mode] and not ops - ops_before


def test_the_1d_residual_stream_holds_whole_gradients(monkeypatch):
    """Megatron-LM's convention where it pays: the embedding's all-reduce passes the gradient on,
    the norm's output (into the column-parallel `up`) sums its gradient's shares, and the norm's
    and `down`'s bias's gradients need no bucket: one collective a step fewer. The all-reduce of
    the residual sum (embedding and `down`, one all-reduce) into the head keeps its shares: there
    one entry would buy one exit."""
    sim, _ = simulate_exact(TinyLM, _inputs(), 2, 2, "1d")
    targets = [n.target for n in sim.program.runnable.graph.nodes]
    assert [targets.count(t) for t in (c.all_reduce_alike, c.sum_shares, c.keep_first_alike, c.all_reduce)] == [1] * 4
    assert not [n for n in sim.program.runnable.graph.nodes if "grad_bucket" in str(n.target)]
    monkeypatch.setattr(driver, "alike_regions", lambda gm, mesh: gm)
    before, _ = simulate_exact(TinyLM, _inputs(), 2, 2, "1d")
    assert len(_backward_ops(sim)) == len(_backward_ops(before)) - 2  # the tail's and the bucket's
    assert ("all_reduce", "col") in _backward_ops(sim)  # the sums of the shares


def test_a_tail_that_two_outputs_share_holds_whole_gradients():
    """Both outputs seed their whole gradient on every rank; the loss's is their sum."""
    sim, _ = simulate_exact(lambda: TinyLM(twice=True), _inputs(), 2, 2, "2.5d")
    targets = [n.target for n in sim.program.runnable.graph.nodes]
    assert c.all_gather_alike in targets
    assert not any(n.target is c.seed_once and n.args[1] == "col" for n in sim.program.runnable.graph.nodes)
