"""einsum sharded by its subscripts (`passes/rules/einsum.py`): LongT5's blocked local attention,
a projection whose summed letter is the split one (a partial sum), implicit output and `...`
in float64 simulation at [2,2,2] and 1-D p=4, every op sharded (strict), outputs and every
gradient equal to the unsharded model's, no repeated work; and the subscripts parser."""

from __future__ import annotations

import pytest
import torch
from conftest import simulate_exact
from torch import nn

from tess_compile.passes.rules.einsum import subscripts

MESHES = [(2, 2, "2.5d"), (2, 1, "1d")]
MESH_IDS = ["2.5d-q2d2", "1d-p4"]


class BlockedAttention(nn.Module):
    """LongT5's local attention: queries, keys and values in blocks [b, blocks, block, heads, head dim]."""

    def __init__(self, hidden: int = 16, heads: int = 4, block: int = 2):
        super().__init__()
        self.heads, self.block = heads, block
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, h = x.shape

        def blocks(t):
            return t.view(b, s // self.block, self.block, self.heads, h // self.heads)

        q, k, v = blocks(self.q(x)), blocks(self.k(x)), blocks(self.v(x))
        scores = torch.einsum("...qhd,...khd->...hqk", q, k)
        out = torch.einsum("...hqk,...khd->...qhd", scores.softmax(-1), v)
        return self.o(out.reshape(b, s, h))


class Projections(nn.Module):
    """A projection written as einsum (its summed letter split over col: a partial sum), an implicit
    output, and a weight used twice."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.w = nn.Parameter(torch.randn(hidden, hidden))
        self.u = nn.Parameter(torch.randn(hidden, 8))

    def forward(self, x):
        y = torch.einsum("bsh,hk->bsk", x, self.w)
        z = torch.einsum("bsk,kj", y, self.u)  # implicit: [b, j, s]
        return z + torch.einsum("bsh,bsh->bs", x, x)[:, None, :]


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
@pytest.mark.parametrize("build", [BlockedAttention, Projections], ids=["blocked-attention", "projections"])
def test_einsum_is_sharded_exactly(build, q, d, mode):
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    _, redundant = simulate_exact(build, (x,), q, d, mode)
    assert redundant <= 1.0 + 1e-9


def test_subscripts():
    assert subscripts("...qhd,...khd->...hqk", [5, 5]) == (["ABqhd", "ABkhd"], "ABhqk")
    assert subscripts("bsk,kj", [3, 2]) == (["bsk", "kj"], "bjs")
    assert subscripts("...ij,j->...i", [4, 1]) == (["ABij", "j"], "ABi")
    assert subscripts("i...,...->...", [3, 1]) == (["iAB", "B"], "AB")
