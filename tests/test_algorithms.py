"""Tesseract's matrix products: A @ B for a weight laid out as usual, A @ B^T for
a weight that an earlier consumer laid out the other way round (no weight moves),
in the papers' schedule (summa="broadcast")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_rel, assert_matches_model
from models import mesh_id
from torch import nn

import tess_compile

MESHES = [(2, 1), (2, 2), (3, 1), (3, 3)]


class SharedWeight(nn.Module):
    """One weight used as `x @ W` ([in, out]) and then as `F.linear(y, W)` ([out, in])."""

    def __init__(self, hidden: int, wide: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, wide) / hidden**0.5)
        self.bias = nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        return F.linear(torch.relu(x @ self.weight), self.weight, self.bias)


def _simulate(q, d):
    torch.manual_seed(3)
    model = SharedWeight(4 * q, 6 * q)
    x = torch.randn(d * q, 3, 4 * q)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), strict=True, verify=True, summa="broadcast")
    return model, sim, x


@pytest.mark.parametrize("q, d", MESHES, ids=[mesh_id(q, d) for q, d in MESHES])
def test_transposed_weight_parity(q, d):
    model, sim, x = _simulate(q, d)
    assert_matches_model(sim, model, x)


@pytest.mark.parametrize("q, d", MESHES, ids=[mesh_id(q, d) for q, d in MESHES])
def test_transposed_weight_moves_no_weight(q, d):
    """Forward: x @ W is q broadcasts along col and q along row; F.linear(y, W) with W
    as it lies is q broadcasts of W along row and q reduces along col. No gathers."""
    model, sim, x = _simulate(q, d)
    (sim(x) * torch.randn(d * q, 3, 4 * q)).sum().backward()
    assert sim.comm.counts("forward") == {
        ("broadcast", "col"): q,
        ("broadcast", "row"): 2 * q,
        ("reduce", "col"): q,
    }
    # Backward: W's two broadcasts along row become 2q reduces; the reduce along col
    # becomes q broadcasts; x needs no gradient. The fetched blocks are fetched
    # again: x's along col for x @ W's dW, W's along row for F.linear's dy.
    # Gradient syncs, one bucket: the bias along row, and along depth the weight and the bias.
    expected = {("reduce", "row"): 2 * q, ("broadcast", "col"): 2 * q, ("broadcast", "row"): q, ("all_reduce", "row"): 1}
    if d > 1:
        expected[("all_reduce", "depth")] = 1
    assert sim.comm.counts("backward") == expected


class Conv1DAttentionInput(nn.Module):
    """GPT-2's fused QKV: addmm on flattened rows, view back, split into q, k, v."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, 3 * hidden) / hidden**0.5)
        self.bias = nn.Parameter(torch.randn(3 * hidden))

    def forward(self, x):
        b, s, h = x.shape
        qkv = torch.addmm(self.bias, x.view(-1, h), self.weight).view(b, s, 3 * h)
        q, k, v = qkv.split(h, dim=2)
        return q * k + v


@pytest.mark.parametrize("q, d", [(2, 2), (3, 1)], ids=[mesh_id(2, 2), mesh_id(3, 1)])
def test_fused_qkv_through_view_needs_no_gather(q, d):
    """The split asks the addmm (through the view) for a grouped layout of its output."""
    torch.manual_seed(4)
    model = Conv1DAttentionInput(4 * q)
    x = torch.randn(d * q, 3, 4 * q)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), strict=True, verify=True, summa="broadcast")
    out, expected = sim(x), model(x)
    assert_close_rel(out, expected, name="output")
    assert not [r for r in sim.comm.records if r.op == "all_gather"]  # the papers' schedule fetches by broadcasts
    assert str(sim.program.slots[0].layout) == "RS(0)S(1,g=3)"
