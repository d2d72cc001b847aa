"""Parity with the unsharded model: outputs and every gradient, on every mesh.

The oracle is the unsharded model itself (DESIGN.md section 5): same
weights, same inputs, fp32 with TF32 off; outputs, parameter gradients
(gathered from the shards by `full_grads`) and the input gradient must
agree within 1e-5 relative to each tensor's scale.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import tess_compile
from conftest import assert_close_rel
from models import MESHES, GPTBlock, LlamaBlock, TinyGPT, make_block, mesh_id


def check_parity(model: torch.nn.Module, x: torch.Tensor, q: int, d: int, *, strict: bool = True):
    """Simulate `model` on [q, q, d] and compare forward, input grad and all parameter grads."""
    reference = copy.deepcopy(model)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), strict=strict, verify=True)

    floating = x.is_floating_point()
    x_sim = x.clone().requires_grad_(floating)
    x_ref = x.clone().requires_grad_(floating)
    out = sim(x_sim)
    expected = reference(x_ref)
    assert_close_rel(out, expected, name="output")

    target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1234), dtype=expected.dtype)
    (out * target).sum().backward()
    (expected * target).sum().backward()

    if floating:
        assert_close_rel(x_sim.grad, x_ref.grad, name="input grad")
    grads = sim.full_grads()
    names = [name for name, _ in reference.named_parameters()]
    assert list(grads) == names, f"full_grads keys {list(grads)} != named_parameters {names}"
    for name, param in reference.named_parameters():
        assert grads[name] is not None, f"gradient of {name} is None"
        assert_close_rel(grads[name], param.grad, name=f"grad of {name}")
    return sim


BLOCK_CASES = [
    pytest.param(kind, q, d, heads_per_q, id=f"{kind}-{mesh_id(q, d)}-heads{heads_per_q}q")
    for kind in ("gpt", "llama")
    for q, d in MESHES
    for heads_per_q in (1, 2)
]


@pytest.mark.parametrize("kind, q, d, heads_per_q", BLOCK_CASES)
def test_block_parity(kind, q, d, heads_per_q):
    torch.manual_seed(q * 100 + d * 10 + heads_per_q)
    hidden, heads = 4 * q, heads_per_q * q
    batch = heads_per_q * d * q  # d*q, or 2*d*q (several batch rows per rank)
    model = make_block(kind, hidden, heads)
    x = torch.randn(batch, 4, hidden)
    check_parity(model, x, q, d)


@pytest.mark.parametrize("q, d", [(2, 2), (2, 1)], ids=[mesh_id(2, 2), mesh_id(2, 1)])
def test_tiny_gpt_parity(q, d):
    torch.manual_seed(7)
    vocab, hidden, heads, layers, seq = 16, 8, 2, 2, 4
    model = TinyGPT(vocab, hidden, heads, layers, seq)
    ids = torch.randint(0, vocab, (2 * d * q, seq))
    sim = check_parity(model, ids, q, d)
    # The token ids are not differentiable; every parameter still gets a gradient,
    # including the position table (indexed by arange, not by the input).
    assert sim.full_grads()["positions.weight"].abs().sum() > 0


@pytest.mark.parametrize(
    "bias, mlp",
    [(False, "gelu"), (True, "swiglu"), (False, "swiglu")],
    ids=["nobias-gelu", "bias-swiglu", "nobias-swiglu"],
)
def test_gpt_variants_parity(bias, mlp):
    torch.manual_seed(11)
    q, d = 2, 2
    model = GPTBlock(4 * q, q, bias=bias, mlp=mlp)
    names = [n for n, _ in model.named_parameters()]
    assert any("bias" in n for n in names) == bias
    check_parity(model, torch.randn(2 * d * q, 4, 4 * q), q, d)


def test_llama_mlp_hidden_parity():
    """A SwiGLU width that is not 4*hidden (Llama's 8/3 rounding)."""
    torch.manual_seed(12)
    q, d = 2, 2
    check_parity(LlamaBlock(8, 2, mlp_hidden=22 - 22 % q), torch.randn(d * q, 3, 8), q, d)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_blocks_need_no_fallback(kind):
    """The standard blocks are fully covered by sharding rules: no replicated-op warning."""
    q, d = 2, 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sim = tess_compile.simulate(make_block(kind, 8, 2), q, d, example_inputs=(torch.randn(4, 4, 8),), verify=True)
    # No collective gathers a whole activation: the blocks run on local shards only.
    sim(torch.randn(4, 4, 8)).sum().backward()
    ops = {op for op, _ in sim.comm.counts()}
    assert "all_gather" not in ops, sim.comm.counts()
