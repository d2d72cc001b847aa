"""Patterns sharded exactly instead of run replicated: a speech front-end (conv1d with
group_norm, a positional conv with weight_norm), group_norm whose groups spread over
ranks, views that only insert size-1 dims of values split by repeat_interleave, a
selective-scan block that stacks its steps, roll, gather and scatter, argmax over a
split dim, upsampling, a masked_scatter of image features, and multi-query attention
cut from one fused projection. Each in float64
simulation at [2,2,2] and 1-D p=4, with every op sharded (strict=True) and the
output and every parameter gradient equal to the unsharded model's."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_rel, seeded, simulate_exact
from torch import nn

import tess_compile
from tess_compile.analysis.accounting import redundant_work, unsharded_forward_flops
from tess_compile.core.layout import Shard

MESHES = [(2, 2, "2.5d"), (2, 1, "1d")]
MESH_IDS = ["2.5d-q2d2", "1d-p4"]
aten = torch.ops.aten


def _per_rank_calls(sim, op) -> list:
    return [n for n in sim.program.runnable.graph.nodes if n.target is op]


# 1. A speech front-end: conv1d + group_norm over channels, a positional conv with weight_norm.


class SpeechFrontEnd(nn.Module):
    """wav2vec2's feature encoder in small: Conv1d(bias=False) + GroupNorm(C, C) + GELU, a
    strided conv, a feature projection, and a grouped positional conv whose weight is
    `weight_norm`ed over its kernel dim (dim=2), as wav2vec2's."""

    def __init__(self, channels: int = 8, hidden: int = 8):
        super().__init__()
        self.conv0 = nn.Conv1d(1, channels, 4, stride=2, bias=False)
        self.norm0 = nn.GroupNorm(channels, channels)
        self.conv1 = nn.Conv1d(channels, channels, 3, stride=2, bias=False)
        self.project = nn.Linear(channels, hidden)
        positional = nn.Conv1d(hidden, hidden, 4, padding=2, groups=4)
        self.positional = nn.utils.parametrizations.weight_norm(positional, name="weight", dim=2)

    def forward(self, wav):
        x = F.gelu(self.norm0(self.conv0(wav[:, None])))
        x = self.project(F.gelu(self.conv1(x)).transpose(1, 2))
        position = self.positional(x.transpose(1, 2))[:, :, :-1]
        return x + F.gelu(position).transpose(1, 2)


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_speech_front_end_is_sharded_exactly(q, d, mode):
    torch.manual_seed(0)
    sim, redundant = simulate_exact(SpeechFrontEnd, (torch.randn(4, 34, dtype=torch.float64),), q, d, mode)
    assert redundant <= 1.05
    layouts = {slot.name: str(slot.layout) for slot in sim.program.slots}
    assert layouts["norm0.weight"] == "RRS(0)", "group_norm's affine split like the channels"
    assert layouts["positional.parametrizations.weight.original1"] == "RRS(0)", "v split as the grouped conv's weight"
    parts = sim.program.mesh.size("col")
    [norm] = _per_rank_calls(sim, aten.group_norm.default)
    assert norm.args[1] == 8 // parts, "each rank normalises its own groups"


class WeightNormed(nn.Module):
    """weight_norm, old and new, on linears (per out feature, and over the whole weight) and
    on convs (per out channel, and per kernel position with groups)."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        old, new = nn.utils.weight_norm, nn.utils.parametrizations.weight_norm
        self.fc1 = new(nn.Linear(hidden, 2 * hidden))
        self.fc2 = old(nn.Linear(2 * hidden, hidden), dim=None)
        self.conv1 = new(nn.Conv1d(hidden, hidden, 3, padding=1))
        self.conv2 = old(nn.Conv1d(hidden, hidden, 3, padding=1, groups=4), dim=2)

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        z = self.conv2(F.gelu(self.conv1(y.transpose(1, 2))))
        return y + z.transpose(1, 2)


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_weight_norm_shards_with_its_weight(q, d, mode):
    torch.manual_seed(0)
    sim, redundant = simulate_exact(WeightNormed, (torch.randn(4, 6, 8, dtype=torch.float64),), q, d, mode)
    assert redundant <= 1.05
    layouts = {slot.name: slot.layout for slot in sim.program.slots}
    for name in ("fc1.parametrizations.weight.original1", "fc2.weight_v", "conv1.parametrizations.weight.original1",
                 "conv2.weight_v"):
        assert layouts[name].axes_where(Shard, sim.program.mesh), f"{name} is split as its weight"


class SpreadGroups(nn.Module):
    """GroupNorm with fewer groups than col's ranks (1 and 2 groups of 8 channels), on a
    row-parallel conv's partial output and on a 4-d map."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.one = nn.GroupNorm(1, 8)
        self.out = nn.Conv1d(8, 4, 1)
        self.two = nn.GroupNorm(2, 4)

    def forward(self, x):
        y = self.out(F.gelu(self.one(self.conv(x))))
        return self.two(y[:, :, None, :] * 3)


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_group_norm_with_groups_spread_over_ranks(q, d, mode):
    torch.manual_seed(0)
    sim, _ = simulate_exact(SpreadGroups, (torch.randn(4, 4, 6, dtype=torch.float64),), q, d, mode)
    local = [n.args[1] for n in _per_rank_calls(sim, aten.group_norm.default)]
    # 1 group: merged across col's ranks; 2 groups: a group a rank on 2 ranks, merged on 4
    assert local == ([1] if sim.program.mesh.size("col") == 2 else []), local


# 2. Views that only insert or remove size-1 dims, of values split by repeat_interleave.


class HeadLogits(nn.Module):
    """Per-head logits repeat_interleaved to the query heads and unsqueezed before a softmax
    over them; a per-kv-head sink parameter repeat_interleaved and viewed as [1, n, 1, 1];
    a value repeated in groups (`repeat`) and unsqueezed."""

    def __init__(self, hidden: int = 8, kv_heads: int = 4, repeats: int = 2):
        super().__init__()
        self.logits = nn.Linear(hidden, kv_heads)
        self.pre = nn.Linear(hidden, hidden)
        self.sinks = nn.Parameter(torch.randn(kv_heads))
        self.mix = nn.Linear(2 * hidden, hidden)
        self.repeats = repeats

    def forward(self, x):
        b, s, _ = x.shape
        heads = self.logits(x).repeat_interleave(self.repeats, dim=-1)  # [b, s, n * r]
        weights = torch.softmax(heads.unsqueeze(2), dim=-1).squeeze(2)
        sinks = self.sinks.repeat_interleave(self.repeats).view(1, 1, -1)
        grouped = self.pre(x).repeat(1, 1, 2).unsqueeze(-2)  # [b, s, 1, 2h], split in 2 groups
        return self.mix((grouped * 2).squeeze(-2)) + (weights * sinks).sum(-1, keepdim=True)


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_unit_dim_views_keep_splits_and_groups(q, d, mode):
    torch.manual_seed(0)
    sim, redundant = simulate_exact(HeadLogits, (torch.randn(4, 6, 8, dtype=torch.float64),), q, d, mode)
    assert redundant <= 1.05
    unsqueezed = [n for n in _per_rank_calls(sim, aten.unsqueeze.default) if len(n.meta["global_shape"]) == 4]
    layouts = {str(n.meta["layout"].col) for n in unsqueezed}
    assert "S(3)" in layouts and "S(3,g=2)" in layouts, layouts


# 3. A selective-scan block that stacks its steps; indexing ops; masked_scatter.


class SelectiveScan(nn.Module):
    """A state-space block: per time step t, x[:, t] updates a state with elementwise ops and
    products, the steps' outputs are stacked."""

    def __init__(self, hidden: int = 8, inner: int = 16, state: int = 4):
        super().__init__()
        self.in_proj = nn.Linear(hidden, 2 * inner)
        self.x_proj = nn.Linear(inner, 2 * state + inner, bias=False)
        self.A_log = nn.Parameter(torch.randn(inner, state))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, hidden)
        self.state, self.inner = state, inner

    def forward(self, x):
        b, s, _ = x.shape
        u, z = self.in_proj(x).chunk(2, dim=-1)
        u = F.silu(u)
        delta, B, C = torch.split(self.x_proj(u), [self.inner, self.state, self.state], dim=-1)
        delta, A = F.softplus(delta), -torch.exp(self.A_log)
        h = u.new_zeros(b, self.inner, self.state)
        ys = []
        for t in range(s):
            step = delta[:, t].unsqueeze(-1)
            h = torch.exp(step * A) * h + (step * u[:, t].unsqueeze(-1)) @ B[:, t].unsqueeze(1)
            ys.append((h @ C[:, t].unsqueeze(-1)).squeeze(-1))
        y = torch.stack(ys, dim=1)
        return self.out_proj((y + u * self.D) * F.silu(z))


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_selective_scan_stacks_its_steps_sharded(q, d, mode):
    torch.manual_seed(0)
    sim, redundant = simulate_exact(SelectiveScan, (torch.randn(4, 5, 8, dtype=torch.float64),), q, d, mode)
    assert redundant <= 1.05
    [stack] = _per_rank_calls(sim, aten.stack.default)
    assert stack.meta["layout"].axes_where(Shard, sim.program.mesh), "the steps stay split"


class Indexing(nn.Module):
    """roll along whole dims; gather, scatter, scatter_add and an in-place scatter_ along the
    sequence with an index laid out like the values; argmax over the col-split features
    (with ties) and argmin over the sequence; bilinear and nearest upsampling of a conv's map."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x, index):
        h = self.lin(x)
        rolled = h.roll(1, dims=1) + h.roll((-2, 1), dims=(1, 0))
        picked = h.gather(1, index)
        scattered = h.scatter_add(1, index, picked * 2) + h.scatter(1, index, picked) + h.clone().scatter_(1, index, 3.0)
        best = torch.floor(h * 2).argmax(-1)
        worst = h.argmin(1, keepdim=True)
        image = self.conv(h.reshape(h.shape[0], 4, 4, 4))
        up = F.interpolate(image, scale_factor=2, mode="bilinear") + F.interpolate(image, size=(8, 8), mode="nearest")
        return rolled + scattered + h.gather(1, worst), up, best, worst


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_roll_gather_scatter_argmax_upsample_are_sharded(q, d, mode):
    torch.manual_seed(0)
    inputs = (torch.randn(4, 8, 8, dtype=torch.float64), torch.randint(0, 8, (4, 3, 8)))
    sim, redundant = simulate_exact(Indexing, inputs, q, d, mode)
    assert redundant <= 1.05
    [argmax] = _per_rank_calls(sim, aten.argmax.default)
    assert argmax.args[1:] == (2, True), "a local argmax over the split features, merged by the lowering"


class SplitArgmax(nn.Module):
    """argmax and argmin over the features split over col, of values with ties and NaNs."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, x, holes):
        h = torch.floor(self.lin(x)).masked_fill(holes, float("nan"))
        return h.argmax(-1), h.argmin(-1), self.lin(x)


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_argmax_over_a_split_dim_picks_torch_s_index(q, d, mode):
    torch.manual_seed(0)
    holes = torch.zeros(4, 6, 8, dtype=torch.bool)
    holes[0, 0, 5] = holes[1, 2, 3] = holes[1, 2, 6] = True
    simulate_exact(SplitArgmax, (torch.randn(4, 6, 8, dtype=torch.float64), holes), q, d, mode)


class ImageTokens(nn.Module):
    """A vision-language merge: image features scattered into the token embeddings at the
    image tokens (`masked_scatter` with the mask expanded over the hidden size)."""

    def __init__(self, vocab: int = 16, hidden: int = 8, patch: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.vision = nn.Linear(patch, hidden)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, ids, patches):
        embeddings = self.embed(ids)
        mask = (ids == 3).unsqueeze(-1).expand_as(embeddings)
        return self.head(embeddings.masked_scatter(mask, self.vision(patches)))


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_masked_scatter_keeps_batch_and_hidden_splits(q, d, mode):
    torch.manual_seed(0)
    ids = torch.randint(4, 16, (4, 6))
    ids[0, 1] = ids[1, 4] = ids[1, 5] = ids[3, 0] = 3  # ranks of the batch split mask 1, 2, 0 and 1 tokens
    sim, _ = simulate_exact(ImageTokens, (ids, torch.randn(8, 6, dtype=torch.float64)), q, d, mode)
    [merge] = _per_rank_calls(sim, aten.masked_scatter.default)
    if mode == "2.5d":  # in 1-D the embeddings come whole, as Megatron's
        assert str(merge.meta["layout"]) == "S(0)S(0)S(2)", "batch and hidden splits kept"


def test_masked_scatter_says_when_it_runs_replicated():
    """A mask that varies along the hidden size: only dim 0 keeps its split (the hidden size
    is gathered over col, with a warning)."""

    class Varying(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, source):
            h = self.lin(x)
            return h.masked_scatter(h > 0, source)

    torch.manual_seed(0)
    model = Varying().double()
    oracle = copy.deepcopy(model)
    inputs = (torch.randn(4, 6, 8, dtype=torch.float64), torch.randn(4 * 6 * 8, dtype=torch.float64))
    with pytest.warns(UserWarning, match=r"masked_scatter.* runs replicated over col:"):
        sim = tess_compile.simulate(model, 2, 2, example_inputs=inputs)
    assert_close_rel(sim(*inputs), oracle(*inputs), 1e-12, "output")


# Products of tables that are no batch: a relative-position table projected by attention's weights.


class RelativeAttention(nn.Module):
    """Attention with DeBERTa-style content-to-position scores: the relative-position table
    `[1, 2 * span, hidden]` (a parameter, leading dim 1) goes through the attention's own key
    projection, then each query picks its relative distances (`gather`)."""

    def __init__(self, hidden: int = 16, heads: int = 4, span: int = 8):
        super().__init__()
        self.heads, self.span = heads, span
        # no key bias: softmax cancels it, so its gradient is rounding noise around zero
        self.qkv = nn.ModuleList(nn.Linear(hidden, hidden, bias=index != 1) for index in range(3))
        self.out = nn.Linear(hidden, hidden)
        self.table = nn.Parameter(torch.randn(2 * span, hidden))
        distance = torch.arange(span)[:, None] - torch.arange(span)[None, :] + span
        self.register_buffer("distance", distance, persistent=False)

    def _heads(self, t):
        return t.view(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)

    def forward(self, x):
        q, k, v = (self._heads(proj(x)) for proj in self.qkv)
        position = self._heads(self.qkv[1](self.table.unsqueeze(0)))  # [1, heads, 2 * span, head_dim]
        by_distance = q @ position.transpose(-1, -2)  # [batch, heads, span, 2 * span]
        index = self.distance.expand(x.shape[0], self.heads, self.span, self.span)
        scores = (q @ k.transpose(-1, -2) + torch.gather(by_distance, -1, index)) / q.shape[-1] ** 0.5
        out = torch.softmax(scores, -1) @ v
        return self.out(out.transpose(1, 2).reshape(x.shape))


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_position_table_is_no_batch(q, d, mode):
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    _, work = simulate_exact(RelativeAttention, (x,), q, d, mode)
    assert work <= 1.05  # the table's positions are split (2.5-D: over depth and row), not repeated


@pytest.mark.parametrize("summa", ["auto", "gather", "overlap"])
def test_table_too_small_to_split_by_rows_splits_its_out_features(summa):
    """A table whose rows no axis divides (2 positions, depth x row = 4) splits the weight's out
    features instead, by whole heads (4 of them: over depth and row), and runs as one local product
    in every schedule; before, every rank computed it whole."""
    x = torch.randn(4, 1, 16, dtype=torch.float64)
    model = seeded(lambda: RelativeAttention(span=1))
    oracle = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim = tess_compile.simulate(model, 2, 2, example_inputs=(x,), summa=summa)
    assert not [w for w in caught if "computes it whole" in str(w.message)], [str(w.message) for w in caught]
    assert_close_rel(sim(x), oracle(x), 1e-12, "output")


class FusedMultiQuery(nn.Module):
    """Falcon's attention in small: one fused projection to `heads` query heads and one key/value
    head, viewed as `heads + 2` heads (which 4 ranks do not divide) and cut apart."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, (heads + 2) * self.head_dim, bias=False)
        self.dense = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x):
        b, s, _ = x.shape
        fused = self.qkv(x).view(b, s, self.heads + 2, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # one key/value head for all
        x = x + self.dense(attention.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(x)


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_fused_multi_query_attention_splits_its_heads(q, d, mode):
    """1-D: the fused output is gathered for the view; the attention then splits its query heads
    (a free slice of the whole value) instead of running every head on every rank."""
    x = torch.randn(8, 8, 32, dtype=torch.float64)
    _, work = simulate_exact(FusedMultiQuery, (x,), q, d, mode, gathers=True)
    assert work <= 1.05


# An HF wav2vec2 model: its feature encoder and positional conv embedding.


@pytest.mark.slow
@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_wav2vec2_runs_sharded(q, d, mode):
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32, conv_dim=(8, 8),
        conv_kernel=(4, 3), conv_stride=(2, 2), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=4,
        feat_extract_norm="group", hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, layerdrop=0.0, apply_spec_augment=False,
    )
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(config).double()
    oracle = copy.deepcopy(model)
    wav = torch.randn(4, 40, dtype=torch.float64)
    sim = tess_compile.simulate(model, q, d, example_inputs=(wav,), mode=mode, strict=True)
    assert redundant_work(sim.program, unsharded_forward_flops(oracle, (wav,))) <= 1.05
    out, expected = sim(wav).last_hidden_state, oracle(wav).last_hidden_state
    assert_close_rel(out, expected, 1e-12, "output")
    target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (out * target).sum().backward()
    (expected * target).sum().backward()
    grads = sim.full_grads()  # the key bias's gradient is zero (softmax's shift): measure on the model's scale
    scale = max(param.grad.abs().max().item() for param in oracle.parameters() if param.grad is not None)
    for name, param in oracle.named_parameters():
        if param.grad is not None:
            assert (grads[name] - param.grad).abs().max().item() <= 1e-12 * scale, name
