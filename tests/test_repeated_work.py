"""Work that ranks repeat is named, and the dense-expert pattern no longer repeats it
(`passes/repeated_work.py`, the batched-weight branch of `passes/rules/products.py`).

1. PyTorch's own TP test Transformer with `num_experts=2` (every expert runs on
   every token: `x.unsqueeze(0).expand(E, ...)` then `bmm`) in float64 at
   [2,2,2] and 1-D p=4: forward FLOPs over all ranks at most 1.05x the
   unsharded model's, no warning, output and every gradient to 1e-12.
2. A product whose weights are computed (so they are not a free parameter the
   rule may split) repeats its FLOPs on every column: one warning names the op,
   the model's source line and the repeated FLOPs; `strict=True` refuses it.
3. Ops under the share each that repeat 12% of the model's FLOPs together are
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
    products cannot split them: the first one's partial sums are reduced for the
    GELU, and every column repeats the second."""

    def __init__(self, experts: int = 2, dim: int = 16, hidden: int = 64):
        super().__init__()
        self.up = nn.Parameter(0.1 * torch.randn(experts, dim, hidden))
        self.down = nn.Parameter(0.1 * torch.randn(experts, hidden, dim))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        h = torch.bmm(flat.unsqueeze(0).expand(self.up.shape[0], -1, -1), 2 * self.up)
        out = torch.bmm(torch.nn.functional.gelu(h), 2 * self.down)  # the repeated op
        return out.sum(0).reshape(x.shape)


def test_repeated_products_are_named_and_strict_refuses_them():
    torch.manual_seed(3)
    model, x = ComputedExperts().double(), torch.randn(8, 4, 16, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,))
    messages = [str(w.message) for w in caught if "repeat work" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert "aten.bmm.default" in messages[0] and f"{__file__}:" in messages[0] and "FLOPs" in messages[0]
    assert_close_rel(sim(x), model(x), 1e-12, "output")  # repeated, still exact
    with pytest.raises(ValueError, match=r"repeat work across the ranks(.|\n)*strict=True forbids repeated work"):
        tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,), strict=True)


class SmallRepeats(nn.Module):
    """A wide MLP, then 5 small products (2% each of the model's FLOPs) whose weights are computed,
    after a product whose partial sums the GELU needs whole: each repeats its FLOPs on every column."""

    def __init__(self, dim: int = 16, wide: int = 256, num_small: int = 5, hidden: int = 16):
        super().__init__()
        self.wide, self.narrow = nn.Linear(dim, wide), nn.Linear(wide, dim)
        self.up = nn.ParameterList([nn.Parameter(0.1 * torch.randn(dim, hidden)) for _ in range(num_small)])
        self.down = nn.ParameterList([nn.Parameter(0.1 * torch.randn(hidden, dim)) for _ in range(num_small)])

    def forward(self, x):
        y = self.narrow(torch.relu(self.wide(x)))
        for up, down in zip(self.up, self.down):
            y = y + torch.nn.functional.gelu(y @ (2 * up)) @ (2 * down)  # the second product repeats
        return y


def test_ops_under_the_share_each_warn_when_they_add_up():
    torch.manual_seed(4)
    model, x = SmallRepeats().double(), torch.randn(8, 4, 16, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = tess_compile.check(model, 2, 2, example_inputs=(x,), progress=False)
    messages = [str(w.message) for w in caught if "repeat work" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert "1.12x the unsharded model's" in messages[0] and "(12% repeated, over 5%)" in messages[0], messages[0]
    named = [line for line in messages[0].splitlines() if line.startswith("  aten.matmul")]
    assert len(named) == 5 and all("(2% of the model's)" in line for line in named), messages[0]
    assert report.ok and report.redundant_work == pytest.approx(1.12, abs=0.005), report.table()
