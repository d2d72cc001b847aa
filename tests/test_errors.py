"""User errors: a ValueError whose text gives what, the sizes, the mesh and a fix
(DESIGN.md section 6 item 6); and the replicated fallback for ops without rules."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

import tess_compile
from conftest import assert_close_rel
from models import GPTBlock, LlamaBlock


def error_text(q, d, model, x, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        tess_compile.simulate(model, q, d, example_inputs=(x,), verify=True, **kwargs)
    return str(info.value)


def test_depth_larger_than_q():
    msg = error_text(2, 3, GPTBlock(8, 2), torch.randn(12, 4, 8))
    assert "d=3" in msg and "q=2" in msg, msg
    assert "d <= 2" in msg or "d<=2" in msg, msg  # the fix


@pytest.mark.parametrize("q, d", [(0, 1), (0, 0), (2, 0), (-1, 1)], ids=["q0", "q0d0", "d0", "qneg"])
def test_non_positive_mesh(q, d):
    msg = error_text(q, d, GPTBlock(8, 2), torch.randn(4, 4, 8))
    assert f"q={q}" in msg and f"d={d}" in msg, msg
    assert "positive" in msg, msg


def test_batch_not_divisible_by_depth_times_q():
    msg = error_text(2, 2, GPTBlock(8, 2), torch.randn(6, 4, 8))
    assert "6" in msg and "4" in msg, msg
    assert "batch" in msg, msg
    assert "[q=2, q=2, d=2]" in msg, msg  # the mesh
    assert "multiple of 4" in msg, msg  # the fix


def test_hidden_not_divisible_by_q():
    msg = error_text(4, 1, GPTBlock(6, 2), torch.randn(4, 4, 6))
    assert "6" in msg and "4" in msg, msg
    assert "qkv" in msg, msg  # the tensor: the first weight that cannot be split
    assert "[q=4, q=4, d=1]" in msg, msg
    assert "multiple" in msg and "q=4" in msg, msg


@pytest.mark.parametrize("block", [GPTBlock, LlamaBlock], ids=["gpt", "llama"])
def test_heads_not_divisible_by_q(block):
    msg = error_text(2, 1, block(12, 3), torch.randn(2, 4, 12))
    assert "head count" in msg, msg
    assert "3" in msg and "q=2" in msg, msg
    assert "[q=2, q=2, d=1]" in msg, msg
    assert "multiple of 2" in msg, msg


@pytest.mark.parametrize(
    "shape", [(4, 5, 8), (8, 4, 8), (4, 4, 16)], ids=["seq", "batch", "hidden"]
)
def test_call_with_other_shape(shape):
    model = GPTBlock(8, 2)
    sim = tess_compile.simulate(model, 2, 2, example_inputs=(torch.randn(4, 4, 8),), verify=True)
    with pytest.raises(ValueError) as info:
        sim(torch.randn(*shape))
    msg = str(info.value)
    assert str(list(shape)) in msg and "[4, 4, 8]" in msg, msg
    assert "example_inputs" in msg, msg


def test_call_with_other_number_of_inputs():
    model = GPTBlock(8, 2)
    x = torch.randn(4, 4, 8)
    sim = tess_compile.simulate(model, 2, 1, example_inputs=(x,), verify=True)
    with pytest.raises(ValueError, match="example_inputs"):
        sim(x, x)


class FlipModel(nn.Module):
    """Linear, flip over the batch dim (no sharding rule for aten.flip), linear."""

    def __init__(self, hidden: int):
        super().__init__()
        self.first = nn.Linear(hidden, hidden)
        self.second = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.second(torch.flip(self.first(x), dims=[0]))


def test_flip_is_not_in_the_rule_table():
    from passes.placement_rules import PLACEMENT_RULES

    assert torch.ops.aten.flip.default not in PLACEMENT_RULES


def test_strict_rejects_op_without_rule():
    msg = error_text(2, 2, FlipModel(8), torch.randn(4, 3, 8), strict=True)
    assert "flip" in msg, msg
    assert "test_errors.py" in msg, msg  # the model's source line
    assert "strict" in msg, msg


@pytest.mark.parametrize("q, d", [(2, 1), (2, 2)], ids=["q2d1", "q2d2"])
def test_non_strict_warns_and_matches(q, d):
    torch.manual_seed(5)
    model = FlipModel(8)
    reference = copy.deepcopy(model)
    x = torch.randn(2 * d * q, 3, 8)
    with pytest.warns(UserWarning, match=re.escape("aten.flip")) as record:
        sim = tess_compile.simulate(model, q, d, example_inputs=(x,), verify=True)
    assert any("test_errors.py" in str(w.message) for w in record), [str(w.message) for w in record]

    x_sim, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = sim(x_sim), reference(x_ref)
    assert_close_rel(out, expected, name="output")
    target = torch.randn_like(expected)
    (out * target).sum().backward()
    (expected * target).sum().backward()
    assert_close_rel(x_sim.grad, x_ref.grad, name="input grad")
    grads = sim.full_grads()
    for name, param in reference.named_parameters():
        assert_close_rel(grads[name], param.grad, name=f"grad of {name}")


def test_supported_model_does_not_warn():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tess_compile.simulate(nn.Linear(8, 8), 2, 2, example_inputs=(torch.randn(4, 3, 8),), strict=False)
    assert [str(w.message) for w in caught if "sharding rule" in str(w.message)] == []
