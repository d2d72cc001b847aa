"""The peak memory of ZeRO-3 run one FSDP2 unit per block, tracked against the planner's.

`tess_compile.parallelize` of a ZeRO-3 spec, data parallel 2 x 2-D [2,2,1] over 8 gloo processes
(`scale_out/block_units.py`: one unit per block of `benchmarks/memory.py`'s GPT stack), runs the
two training steps of `benchmarks/peak_memory.py` on each replica's half of the batch, its peak
counted by that file's `LiveBytes`. Beside it the planner's peak (`parallel_plan.price` around the
[2,2,1] row of one replica's batch, as the planner calls it) per unit (`units` = the blocks, what
the runtime runs) and as one unit (what `shard(..., zero=True)` runs), each with its error.

    python3 benchmarks/zero_units_memory.py [--layers 8] [--hidden 256] [--heads 8] [--batch 4] [--seq 16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile
from benchmarks.peak_memory import D, Q, _model, _training_step, live_peak
from tess_compile import CompileOptions, ParallelSpec
from tess_compile.analysis.parallel_plan import Outer, num_blocks, price
from tess_compile.core.cluster import CALIBRATED_CLUSTER
from tess_compile.runtime.launch import run_local

MIB = 2**20
DP = 2


def rank_peak(rank: int, world: int, size: dict) -> int:
    """This rank's tracked peak of two training steps of dp 2 x [2,2,1] with ZeRO-3 per block."""
    model, x = _model(size)
    spec = ParallelSpec(Q, D, dp=DP, zero=3, options=CompileOptions(mode="2d", keep_blocks=False))
    run = tess_compile.parallelize(model, spec, example_inputs=(x,), timeout=300)
    rows = x.shape[0] // DP
    part = x[run.dp_rank * rows:(run.dp_rank + 1) * rows].clone()  # its own storage: the replica's half
    optimizer = torch.optim.AdamW(run.parameters())
    return live_peak(_training_step(run.module, optimizer, part), run.module, optimizer, part)


def planned(size: dict) -> tuple[int, int]:
    """The planner's peak per rank of ZeRO-3 over dp 2 around [2,2,1]: per unit, and as one unit."""
    model, x = _model(size)
    micro = x[:x.shape[0] // DP]
    rows = tess_compile.plan(model, Q * Q * D, example_inputs=(micro,), modes=("2d",), keep_blocks=False)
    row = next(r for r in rows if r.mesh.q == Q and r.mesh.d == D)
    outer, tp = Outer(dp=DP, zero=True), row.mesh.num_ranks
    per_unit = price(row.time, row.memory, outer, tp, CALIBRATED_CLUSTER, units=num_blocks(model))[1]
    return per_unit.total, price(row.time, row.memory, outer, tp, CALIBRATED_CLUSTER, units=1)[1].total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 8), ("hidden", 256), ("heads", 8), ("batch", 4), ("seq", 16)):
        parser.add_argument(f"--{name}", type=int, default=default)
    size = vars(parser.parse_args())
    tracked = max(run_local(rank_peak, DP * Q * Q * D, args=(size,), timeout_s=900, collective_timeout_s=300))
    per_unit, one_unit = planned(size)
    print(f"ZeRO-3 per block, dp {DP} x 2-D [2,2,1], {size}: peak MiB per rank (worst rank)")
    print(f"{'tracked':>10} {'per unit':>10} {'error':>7} {'one unit':>10} {'error':>7}")
    print(f"{tracked / MIB:10.2f} {per_unit / MIB:10.2f} {100 * (per_unit / tracked - 1):+6.1f}% "
          f"{one_unit / MIB:10.2f} {100 * (one_unit / tracked - 1):+6.1f}%")


if __name__ == "__main__":
    main()
