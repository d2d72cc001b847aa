"""The peak memory of a training step per rank: predicted against tracked, every mode and recompute option.

The GPT stack of `benchmarks/memory.py` (4 blocks, hidden 128, 8 heads, batch 16, sequence 64,
fp32 by default) is sharded over 8 gloo processes (`tess_compile.shard`, [2,2,2] for 2.5-D and
3-D, 1-D over p = 8; 2-D over [2,2] in 4 processes). Each rank runs two training steps under
torch's `MemTracker` (`torch.distributed._tools.mem_tracker`): forward, backward from the local
output with a gradient of ones (as a loss's backward hands it), AdamW's step, gradients set to
None. Its tracked peak, the most bytes of tensors alive at once (parameters, inputs, activations,
gradients, temporaries, optimizer state), is compared with the prediction,
`predict_memory(program).total` (`tess_compile.analysis.memory.step_peak`: the same step on fake
tensors), and with the old figure, what a rank holds at the start of backward (`at_backward`).

    python3 benchmarks/peak_memory.py [--layers 4] [--hidden 128] [--heads 8] [--batch 16] [--seq 64]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile
from benchmarks.memory import Stack
from tess_compile.analysis.memory import predict_memory
from tess_compile.runtime.launch import run_local

MIB = 2**20
RECOMPUTE = ("none", "blocks", "selective")
MESHES = {"2.5d": (2, 2), "3d": (2, 2), "1d": (2, 2), "2d": (2, 1)}  # mode: (q, d); 1-D: p = q * q * d


def _model(size: dict):
    torch.manual_seed(0)
    model = Stack(size["layers"], size["hidden"], size["heads"])
    x = torch.randn(size["batch"], size["seq"], size["hidden"])
    return model, x


def tracked_peaks(rank: int, world: int, size: dict, configs: list) -> list[dict]:
    """Each (mode, recompute) of `configs` on this rank: the tracked peak of two training steps,
    and the prediction's total and start-of-backward figure."""
    from torch.distributed._tools.mem_tracker import MemTracker

    rows = []
    for mode, recompute in configs:
        q, d = MESHES[mode]
        model, x = _model(size)
        sharded = tess_compile.shard(model, q, d, example_inputs=(x,), mode=mode, recompute=recompute)
        optimizer = torch.optim.AdamW(sharded.parameters())
        tracker = MemTracker()
        tracker.track_external(sharded, optimizer, x)
        with tracker:
            for _ in range(2):
                tracker.reset_mod_stats()  # the tracker refuses a module's second call otherwise
                local = sharded(x).to_local()
                local.backward(torch.ones_like(local))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del local
        tracked = max(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())
        predicted = predict_memory(sharded.program)
        rows.append({"mode": mode, "recompute": recompute, "ranks": world, "tracked": tracked,
                     "predicted": predicted.total, "at_backward": predicted.at_backward})
    return rows


def measure(size: dict, configs: list) -> list[dict]:
    """The worst rank's row of each config (largest relative error), the 8-rank meshes in one
    launch of 8 processes and 2-D in one of 4."""
    rows = []
    for world in (8, 4):
        chosen = [c for c in configs if (world == 4) == (c[0] == "2d")]
        if not chosen:
            continue
        per_rank = run_local(tracked_peaks, world, args=(size, chosen), timeout_s=600)
        for k in range(len(chosen)):
            rows.append(max((ranks[k] for ranks in per_rank), key=lambda r: abs(r["predicted"] / r["tracked"] - 1)))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'mode':<6} {'ranks':>5} {'recompute':<10} {'tracked MiB':>11} {'predicted MiB':>13} {'error':>7} "
          f"{'at backward MiB':>15} {'error':>7}")
    for r in rows:
        print(f"{r['mode']:<6} {r['ranks']:>5} {r['recompute']:<10} {r['tracked'] / MIB:11.2f} "
              f"{r['predicted'] / MIB:13.2f} {100 * (r['predicted'] / r['tracked'] - 1):6.1f}% "
              f"{r['at_backward'] / MIB:15.2f} {100 * (r['at_backward'] / r['tracked'] - 1):6.1f}%")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 4), ("hidden", 128), ("heads", 8), ("batch", 16), ("seq", 64)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    size = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "batch", "seq")}
    print(f"GPT stack {size}, fp32, AdamW; the worst rank of each mesh")
    print_table(measure(size, [(mode, r) for mode in MESHES for r in RECOMPUTE]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
