"""torch.autocast as a mode of the program: autocast's casts in the per-rank graph, so that the pieces
a sharded op runs as (a bias added after the product, a cross entropy's sums over a split vocabulary)
run in the dtypes of the whole op, and the outputs take the dtypes the unsharded model gives.

The reference is the unsharded model under the same autocast; bfloat16 rounding differs with the
order of sums, so values are compared as test_bf16 does: the sharded error against float64 at most
twice the unsharded model's plus a margin.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import mesh_id
from torch import nn

import tess_compile

BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


def _rel(actual: torch.Tensor, truth: torch.Tensor) -> float:
    return ((actual.double() - truth).norm() / truth.norm()).item()


class TinyLM(nn.Module):
    """Embedding, a biased projection, a head and the cross entropy inside forward (as transformers'
    models compute the loss when given labels)."""

    def __init__(self, vocab: int = 256, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.proj(self.embed(ids))))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


@pytest.mark.parametrize("q, d", [(2, 1), (2, 2)], ids=[mesh_id(2, 1), mesh_id(2, 2)])
def test_cross_entropy_under_autocast_as_exact_as_unsharded(q, d):
    """Autocast runs the cross entropy in float32; the program's pieces of it do too (before: its
    log-sum-exp ran in bfloat16, 400x the unsharded model's error). Loss and every gradient."""
    torch.manual_seed(0)
    model = TinyLM()
    ids, labels = torch.randint(0, 256, (2 * q * d, 8)), torch.randint(0, 256, (2 * q * d, 8))
    truth_model = copy.deepcopy(model).double()
    truth = truth_model(ids, labels)
    truth.backward()
    sim = tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs=(ids, labels))
    with torch.autocast(**BF16):
        loss, ref = sim(ids, labels), model(ids, labels)
    loss.backward()
    ref.backward()
    assert loss.dtype == ref.dtype == torch.float32
    errors = {"loss": (_rel(loss, truth), _rel(ref, truth))}
    grads = sim.full_grads()
    for (name, param), truth_param in zip(model.named_parameters(), truth_model.parameters()):
        errors[name] = (_rel(grads[name], truth_param.grad), _rel(param.grad, truth_param.grad))
    for name, (sharded, plain) in errors.items():
        assert sharded <= 2 * plain + 1e-4, f"{name}: sharded error {sharded:.2e} vs unsharded {plain:.2e}"


def test_outputs_take_the_dtypes_of_autocast():
    """A biased linear under autocast gives bfloat16, its bias included (before: the bias added after
    the product promoted every output, and what follows, to float32)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    x = torch.randn(8, 16)
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,))
    with torch.autocast(**BF16):
        out, ref = sim(x), model(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    truth = copy.deepcopy(model).double()(x.double())
    assert _rel(out, truth) <= 2 * _rel(ref, truth) + 1e-3


def test_each_autocast_state_has_its_program():
    """One module called without autocast, under it, and without again: a program per state, the
    parameters laid out alike."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    x = torch.randn(8, 16)
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 1, example_inputs=(x,))
    first = sim(x)
    with torch.autocast(**BF16):
        mixed = sim(x)
        assert sim.program.autocast == ("cpu", torch.bfloat16)
    again = sim(x)
    assert sim.program.autocast is None
    assert mixed.dtype == torch.bfloat16 and first.dtype == again.dtype == torch.float32
    torch.testing.assert_close(first, model(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_float64_is_not_autocast():
    """Autocast casts float32 only: a float64 model under it is exact (no cast in its program)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,))
    with torch.autocast(**BF16):
        out = sim(x)
    torch.testing.assert_close(out, model(x), rtol=1e-13, atol=1e-13)


class Mixed(nn.Module):
    """A model that enters autocast for its projection and leaves it for its router's scores."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.gate = nn.Linear(hidden, hidden)

    def forward(self, x):
        with torch.autocast(**BF16):
            y = self.proj(x)
            with torch.autocast("cpu", enabled=False):
                scores = self.gate(y.float()).softmax(-1)
        return y.float() * scores


def test_autocast_regions_inside_forward():
    """A region under its own autocast takes its casts (before: refused), and a region that turns
    autocast off inside it keeps float32."""
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(8, 4, 16)
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,))
    out, ref = sim(x), model(x)
    truth = copy.deepcopy(model).double()
    truth.forward = lambda v: truth.proj(v) * truth.gate(truth.proj(v)).softmax(-1)
    expected = truth(x.double())
    assert out.dtype == ref.dtype == torch.float32
    assert _rel(out, expected) <= 2 * _rel(ref, expected) + 1e-3
    cast_dtypes = {node.kwargs["dtype"] for node in sim.program.graph.graph.nodes
                   if node.target is torch.ops.aten._to_copy.default and "dtype" in node.kwargs}
    assert torch.bfloat16 in cast_dtypes


def test_sharded_module_under_autocast(world_of_one):
    """`shard` at a world of one: the program of the autocast in force, run with autocast off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    x = torch.randn(8, 16)
    sharded = tess_compile.shard(copy.deepcopy(model), 1, 1, example_inputs=(x,), timeout=60)
    with torch.autocast(**BF16):
        out, ref = sharded(x).to_local(), model(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_norms_kept_in_float32_compute_in_float32():
    """A bfloat16 model whose norms keep float32 weights (no autocast): torch runs such a norm in
    float32 and returns bfloat16; so do its pieces over a split dim (before: their sums ran in
    bfloat16, 4x the unsharded model's error)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16), nn.RMSNorm(16)).bfloat16()
    model[1].float()
    model[3].float()
    x = torch.randn(8, 4, 16).bfloat16()
    truth = copy.deepcopy(model).double()(x.double())
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,))
    out, ref = sim(x), model(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert _rel(out, truth) <= 2 * _rel(ref, truth) + 1e-3
