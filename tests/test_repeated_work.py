"""Work that ranks repeat is named, and the dense-expert pattern no longer repeats it
(`passes/repeated_work.py`, the batched-weight branch of `passes/rules/products.py`).

1. PyTorch's own TP test Transformer with `num_experts=2` (every expert runs on
   every token: `x.unsqueeze(0).expand(E, ...)` then `bmm`) in float64 at
   [2,2,2] and 1-D p=4: forward FLOPs over all ranks at most 1.05x the
   unsharded model's, no warning, output and every gradient to 1e-12.
2. A product whose inputs both come whole over an axis (dense experts whose
   weights are computed) has its rows sliced: no rank repeats it.
3. A product of computed weights alone, of sizes no axis divides, repeats its
   FLOPs on every rank: one warning names the op, the model's source line and
   the repeated FLOPs; `strict=True` refuses it.
4. Ops under the share each that repeat 12% of the model's FLOPs together are
   named as the sum's largest contributors, and the sum agrees with `check`'s
   redundant work row.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_close_rel
from torch import nn

import tess_compile
from tess_compile.analysis.accounting import redundant_work, unsharded_forward_flops

MESHES = [(2, 2, "2.5d"), (2, 1, "1d")]
MESH_IDS = ["2.5d-q2d2", "1d-p4"]


def _experts_transformer():
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    args = ModelArgs(n_layers=2, vocab_size=16, max_seq_len=16, dim=16, n_heads=4, dropout_p=0.0, num_experts=2)
    ids = torch.randint(0, 16, (8, 8), generator=torch.Generator().manual_seed(1))
    return Transformer(args).double(), ids


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
def test_dense_experts_are_split_not_repeated(q, d, mode):
    model, ids = _experts_transformer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no replicated op, no repeated work
        sim = tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs=(ids,), mode=mode)
    assert redundant_work(sim.program, unsharded_forward_flops(model, (ids,))) <= 1.05
    out, expected = sim(ids), model(ids)
    assert_close_rel(out, expected, 1e-12, "logits")
    target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2), dtype=expected.dtype)
    (out * target).sum().backward()
    (expected * target).sum().backward()
    grads = sim.full_grads()
    for name, param in model.named_parameters():
        assert_close_rel(grads[name], param.grad, 1e-12, f"grad {name}")


class ComputedExperts(nn.Module):
    """Dense experts whose weights are computed from parameters (`2 * w`), so the
    products cannot split them as weights: the first one's partial sums are reduced
    for the GELU; the second takes both inputs whole over col, and its rows are sliced."""

    def __init__(self, experts: int = 2, dim: int = 16, hidden: int = 64):
        super().__init__()
        self.up = nn.Parameter(0.1 * torch.randn(experts, dim, hidden))
        self.down = nn.Parameter(0.1 * torch.randn(experts, hidden, dim))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        h = torch.bmm(flat.unsqueeze(0).expand(self.up.shape[0], -1, -1), 2 * self.up)
        out = torch.bmm(torch.nn.functional.gelu(h), 2 * self.down)
        return out.sum(0).reshape(x.shape)


def test_products_of_inputs_whole_over_an_axis_are_sliced_not_repeated():
    torch.manual_seed(3)
    model, x = ComputedExperts().double(), torch.randn(8, 4, 16, dtype=torch.float64)
    report = tess_compile.check(model, 2, 2, example_inputs=(x,), strict=True, progress=False)
    assert report.ok and report.redundant_work == pytest.approx(1.0), report.table()


class WeightProducts(nn.Module):
    """A wide MLP (most of the FLOPs), then products of computed weights alone (`(2 * a) @ (2 * b)`,
    of odd sizes that no axis divides): every rank computes each of them whole."""

    def __init__(self, num: int, sizes: tuple[int, int, int], dim: int = 16, wide: int = 256):
        super().__init__()
        m, k, n = sizes
        self.wide, self.narrow = nn.Linear(dim, wide), nn.Linear(wide, dim)
        self.left = nn.ParameterList([nn.Parameter(0.1 * torch.randn(m, k)) for _ in range(num)])
        self.right = nn.ParameterList([nn.Parameter(0.1 * torch.randn(k, n)) for _ in range(num)])

    def forward(self, x):
        y = self.narrow(torch.relu(self.wide(x)))
        for left, right in zip(self.left, self.right):
            y = y + ((2 * left) @ (2 * right)).sum()  # the repeated op
        return y


def _repeat_warnings(model, x, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = tess_compile.check(model, 2, 2, example_inputs=(x,), progress=False, **options)
    return [str(w.message) for w in caught if "repeat work" in str(w.message)], result


def test_repeated_products_are_named_and_strict_refuses_them():
    torch.manual_seed(3)
    model, x = WeightProducts(1, (7, 63, 7)), torch.randn(8, 4, 16)
    messages, report = _repeat_warnings(model, x)
    assert len(messages) == 1, messages
    assert "aten.matmul.default" in messages[0] and f"{__file__}:" in messages[0] and "(8% of the model's)" in \
        messages[0], messages[0]
    assert report.ok, report.table()  # repeated, still exact
    with pytest.raises(ValueError, match=r"repeat work across the ranks(.|\n)*strict=True forbids repeated work"):
        tess_compile.simulate(model, 2, 2, example_inputs=(x,), strict=True)


def test_ops_under_the_share_each_warn_when_they_add_up():
    torch.manual_seed(4)
    model, x = WeightProducts(5, (7, 19, 7)), torch.randn(8, 4, 16)
    messages, report = _repeat_warnings(model, x)
    assert len(messages) == 1, messages
    assert "1.12x the unsharded model's" in messages[0] and "(12% repeated, over 5%)" in messages[0], messages[0]
    named = [line for line in messages[0].splitlines() if line.startswith("  aten.matmul")]
    assert len(named) == 5 and all("(2% of the model's)" in line for line in named), messages[0]
    assert report.ok and report.redundant_work == pytest.approx(1.12, abs=0.005), report.table()
