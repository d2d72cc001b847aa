"""Sequence mixers without attention, sharded: no rank repeats another's scan.

Two layers of `tests/models.py` in a small causal LM (`MixerLM`), each called with
labels and a right-padded attention_mask: a chunked gated delta rule (linear
attention: a triangular solve within chunks and a state carried across them, split
over heads; its queries and keys have half as many heads, repeated) and Mamba-2's SSD
by einsum (split over heads). `check` in float64 at [2,2,2] and 1-D p=4 with
strict=True (no op replicated, no work repeated): outputs, every gradient and the
weights after a step to 1e-12, forward FLOPs over all ranks at most 1.05x. The
fast tier runs one case; the zoo (`tests/test_coverage.py`) runs transformers' Mamba,
Mamba-2 and Qwen3-Next the same way.

The rules these layers need, each on its own at both meshes (exact, at most 1.05x,
strict): Mamba's causal depthwise conv by a view of its weight (split over channels)
and its time step `dt_proj.weight @ dt` (a weight on the left, split by its rows); a
long convolution by FFTs along the sequence (`irfft(rfft(x) * rfft(k))`, Hyena's),
whose FLOPs the counter now counts; and a table of relative positions (batch 1, 2s-1
rows that no axis divides) projected by a weight, split over its out features.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from models import ChunkedDeltaRule, MixerLM, StateSpaceDuality
from torch import nn

import tess_compile

HIDDEN, VOCAB, BATCH, SEQ = 16, 32, 8, 4
MIXERS = {
    "chunked-delta-rule": lambda: ChunkedDeltaRule(HIDDEN, heads=8, head_dim=2, chunk=2),
    "state-space-duality": lambda: StateSpaceDuality(HIDDEN, heads=4, chunk=2),
}
MESHES = [(2, 2, "2.5d", "2.5d-q2d2"), (2, 1, "1d", "1d-p4")]
FAST = ("chunked-delta-rule", "1d")  # the fast tier's one case; the others are slow


def _cases():
    return [pytest.param(name, q, d, mode, id=f"{name}-{mesh_id}",
                         marks=() if (name, mode) == FAST else pytest.mark.slow)
            for name in MIXERS for q, d, mode, mesh_id in MESHES]


def _inputs():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -2:] = mask[5, -1:] = 0  # padded on the right
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("name, q, d, mode", _cases())
def test_a_mixer_is_sharded_and_exact(name, q, d, mode):
    torch.manual_seed(0)
    model = MixerLM(MIXERS[name], vocab=VOCAB, hidden=HIDDEN, layers=1)
    report = tess_compile.check(model, q, d, example_inputs=_inputs(), mode=mode, strict=True, progress=False,
                                loss_fn=lambda out: out["loss"])
    assert report.ok and report.tolerance == 1e-12, report.table()
    assert report.redundant_work <= 1.05, report.table()


class MambaProjections(nn.Module):
    """Mamba's conv and time step as transformers writes them: `F.conv1d` by `conv.weight.squeeze(1)`
    unsqueezed again (groups = channels), and `dt_proj.weight @ dt` with the weight on the left."""

    def __init__(self, hidden: int = 16, inner: int = 16, rank: int = 4):
        super().__init__()
        self.in_proj = nn.Linear(hidden, inner)
        self.conv = nn.Conv1d(inner, inner, 4, groups=inner, padding=3)
        self.x_proj = nn.Linear(inner, rank, bias=False)
        self.dt_proj = nn.Linear(rank, inner)
        self.out_proj = nn.Linear(inner, hidden)

    def forward(self, x):
        s = x.shape[1]
        h = self.in_proj(x).transpose(1, 2)
        weight = self.conv.weight.squeeze(1)
        h = F.silu(F.conv1d(h, weight.unsqueeze(1), self.conv.bias, padding=3, groups=h.shape[1])[..., :s])
        dt = self.dt_proj.weight @ self.x_proj(h.transpose(1, 2)).transpose(1, 2)  # [b, inner, s]
        return self.out_proj((h * F.softplus(dt + self.dt_proj.bias[:, None])).transpose(1, 2))


class FourierLongConv(nn.Module):
    """A long convolution along the sequence by FFTs (Hyena's): `irfft(rfft(x) * rfft(filter))`."""

    def __init__(self, hidden: int = 16, seq: int = 8):
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.filter = nn.Parameter(torch.randn(seq, hidden) / seq)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, x):
        s = x.shape[1]
        h = self.up(x)
        spectrum = torch.fft.rfft(h, n=2 * s, dim=1) * torch.fft.rfft(self.filter, n=2 * s, dim=0)
        return self.down(torch.fft.irfft(spectrum, n=2 * s, dim=1)[:, :s] + h)


class RelativePositionTable(nn.Module):
    """Transformer-XL's relative positions: a sinusoid table of the 2s-1 offsets (batch 1) projected by
    a weight, scored against the queries of each head."""

    def __init__(self, hidden: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.positions = nn.Linear(hidden, hidden, bias=False)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        hd = h // self.heads
        q, k, v = (t.view(b, s, self.heads, hd).transpose(1, 2) for t in self.qkv(x).split(h, -1))
        offsets = torch.arange(-(s - 1), s, device=x.device, dtype=x.dtype)[None, :, None]
        freqs = torch.exp(torch.arange(0, h, 2, device=x.device, dtype=x.dtype) * (-math.log(1e4) / h))
        table = torch.cat([torch.sin(offsets * freqs), torch.cos(offsets * freqs)], -1)  # [1, 2s - 1, h]
        r = self.positions(table).view(2 * s - 1, self.heads, hd).transpose(0, 1)
        scores = q @ k.transpose(-1, -2) + torch.einsum("bnqd,nrd->bnqr", q, r)[..., :s]
        y = torch.softmax(scores / math.sqrt(hd), -1) @ v
        return self.out(y.transpose(1, 2).reshape(b, s, h))


RULES = {"mamba-projections": MambaProjections, "fourier-long-conv": FourierLongConv,
         "relative-position-table": RelativePositionTable}
FAST_RULES = (("fourier-long-conv", "1d"), ("relative-position-table", "2.5d"))


@pytest.mark.parametrize("name, q, d, mode", [
    pytest.param(name, q, d, mode, id=f"{name}-{mesh_id}", marks=() if (name, mode) in FAST_RULES else pytest.mark.slow)
    for name in RULES for q, d, mode, mesh_id in MESHES])
def test_a_rule_of_the_mixers_is_exact_and_sharded(name, q, d, mode):
    torch.manual_seed(0)
    # a batch of 16: a long convolution's filter, FFT'd on every block of rows, stays small beside them
    # (torch's depthwise conv is slow in float64 on CPU: the conv runs on 4 rows)
    x = torch.randn(4 if name == "mamba-projections" else 16, 8, 16)
    report = tess_compile.check(RULES[name](), q, d, example_inputs=x, mode=mode, strict=True, progress=False)
    assert report.ok and report.tolerance == 1e-12, report.table()
    assert report.redundant_work <= 1.05, report.table()
