"""Training step time on this machine over gloo: 2.5-D [2,2,2] against 1-D p=8.

One launch of 8 local processes. Every rank compiles the same model (a stack
of `Block`s) for each configuration, runs warm-up steps, then times
`--steps` AdamW steps (forward, backward of the mean square of this rank's
output block, optimizer) between barriers. Rank
0 prints one row per configuration: median and best step seconds, and the
bytes each rank moved per step (recorded by the runtime). CPU cores are
shared by all 8 processes, so the numbers rank configurations on this
machine; they are not GPU predictions.

    python3 benchmarks/gloo_step_time.py [--layers 2] [--hidden 256] [--heads 8] [--batch 16] [--seq 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile  # noqa: E402
from benchmarks.paper_tables import Block  # noqa: E402
from tess_compile.runtime.launch import run_local

WORLD = 8
# (label, q, d, mode, summa)
CONFIGS = [
    ("1-D p=8", 2, 2, "1d", "broadcast"),
    ("2.5-D [2,2,2]", 2, 2, "2.5d", "broadcast"),
    ("2.5-D [2,2,2] overlap", 2, 2, "2.5d", "overlap"),
    ("2.5-D [2,2,2] gather", 2, 2, "2.5d", "gather"),
]


def _time_config(model_args: dict, q: int, d: int, mode: str, summa: str, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(model_args["hidden"], model_args["heads"]) for _ in range(model_args["layers"])])
    x = torch.randn(model_args["batch"], model_args["seq"], model_args["hidden"])
    sharded = tess_compile.shard(model, q, d, example_inputs=(x,), mode=mode, summa=summa, timeout=300)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
    times = []
    for step in range(warmup + steps):
        if step == warmup:
            sharded.comm.records.clear()
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        sharded(x).to_local().square().mean().backward()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    moved = sum(r.num_bytes for r in sharded.comm.records) / steps
    return {"median": statistics.median(times[warmup:]), "best": min(times[warmup:]), "bytes": moved}


def _worker(rank: int, world_size: int, model_args: dict, steps: int, warmup: int) -> list:
    torch.set_num_threads(1)
    return [_time_config(model_args, q, d, mode, summa, steps, warmup) for _, q, d, mode, summa in CONFIGS]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    model_args = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "batch", "seq")}
    start = time.perf_counter()
    results = run_local(_worker, WORLD, args=(model_args, args.steps, args.warmup), timeout_s=1200, collective_timeout_s=300)
    print(f"GPT stack: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, batch {args.batch}, "
          f"sequence {args.seq}, fp32; {WORLD} gloo processes on {os.cpu_count()} CPU cores; "
          f"{args.steps} timed AdamW steps after {args.warmup} warm-up")
    print(f"{'configuration':<24} {'median s':>9} {'best s':>8} {'MB/rank/step':>13}")
    for index, (label, *_) in enumerate(CONFIGS):
        slowest = max(rank_rows[index]["median"] for rank_rows in results)
        row = results[0][index]
        print(f"{label:<24} {slowest:9.3f} {row['best']:8.3f} {row['bytes'] / 1e6:13.2f}")
    print(f"(median: the slowest rank's median; wall time of the whole run {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
