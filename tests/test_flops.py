"""No redundant matmul work: a rank's forward FLOPs times p equal the unsharded model's."""

from __future__ import annotations

import pytest
import torch
from models import GPTBlock, LlamaBlock, mesh_id

import tess_compile
from tess_compile.core.flops import flop_counter
from tess_compile.analysis.accounting import forward_flops

MESHES = [(2, 1), (2, 2), (3, 3), (4, 2)]


@pytest.mark.parametrize("q, d", MESHES, ids=[mesh_id(q, d) for q, d in MESHES])
@pytest.mark.parametrize("block", [GPTBlock, LlamaBlock], ids=["gpt", "llama"])
def test_per_rank_flops_times_p_equal_the_model(block, q, d):
    torch.manual_seed(0)
    model = block(8 * q, 2 * q)
    x = torch.randn(2 * q * d, 8, 8 * q)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,))
    with flop_counter() as counter:
        model(x)
    total = counter.get_total_flops()
    per_rank = forward_flops(sim.program)
    assert abs(per_rank * sim.mesh.num_ranks - total) <= 0.01 * total, (per_rank, sim.mesh.num_ranks, total)
