"""Complex-number rotary embeddings and a top-2 mixture of experts, sharded: every
output and gradient matches the unsharded float64 model to 1e-12, no op runs
replicated, and no rank repeats another's matmul work (redundant work <= 1.05),
at [2,2,2] and in mode "1d" with p=4."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tess_compile
from tess_compile.analysis.accounting import redundant_work, unsharded_forward_flops

HIDDEN, HEADS, SEQ, BATCH = 32, 4, 8, 4
MESHES = [(2, 2, "2.5d"), (2, 1, "1d")]


class ComplexRopeAttention(nn.Module):
    """Attention with llama3's rotary embedding: adjacent pairs of each head's dims
    as complex numbers, rotated by `polar(1, position * frequency)`."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(3))
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)
        head_dim = HIDDEN // HEADS
        frequencies = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(SEQ, dtype=torch.float64), frequencies)
        self.register_buffer("angles", angles)
        self.register_buffer("magnitudes", torch.ones_like(angles))

    def rotate(self, x):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        rotation = torch.polar(self.magnitudes, self.angles)[None, :, None]
        return torch.view_as_real(pairs * rotation).flatten(3)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, HEADS, -1) for proj in (self.q, self.k, self.v))
        q, k = self.rotate(q), self.rotate(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return x + self.out(out.transpose(1, 2).reshape(b, s, HIDDEN))


class TopTwoExperts(nn.Module):
    """Token-choice top-2 routing over 4 SwiGLU experts stacked as `[E, out, in]`
    tables; each token's expert weights are gathered (static shapes, as
    transformers' `batched_mm` experts)."""

    def __init__(self, num_experts: int = 4, ffn: int = 16):
        super().__init__()
        self.router = nn.Linear(HIDDEN, num_experts, bias=False)
        self.gate_up = nn.Parameter(0.2 * torch.randn(num_experts, 2 * ffn, HIDDEN))
        self.down = nn.Parameter(0.2 * torch.randn(num_experts, HIDDEN, ffn))

    def forward(self, x):
        tokens = x.reshape(-1, HIDDEN)
        weights, ids = self.router(tokens).softmax(-1).topk(2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        ids = ids.reshape(-1)
        picked = tokens.repeat_interleave(2, dim=0).unsqueeze(-1)
        gate, up = torch.bmm(self.gate_up[ids], picked).squeeze(-1).chunk(2, dim=-1)
        expert_out = torch.bmm(self.down[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        mixed = (expert_out * weights.reshape(-1, 1)).reshape(-1, 2, HIDDEN).sum(1)
        return x + mixed.reshape(x.shape)


def _check(model: nn.Module, q: int, d: int, mode: str) -> list[str]:
    """Simulate, compare outputs and full gradients to 1e-12, bound redundant work;
    returns the warnings of the compile."""
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    oracle = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim = tess_compile.simulate(model, q, d, example_inputs=(x,), mode=mode, verify=True)
    out, expected = sim(x), oracle(x)
    assert (out - expected).abs().max() <= 1e-12
    out.square().mean().backward()
    expected.square().mean().backward()
    grads = sim.full_grads()
    for name, param in oracle.named_parameters():
        assert (grads[name] - param.grad).abs().max() <= 1e-12 * max(param.grad.abs().max(), 1), name
    assert redundant_work(sim.program, unsharded_forward_flops(oracle, (x,))) <= 1.05
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("q, d, mode", MESHES, ids=["2.5d-222", "1d-p4"])
def test_complex_rope_is_sharded_and_exact(q, d, mode):
    torch.manual_seed(0)
    messages = _check(ComplexRopeAttention().double(), q, d, mode)
    assert not [m for m in messages if "run replicated" in m], messages


@pytest.mark.parametrize("q, d, mode", MESHES, ids=["2.5d-222", "1d-p4"])
def test_top2_experts_are_sharded_and_exact(q, d, mode):
    torch.manual_seed(0)
    messages = _check(TopTwoExperts().double(), q, d, mode)
    assert not [m for m in messages if "run replicated" in m], messages


def test_view_as_complex_keeps_the_pair_dim_whole():
    """A split of the real/imaginary pair dim is gathered before `view_as_complex`;
    other splits carry over, and `view_as_real` gives them back."""
    from tess_compile.passes.rules.complex_numbers import place_view_as_complex, place_view_as_real
    from tess_compile.core.layout import Layout, Replicate, Shard
    from tess_compile.core.mesh import Mesh

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 8, 2, 4, 2)
    z = graph.call_function(torch.ops.aten.view_as_complex.default, (x,))
    z.meta["val"] = torch.empty(4, 8, 2, 4, dtype=torch.complex128)
    back = graph.call_function(torch.ops.aten.view_as_real.default, (z,))

    class Context:
        mesh = Mesh(2, 2)
        layouts = {x: Layout(Shard(0), Shard(2), Shard(4)), z: None}

        def layout(self, node):
            return self.layouts.get(node)

    ctx = Context()
    decision = place_view_as_complex(z, ctx)
    assert decision.out == decision.args[x] == Layout(Shard(0), Shard(2), Replicate())
    ctx.layouts[z] = decision.out
    assert place_view_as_real(back, ctx).out == decision.out
