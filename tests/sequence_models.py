"""A decoder with every sequence-mixing op that a token split must keep exact (no tests here).

`SequenceMixer` runs, on `[batch, tokens]` ids: learned positions indexed by
`arange`, rotary positions from `position_ids`, a causal depthwise conv1d
(padding k-1, then the first `tokens` outputs), token shifts by pad-then-slice
and by `roll`, a prefix sum (`cumsum`), a chunked scan whose carry passes from
chunk to chunk, attention with a sliding window and an ALiBi-style bias built
in the graph, and the causal LM's loss with its labels shifted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SequenceMixer"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class SequenceMixer(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 8, tokens: int = 32, kernel: int = 4,
                 chunk: int = 4, window: int = 5):
        super().__init__()
        self.heads, self.chunk, self.window = heads, chunk, window
        self.embed = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(tokens, hidden)
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, padding=kernel - 1)
        self.mix = nn.Linear(3 * hidden, hidden)
        self.decay = nn.Parameter(torch.rand(hidden))
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        head_dim = hidden // heads
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).double() / head_dim),
                             persistent=False)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)]),
                             persistent=False)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.embed(ids) + self.positions(torch.arange(s, device=ids.device))
        conv = self.conv(x.transpose(1, 2))[..., :s].transpose(1, 2)  # causal depthwise
        shifted = F.pad(x, (0, 0, 1, 0))[:, :s]  # the previous token's features
        rolled = torch.roll(x, 1, dims=1) * (torch.arange(s, device=x.device) > 0)[None, :, None].to(x.dtype)
        x = x + self.mix(torch.cat([conv, shifted, rolled], dim=-1))
        x = x + x.cumsum(1) / (torch.arange(s, device=x.device) + 1)[None, :, None].to(x.dtype)
        x = x + self._scan(x)
        x = x + self.out(self._attention(self.norm(x), position_ids))
        logits = self.head(x)
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def _scan(self, x: torch.Tensor) -> torch.Tensor:
        """A linear recurrence run chunk by chunk, each chunk's carry from the one before."""
        decay = torch.sigmoid(self.decay)
        carry = torch.zeros_like(x[:, 0])
        outs = []
        for start in range(0, x.shape[1], self.chunk):
            piece = x[:, start:start + self.chunk]
            steps = torch.arange(1, piece.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]
            inner = (piece * decay ** -steps).cumsum(1) * decay ** steps
            outs.append(inner + carry[:, None] * decay ** steps)
            carry = outs[-1][:, -1]
        return torch.cat(outs, dim=1)

    def _attention(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(h, dim=-1))
        angles = position_ids[:, None, :, None].to(x.dtype) * self.inv_freq.to(x.dtype)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        distance = torch.arange(s, device=x.device)[:, None] - torch.arange(s, device=x.device)[None, :]
        allowed = (distance >= 0) & (distance < self.window)
        bias = (-self.slopes[:, None, None].to(x.dtype) * distance).masked_fill(~allowed, -math.inf)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return y.transpose(1, 2).reshape(b, s, h)
