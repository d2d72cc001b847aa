"""Writes through views, the patterns that once went silently wrong: a sequence-to-sequence
model fed `labels` (shifted right into its decoder's inputs by writes into slices, as T5
and BART do), latent attention whose keys are assembled by writes into the two parts of a
new tensor (DeepSeek's decoupled rotary part), and time-shift mixing with a recurrence
written step by step into a tensor (RWKV). Capture once dropped those writes as dead code
(`passes/view_mutations.py` makes them functional now). Each model in float64 simulation
at [2,2,2] and 1-D p=4, every op sharded (strict), its outputs and every gradient equal to
the unsharded model's to 1e-12; and the unit cases of the rewrite itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import simulate_exact
from torch import nn

from tess_compile.passes.capture import capture

MESHES = [(2, 2, "2.5d"), (2, 1, "1d")]
MESH_IDS = ["2.5d-q2d2", "1d-p4"]
aten = torch.ops.aten


class Seq2SeqWithLabels(nn.Module):
    """An encoder-decoder fed `labels` only: the decoder reads them shifted right, written into a new
    tensor through slices (`shifted[:, 1:] = labels[:, :-1]`, `shifted[:, 0] = start`, -100 made padding)."""

    def __init__(self, vocab: int = 12, hidden: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder = nn.Linear(hidden, hidden)
        self.query, self.key_value = nn.Linear(hidden, hidden), nn.Linear(hidden, 2 * hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, labels):
        memory = torch.tanh(self.encoder(self.embed(input_ids)))
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = 1
        shifted.masked_fill_(shifted == -100, 0)
        x = self.embed(shifted)
        b, s, h = x.shape
        q = self.query(x).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = self.key_value(memory).view(b, s, 2, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        logits = self.head(attended + x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), logits


def _seq2seq_inputs():
    gen = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, 12, (4, 6), generator=gen), torch.randint(0, 12, (4, 6), generator=gen)
    labels[1, -2:] = -100
    return ids, labels


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_seq2seq_fed_labels(q, d, mode):
    simulate_exact(Seq2SeqWithLabels, _seq2seq_inputs(), q, d, mode)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of interleaved pairs (x[..., 2i], x[..., 2i + 1])."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs.unbind(-1)
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)


class LatentAttention(nn.Module):
    """Multi-head latent attention with a decoupled rotary part, as DeepSeek-V2's: keys and values from a
    low-rank latent, one rotary key part shared by every head, the keys written into a new tensor in two
    parts (`key[..., :nope].copy_(k_nope)`, `key[..., nope:].copy_(k_rot)`), queries concatenated."""

    def __init__(self, hidden: int = 16, heads: int = 4, rank: int = 8, nope: int = 4, rope: int = 4, value: int = 4,
                 seq: int = 6):
        super().__init__()
        self.heads, self.rank, self.nope, self.rope, self.value = heads, rank, nope, rope, value
        self.query = nn.Linear(hidden, heads * (nope + rope))
        self.latent = nn.Linear(hidden, rank + rope, bias=False)
        self.norm = nn.LayerNorm(rank)
        self.key_value = nn.Linear(rank, heads * (nope + value), bias=False)
        self.out = nn.Linear(heads * value, hidden)
        angles = torch.arange(seq)[:, None] * (10.0 ** -torch.arange(rope // 2))[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.query(x).view(b, s, self.heads, -1).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)
        latent, k_rot = torch.split(self.latent(x), [self.rank, self.rope], dim=-1)
        q_rot = _rotated(q_rot, self.cos, self.sin)
        k_rot = _rotated(k_rot.view(b, 1, s, self.rope), self.cos, self.sin)
        kv = self.key_value(self.norm(latent)).view(b, s, self.heads, -1).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.nope, self.value], dim=-1)
        key = kv.new_empty(b, self.heads, s, self.nope + self.rope)
        key[..., : self.nope].copy_(k_nope)
        key[..., self.nope :].copy_(k_rot.expand(-1, self.heads, -1, -1))
        query = torch.cat([q_nope, q_rot], dim=-1)
        attended = F.scaled_dot_product_attention(query, key, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_latent_attention_with_a_decoupled_rotary_part(q, d, mode):
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    simulate_exact(LatentAttention, (x,), q, d, mode)


class TimeShiftMix(nn.Module):
    """RWKV's token mixing: the hidden states shifted one step in time (`ZeroPad2d((0, 0, 1, -1))`), mixed
    with the unshifted ones, and a decaying recurrence written step by step into a tensor (`out[:, t] = ...`)."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.mix_key, self.mix_gate = nn.Parameter(torch.rand(1, 1, hidden)), nn.Parameter(torch.rand(1, 1, hidden))
        self.decay = nn.Parameter(torch.randn(hidden))
        self.key, self.value, self.gate = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        shifted = self.shift(x)
        key = self.key(x * self.mix_key + shifted * (1 - self.mix_key))
        gate = torch.sigmoid(self.gate(x * self.mix_gate + shifted * (1 - self.mix_gate)))
        value = self.value(x)
        out = torch.zeros_like(key)
        state = torch.zeros_like(key[:, 0])
        for t in range(x.shape[1]):
            state = state * torch.exp(-torch.exp(self.decay)) + torch.exp(key[:, t]) * value[:, t]
            out[:, t] = state
        return self.out(gate * out)


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_time_shift_mixing(q, d, mode):
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    simulate_exact(TimeShiftMix, (x,), q, d, mode)


# The rewrite on its own: which writes it makes functional and what it leaves.


class _Writes(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x)


def _targets(body, x) -> list:
    gm = capture(_Writes(body), (x,))
    return [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]


def test_a_write_through_a_view_becomes_a_scatter():
    def body(x):
        y = x.new_zeros(x.shape)
        y[:, 1:] = x[:, :-1]
        y.select(1, 0).fill_(2.0)
        return y * 3

    targets = _targets(body, torch.randn(2, 4))
    assert "aten.slice_scatter.default" in targets and "aten.select_scatter.default" in targets
    assert not [t for t in targets if t.split(".")[1].endswith("_")]


def test_a_write_into_a_whole_tensor_read_only_through_its_result_stays_in_place():
    def body(x):
        y = x * 2
        return y.add_(1).relu_()

    assert _targets(body, torch.randn(2, 4)) == ["aten.mul.Tensor", "aten.add_.Tensor", "aten.relu_.default"]


def test_an_alias_read_after_a_write_into_its_base_sees_the_write():
    def body(x):
        y = x * 2
        top = y[:1]
        y.mul_(3)
        return top + 0

    x = torch.randn(2, 4)
    gm = capture(_Writes(body), (x,))
    assert torch.equal(gm(x)[0], body(x.clone()))


def test_a_dead_write_into_a_view_of_a_temporary_is_dropped():
    def body(x):
        cache = x.new_zeros(4, 4)
        cache[:2] = x[:, :4]
        return x + 1

    assert _targets(body, torch.randn(2, 4)) == ["aten.add.Tensor"]


def test_a_write_through_a_view_without_an_inverse_is_a_value_error():
    def body(x):
        y = x * 2
        y.unfold(1, 2, 2).mul_(3)
        return y

    with pytest.raises(ValueError, match=r"aten.mul_.Tensor at .*test_view_writes.py:\d+ writes through a view made "
                                         r"by aten.unfold.default .*compute the new value out of place"):
        capture(_Writes(body), (torch.randn(2, 4),))
