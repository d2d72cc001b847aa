"""Uneven sizes: a dim the mesh does not divide (GPT-2's vocabulary of 50257, an MLP width of
37 over 2 or 3) is split unevenly and padded inside the per-rank program; the padding is
never seen outside (outputs, losses, gradients, state dicts and parameters keep the model's
true shapes), and where exactness needs the true size a ValueError says so. A dim of size 1
split over an axis (a projection to one feature) holds its element on one rank and padding on
the others: the views and pointwise ops that meet it gather it (defects the fuzzer found). A
Hugging Face config as shipped (`use_cache` left on) compiles with the cache off."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_close_rel, null_gradients, simulate_exact, trained_error
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import tess_compile
from tess_compile.passes.driver import compile_model
from tess_compile.analysis.accounting import redundant_work, unsharded_forward_flops
from tess_compile.core.mesh import Mesh

MESHES = [(2, 2, "2.5d"), (1, 4, "1d"), (3, 1, "2.5d")]
IDS = ["q2d2", "1d-p4", "q3d1"]


def odd_gpt2(vocab: int = 257, hidden: int = 24, heads: int = 12, mlp: int = 37) -> GPT2LMHeadModel:
    """A GPT-2 whose vocabulary and MLP width no mesh divides; cache left on, as shipped."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=16, n_embd=hidden, n_layer=1, n_head=heads, n_inner=mlp,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).double()


class Float64Loss(nn.Module):
    """GPT-2's logits and a loss of them in float64 (its own loss is taken in float32)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        logits = self.model(input_ids=ids, use_cache=False).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()) + 0.1 * logits.pow(2).mean()


def check_exact(sim, model: nn.Module, *inputs) -> None:
    out, expected = sim(*inputs), model(*inputs)
    assert_close_rel(out, expected, 1e-12, "loss")
    out.backward()
    expected.backward()
    grads = sim.full_grads()
    for name, param in model.named_parameters():
        assert_close_rel(grads[name], param.grad, 1e-12, f"grad {name}")


@pytest.mark.parametrize("q, d, mode", MESHES, ids=IDS)
def test_odd_sizes_are_exact(q, d, mode):
    model = Float64Loss(odd_gpt2())
    ids = torch.randint(0, 257, (6 if q == 3 else 8, 8))
    sim = tess_compile.simulate(copy.deepcopy(model), q, d, mode=mode, example_inputs=(ids,), strict=True)
    check_exact(sim, model, ids)
    block = sim.rank_tensor("model.transformer.wte.weight", sim.mesh.num_ranks - 1)
    assert block.shape[0] < -(-257 // (q if mode != "1d" else d))  # the last rank's block is the short one


@pytest.mark.parametrize("q, d, mode", MESHES[:2], ids=IDS[:2])
def test_default_gpt2_config_with_the_cache_on(q, d, mode, caplog):
    """GPT-2's real vocabulary, `use_cache` at its default: the cache is left out (said once in
    the log), logits exact, the model's own (float32) loss within float32 rounding."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=48, n_layer=1, n_head=12, n_positions=64)).double()
    assert model.config.vocab_size == 50257 and model.config.use_cache
    ids = torch.randint(0, 50257, (8, 8))
    with caplog.at_level(logging.WARNING, logger="tess_compile"):
        sim = tess_compile.simulate(copy.deepcopy(model).eval(), q, d, mode=mode, example_inputs={"input_ids": ids, "labels": ids})
    assert "returns a DynamicCache" in caplog.text and "compiled with use_cache=False" in caplog.text
    out, expected = sim(input_ids=ids, labels=ids), model.eval()(input_ids=ids, labels=ids)
    assert out.past_key_values is None and out.logits.shape == (8, 8, 50257)
    assert_close_rel(out.logits, expected.logits, 1e-12, "logits")
    assert_close_rel(out.loss, expected.loss, 1e-6, "loss")


def test_state_keeps_the_true_shapes():
    model = odd_gpt2()
    ids = torch.randint(0, 257, (8, 8))
    sim = tess_compile.simulate(model, 2, 2, example_inputs=(ids,))
    state = sim.full_state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
    blocks = [sim.rank_tensor("transformer.h.0.mlp.c_fc.weight", rank).shape for rank in range(8)]
    assert sorted({tuple(b) for b in blocks}) == [(12, 18), (12, 19)]  # 37 over col: 19 and 18, never padded
    other = odd_gpt2(vocab=257)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(1.0)
    sim.load_full_state_dict(other.state_dict())
    assert all(torch.equal(sim.full_state_dict()[k], v) for k, v in other.state_dict().items())


def test_only_padding_adds_work():
    model = odd_gpt2()
    ids = torch.randint(0, 257, (8, 8))
    program = compile_model(model, Mesh(2, 2), {"input_ids": ids})
    ratio = redundant_work(program, unsharded_forward_flops(model, {"input_ids": ids}))
    assert 1.0 <= ratio <= 258 / 257 + 0.02, ratio  # the padded vocabulary row, the padded MLP column


class PaddedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.norm = nn.Linear(8, 9), nn.LayerNorm(9)

    def forward(self, x):
        return self.norm(self.up(x))


class PaddedHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 9)

    def forward(self, x):
        return self.qkv(x).unflatten(-1, (3, 3)).softmax(-1)


def test_a_norm_over_a_padded_dim_is_refused():
    with pytest.raises(ValueError) as info:
        tess_compile.simulate(PaddedNorm(), 2, 1, example_inputs=(torch.randn(4, 3, 8),))
    msg = str(info.value)
    assert msg.startswith("aten.layer_norm.default (layer_norm) at ") and "whose size 9 is not divisible by 2" in msg, msg
    assert "so its blocks are padded: the norms rules need its true size; use a size that is a multiple of 2" in msg
    assert "[q=2, q=2, d=1]" in msg, msg


def test_heads_of_a_padded_dim_are_refused():
    with pytest.raises(ValueError, match=r"splits dim 2 .* into \[3, 3\]: the outer factor 3 is not divisible by 2"):
        tess_compile.simulate(PaddedHeads(), 2, 1, example_inputs=(torch.randn(4, 3, 8),))


class OddMLP(nn.Module):
    """Padded width through sums, means, a softmax and an activation whose value at 0 is not 0."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 11), nn.Linear(11, 8)

    def forward(self, x):
        h = self.up(x)
        return self.down(torch.sigmoid(h)) + h.softmax(-1).sum(-1, keepdim=True) + h.mean(-1, keepdim=True)


@pytest.mark.parametrize("q, d, mode", MESHES[:2], ids=IDS[:2])
def test_padding_is_masked_where_it_would_count(q, d, mode):
    torch.manual_seed(1)
    model = OddMLP().double()
    x = torch.randn(8, 3, 8, dtype=torch.float64)
    sim = tess_compile.simulate(copy.deepcopy(model), q, d, mode=mode, example_inputs=(x,))
    out, expected = sim(x), model(x)
    assert_close_rel(out, expected, 1e-12, "output")
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    grads = sim.full_grads()
    for name, param in model.named_parameters():
        assert_close_rel(grads[name], param.grad, 1e-12, f"grad {name}")


class TokenGate(nn.Module):
    """One gate a token (`x @ w`, w of one column: its single feature split unevenly over col), broadcast
    over the heads by a view that inserts size-1 dims."""

    def __init__(self):
        super().__init__()
        self.value, self.gate, self.out = nn.Linear(8, 8), nn.Parameter(torch.randn(8, 1)), nn.Linear(8, 8)

    def forward(self, x):
        b, t, _ = x.shape
        heads = self.value(x).view(b, t, 2, 4).transpose(1, 2)
        gate = torch.sigmoid(x @ self.gate).view(b, 1, t, 1)
        return self.out((heads * gate).transpose(1, 2).reshape(b, t, 8))


class SplitBatch(nn.Module):
    """A one-feature projection, then the batch unflattened: the view keeps each split on its own dim."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(1, 1), nn.Linear(1, 3)

    def forward(self, x):
        return self.second(self.first(x).unflatten(0, (2, 2)))


class BatchLast(nn.Module):
    """The batch moved last and a row of a table added: two inputs' splits meet on one dim of 4."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(1, 4)

    def forward(self, x):
        return x.permute(1, 2, 0) + self.table(torch.arange(1, device=x.device))


@pytest.mark.parametrize("build, shape, q, d, mode", [
    (TokenGate, (4, 6, 8), 2, 2, "2.5d"), (TokenGate, (4, 6, 8), 2, 1, "2.5d"), (TokenGate, (4, 6, 8), 2, 1, "1d"),
    (SplitBatch, (4, 1, 1), 2, 2, "2.5d"), (BatchLast, (4, 1, 1), 2, 2, "2.5d"),
], ids=["gate-q2d2", "gate-q2d1", "gate-1d-p4", "unflatten-q2d2", "meet-q2d2"])
def test_a_dim_of_one_split_unevenly_is_gathered_where_needed(build, shape, q, d, mode):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    simulate_exact(build, (x,), q, d, mode, gathers=True, strict=False)


@pytest.mark.slow
@pytest.mark.parametrize("q, d, mode", [(2, 2, "2.5d"), (4, 1, "2.5d"), (3, 1, "2.5d"), (1, 4, "1d")],
                         ids=["q2d2", "q4d1", "q3d1", "1d-p4"])
def test_real_gpt2_sizes(q, d, mode):
    """GPT-2's own sizes (vocabulary 50257, hidden 768, 12 heads; one layer) shard and are exact."""
    torch.manual_seed(0)
    model = Float64Loss(GPT2LMHeadModel(GPT2Config(n_layer=1, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0)).double())
    ids = torch.randint(0, 50257, (12 if q == 3 else 8, 8))
    sim = tess_compile.simulate(copy.deepcopy(model), q, d, mode=mode, example_inputs=(ids,), strict=True)
    check_exact(sim, model, ids)


def _gloo_worker(rank, world_size, folder):
    torch.set_num_threads(1)
    model = Float64Loss(odd_gpt2())
    oracle = copy.deepcopy(model)
    ids = torch.randint(0, 257, (8, 8), generator=torch.Generator().manual_seed(3))
    sharded = tess_compile.shard(model, 2, 2, example_inputs=(ids,), timeout=120)
    shapes = {name: tuple(p.shape) for name, p in sharded.named_parameters()}
    opt, oracle_opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2), torch.optim.AdamW(oracle.parameters(), lr=1e-2)
    errors, null = [], {}
    for _ in range(2):
        loss, expected = sharded(ids), oracle(ids)
        errors.append(abs(float(loss) - float(expected)) / abs(float(expected)))
        loss.backward()
        expected.backward()
        null = null_gradients(oracle, null)  # the key bias's: rounding noise, which AdamW turns into lr-sized steps
        norms = sharded.clip_grad_norm_(1.0), torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1.0)
        errors.append(abs(float(norms[0]) - float(norms[1])) / float(norms[1]))
        opt.step(), oracle_opt.step(), opt.zero_grad(), oracle_opt.zero_grad()
    state = sharded.full_state_dict()
    errors += [trained_error(state[k], v, null.get(k)) for k, v in oracle.state_dict().items()]
    dcp_shapes = {k: tuple(v.shape) for k, v in sharded.state_dict().items()}
    dcp.save(sharded.state_dict(), checkpoint_id=folder)  # saved from uneven blocks, loaded into a fresh module
    fresh = tess_compile.shard(Float64Loss(odd_gpt2()), 2, 2, example_inputs=(ids,), timeout=120)
    loaded = fresh.state_dict()
    dcp.load(loaded, checkpoint_id=folder)
    errors += [(fresh.full_state_dict()[k] - v).abs().max().item() for k, v in state.items()]
    return max(errors), shapes, dcp_shapes


@pytest.mark.slow
def test_uneven_sizes_over_gloo(tmp_path):
    """8 processes at [2,2,2]: losses, the clipped norm and the weights after AdamW steps (where no
    gradient is mathematically zero) equal the unsharded model's; parameters and state-dict DTensors
    have the model's true shapes, and a DCP checkpoint of them loads back."""
    truth = {name: tuple(p.shape) for name, p in Float64Loss(odd_gpt2()).named_parameters()}
    results = tess_compile.run_local(_gloo_worker, 8, args=(str(tmp_path / "ckpt"),), timeout_s=300,
                                     collective_timeout_s=120)
    for error, shapes, dcp_shapes in results:
        assert error <= 1e-12, error
        assert shapes == truth
        assert {k: dcp_shapes[k] for k in truth} == truth
