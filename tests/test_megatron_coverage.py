"""Whole layers in the 1-D (Megatron-LM) and 2.5-D rules: vocab-split lookups with
`padding_idx` (and `scale_grad_by_freq`), a masked-LM head and cross attention,
each exact in float64 against the unsharded model, with the redundant work
(forward FLOPs over all ranks / unsharded) they leave."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tess_compile
from tess_compile.analysis.accounting import predict_bytes, redundant_work, unsharded_forward_flops

VOCAB, HIDDEN, HEADS, SEQ, BATCH = 16, 32, 4, 4, 4
LM_VOCAB = 128  # wider than HIDDEN, as a vocabulary is
# (q, d, mode): 1-D p=4, and 2.5-D [2,2,2]
ONE_D, TESSERACT = (2, 1, "1d"), (2, 2, "2.5d")


def _check_exact(model: nn.Module, inputs: tuple, mesh: tuple, loss=lambda out: out.square().sum(), **options):
    """Simulate `model` on `mesh` (with compile `options`), compare the output and every full gradient with the
    unsharded model's, and return (simulation, the unsharded model, its FLOPs)."""
    oracle = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op may run replicated
        sim = tess_compile.simulate(model, *mesh[:2], example_inputs=inputs, mode=mesh[2], **options)
    out, expected = sim(*inputs), oracle(*inputs)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    loss(out).backward()
    loss(expected).backward()
    grads = sim.full_grads()
    for name, param in oracle.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-12, atol=1e-12, msg=lambda text: f"{name}: {text}")
    return sim, oracle


def _redundant(sim, oracle, inputs) -> float:
    return redundant_work(sim.program, unsharded_forward_flops(oracle, inputs))


def _ids(padding_idx: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    ids[0, :2] = padding_idx
    ids[3, -1] = padding_idx
    return ids


class TiedLookup(nn.Module):
    """An embedding with options, and a head tied to it (or a head of its own)."""

    def __init__(self, tied: bool, **options):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN, **options)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


@pytest.mark.parametrize("mesh", [ONE_D, TESSERACT], ids=["1d", "2.5d"])
@pytest.mark.parametrize("padding_idx", [4, 9])  # the first row of a 1-D block; inside a block
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_padding_idx_splits_by_vocab(mesh, padding_idx, tied):
    torch.manual_seed(0)
    model = TiedLookup(tied, padding_idx=padding_idx).double()
    inputs = (_ids(padding_idx),)
    sim, oracle = _check_exact(model, inputs, mesh)
    assert _redundant(sim, oracle, inputs) == pytest.approx(1.0)
    if not tied:  # only the head's gradient reaches a tied table's padding row
        assert sim.full_grads()["embed.weight"][padding_idx].abs().max() == 0


@pytest.mark.parametrize("mesh", [ONE_D, TESSERACT], ids=["1d", "2.5d"])
def test_scale_grad_by_freq_counts_the_whole_batch(mesh):
    torch.manual_seed(0)
    model = TiedLookup(False, scale_grad_by_freq=True, padding_idx=3).double()
    _check_exact(model, (_ids(3),), mesh)


class MaskedLM(nn.Module):
    """A BERT-like layer and its masked-LM head: dense, gelu, LayerNorm, and a decoder
    (tied to the word embeddings, padding_idx 0, or not) with a bias of its own."""

    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(LM_VOCAB, HIDDEN, padding_idx=0)
        self.positions = nn.Embedding(SEQ, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.mlp_norm = nn.LayerNorm(HIDDEN)
        self.transform = nn.Linear(HIDDEN, HIDDEN)
        self.head_norm = nn.LayerNorm(HIDDEN)
        self.decoder = nn.Linear(HIDDEN, LM_VOCAB)
        if tied:
            self.decoder.weight = self.embed.weight

    def forward(self, ids):
        x = self.norm(self.embed(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device)))
        x = self.mlp_norm(x + self.down(F.gelu(self.up(x))))
        return self.decoder(self.head_norm(F.gelu(self.transform(x))))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_masked_lm_head_1d(tied):
    """The decoder is column-parallel after the split LayerNorm, tied or not: the
    forward resolves [b, s, h] sums (lookup, MLP; reduce-scattered over the tokens,
    sequence parallelism), never the [b, s, V] logits."""
    torch.manual_seed(0)
    model, inputs = MaskedLM(tied).double(), (_ids(0),)
    labels = torch.randint(0, LM_VOCAB, (BATCH * SEQ,), generator=torch.Generator().manual_seed(1))
    sim, oracle = _check_exact(model, inputs, ONE_D, lambda out: F.cross_entropy(out.reshape(-1, LM_VOCAB), labels))
    assert _redundant(sim, oracle, inputs) <= 1.05
    logits_bytes = BATCH * SEQ * LM_VOCAB * 8
    forward = predict_bytes(sim.program)["forward"]
    assert sum(forward.get((op, "col"), 0) for op in ("all_reduce", "reduce_scatter")) < logits_bytes


class CrossAttention(nn.Module):
    """A decoder block's cross attention (queries from the decoder, keys and values from
    the encoder's output), post-norm, then an MLP."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.norm, self.mlp_norm = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def _heads(self, x):
        return x.unflatten(-1, (HEADS, HIDDEN // HEADS)).transpose(1, 2)

    def forward(self, decoder, encoder):
        q, k, v = self._heads(self.q(decoder)), self._heads(self.k(encoder)), self._heads(self.v(encoder))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)
        x = self.norm(decoder + self.out(attended))
        return self.mlp_norm(x + self.down(torch.relu(self.up(x))))


def test_cross_attention_1d():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    inputs = (torch.randn(BATCH, SEQ, HIDDEN, generator=gen, dtype=torch.float64),
              torch.randn(BATCH, 2 * SEQ, HIDDEN, generator=gen, dtype=torch.float64))
    sim, oracle = _check_exact(CrossAttention().double(), inputs, ONE_D)
    assert _redundant(sim, oracle, inputs) <= 1.05


@pytest.mark.parametrize("mesh", [ONE_D, (2, 2, "1d"), (1, 1, "2.5d")], ids=["1d-p4", "1d-p8", "world-of-one"])
def test_linear_biases_run_in_the_products(mesh):
    """A linear runs with its bias in the product, as the unsharded model's addmm: on a mesh with
    q = 1 (one step: its bias block in one local linear), and in 1-D without sequence parallelism
    (column-parallel, and row-parallel with the bias on one rank). No add follows a product; exact in
    float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN)).double()
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    sim, _ = _check_exact(model, (x,), mesh, token_split="none")
    nodes = sim.program.runnable.graph.nodes
    linears = [n for n in nodes if n.target is torch.ops.aten.linear.default]
    assert len(linears) == 2 and all(len(n.args) == 3 for n in linears)
    assert not any(n.target is torch.ops.aten.add.Tensor for n in nodes)
