"""Vocab parallelism: the embedding table split vocab over row and hidden over col,
and cross-entropy over vocab-split logits with log-sum-exp and the target logit by
collectives (Optimus 3.2); the full logits never exist on a rank."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_matches_model
from models import mesh_id
from torch import nn

import tess_compile

MESHES = [(2, 1), (2, 2), (3, 3)]


class TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, reduction: str):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.reduction = reduction

    def forward(self, ids, targets):
        logits = self.head(self.embed(ids))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), reduction=self.reduction)


@pytest.mark.parametrize("q, d", MESHES, ids=[mesh_id(q, d) for q, d in MESHES])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy(reduction, q, d):
    torch.manual_seed(1)
    vocab, batch, seq = 6 * q, 2 * q * d, 3
    model = TinyLM(vocab, 4 * q, reduction)
    ids = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    targets[0, 0] = -100  # ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op may fall back to running replicated
        # the papers' schedule, whose products fetch by broadcasts: every all-gather is the loss's or the lookup's
        sim = tess_compile.simulate(model, q, d, example_inputs=(ids, targets), verify=True, summa="broadcast")
    assert_matches_model(sim, model, ids, targets)
    assert str(sim.program.slots[0].layout) == "RS(0)S(1)", "table: vocab over row, hidden over col"
    rows = batch * seq // (d * q)
    gathers = [r for r in sim.comm.records if r.op == "all_gather" and r.phase == "forward"]
    # Gathered: the token ids of the row group (int64, for the vocab-parallel lookup)
    # and, in one collective, the per-row log-sum-exps and target logits (fp32, two a row); never logits.
    assert [(r.axis, r.num_bytes) for r in gathers] == [("row", rows * 8), ("col", rows * 8)]
