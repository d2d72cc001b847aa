"""Tokens as rows: a batch too small for the mesh splits each sequence's tokens over the axes the batch
leaves (`tess_compile.core.row_split`), attention runs each rank's queries over every key (context
parallelism, `tess_compile.ops.context_attention`), and mode 1d runs Megatron-LM's sequence parallelism.
The oracle is the unsharded model in float64: outputs and every gradient."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_matches_model, simulate_exact
from models import GPTStack, LlamaBlock, TinyGPT
from torch import nn

import tess_compile
from tess_compile.analysis.accounting import (
    bytes_from_records,
    forward_flops,
    predict_bytes,
    redundant_work,
    saved_bytes,
    unsharded_forward_flops,
)
from tess_compile.core.layout import Layout, Shard
from tess_compile.core.mesh import Mesh
from tess_compile.core.row_split import RowSplit, resolve_row_split
from tess_compile.ops import collectives as c
from tess_compile.ops.context_attention import context_attention
from tess_compile.ops.ring_attention import ring_attention

HIDDEN, HEADS, SEQ = 32, 8, 16


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return GPTStack(HIDDEN, HEADS, 2).double()


def _token_splits(sim) -> list[str]:
    """The axes along which the program slices its input's tokens (dim 1) to this rank's block."""
    x = next(n for n in sim.program.graph.graph.nodes if n.op == "placeholder" and n.target == "x")
    axes, node = [], x
    while True:
        slices = [u for u in node.users if u.target is c.shard_slice]
        if not slices:
            return axes
        node = slices[0]
        if node.args[3] == 1:
            axes.append(node.args[1])


def _input(batch: int = 1, seq: int = SEQ) -> torch.Tensor:
    return torch.randn(batch, seq, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("q", "d", "mode", "tokens"), [(2, 2, "2.5d", "depth_row"), (2, 2, "1d", "col")],
                         ids=["q2d2", "1d-p8"])
def test_a_batch_of_one_spreads_its_tokens_over_every_rank(q, d, mode, tokens):
    """At a batch of one the tokens split over every rank that splits rows: exact, no work repeated,
    and autograd saves no more over all ranks than the unsharded model (the issue's goal: 1.1x)."""
    model, x = _stack(), _input()
    sim = tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs=(x,), mode=mode)
    assert _token_splits(sim) == (["col"] if mode == "1d" else ["depth", "row"])
    assert any(n.target is context_attention for n in sim.program.graph.graph.nodes) == (mode != "1d")
    assert_matches_model(sim, model, x, rtol=1e-12)
    unsharded = saved_bytes(lambda: model(x.clone().requires_grad_()), list(model.parameters()))
    sharded = saved_bytes(lambda: sim(x.clone().requires_grad_()), list(sim.parameters()))
    assert sharded <= 1.1 * unsharded, (sharded, unsharded)
    _, work = simulate_exact(_stack, (x,), q, d, mode)
    assert work <= 1.05


def test_an_embedding_enters_the_sequence_parallel_residual_stream():
    """1-D at a batch of one: the vocab-split embedding's partial sums are reduce-scattered to the token
    blocks before the first norm (not all-reduced), so the first block's norms and residual adds run on
    token blocks too, and autograd saves no more over all ranks than the unsharded model (it saved
    1.84x when a norm resolved partial sums by all-reduce)."""
    torch.manual_seed(0)
    model, ids = TinyGPT(64, HIDDEN, HEADS, 2, SEQ).double(), torch.randint(0, 64, (1, SEQ))
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(ids,), mode="1d")
    assert_matches_model(sim, model, ids, rtol=1e-12)
    assert ("all_reduce", "col") not in predict_bytes(sim.program)["forward"]
    unsharded = saved_bytes(lambda: model(ids), list(model.parameters()))
    assert saved_bytes(lambda: sim(ids), list(sim.parameters())) <= 1.1 * unsharded


class _Llama(nn.Module):
    """A vocab-split embedding into Llama blocks (hand-written RMSNorm first): the residual stream
    starts as the TP ranks' partial sums, read by a norm and by the next residual add."""

    def __init__(self, vocab: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, HIDDEN)
        self.blocks = nn.ModuleList([LlamaBlock(HIDDEN, HEADS) for _ in range(layers)])

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x


def test_the_residual_stream_runs_on_token_blocks_in_1d():
    """1-D at a batch of one: a value that several ops read (the residual stream) is reduce-scattered to
    its token blocks once, so the residual adds run on each rank's tokens and each row-parallel product's
    sums are reduce-scattered as they come (Megatron-LM's sequence parallelism). Before, the residual
    stayed the whole pending sum through every block, each norm reduce-scattering its own copy."""
    torch.manual_seed(0)
    model, ids = _Llama().double(), torch.randint(0, 64, (1, SEQ))
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(ids,), mode="1d")
    assert_matches_model(sim, model, ids, rtol=1e-12)
    scattered = [n.args[0] for n in sim.program.graph.graph.nodes if n.target is c.reduce_scatter]
    assert len(scattered) == 1 + 2 * len(model.blocks)  # the embedding's, then two products a block
    assert not [x for x in scattered if x.target is torch.ops.aten.add.Tensor], scattered  # no residual sum


def test_1d_runs_megatron_sequence_parallelism():
    """Mode 1d at a batch of one: a block all-gathers its tokens before each column-parallel product and
    reduce-scatters after each row-parallel one (no all-reduce of activations), and each column-parallel
    product keeps its own tokens for backward and gathers them again there."""
    model, x = _stack(), _input()
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,), mode="1d")
    sim.comm.records.clear()
    sim(x.clone().requires_grad_()).sum().backward()
    forward = sim.comm.counts("forward")
    assert forward == {("all_gather", "col"): 4, ("reduce_scatter", "col"): 4}, forward
    backward = sim.comm.counts("backward")
    assert backward[("all_gather", "col")] == 4 + 4  # the reduce-scatters' adjoints, and the refetches
    assert backward[("reduce_scatter", "col")] == 4


def test_batch_over_depth_and_tokens_over_row():
    """A batch of 2 on [2,2,2]: over depth, and each sequence's tokens over row."""
    model, x = _stack(), _input(batch=2)
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,))
    assert _token_splits(sim) == ["row"]
    assert_matches_model(sim, model, x, rtol=1e-12)


class _Attention(nn.Module):
    """SDPA with a mask, grouped-query heads, or a learned additive bias (ALiBi-like) as its mask."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.kv = nn.Linear(HIDDEN, HIDDEN if kind != "gqa" else HIDDEN // 2)
        if kind == "bias":
            self.slopes = nn.Parameter(torch.rand(HEADS, 1, 1))

    def forward(self, x):
        b, s, h = x.shape
        q = self.q(x).view(b, s, HEADS, -1).transpose(1, 2)
        kv = self.kv(x).view(b, s, HEADS // 2 if self.kind == "gqa" else HEADS, -1).transpose(1, 2)
        if self.kind == "gqa":
            y = F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        elif self.kind == "mask":
            distance = torch.arange(s)[:, None] - torch.arange(s)[None, :]
            y = F.scaled_dot_product_attention(q, kv, kv, attn_mask=(distance >= 0) & (distance % 3 != 1))
        else:  # a learned bias by distance, causal
            distance = torch.arange(s)[None, :] - torch.arange(s)[:, None]
            bias = (self.slopes * distance).masked_fill(distance > 0, -math.inf)
            y = F.scaled_dot_product_attention(q, kv, kv, attn_mask=bias)
        return y.transpose(1, 2).reshape(b, s, h)


@pytest.mark.parametrize("kind", ["gqa", "mask", "bias"])
def test_context_attention_masks(kind):
    """Each rank's queries against every key: causal with grouped-query heads, a boolean mask built in
    the graph, a learned additive bias whose gradient flows; exact, attention not repeated."""
    sim, work = simulate_exact(lambda: _Attention(kind), (_input(),), 2, 2, "2.5d")
    assert any(n.target is context_attention for n in sim.program.graph.graph.nodes)
    assert work <= 1.0 + 1e-9


def test_explicit_attention_over_a_token_split():
    """Attention written out (a mask from `triu`, softmax, two products): the keys and values gathered
    for the rank's queries, exact."""
    _, work = simulate_exact(lambda: LlamaBlock(HIDDEN, HEADS), (_input(),), 2, 2, "2.5d")
    assert work <= 1.0 + 1e-9


def test_row_split_choices_and_errors():
    mesh, mesh_1d = Mesh(2, 2), Mesh(2, 2, "1d")
    assert resolve_row_split("auto", "auto", 8, 16, mesh) == RowSplit("depth_row", "none", 16)
    assert resolve_row_split("auto", "auto", 2, 16, mesh) == RowSplit("depth", "row", 16)
    assert resolve_row_split("auto", "auto", 1, 16, mesh) == RowSplit("none", "depth_row", 16)
    assert resolve_row_split("auto", "auto", 1, 1, mesh) == RowSplit("none", "none", 1)  # a decode step
    assert resolve_row_split("auto", "auto", 1, 16, mesh_1d) == RowSplit("none", "col", 16)
    assert resolve_row_split("auto", "auto", 1, None, mesh, dynamic=True) == RowSplit("none", "none", None)
    assert resolve_row_split("auto", "row", 4, 16, mesh) == RowSplit("depth", "row", 16)
    with pytest.raises(ValueError, match="both split over row .* split the tokens over the axes the batch leaves"):
        resolve_row_split("depth_row", "row", 8, 16, mesh)
    with pytest.raises(ValueError, match="token_split='col' does not fit mode '2.5d'"):
        resolve_row_split("auto", "col", 1, 16, mesh)
    with pytest.raises(ValueError, match="18 tokens, not divisible by 4; use a sequence length that is a multiple"):
        resolve_row_split("auto", "depth_row", 1, 18, mesh)
    with pytest.raises(ValueError, match="dynamic=True"):
        resolve_row_split("auto", "row", 1, None, mesh, dynamic=True)
    with pytest.raises(ValueError, match="token_split='rows' is not a token split"):
        tess_compile.simulate(_stack(), 2, 2, example_inputs=(_input(),), token_split="rows")


class _Carries(nn.Module):
    """cumsum, roll and token shifts (pad one end, cut the other) along the tokens, then a product."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        y = x.cumsum(1) + torch.roll(x, 2, 1) + torch.roll(x, -1, 1)
        y = y + F.pad(x, (0, 0, 1, -1)) + F.pad(x, (0, 0, -2, 2))
        return self.proj(y)


@pytest.mark.parametrize(("q", "d", "mode"), [(2, 2, "2.5d"), (2, 2, "1d")], ids=["q2d2", "1d-p8"])
def test_carries_and_shifts_keep_the_token_split(q, d, mode):
    """A prefix sum adds the totals of the blocks before a rank's; a shift takes its edge from the
    neighbouring block: exact, and the tokens are never gathered whole (only each block's total or
    edge moves)."""
    x = _input()
    sim, _ = simulate_exact(_Carries, (x,), q, d, mode)
    token_axes = ("col",) if mode == "1d" else ("depth", "row")
    sources = []  # what each gather along a token axis gathers
    for node in sim.program.graph.graph.nodes:
        if node.target is c.all_gather and node.args[1] in token_axes and node.args[0].target is not c.all_gather:
            source = node.args[0]
            sources.append("edge" if source.target is torch.ops.aten.narrow.default else source.name)
    # the edges of cumsum, two rolls and two shifts; in 2.5-D the product's weight (SUMMA, along row), in
    # 1-D the product's input (sequence parallelism)
    assert sorted(sources) == sorted(["add_4" if mode == "1d" else "p_proj_weight_synced"] + ["edge"] * 5), sources


class _CausalConvs(nn.Module):
    """Mamba's causal conv over the tokens (`conv(x)[..., :L]`, padded by k-1): a depthwise one, then a
    full one (its channels over col row-parallel in 2.5-D), on a gated input, then a product."""

    def __init__(self, kernel: int = 4):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(HIDDEN))
        self.depthwise = nn.Conv1d(HIDDEN, HIDDEN, kernel, groups=HIDDEN, padding=kernel - 1)
        self.full = nn.Conv1d(HIDDEN, HIDDEN, kernel, padding=kernel - 1)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        tokens = x.shape[1]
        h = (x * self.gain).transpose(1, 2)
        h = self.full(F.silu(self.depthwise(h)[..., :tokens]))[..., :tokens]
        return self.proj(h.transpose(1, 2))


def _conv_paddings_and_gathers(sim, token_axes) -> tuple[list, list[str]]:
    """The padding of each conv of the program, and what each all-gather along a token axis gathers."""
    nodes = list(sim.program.graph.graph.nodes)
    paddings = [n.args[4] for n in nodes if n.target is torch.ops.aten.conv1d.default]
    sources = ["edge" if n.args[0].target is torch.ops.aten.narrow.default else n.args[0].name for n in nodes
               if n.target is c.all_gather and n.args[1] in token_axes and n.args[0].target is not c.all_gather]
    return paddings, sources


@pytest.mark.parametrize(("q", "d", "mode"), [(2, 2, "2.5d"), (2, 1, "1d")], ids=["q2d2", "1d-p4"])
def test_a_causal_conv_keeps_the_token_split(q, d, mode):
    """A causal conv over split tokens convolves each rank's block with the k-1 tokens before it,
    which come as the previous block's edge: exact (forward and every gradient), no conv padded, and
    the tokens never gathered whole (only each block's edge moves)."""
    sim, work = simulate_exact(_CausalConvs, (_input(),), q, d, mode)
    paddings, sources = _conv_paddings_and_gathers(sim, ("col",) if mode == "1d" else ("depth", "row"))
    assert paddings == [[0], [0]]
    # the two convs' edges; in 2.5-D the product's weight (SUMMA, along row), in 1-D the product's input
    assert sorted(sources) == sorted(["transpose_1" if mode == "1d" else "p_proj_weight_synced"] + ["edge"] * 2)
    assert work <= 1.0 + 1e-9


def test_a_causal_conv_wider_than_a_block_is_exact():
    """A halo of k-1 = 3 tokens wider than a rank's block (8 tokens over 4 ranks) is cut from the
    tokens gathered whole: exact, and still no conv runs twice."""
    sim, work = simulate_exact(_CausalConvs, (_input(seq=8),), 2, 2, "2.5d")
    paddings, _ = _conv_paddings_and_gathers(sim, ("depth", "row"))
    assert paddings == [[0], [0]]
    assert work <= 1.0 + 1e-9


class _DilatedCausalConv(nn.Module):
    """A causal conv with dilation 2: no halo rule, its tokens whole."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(HIDDEN, HIDDEN, 3, groups=HIDDEN, padding=4, dilation=2)

    def forward(self, x):
        return self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)


def test_a_dilated_causal_conv_makes_the_tokens_whole():
    """Dilation 2 is no causal conv of the halo rule: the conv and its slice stay as captured and
    run on the tokens made whole, exact."""
    sim, _ = simulate_exact(_DilatedCausalConv, (_input(),), 2, 2, "2.5d", gathers=True, strict=False)
    paddings, _ = _conv_paddings_and_gathers(sim, ("depth", "row"))
    assert paddings == [[4]]


@pytest.mark.parametrize(("batch", "q", "d", "mode"), [
    (1, 2, 2, "2.5d"),
    pytest.param(2, 2, 2, "2.5d", marks=pytest.mark.slow),
    pytest.param(1, 4, 1, "2.5d", marks=pytest.mark.slow),
    pytest.param(2, 4, 1, "2.5d", marks=pytest.mark.slow),
    pytest.param(1, 2, 2, "1d", marks=pytest.mark.slow),
    pytest.param(2, 2, 2, "1d", marks=pytest.mark.slow),
], ids=["b1-q2d2", "b2-q2d2", "b1-q4d1", "b2-q4d1", "b1-1d-p8", "b2-1d-p8"])
def test_every_sequence_mixing_op_is_exact_across_the_split(batch, q, d, mode):
    """Positions (arange, position_ids, rotary), a causal conv, shifts, a prefix sum, a chunked scan with
    its carry, a windowed ALiBi attention and the shifted labels of the loss (tests/sequence_models.py),
    with the tokens split: the loss and every gradient exact."""
    from sequence_models import SequenceMixer

    tokens = 32
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (batch, tokens), generator=generator)
    inputs = (ids, torch.arange(tokens).repeat(batch, 1), ids)
    simulate_exact(lambda: SequenceMixer(tokens=tokens), inputs, q, d, mode, gathers=True, strict=False)


@pytest.mark.parametrize(("kind", "q", "d", "order"), [("gqa", 2, 2, "auto"), ("bias", 2, 2, "auto"),
                                                       ("bias", 2, 2, "striped"), ("mask", 4, 1, "auto")],
                         ids=["causal-gqa-q2d2", "learned-bias-q2d2", "learned-bias-striped-q2d2", "mask-q4d1"])
def test_ring_schedule_visits_one_key_block_at_a_time(kind, q, d, order):
    """context="ring": each rank's queries attend over one block of keys and values at a time, broadcast
    from its owner along the token axes and merged by log-sum-exp; exact, its bytes as predicted, and no
    all-gather of keys (only each block broadcast). In a striped order a block holds a run of each part
    of the sequence (a learned bias's columns picked and its gradient added at their positions)."""
    x = _input()
    torch.manual_seed(0)
    model = _Attention(kind).double()
    sim = tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs=(x,), context="ring", token_order=order)
    assert sim.program.rows.stripes == (4 if order == "striped" else 1)
    assert any(n.target is ring_attention for n in sim.program.graph.graph.nodes)
    assert_matches_model(sim, model, x, rtol=1e-12)
    sim.comm.records.clear()
    (sim(x) * 1.0).sum().backward()
    assert bytes_from_records(sim.comm.records) == predict_bytes(sim.program)
    gather = tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs=(x,), context="gather",
                                   token_order=order)
    (fetch,) = [n.args[7] for n in gather.program.graph.graph.nodes if n.target is context_attention]
    assert _token_gathers(gather) - _token_gathers(sim) == 2 * len(fetch)  # the keys' and values' all-gathers


def _token_gathers(sim) -> int:
    return sum(n.target is c.all_gather and n.args[1] != "col" for n in sim.program.graph.graph.nodes)


def _gloo_worker(rank, world_size, q, d, runs):
    """Each (mode, context) of `runs` on this rank of a gloo world: the largest error of the output and of
    this rank's gradient blocks against the unsharded model, relative to each tensor's largest entry."""
    from tess_compile.core.layout import local_block

    torch.set_num_threads(1)
    errors = {}
    for mode, context in runs:
        model, x = _stack(), _input()
        sharded = tess_compile.shard(copy.deepcopy(model), q, d, example_inputs=(x,), mode=mode, context=context,
                                     timeout=120)
        target = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(5))
        got, expected = sharded(x).full_tensor(), model(x)
        (got * target).sum().backward()
        (expected * target).sum().backward()
        worst = (got - expected).abs().max().item() / expected.abs().max().item()
        grads = dict(model.named_parameters())
        for slot in sharded.program.params:
            oracle = local_block(grads[slot.name].grad, slot.layout, sharded.mesh, rank)
            mine = dict(sharded.named_parameters())[slot.name].grad.to_local()
            worst = max(worst, (mine - oracle).abs().max().item() / oracle.abs().max().clamp_min(1e-300).item())
        errors[f"{mode} {context}"] = worst
    return errors


@pytest.mark.slow
def test_token_splits_over_gloo_processes():
    """8 gloo processes at a batch of one: [2,2,2] with both attention schedules (the ring's broadcasts
    left running while the block before is used) and 1-D sequence parallelism, exact."""
    from tess_compile.runtime.launch import run_local

    runs = [("2.5d", "gather"), ("2.5d", "ring"), ("1d", "gather")]
    for errors in run_local(_gloo_worker, 8, args=(2, 2, runs), timeout_s=600):
        assert max(errors.values()) < 1e-12, errors


def test_plan_rows_say_their_token_split():
    """plan prices a batch of one with its tokens split, and its row says so."""
    from tess_compile.analysis.planner import plan

    (row,) = plan(lambda: (_stack(), _input()), 8, modes=("2.5d",), dp=1, pp=1)
    assert row.fits and row.note.startswith("tokens over depth_row"), row.note
    assert row.redundant_work <= 1.05


def test_a_striped_order_evens_out_causal_attention():
    """Over a token split a causal model that returns its loss takes a striped token order
    (`RowSplit.stripes`): each rank holds a block of each of 8 parts of the sequence, its queries of part
    j attend parts 0 to j alone, so each rank computes 9/16 of its rows' scores. Exact, forward and every
    gradient."""
    x = _input(seq=64)
    model = _Loss(_stack())
    runs = {order: tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,), token_order=order)
            for order in ("contiguous", "auto")}
    striped = runs["auto"]
    assert striped.program.rows.stripes == 8 and runs["contiguous"].program.rows.stripes == 1
    assert str(striped.program.rows) == "batch over none, tokens over depth_row in 8 stripes"
    assert_matches_model(striped, model, x, rtol=1e-12)
    unsharded = unsharded_forward_flops(model, (x,))
    attention = 2 * 4 * HEADS * 64 * 64 * (HIDDEN // HEADS)  # two layers' scores and weighted values, unsharded
    work = {order: redundant_work(sim.program, unsharded) * unsharded for order, sim in runs.items()}
    assert work["contiguous"] - work["auto"] == pytest.approx(attention * 7 / 16, rel=1e-12)


@pytest.mark.slow
def test_stripes_over_the_ring_and_outputs_that_hold_tokens():
    """The ring schedule over stripes: exact, the same share of the scores as the gather schedule. A
    model whose output holds the tokens keeps one block a rank unless asked; asked, it gathers the
    output to leave in blocks."""
    x = _input(seq=64)
    model = _Loss(_stack())
    gathered = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,))
    ring = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,), context="ring")
    assert ring.program.rows.stripes == 8 and any(n.target is ring_attention for n in ring.program.graph.graph.nodes)
    assert_matches_model(ring, model, x, rtol=1e-12)
    assert forward_flops(ring.program) == forward_flops(gathered.program)
    states = _stack()  # its output [1, 64, h] holds the tokens: auto keeps blocks, striped gathers it to leave
    assert tess_compile.simulate(copy.deepcopy(states), 2, 2, example_inputs=(x,)).program.rows.stripes == 1
    asked = tess_compile.simulate(copy.deepcopy(states), 2, 2, example_inputs=(x,), token_order="striped")
    assert asked.program.rows.stripes == 8 and asked.program.output_layouts[0] == Layout(Shard(1), Shard(1), Shard(2))
    assert_matches_model(asked, states, x, rtol=1e-12)


class _Loss(nn.Module):
    """A model's output reduced to a scalar by a fixed random projection (a training step that returns its
    loss alone)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.register_buffer("target", torch.randn(HIDDEN, dtype=torch.float64,
                                                   generator=torch.Generator().manual_seed(2)))

    def forward(self, x):
        return (self.model(x) * self.target).sum()


def test_a_striped_order_is_not_taken_where_it_cannot_pay():
    """"auto" keeps one block a rank where an op reads neighbouring tokens of an activation (a prefix sum,
    a causal conv1d) or nothing is causal; "striped" then says why."""
    x = _input(seq=64)

    class Cumulative(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = GPTStack(HIDDEN, HEADS, 1)

        def forward(self, x):
            return self.block(x.cumsum(1)).sum()

    sim = tess_compile.simulate(Cumulative().double(), 2, 2, example_inputs=(x,))
    assert sim.program.rows.tokens == "depth_row" and sim.program.rows.stripes == 1
    with pytest.raises(ValueError, match=r"aten.cumsum.default at .* reads neighbouring tokens of an activation"):
        tess_compile.simulate(Cumulative().double(), 2, 2, example_inputs=(x,), token_order="striped")

    class Convolved(Cumulative):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(HIDDEN, HIDDEN, 4, groups=HIDDEN, padding=3)

        def forward(self, x):
            return self.block(self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)).sum()

    with pytest.raises(ValueError, match=r"aten.conv1d.default at .* reads neighbouring tokens of an activation"):
        tess_compile.simulate(Convolved().double(), 2, 2, example_inputs=(x,), token_order="striped")
    with pytest.raises(ValueError, match=r"token_order='striped' on mesh .*: the tokens do not split"):
        tess_compile.simulate(Cumulative().double(), 2, 2, example_inputs=(_input(batch=4, seq=64),),
                              token_order="striped")
