"""Dropout in train mode draws the unsharded model's masks (`tess_compile.ops.dropout`).

With the same seed set before the sharded call and before the unsharded one,
outputs and every parameter gradient equal the unsharded model's to 1e-12 in
float64, and the random generator ends in the same state (so the next step's
masks match too):

1. The draws themselves, bit for bit against torch's dropout, native_dropout
   and bernoulli_, non-contiguous inputs included.
2. A small model with dropout on replicated values (an embedding output plus
   an input before a norm, a parameter) and on split and transposed
   activations, at [2,2,2] and 1-D p=4, two steps.
3. native_dropout and random ops that run whole on every rank (rand,
   bernoulli, randn_like); `copy_` keeps its target's layout.
4. GPT-2 from a tiny config with embedding, residual and attention dropout
   0.1 (scaled_dot_product_attention with dropout_p), at [2,2,2] and 1-D p=4.
5. Eval mode and p = 0: the input passes through, nothing is drawn.
6. Slow: the same over 4 gloo processes (tess_compile.shard, run_local), and
   the refusal of simulate(compile=True), whose ranks share a generator.

HF's causal-LM loss upcasts the logits to float32, so gradients are taken of
a fixed projection of the float64 logits.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_rel
from torch import nn

import tess_compile
from tess_compile.core.layout import local_block
from tess_compile.core.mesh import Mesh
from tess_compile.ops.dropout import full_draw, lockstep_dropout, lockstep_native_dropout, sharded_dropout
from tess_compile.runtime.simulator import SimComm

P, HIDDEN, VOCAB, SEQ = 0.1, 8, 16, 3
MESHES = [(2, 2, "2.5d"), (1, 4, "1d")]
MESH_IDS = ["q2d2", "1d-p4"]


class DropoutNet(nn.Module):
    """Dropout on a replicated value (embedding output plus input, before a norm; whole in mode
    1d), on a parameter (whole), on a transposed (non-contiguous) activation and on split ones."""

    def __init__(self, p: float = P):
        super().__init__()
        self.embed, self.norm = nn.Embedding(VOCAB, HIDDEN), nn.LayerNorm(HIDDEN)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.inner, self.outer = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)
        self.drop_in, self.drop_gain, self.drop_t, self.drop = (nn.Dropout(p) for _ in range(4))

    def forward(self, ids, x):
        h = self.norm(self.drop_in(self.embed(ids) + x)) * self.drop_gain(self.gain)
        h = self.drop_t(h.transpose(1, 2)).transpose(1, 2)
        return self.outer(self.drop(torch.relu(self.inner(h))))


def _inputs(batch: int = 4):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    return ids, torch.randn(batch, SEQ, HIDDEN, generator=gen, dtype=torch.float64)


def _projection(like: torch.Tensor) -> torch.Tensor:
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(1234), dtype=like.dtype)


def _step(sim, model, inputs: dict, seed: int, logits=lambda out: out) -> None:
    """One forward and backward of both under `seed`: outputs, gradients and the generator's
    state afterwards equal."""
    torch.manual_seed(seed)
    got = logits(sim(**inputs))
    sharded_state = torch.get_rng_state()
    torch.manual_seed(seed)
    expected = logits(model(**inputs))
    assert torch.equal(sharded_state, torch.get_rng_state()), "the generator advanced differently"
    assert_close_rel(got, expected, 1e-12, f"output (seed {seed})")
    sim.zero_grad()
    model.zero_grad()
    weights = _projection(expected)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    grads = sim.full_grads()
    for name, param in model.named_parameters():
        assert_close_rel(grads[name], param.grad, 1e-12, f"grad {name} (seed {seed})")


def _draws(sim) -> list:
    """The split dims of each `sharded_dropout` of the per-rank graph."""
    return [node.args[5] for node in sim.program.graph.graph.nodes if node.target is sharded_dropout]


# ---------------------------------------------------------------------------
# 1. The draws, bit for bit
# ---------------------------------------------------------------------------


def _same_run(reference, ours, x: torch.Tensor, seed: int) -> None:
    """`ours(x)` gives `reference(x)`'s outputs and input gradient bit for bit from the same
    seed, and leaves the generator in the same state."""
    grads = []
    for run in (reference, ours):
        torch.manual_seed(seed)
        x_run = x.detach().clone().requires_grad_()
        outs = run(x_run)
        grads.append((torch.get_rng_state(), outs, torch.autograd.grad(outs[0], x_run, torch.ones_like(outs[0]))))
    (state, expected, grad), (state_ours, got, grad_ours) = grads
    assert torch.equal(state, state_ours), "the generator advanced differently"
    assert all(torch.equal(a, e) for a, e in zip(got, expected)) and torch.equal(grad_ours[0], grad[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_draws_are_torchs(dtype, transposed):
    """The lockstep versions on a one-rank mesh against torch's own ops."""
    x = torch.randn(6, 4, 5, dtype=torch.float64).to(dtype) * 3
    x = x.transpose(0, 2) if transposed else x
    comm, shape, stride = SimComm(Mesh(1, 1)), list(x.shape), list(torch.empty_like(x).stride())
    whole = ([-1, -1, -1], [1, 1, 1], shape)
    _same_run(lambda t: (F.dropout(t, P, True),),
              lambda t: lockstep_dropout(comm, [t], P, False, shape, stride, *whole), x, 0)
    _same_run(lambda t: torch.ops.aten.native_dropout(t, P, True),
              lambda t: lockstep_native_dropout(comm, [t], P, shape, stride, *whole)[0], x, 1)
    torch.manual_seed(2)
    bits = torch.empty_like(x).bernoulli_(0.7)
    torch.manual_seed(2)
    assert torch.equal(full_draw("bits", 0.7, x.shape, stride, dtype, "cpu"), bits)


# ---------------------------------------------------------------------------
# 2. A small model: replicated and split values, two steps
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=MESHES, ids=MESH_IDS)
def small(request):
    """(simulated model, unsharded model, keyword inputs) of `DropoutNet` in train mode."""
    q, d, mode = request.param
    torch.manual_seed(4)
    model = DropoutNet().double().train()
    ids, x = _inputs()
    inputs = {"ids": ids, "x": x}
    return tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs=inputs, mode=mode), model, inputs


def test_small_model_draws_the_unsharded_masks(small):
    sim, model, inputs = small
    draws = _draws(sim)
    assert len(draws) == 4
    assert any(dims == [-1, -1, -1] for dims in draws), "no dropout on a replicated value"
    assert any(dims != [-1, -1, -1] for dims in draws), "no dropout on a split value"
    for seed in (5, 6):  # two steps: the generator's sequence keeps matching
        _step(sim, model, inputs, seed)


def test_eval_mode_draws_nothing(small):
    sim, model, inputs = small
    sim.eval()
    model.eval()
    try:
        state = torch.get_rng_state()
        assert_close_rel(sim(**inputs), model(**inputs), 1e-12, "eval output")
        assert torch.equal(torch.get_rng_state(), state), "eval mode drew random numbers"
    finally:
        sim.train()
        model.train()


def test_p0_passes_the_input_through():
    torch.manual_seed(4)
    model = DropoutNet(p=0.0).double().train()
    ids, x = _inputs()
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(ids, x))
    assert not _draws(sim)
    assert not any("dropout" in str(node.target) for node in sim.program.graph.graph.nodes)
    state = torch.get_rng_state()
    assert_close_rel(sim(ids, x), model(ids, x), 1e-12, "output with p=0")
    assert torch.equal(torch.get_rng_state(), state), "p=0 drew random numbers"


# ---------------------------------------------------------------------------
# 3. native_dropout, random ops that run whole, copy_
# ---------------------------------------------------------------------------


class RandomOps(nn.Module):
    """native_dropout on a split activation, random ops whose output is whole on every rank,
    and an in-place copy_ into a split activation."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.inner(x)
        dropped, mask = torch.ops.aten.native_dropout(h, P, True)
        noise = torch.rand(h.shape, dtype=h.dtype, device=h.device)
        keep = torch.bernoulli(torch.sigmoid(h))
        h = dropped * noise + keep * mask + 0.1 * torch.randn_like(h)
        copied = h.clone()
        copied.copy_(h * 2 + 1)
        return self.outer(copied)


def test_native_dropout_random_ops_and_copy():
    torch.manual_seed(8)
    model = RandomOps().double().train()
    _, x = _inputs(8)
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs={"x": x})
    copies = [n for n in sim.program.graph.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert [str(n.meta["layout"]) for n in copies] == ["S(0)S(0)S(2)"] and "replicated" not in copies[0].meta
    for seed in (9, 10):
        _step(sim, model, {"x": x}, seed)


# ---------------------------------------------------------------------------
# 4. GPT-2 with dropout 0.1, attention dropout through scaled_dot_product_attention
# ---------------------------------------------------------------------------


def gpt2_with_dropout(batch: int, attn_implementation: str = "sdpa"):
    """A tiny GPT-2 (float64, train mode) with embedding, residual and attention dropout 0.1,
    and its keyword inputs; the same weights in every process."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=4, n_inner=32, resid_pdrop=P, embd_pdrop=P,
        attn_pdrop=P, summary_first_dropout=0.0, use_cache=False, tie_word_embeddings=True,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(101)  # HF initialises weights from the global generator
    model = GPT2LMHeadModel(cfg).double().train()
    ids = torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(102))
    return model, {"input_ids": ids, "use_cache": False}


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_gpt2_with_dropout(q, d, mode):
    model, inputs = gpt2_with_dropout(2 * q * d if mode != "1d" else 4)
    sim = tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs=inputs, mode=mode)
    _step(sim, model, inputs, 11, logits=lambda out: out.logits)


@pytest.mark.slow
def test_gpt2_with_eager_attention_dropout():
    model, inputs = gpt2_with_dropout(8, "eager")
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=inputs)
    _step(sim, model, inputs, 12, logits=lambda out: out.logits)


# ---------------------------------------------------------------------------
# 6. Slow: real gloo processes; the compiled simulator refuses
# ---------------------------------------------------------------------------


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = max(expected.abs().max().item(), 1e-12)
    return (actual.detach() - expected.detach()).abs().max().item() / scale


def _gloo_worker(rank, world_size):
    """Over gloo: DropoutNet at [2,2,1] and 1-D p=4, GPT-2 at [2,2,1], two steps each; returns
    the largest relative error of outputs and of this rank's gradient blocks, and whether the
    generator's states matched."""
    torch.set_num_threads(1)
    errors, states_match = [], True
    cases = [("net", 2, 1, "2.5d"), ("net", 1, 4, "1d"), ("gpt2", 2, 1, "2.5d")]
    for name, q, d, mode in cases:
        if name == "net":
            torch.manual_seed(4)
            model = DropoutNet().double().train()
            ids, x = _inputs()
            inputs, logits = {"ids": ids, "x": x}, (lambda out: out)  # noqa: E731
        else:
            model, inputs = gpt2_with_dropout(4)
            logits = (lambda out: out.logits)
        sharded = tess_compile.shard(copy.deepcopy(model), q, d, example_inputs=inputs, mode=mode, timeout=60)
        mesh, params = Mesh(q, d, mode), dict(sharded.named_parameters())
        for seed in (5, 6):
            torch.manual_seed(seed)
            got = tess_compile.full_tensor(logits(sharded(**inputs)))
            state = torch.get_rng_state()
            torch.manual_seed(seed)
            expected = logits(model(**inputs))
            states_match &= torch.equal(state, torch.get_rng_state())
            errors.append(_rel_err(got, expected))
            sharded.zero_grad()
            model.zero_grad()
            weights = _projection(expected)
            (got * weights).sum().backward()
            (expected * weights).sum().backward()
            for slot in sharded.program.params:
                oracle = local_block(dict(model.named_parameters())[slot.name].grad, slot.layout, mesh, rank)
                errors.append(_rel_err(params[slot.name].grad.to_local(), oracle))
    return max(errors), states_match


@pytest.mark.slow
def test_dropout_over_gloo():
    from tess_compile.runtime.launch import run_local

    for error, states_match in run_local(_gloo_worker, 4, timeout_s=600):
        assert error <= 1e-12 and states_match, (error, states_match)


@pytest.mark.slow
def test_compiled_simulation_refuses_dropout():
    torch.manual_seed(4)
    model = DropoutNet().double().train()
    ids, x = _inputs()
    sim = tess_compile.simulate(model, 2, 2, example_inputs=(ids, x), compile=True)
    with pytest.raises(ValueError, match=r"compile=True.*share one random generator.*compile=False"):
        sim(ids, x)
