"""`tensor_split` (indices, sections, a tensor of indices) and `view_as` / `reshape_as` / `expand_as`
are sharded, not run replicated (`passes/rules/view_aliases.py`).

One model takes each: a projection cut by `tensor_split` at uneven indices, swapped and
rejoined (as `split` is in the fuzzer), into equal sections multiplied, and at a tensor of
indices; a batch norm over the tokens flattened and `reshape_as` the tokens again, with
`view_as` and `expand_as` beside it, before a product. `check` in float64 at [2,2,2] and
1-D p=4 with strict=True (no op replicated, no work repeated): outputs, every gradient and
the weights after a step to 1e-12.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tess_compile

MESHES = [pytest.param(2, 2, "2.5d", id="2.5d-q2d2"), pytest.param(2, 1, "1d", id="1d-p4")]


class ViewAliases(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.norm = nn.BatchNorm1d(4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        h = self.up(x)
        wide = h.shape[-1]
        first, middle, last = torch.tensor_split(h, [wide // 4, wide // 2], dim=-1)
        h = torch.cat([last, middle, first], dim=-1)  # swapped and rejoined
        gate, value = torch.tensor_split(h, 2, dim=-1)  # equal sections
        h = torch.cat([gate * torch.sigmoid(value), value], dim=-1)
        left, right = torch.tensor_split(h, torch.tensor([wide // 2]), dim=-1)  # a tensor of indices
        h = torch.cat([right, left], dim=-1)
        normed = self.norm(h.reshape(-1, wide)).reshape_as(h)  # the tokens flattened for a batch norm
        scale = h.mean(-1, keepdim=True).expand_as(h)
        return self.down(normed.view_as(h) * scale + h)


@pytest.mark.parametrize("q, d, mode", MESHES)
def test_tensor_split_and_the_as_views_are_sharded_and_exact(q, d, mode):
    torch.manual_seed(0)
    report = tess_compile.check(ViewAliases(), q, d, example_inputs=torch.randn(8, 4, 16), mode=mode, strict=True,
                                progress=False)
    assert report.ok and report.tolerance == 1e-12, report.table()
    assert report.replicated_ops == [] and report.redundant_work <= 1.05, report.table()
