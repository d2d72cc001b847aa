"""Any batch on every mesh: a batch that d*q does not divide stays whole over row (and over depth
unless d divides it), and the matrix products keep their weight blocks still and move the rows
(weight-stationary, `passes/rules/products.py`). The tokens stay whole here (`token_split="none"`; a
token split takes the axes the batch leaves by default: tests/test_token_split.py). The oracle is the unsharded model in float64:
outputs and every gradient."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from conftest import assert_matches_model
from models import TinyGPT

import tess_compile
from tess_compile.core.layout import Partial, Replicate, Shard
from tess_compile.core.meta_keys import LAYOUT

VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 8


def tiny_gpt(tied: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ).double()
    if tied:  # the head uses the embedding's layout as it is: x @ W^T with W's out features over row
        model.head.weight = model.tokens.weight
    return model


def products(program) -> list:
    return [n for n in program.graph.graph.nodes if n.target in (torch.ops.aten.linear.default,
                                                                 torch.ops.aten.matmul.default)]


@pytest.mark.parametrize(("batch", "q", "d", "split"), [
    (1, 2, 2, "none"), (2, 2, 2, "depth"), (3, 2, 1, "none"), pytest.param(1, 3, 3, "none", marks=pytest.mark.slow)],
    ids=["b1-q2d2", "b2-q2d2", "b3-q2d1", "b1-q3d3"])
def test_a_batch_that_does_not_split_is_exact(batch, q, d, split):
    hidden = HIDDEN if q == 2 else 36
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, hidden, 6 if q == 3 else HEADS, LAYERS, SEQ).double()
    ids = torch.randint(0, VOCAB, (batch, SEQ))
    with pytest.warns(UserWarning, match="repeat work") if split == "none" and d > 1 else _no_warning():
        sim = tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs=(ids,), token_split="none")
    assert_matches_model(sim, model, ids, rtol=1e-12)
    # weight-stationary: every product's output a partial sum, its rows split as the batch; no weight
    # block moves along row
    depth = Shard(0) if split == "depth" else Replicate()
    layouts = [LAYOUT.of(n) for n in products(sim.program)]
    assert all(layout.depth == depth and Partial() in (layout.row, layout.col) for layout in layouts)
    assert not any(r.axis == "row" and r.op in ("broadcast", "all_gather") for r in sim.comm.records)


def _no_warning():
    return contextlib.nullcontext()


def test_a_tied_head_runs_weight_stationary_as_a_b_transposed():
    """The head shares the embedding's weight, laid out out-features over row: the stationary product
    sums its partial products over col instead, and the bias-free head needs nothing else."""
    model = tiny_gpt(tied=True)
    ids = torch.randint(0, VOCAB, (1, SEQ))
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(ids,), token_split="none")
    assert_matches_model(sim, model, ids, rtol=1e-12)


def test_a_batch_of_one_in_1d_and_a_split_it_does_not_divide():
    model = tiny_gpt()
    ids = torch.randint(0, VOCAB, (1, SEQ))
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 1, example_inputs=(ids,), mode="1d")
    assert_matches_model(sim, model, ids, rtol=1e-12)
    with pytest.raises(ValueError, match=r"batch_split='depth': the inputs' batch 1 is not divisible by the 2 ranks "
                                         r"that split it on mesh \[q=2, q=2, d=2\]"):
        tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(ids,), batch_split="depth")
    with pytest.raises(ValueError, match="batch_split='rows' is not a batch split"):
        tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(ids,), batch_split="rows")


def test_a_batch_that_splits_can_stay_whole_over_row():
    """batch_split="depth" on a batch that d*q divides: the decode layout, exact, its products stationary."""
    model = tiny_gpt()
    ids = torch.randint(0, VOCAB, (4, SEQ))
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(ids,), batch_split="depth",
                                token_split="none")
    assert_matches_model(sim, model, ids, rtol=1e-12)
    partial = [n for n in products(sim.program) if any(isinstance(p, Partial) for p in LAYOUT.of(n).placements)]
    assert partial and len(partial) == len(products(sim.program))
