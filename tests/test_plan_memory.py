"""The planner's memory figure (`PlanRow.memory`, GB/GPU) of ZeRO-3 x TP rows against a hand count.

A stack of residual MLP blocks without biases or norms, whose every weight 1-D splits over the TP ranks
and whose input `[b, h]` has no tokens to split, in bf16 (the AdamW state is two tensors of each
parameter's dtype), every block recomputed (`recompute="blocks"`: a block saves its input alone):

- a rank's parameter shards, gradients and AdamW state are params / (tp * dp) times 2, 2 and 4 bytes,
  two blocks of parameters and gradients whole beside them (the unit running and the one prefetched);
- the saved activations are one `[b, h]` input per block;
- the peak is never below the shards and the saved activations (a 405B row was priced at 8 GB once);
- priced only (block reuse, repeated blocks reused), one block more moves each part by one block's;
- the peak's arithmetic (`parallel_plan._unit_peak`) on a breakdown given by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tess_compile.analysis.cost_model import StepTime
from tess_compile.analysis.memory import MemoryEstimate
from tess_compile.analysis.parallel_plan import Outer, price
from tess_compile.analysis.planner import plan
from tess_compile.analysis.step_tail import MODULE_LOSS
from tess_compile.core.cluster import CALIBRATED_CLUSTER

HIDDEN, BATCH, TP, DP = 32, 8, 2, 4
BLOCK_PARAMS = 2 * 4 * HIDDEN * HIDDEN  # fc1 and fc2, no biases
BYTES = 2  # bf16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _row(layers: int):
    """The FSDP (dp 4) x 1-D TP 2 row of a stack of `layers` blocks, priced only on the meta device."""
    def make():
        return Stack(layers).to(torch.bfloat16), torch.randn(BATCH * DP, HIDDEN, dtype=torch.bfloat16)

    rows = plan(make, TP * DP, gpus_per_node=TP, modes=("1d",), dp=DP, zero=True, recompute="blocks",
                keep_blocks=False, summa="broadcast", tail=MODULE_LOSS, memory_budget=float("inf"))
    (row,) = [row for row in rows if row.outer.zero and not row.outer.zero_shard]
    return row


def _hand_count(layers: int) -> tuple[int, int, int, int]:
    """(params, grads, AdamW state, saved activations) of a rank of the row of `layers` blocks."""
    shards = layers * BLOCK_PARAMS * BYTES // (TP * DP)
    whole = 2 * BLOCK_PARAMS * BYTES // TP  # two units gathered: the running block, the prefetched one
    return shards + whole, shards + whole, 2 * shards, layers * BATCH * HIDDEN * BYTES  # a block saves its input


@pytest.fixture(scope="module")
def five():
    return _row(5).memory


def test_zero_times_tp_row_is_the_hand_count(five):
    assert (five.params, five.grads, five.optimizer, five.activations) == _hand_count(5)
    assert five.total == five.peak >= five.params + five.grads + five.optimizer + five.activations


def test_one_block_more_moves_each_part_by_a_blocks(five):
    """Priced only, the middle blocks reused: a sixth block adds its shards of parameters, gradients
    and AdamW state and its saved input; the peak grows by at least its saved input and at most
    those and a whole block's AdamW step counts (two float32 scalars, not sharded)."""
    six = _row(6).memory
    assert (six.params, six.grads, six.optimizer, six.activations) == _hand_count(6)
    shard, saved = BLOCK_PARAMS * BYTES // (TP * DP), BATCH * HIDDEN * BYTES
    assert saved < six.peak - five.peak <= 4 * shard + saved + 2 * 4


def test_unit_peak_is_the_lower_bound_of_two_over_the_optimizers():
    """A program of 400 bytes of parameters (as many gradients, 800 of AdamW state), peak 4000, of which
    2500 working bytes at most, and 1700 in the optimizer's step; dp 4 in 4 units: shards of 100 and
    200, two units whole of 200 each (parameters, gradients)."""
    memory = MemoryEstimate(params=400, grads=400, optimizer=800, activations=2000, transient=100, peak=4000,
                            working=2500, update=1700)
    time = StepTime(0.0, 0.0, 0.0, 0.0, 0, 0, grad_tensors=4)

    def peak(memory):
        return price(time, memory, Outer(dp=4, zero=True), 2, CALIBRATED_CLUSTER, units=4)[1].peak

    held = (100 + 200) + (100 + 200) + 200  # parameters, gradients, AdamW state
    assert peak(memory) == min(held + 2500, (4000 - 2500) // 4 + 2500 + 400) == 3275
    assert peak(MemoryEstimate(**{**vars(memory), "working": 1000})) == held + 1000  # the sum is lower
    assert peak(MemoryEstimate(**{**vars(memory), "working": 100, "update": 16000})) == 16000 // 4  # AdamW's
    unsplit = MemoryEstimate(**{**vars(memory), "working": None, "update": None})  # working <= peak - 1200
    assert peak(unsplit) == min(held + 2800, (4000 - 2800) // 4 + 2800 + 400)
