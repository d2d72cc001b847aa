"""Small test models for the simulation suite (no tests here).

`GPTBlock` (pre-LN, fused QKV, SDPA), `LlamaBlock` (RMSNorm by hand and
`nn.RMSNorm`, separate q/k/v/o, attention written out, SwiGLU) and
`TinyGPT` (embeddings, GPT blocks, final norm, vocab head).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MESHES", "GPTBlock", "LlamaBlock", "TinyGPT", "make_block", "mesh_id"]

# (q, d): the simulated meshes [q, q, d] every parity test runs on.
MESHES = [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 2), (4, 4)]


def mesh_id(q: int, d: int) -> str:
    return f"q{q}d{d}"


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int, bias: bool):
        super().__init__()
        self.gate = nn.Linear(hidden, inner, bias=bias)
        self.up = nn.Linear(hidden, inner, bias=bias)
        self.down = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeluMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(hidden, inner, bias=bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class GPTBlock(nn.Module):
    """Pre-LN GPT-2 block: fused QKV split with `.split`, SDPA (causal), MLP, residuals."""

    def __init__(self, hidden: int, heads: int, bias: bool = True, mlp: str = "gelu"):
        super().__init__()
        assert hidden % heads == 0
        self.hidden, self.heads = hidden, heads
        self.ln1 = nn.LayerNorm(hidden, bias=bias)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.proj = nn.Linear(hidden, hidden, bias=bias)
        self.ln2 = nn.LayerNorm(hidden, bias=bias)
        if mlp == "gelu":
            self.mlp = GeluMLP(hidden, 4 * hidden, bias)
        elif mlp == "swiglu":
            self.mlp = SwiGLU(hidden, 4 * hidden, bias)
        else:
            raise ValueError(f"unknown mlp {mlp!r}")
        self.drop = nn.Dropout(0.0)

    def attention(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q = q.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        k = k.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        v = v.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, s, h)
        return self.proj(y)

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.drop(self.mlp(self.ln2(x)))


class LlamaBlock(nn.Module):
    """Llama block: hand-written RMSNorm, nn.RMSNorm, q/k/v/o, attention by hand, SwiGLU."""

    def __init__(self, hidden: int, heads: int, mlp_hidden: int | None = None, eps: float = 1e-6):
        super().__init__()
        assert hidden % heads == 0
        self.hidden, self.heads, self.eps = hidden, heads, eps
        mlp_hidden = mlp_hidden or 4 * hidden
        self.attn_norm_weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, hidden, bias=False)
        self.wv = nn.Linear(hidden, hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.mlp = SwiGLU(hidden, mlp_hidden, bias=False)

    def rms_norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.attn_norm_weight

    def attention(self, x):
        b, s, h = x.shape
        hd = h // self.heads
        q = self.wq(x).reshape(b, s, self.heads, hd).permute(0, 2, 1, 3)
        k = self.wk(x).reshape(b, s, self.heads, hd).permute(0, 2, 1, 3)
        v = self.wv(x).reshape(b, s, self.heads, hd).permute(0, 2, 1, 3)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        y = y.permute(0, 2, 1, 3).reshape(b, s, h)
        return self.wo(y)

    def forward(self, x):
        x = x + self.attention(self.rms_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def make_block(kind: str, hidden: int, heads: int, bias: bool = True, mlp: str = "gelu") -> nn.Module:
    """`kind` "gpt" gives a GPTBlock, "llama" a LlamaBlock (always SwiGLU, no bias)."""
    if kind == "gpt":
        return GPTBlock(hidden, heads, bias=bias, mlp=mlp)
    if kind == "llama":
        return LlamaBlock(hidden, heads)
    raise ValueError(f"unknown block kind {kind!r}")


class TinyGPT(nn.Module):
    """Token and learned position embeddings, GPT blocks, final LayerNorm, untied head."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList([GPTBlock(hidden, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        b, s = ids.shape
        x = self.tokens(ids) + self.positions(torch.arange(s, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTStack(nn.Module):
    """Pre-LN GPT blocks and a final LayerNorm on hidden states; `checkpoint` wraps each
    block in torch.utils.checkpoint ("reentrant" or "non-reentrant"), as training scripts do."""

    def __init__(self, hidden: int, heads: int, layers: int, checkpoint: str | None = None):
        super().__init__()
        self.blocks = nn.ModuleList([GPTBlock(hidden, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.checkpoint = checkpoint

    def forward(self, x):
        for block in self.blocks:
            if self.checkpoint is None:
                x = block(x)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
        return self.ln_f(x)
