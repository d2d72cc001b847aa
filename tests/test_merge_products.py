"""Horizontal fusion (`tess_compile.passes.merge_products`): the products that read one input run as one.

q, k and v of one normed input, and a gated MLP's gate and up, become one
product over their concatenated weights, split after; in the broadcast and
overlap schedules step t's products merge and the loop sums (and, for
`A @ B^T`, reduces) the merged steps once. Exact in float64 against the
unsharded model (output, every gradient, the weights after an AdamW step) in
every schedule, with `keep_blocks`, on [2,2,2], [2,2,1] and 1-D p=4, and in
a dynamic program; the gather schedule's collectives per phase, before and
after; `A @ B^T` merged where its weight is broadcast, apart where gathered;
products that must not merge (an in-place op between them, a weight that is
not one of the graph's, different outputs) stay apart and exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_rel, assert_matches_model
from models import SwiGLU
from torch import nn

import tess_compile.passes.driver
import tess_compile
from tess_compile.passes.driver import compile_model
from tess_compile.analysis.accounting import bytes_from_records, predict_bytes
from tess_compile.analysis.memory import predict_memory
from tess_compile.core.mesh import Mesh
from tess_compile.ops.fetched_product import fetched_product

aten = torch.ops.aten
HIDDEN, HEADS, SEQ = 8, 4, 3


class FusedInputsBlock(nn.Module):
    """q, k, v of one normed input (no biases: a key bias's gradient is exactly zero, its float64
    rounding noise no oracle) and a SwiGLU MLP with `mlp_bias`. `parallel`: the MLP reads the
    attention's input too (GPT-J, PaLM), beside a `skip` product of half the MLP's width, so that
    gate, up and skip (of unequal sizes) read q, k and v's input."""

    def __init__(self, mlp_bias: bool, parallel: bool):
        super().__init__()
        self.parallel = parallel
        self.norm = nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))
        self.mlp = SwiGLU(HIDDEN, 2 * HIDDEN, mlp_bias)
        if parallel:
            self.skip = nn.Linear(HIDDEN, HIDDEN, bias=mlp_bias)
        else:
            self.mlp_norm = nn.LayerNorm(HIDDEN)

    def heads(self, y):
        b, s, h = y.shape
        return y.view(b, s, HEADS, h // HEADS).transpose(1, 2)

    def forward(self, x):
        b, s, h = x.shape
        normed = self.norm(x)
        q, k, v = self.heads(self.q(normed)), self.heads(self.k(normed)), self.heads(self.v(normed))
        attention = self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        if self.parallel:
            return x + attention + self.mlp(normed) + self.skip(normed)
        x = x + attention
        return x + self.mlp(self.mlp_norm(x))


# (label, MLP bias, parallel)
MODELS = [("seq-nobias", False, False), ("parallel-bias", True, True)]
# (label, q, d, mode, summa, keep_blocks)
CONFIGS = [  # [2, 2, 1] in the slow tier: [2, 2, 2] runs every schedule with depth
    pytest.param((f"q2d{d}-{summa}{'-keep' if keep else ''}", 2, d, "2.5d", summa, keep),
                 marks=() if d == 2 else (pytest.mark.slow,))
    for d in (2, 1)
    for summa, keep in (("broadcast", False), ("overlap", False), ("gather", False), ("broadcast", True),
                        ("gather", True))
] + [("1d-p4", 2, 1, "1d", "broadcast", False)]


def _model(mlp_bias: bool, parallel: bool) -> nn.Module:
    torch.manual_seed(0)
    model = FusedInputsBlock(mlp_bias, parallel).double()
    with torch.no_grad():  # norm weights and biases start at ones and zeros: make every tensor differ
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def _input(q: int, d: int, mode: str) -> torch.Tensor:
    batch = 2 * q * d if mode != "1d" else 2
    return torch.randn(batch, SEQ, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _simulate(model, x, q, d, mode, summa, keep):
    return tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs=(x,), mode=mode, summa=summa,
                                 keep_blocks=keep, strict=True, verify=True)


def _splits(sim) -> int:
    return sum(n.target is aten.split_with_sizes.default for n in sim.program.graph.graph.nodes)


@pytest.fixture(scope="module", params=MODELS, ids=[m[0] for m in MODELS])
def model_case(request):
    _, mlp_bias, parallel = request.param
    return _model(mlp_bias, parallel), parallel


@pytest.mark.parametrize("config", CONFIGS, ids=lambda config: config[0])
def test_merged_is_exact_and_trains(model_case, config):
    """Output, every gradient and the weights after one AdamW step equal the unsharded model's;
    each group of products of one input is one product (one split of its output): q/k/v and
    gate/up, or in the parallel block all six, whose biases 2.5-D adds after the product, but
    q/k/v and gate/up/skip in 1-D, whose linears take their biases (all or none merge)."""
    model, parallel = model_case
    _, q, d, mode, summa, keep = config
    x = _input(q, d, mode)
    reference = copy.deepcopy(model)
    sim = _simulate(model, x, q, d, mode, summa, keep)
    assert _splits(sim) == (1 if parallel and mode != "1d" else 2)
    assert_matches_model(sim, reference, x, rtol=1e-12)
    assert bytes_from_records(sim.comm.records) == predict_bytes(sim.program)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt_sim = torch.optim.AdamW(sim.parameters(), lr=1e-2, weight_decay=0.1)
    opt_ref.step()
    opt_sim.step()
    state = sim.full_state_dict()
    for name, value in reference.state_dict().items():
        assert not torch.equal(value, model.state_dict()[name]), f"{name} did not move"
        assert_close_rel(state[name], value, 1e-12, f"{name} after an AdamW step")


def _unmerged(gm, mesh):
    return gm


@pytest.fixture(scope="module")
def gather_sims():
    """The sequential block on [2,2,2] in the gather schedule, merged and not, after one step."""
    model = _model(False, False)
    x = _input(2, 2, "2.5d")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tess_compile.passes.driver, "merge_products", _unmerged)
        before = _simulate(model, x, 2, 2, "2.5d", "gather", False)
    after = _simulate(model, x, 2, 2, "2.5d", "gather", False)
    for sim in (before, after):
        out = sim(x.clone().requires_grad_())
        (out * out).sum().backward()
    return before, after


def test_gather_counts_before_and_after(gather_sims):
    """Per step of the sequential block (7 products: q, k, v, o, gate, up, down; 4 inputs):
    each product gathers its weight along row and, with its input's gather shared, each input
    is gathered along col; backward gathers both again per product and reduce-scatters each
    forward gather. Merged, q/k/v and gate/up are one product each: 4 products."""
    before, after = gather_sims
    norms = 2  # each LayerNorm gathers its statistics along col, all-reduces them in backward
    assert before.comm.counts("forward") == {("all_gather", "row"): 7, ("all_gather", "col"): 4 + norms}
    assert after.comm.counts("forward") == {("all_gather", "row"): 4, ("all_gather", "col"): 4 + norms}
    syncs = {("all_reduce", "col"): norms, ("all_reduce", "row"): 1, ("all_reduce", "depth"): 1}  # and buckets
    assert before.comm.counts("backward") == {("all_gather", "row"): 7, ("all_gather", "col"): 7,
                                              ("reduce_scatter", "row"): 7, ("reduce_scatter", "col"): 4, **syncs}
    assert after.comm.counts("backward") == {("all_gather", "row"): 4, ("all_gather", "col"): 4,
                                             ("reduce_scatter", "row"): 4, ("reduce_scatter", "col"): 4, **syncs}
    products = [sum(n.target is fetched_product for n in sim.program.graph.graph.nodes) for sim in gather_sims]
    assert products == [7, 4]


@pytest.mark.parametrize("mode, summa", [("2.5d", "gather"), ("2.5d", "broadcast"), ("1d", "broadcast")])
def test_merged_products_keep_no_more_for_backward(mode, summa):
    """A merged product keeps the weights themselves for backward (its pieces), not a copy of
    their concatenation: the bytes saved for backward are those of the unmerged program."""
    model, (q, d) = _model(False, False), ((1, 4) if mode == "1d" else (2, 2))
    x = _input(q, d, mode)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tess_compile.passes.driver, "merge_products", _unmerged)
        before = compile_model(model, Mesh(q, d, mode), (x,), summa=summa)
    after = compile_model(model, Mesh(q, d, mode), (x,), summa=summa)
    assert after.graph.meta["schedules"] == before.graph.meta["schedules"]
    assert predict_memory(after).activations == predict_memory(before).activations


class TiedHeads(nn.Module):
    """Two heads of one normed input tied to two embeddings, whose layout (vocabulary over row)
    makes each head `A @ B^T`: step t reduces its partial product along col."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Embedding(2 * HIDDEN, HIDDEN), nn.Embedding(2 * HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, ids):
        normed = self.norm(self.first(ids) + self.second(ids))
        return F.linear(normed, self.first.weight) + F.linear(normed, self.second.weight)


@pytest.mark.parametrize("summa, merged", [("broadcast", True), ("overlap", True), ("gather", False)])
def test_transposed_products(summa, merged):
    """`A @ B^T` merges where its weight's fetch is a broadcast (one reduce a step for both heads);
    the gather schedule gathers the weight along its out dim, which would interleave the heads'
    blocks, so there the heads stay apart. Exact either way."""
    torch.manual_seed(0)
    model = TiedHeads().double()
    ids = torch.randint(0, 2 * HIDDEN, (4, SEQ))
    sim = _simulate(model, ids, 2, 2, "2.5d", summa, False)
    assert _splits(sim) == merged
    assert_matches_model(sim, copy.deepcopy(model), ids, rtol=1e-12)
    if merged:
        assert sim.comm.counts("forward")[("reduce", "col")] == 2  # one a step


class InPlaceBetween(nn.Module):
    """Two products of one input with an in-place op between them."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.first = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.second = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        normed = self.norm(x)
        a = self.first(normed)
        a.mul_(2.0)
        return a + self.second(normed)


class CastWeight(nn.Module):
    """Two products of one input whose weights differ in dtype (a float32 one cast before its
    product; its gradient is rounded to float32, by every rank before the sum)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.first = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.second = nn.Parameter(torch.randn(HIDDEN, HIDDEN, dtype=torch.float32))

    def forward(self, x):
        normed = self.norm(x)
        return self.first(normed) + F.linear(normed, self.second.to(normed.dtype))


@pytest.mark.parametrize("summa", ["gather", "broadcast"])
@pytest.mark.parametrize("make", [InPlaceBetween, CastWeight], ids=["in-place-between", "cast-weight"])
def test_not_merged_and_exact(make, summa):
    torch.manual_seed(0)
    model = make().double()
    if isinstance(model, CastWeight):
        model.second.data = model.second.data.float()
    x = _input(2, 2, "2.5d")
    sim = _simulate(model, x, 2, 2, "2.5d", summa, False)
    assert _splits(sim) == 0
    assert_matches_model(sim, copy.deepcopy(model), x, rtol=1e-12 if make is InPlaceBetween else 1e-5)


class TwoOutputs(nn.Module):
    """Two products of one input, each its own output."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.used = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.unused = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        normed = self.norm(x)
        return self.used(normed), self.unused(normed)


def test_products_of_different_outputs_stay_apart():
    """A loss of one output leaves the other's weight without a gradient (None), as unsharded."""
    model = TwoOutputs().double()
    x = _input(2, 2, "2.5d")
    sim = _simulate(model, x, 2, 2, "2.5d", "gather", False)
    assert _splits(sim) == 0
    sim(x)[0].square().sum().backward()
    assert all((param.grad is None) == ("unused" in name) for name, param in sim.named_parameters())


def test_dynamic_shapes():
    """A dynamic program (symbolic batch and sequence) merges and is exact at other sizes."""
    model = _model(False, False)
    x = _input(2, 2, "2.5d")
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,), summa="broadcast", dynamic=True)
    assert _splits(sim) == 2 and sim.program.dynamic is not None
    for batch, length in ((4, 5), (8, 2)):
        y = torch.randn(batch, length, HIDDEN, dtype=torch.float64)
        assert_matches_model(sim, model, y, rtol=1e-12)
