"""The schedules of the matrix products (`summa=`): broadcast, overlap, gather.

Each gives the model's outputs and gradients and moves exactly the bytes the
graph predicts; the overlapped one starts step t+1's broadcasts before step
t's product and waits for them only after it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_matches_model
from models import GPTBlock, LlamaBlock, TinyGPT, make_block, mesh_id

import tess_compile
from tess_compile.analysis.accounting import bytes_from_records, predict_bytes
from tess_compile.ops import collectives as c
from tess_compile.ops.fetched_product import fetched_product

aten = torch.ops.aten
MESHES = [(2, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("summa", ["overlap", "gather"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("q, d", MESHES, ids=[mesh_id(q, d) for q, d in MESHES])
def test_parity_and_bytes(summa, kind, q, d):
    torch.manual_seed(8)
    model = make_block(kind, 4 * q, q)
    x = torch.randn(2 * d * q, 4, 4 * q)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), summa=summa, strict=True, verify=True)
    assert_matches_model(sim, model, x)
    assert bytes_from_records(sim.comm.records) == predict_bytes(sim.program)


def test_tied_head_gathered():
    """A @ B^T (the tied head) in the gather schedule reduce-scatters its partial product."""
    torch.manual_seed(9)
    model = TinyGPT(vocab=16, hidden=8, heads=2, layers=1, seq=4)
    model.head.weight = model.tokens.weight
    ids = torch.randint(0, 16, (4, 4))
    sim = tess_compile.simulate(model, 2, 1, example_inputs=(ids,), summa="gather", strict=True, verify=True)
    assert_matches_model(sim, model, ids)
    assert ("reduce_scatter", "col") in sim.comm.counts("forward")


def _positions(gm, target) -> list[int]:
    return [i for i, n in enumerate(gm.graph.nodes) if n.target is target]


def test_overlap_starts_next_step_before_this_product():
    """q=3, one linear: starts of step t+1 come after the waits of step t and before
    step t's product; each start is waited for once; no plain broadcast is left."""
    q = 3
    model = torch.nn.Linear(12, 12, bias=False)
    x = torch.randn(3, 12)
    program = tess_compile.simulate(model, q, 1, example_inputs=(x,), summa="overlap").program
    gm = program.graph
    nodes = list(gm.graph.nodes)
    starts, waits = _positions(gm, c.broadcast_start), _positions(gm, c.wait)
    products = _positions(gm, fetched_product)
    assert not _positions(gm, c.broadcast)
    assert len(starts) == len(waits) == 2 * q and len(products) == q
    assert sorted(nodes[w].args[0] for w in waits) == sorted(nodes[s] for s in starts)
    for t in range(q - 1):
        this_waits, next_starts = waits[2 * t : 2 * t + 2], starts[2 * t + 2 : 2 * t + 4]
        assert max(this_waits) < min(next_starts) and max(next_starts) < products[t], f"step {t} is not overlapped"


def test_gather_is_one_product_per_linear():
    model = GPTBlock(8, 2)
    x = torch.randn(4, 4, 8)
    gm = tess_compile.simulate(model, 2, 2, example_inputs=(x,), summa="gather").program.graph
    assert len(_positions(gm, fetched_product)) == 4
    assert len(_positions(gm, c.all_gather)) == 8 + 2  # each linear's two operands, each LayerNorm's statistics
    assert not _positions(gm, c.broadcast)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="summa='ring' is not a schedule: use one of 'broadcast', 'overlap', 'gather'"):
        tess_compile.simulate(GPTBlock(8, 2), 2, 1, example_inputs=(torch.randn(2, 4, 8),), summa="ring")


def test_gather_shares_one_input_across_its_products():
    """Llama: q, k and v read one all-gather of the normed input, gate and up another; the
    products of one input are one product (`tess_compile.passes.merge_products`), which gathers the
    input again in its backward. Exact in float64."""
    torch.manual_seed(0)
    model = LlamaBlock(8, 2).to(torch.float64)
    x = torch.randn(4, 4, 8, dtype=torch.float64)
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,), summa="gather", verify=True)
    gm = sim.program.graph
    along_col = [n for n in gm.graph.nodes if n.target is c.all_gather and n.args[1] == "col"]
    assert len(along_col) == 4, "q/k/v, o, gate/up, down"
    assert len(_positions(gm, fetched_product)) == 4, "q/k/v, o, gate/up, down"
    assert_matches_model(sim, model, x, rtol=1e-12)
    assert sim.comm.counts("backward")[("reduce_scatter", "col")] == 4


class _ScaledInPlaceBetween(torch.nn.Module):
    """Two products of one input with an in-place change of that input between them."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 8, bias=False)
        self.second = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        y = x * 1.0
        a = self.first(y)
        y.mul_(2.0)
        return a + self.second(y)


def test_gather_is_not_shared_across_an_in_place_change():
    """(Without grad: autograd refuses an in-place change of a product's saved input.)"""
    torch.manual_seed(0)
    model = _ScaledInPlaceBetween().to(torch.float64)
    x = torch.randn(4, 4, 8, dtype=torch.float64)
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,), summa="gather", verify=True)
    along_col = [n for n in sim.program.graph.graph.nodes if n.target is c.all_gather and n.args[1] == "col"]
    assert len(along_col) == 2
    with torch.no_grad():
        torch.testing.assert_close(sim(x), model(x), rtol=1e-12, atol=1e-12)
