"""Small test models for the simulation suite (no tests here).

`GPTBlock` (pre-LN, fused QKV, SDPA), `LlamaBlock` (RMSNorm by hand and
`nn.RMSNorm`, separate q/k/v/o, attention written out, SwiGLU),
`TinyGPT` (embeddings, GPT blocks, final norm, vocab head), and sequence
mixers without attention in a small causal LM (`MixerLM`): a chunked gated
delta rule (`ChunkedDeltaRule`) and Mamba-2's SSD (`StateSpaceDuality`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MESHES", "ChunkedDeltaRule", "GPTBlock", "LlamaBlock", "MixerLM", "StateSpaceDuality", "TinyGPT",
    "make_block", "mesh_id",
]

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


# ------------------------------------------------------------------ sequence mixers without attention


class ChunkedDeltaRule(nn.Module):
    """Gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) in chunks: per head, a decay
    g and a rate beta; within a chunk the delta rule's lower-triangular system is solved exactly (its
    strict part is nilpotent: (I - A)^-1 = I + A + ... + A^(c-1)); a state `[b, heads, dk, dv]` is
    carried from chunk to chunk. Queries and keys have half as many heads as values."""

    def __init__(self, hidden: int, heads: int, head_dim: int = 4, chunk: int = 4):
        super().__init__()
        self.heads, self.head_dim, self.chunk = heads, head_dim, chunk
        self.qk = nn.Linear(hidden, 2 * (heads // 2) * head_dim, bias=False)
        self.v = nn.Linear(hidden, heads * head_dim, bias=False)
        self.ab = nn.Linear(hidden, 2 * heads, bias=False)
        self.a_log = nn.Parameter(torch.zeros(heads))
        self.out = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x):
        bsz, s, _ = x.shape
        n, d, c = self.heads, self.head_dim, self.chunk
        q, k = (t.reshape(bsz, s, n // 2, d).repeat_interleave(2, dim=2) for t in self.qk(x).chunk(2, dim=-1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        v = self.v(x).reshape(bsz, s, n, d)
        rate, gate = self.ab(x).chunk(2, dim=-1)
        beta, g = rate.sigmoid(), -self.a_log.exp() * F.softplus(gate)  # [b, s, n]: g is a log decay
        q, k, v = (t.transpose(1, 2).reshape(bsz, n, s // c, c, d) for t in (q, k, v))
        beta, g = (t.transpose(1, 2).reshape(bsz, n, s // c, c) for t in (beta, g))
        cum = g.cumsum(-1)
        lower = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
        pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        k_beta, v_beta = k * beta[..., None], v * beta[..., None]
        system = -(k_beta @ k.transpose(-1, -2) * pairwise).masked_fill(lower, 0)
        inverse, power = torch.eye(c, dtype=x.dtype, device=x.device) + system, system
        for _ in range(c - 2):
            power = power @ system
            inverse = inverse + power
        values, keys_decayed = inverse @ v_beta, inverse @ (k_beta * cum.exp()[..., None])
        attn = (q @ k.transpose(-1, -2)) * pairwise
        state = torch.zeros(bsz, n, d, d, dtype=x.dtype, device=x.device)
        outs = []
        for i in range(s // c):
            fresh = values[:, :, i] - keys_decayed[:, :, i] @ state
            outs.append((q[:, :, i] * cum[:, :, i, :, None].exp()) @ state + attn[:, :, i] @ fresh)
            last = cum[:, :, i, -1:]
            state = state * last[..., None].exp() + (k[:, :, i] * (last - cum[:, :, i]).exp()[..., None]).transpose(
                -1, -2) @ fresh
        y = torch.stack(outs, dim=2).reshape(bsz, n, s, d).transpose(1, 2).reshape(bsz, s, n * d)
        return self.out(y)


def _segment_sums(a):
    """`out[..., i, j] = a[..., j+1] + ... + a[..., i]` for j < i, 0 on the diagonal, -inf above it."""
    t = a.shape[-1]
    strict = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    sums = a[..., None].expand(*a.shape, t).masked_fill(~strict, 0).cumsum(-2)
    return sums.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=a.device).tril(), float("-inf"))


class StateSpaceDuality(nn.Module):
    """Mamba-2's SSD in chunks (the paper's minimal listing, by einsum): per head a scalar decay, B and
    C shared by the heads; the diagonal blocks as masked attention, the chunk states passed on by the
    decays between chunks."""

    def __init__(self, hidden: int, heads: int, head_dim: int = 4, state: int = 4, chunk: int = 4):
        super().__init__()
        self.heads, self.head_dim, self.state, self.chunk = heads, head_dim, state, chunk
        self.in_proj = nn.Linear(hidden, heads * head_dim + 2 * state + heads, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(heads))
        self.a_log = nn.Parameter(torch.zeros(heads))
        self.out = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x):
        bsz, s, _ = x.shape
        n, p, c = self.heads, self.head_dim, self.chunk
        xs, b, cc, dt = self.in_proj(x).split([n * p, self.state, self.state, n], dim=-1)
        dt = F.softplus(dt + self.dt_bias)
        xs = (xs.reshape(bsz, s, n, p) * dt[..., None]).reshape(bsz, s // c, c, n, p)
        b, cc = (t.reshape(bsz, s // c, c, self.state) for t in (b, cc))
        a = (dt * -self.a_log.exp()).reshape(bsz, s // c, c, n).permute(0, 3, 1, 2)  # [b, n, chunks, c]
        cum = a.cumsum(-1)
        y_diag = torch.einsum("bcln,bcsn,bhcls,bcshp->bclhp", cc, b, _segment_sums(a).exp(), xs)
        states = torch.einsum("bcln,bhcl,bclhp->bchpn", b, (cum[..., -1:] - cum).exp(), xs)
        states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
        between = _segment_sums(F.pad(cum[..., -1], (1, 0))).exp()  # [b, n, chunks + 1, chunks + 1]
        states = torch.einsum("bhzc,bchpn->bzhpn", between, states)[:, :-1]
        y_off = torch.einsum("bcln,bchpn,bhcl->bclhp", cc, states, cum.exp())
        return self.out((y_diag + y_off).reshape(bsz, s, n * p))


class MixerLM(nn.Module):
    """A causal LM of `mixer` layers (pre-norm, residual): input_ids, an optional attention_mask
    (padded positions zeroed before each mixer, as transformers' Mamba does) and optional labels
    (-100 not scored), scored shifted as a causal LM's own loss; returns `{"logits", "loss"}`."""

    def __init__(self, mixer, vocab: int = 32, hidden: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norms = nn.ModuleList([nn.RMSNorm(hidden) for _ in range(layers)])
        self.mixers = nn.ModuleList([mixer() for _ in range(layers)])
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.embed(input_ids)
        for norm, mixer in zip(self.norms, self.mixers):
            h = norm(x)
            if attention_mask is not None:
                h = h * attention_mask[..., None].to(h.dtype)
            x = x + mixer(h)
        logits = self.head(self.norm(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                          ignore_index=-100)
        return out
