"""Attention written with views: packed QKV (nn.MultiheadAttention), unbind, per-head
biases, heads folded into the batch dim with baddbmm and ALiBi; weights used as
`x @ W.T`. Each runs in float64
simulation at [2,2,2] and 1-D p=4, exact against the unsharded model, every op
sharded (strict) and no matmul-like work repeated on two ranks."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import tess_compile
from tess_compile.analysis.accounting import redundant_work, unsharded_forward_flops

HIDDEN, HEADS, SEQ, BATCH = 16, 4, 4, 4
HEAD_DIM = HIDDEN // HEADS
MESHES = [(2, 2, "2.5d"), (2, 1, "1d")]
MESH_IDS = ["2.5d-q2-d2", "1d-p4"]


class PackedSelfAttention(nn.Module):
    """nn.MultiheadAttention on one input: one packed in-projection, unflatten(-1, (3, E))."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class PackedCrossAttention(nn.Module):
    """nn.MultiheadAttention across two inputs with its weights returned: the packed
    weight cut into q and kv, unflatten(-1, (2, E)), baddbmm with a causal mask."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)

    def forward(self, x, memory):
        mask = torch.triu(torch.full((SEQ, SEQ), -1e4, dtype=x.dtype, device=x.device), diagonal=1)
        out, weights = self.attn(x, memory, memory, attn_mask=mask, need_weights=True, average_attn_weights=False)
        return out * weights.sum()


class UnbindAttention(nn.Module):
    """timm's ViT attention: qkv viewed as [b, s, 3, n, hd], permuted to [3, b, n, s, hd], unbind(0)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, h))


class RelativeBiasAttention(nn.Module):
    """T5's attention: a bias [n, s, s] from an embedding of relative positions,
    unsqueezed to [1, n, s, s] and added to the scores."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.bias = nn.Embedding(2 * SEQ - 1, HEADS)
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).split(h, dim=-1))
        positions = torch.arange(s, device=x.device)
        relative = positions[None, :] - positions[:, None] + s - 1
        bias = self.bias(relative).permute(2, 0, 1).unsqueeze(0)
        probs = torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1)
        return self.proj((probs @ v).transpose(1, 2).reshape(b, s, h))


class AlibiAttention(nn.Module):
    """BLOOM's attention: heads folded into the batch dim ([b*n, s, hd]), ALiBi
    [b*n, 1, s] added by baddbmm, a causal mask, softmax, bmm, and back."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, HEADS + 1, dtype=torch.float64))

    def forward(self, x):
        b, s, h = x.shape
        fused = self.qkv(x).view(b, s, HEADS, 3, HEAD_DIM)
        q, k, v = (fused[..., i, :].transpose(1, 2).reshape(b * HEADS, s, HEAD_DIM) for i in range(3))
        alibi = (self.slopes[:, None, None] * torch.arange(s, device=x.device)[None, None, :]).repeat(b, 1, 1)
        scores = torch.baddbmm(alibi.to(x.dtype), q, k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(HEAD_DIM))
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = torch.where(causal, scores.view(b, HEADS, s, s), -1e4)
        probs = torch.softmax(scores, dim=-1).view(b * HEADS, s, s)
        out = torch.bmm(probs, v).view(b, HEADS, s, HEAD_DIM).permute(0, 2, 1, 3).reshape(b, s, h)
        return self.dense(out)


class TransposedWeights(nn.Module):
    """Falcon's linear layers: `x @ W.T` on a parameter (a permuted free tensor), and `+=`."""

    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(2 * HIDDEN, HIDDEN) / HIDDEN)
        self.down = nn.Parameter(torch.randn(HIDDEN, 2 * HIDDEN) / HIDDEN)

    def forward(self, x):
        out = torch.relu(x @ self.up.T) @ self.down.T
        out += x
        return out


def _inputs(model):
    num_inputs = 2 if isinstance(model, PackedCrossAttention) else 1
    return tuple(torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64) for _ in range(num_inputs))


def _assert_exact(actual, expected, name):
    scale = max(expected.abs().max().item(), 1e-300)
    assert (actual - expected).abs().max().item() <= 1e-12 * scale, name


MODELS = [PackedSelfAttention, PackedCrossAttention, UnbindAttention, RelativeBiasAttention, AlibiAttention, TransposedWeights]


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
@pytest.mark.parametrize("make", MODELS, ids=[m.__name__ for m in MODELS])
def test_attention_views_are_exact_and_sharded(make, q, d, mode):
    torch.manual_seed(0)
    model = make().double()
    oracle = copy.deepcopy(model)
    inputs = _inputs(model)
    sim = tess_compile.simulate(model, q, d, example_inputs=inputs, mode=mode, strict=True)
    out, expected = sim(*inputs), oracle(*inputs)
    _assert_exact(out, expected, "output")
    seed = torch.randn(expected.shape, dtype=torch.float64)
    (out * seed).sum().backward()
    (expected * seed).sum().backward()
    grads = sim.full_grads()
    for name, param in oracle.named_parameters():
        _assert_exact(grads[name], param.grad, f"grad {name}")
    assert redundant_work(sim.program, unsharded_forward_flops(oracle, inputs)) == pytest.approx(1.0, abs=0.005)


class GroupedFeatures(nn.Module):
    """A view of a col-split feature dim into [3, 4], then a mean or (attention) a softmax."""

    def __init__(self, attend: bool):
        super().__init__()
        self.up = nn.Linear(8, 12)
        self.attend = attend

    def forward(self, x):
        b, s, _ = x.shape
        grouped = self.up(x).transpose(1, 2).reshape(b, 3, 4, s)
        return grouped.softmax(-1) if self.attend else grouped.mean(2)


def test_view_error_names_heads_only_for_attention():
    x = torch.randn(4, 4, 8)
    with pytest.raises(ValueError) as error:
        tess_compile.simulate(GroupedFeatures(attend=True), 2, 2, example_inputs=(x,))
    message = str(error.value)
    assert "splits dim 1" in message and "[3, 4]" in message and "outer factor 3 is not divisible by 2" in message, message
    assert "[q=2, q=2, d=2]" in message, message
    assert "head count not divisible by 2" in message and "multiple of 2" in message, message


def test_groups_the_mesh_does_not_divide_are_gathered_once_with_a_warning():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"outer factor 3 is not divisible by 2, and its producer cannot split inside "
                                         r"each group: gathered whole over col") as caught:
        report = tess_compile.check(GroupedFeatures(attend=False), 2, 2, example_inputs=torch.randn(4, 4, 8),
                                    progress=False)
    assert report.ok, report.table()
    assert not any("head" in str(w.message) for w in caught), [str(w.message) for w in caught]


class GroupedLinear(nn.Module):
    """A linear of 2 groups: [b, s, 64] viewed as [b, s, 2, 32], each group by its own [32, 32] weight."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.weight = nn.Parameter(torch.randn(2, 32, 32) / 6)
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        h = self.up(x)
        b, s, n = h.shape
        grouped = (h.view(b, s, 2, n // 2).unsqueeze(-2) @ self.weight).squeeze(-2)
        return self.down(torch.relu(grouped.reshape(b, s, n)))


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_a_grouped_linear_the_mesh_does_not_divide_splits_inside_each_group(q, d, mode):
    """2 groups on 4 ranks (1-D): each rank holds a block of each group's in features, no head advice."""
    torch.manual_seed(0)
    report = tess_compile.check(GroupedLinear(), q, d, example_inputs=torch.randn(8, 12, 16), mode=mode, strict=True,
                                progress=False)
    assert report.ok and report.redundant_work == pytest.approx(1.0), report.table()
