"""Predicted times beside the Tesseract paper's measured times, and the planner's ranking.

For every row of the paper's Tables 1 and 2, one `Block` is compiled on the
meta device for that row's method and mesh and priced by the cost model on
the paper's cluster (`tess_compile.cost_model.PAPER_CLUSTER`: 4 A100 per
node, NVLink 200 GB/s, InfiniBand 200 Gb/s; the figures the paper does not
give are stated there). The prediction is per layer in the papers'
schedule (`summa="broadcast"`); the paper's times are per batch of a model
whose depth it does not state, so the columns to compare are the ratios.
Then the comparisons the paper draws, predicted against measured, and the
planner's table for the Table 1 model on 64 GPUs (it also prices the
"overlap" and "gather" schedules).

    python3 benchmarks/paper_times.py [--table 1|2|both]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.paper_tables import SEQ, TABLE_1, TABLE_2, Block, compile_layer  # noqa: E402
from tess_compile.cost_model import PAPER_CLUSTER, predict_time  # noqa: E402
from tess_compile.planner import format_table, plan  # noqa: E402

MS = 1e3


def predict(row, cluster=PAPER_CLUSTER):
    """The cost model's StepTime of one layer of `row`'s configuration."""
    program = compile_layer(row.mesh, row.batch_used, row.hidden, row.heads)
    return predict_time(program, cluster, inputs_require_grad=True)


def print_rows(title: str, rows) -> dict:
    """One line per row: predicted ms per layer beside the paper's s per batch. Returns the predictions."""
    print(f"\n{title}: predicted per layer (sequence {SEQ}) beside the paper's measured per batch")
    print(f"{'method':<12} {'shape':<10} {'batch':>5} {'fwd ms':>8} {'bwd ms':>8} {'comm %':>7} "
          f"{'paper fwd s':>11} {'paper bwd s':>11}")
    predicted = {}
    for row in rows:
        time = predict(row)
        predicted[(row.method, row.shape)] = time
        comm = (time.forward_comm_s + time.backward_comm_s) / time.step_s
        print(f"{row.method:<12} {row.shape:<10} {row.batch_used:>5} {time.forward_s * MS:8.2f} "
              f"{time.backward_s * MS:8.2f} {100 * comm:7.0f} {row.forward_s:11.4f} {row.backward_s:11.4f}")
    return predicted


def compare(title: str, rows, predicted: dict, pairs) -> None:
    """Forward speedups of `pairs` ((slower method, shape), (faster method, shape)), measured and predicted."""
    by_key = {(row.method, row.shape): row for row in rows}
    print(f"\n{title}: forward-time speedup, paper measured vs predicted")
    print(f"{'comparison':<40} {'paper':>7} {'predicted':>10} {'same direction':>15}")
    for slow, fast in pairs:
        measured = by_key[slow].forward_s / by_key[fast].forward_s
        model = predicted[slow].forward_s / predicted[fast].forward_s
        same = "yes" if (measured > 1) == (model > 1) else "NO"
        label = f"{fast[0]} {fast[1]} over {slow[0]} {slow[1]}"
        print(f"{label:<40} {measured:7.3f} {model:10.3f} {same:>15}")


def rank_64(rows, predicted: dict) -> None:
    """The 64-GPU rows ranked by the paper's forward+backward time and by the prediction."""
    rows64 = [row for row in rows if row.mesh.num_ranks == 64]
    by_paper = sorted(rows64, key=lambda r: r.forward_s + r.backward_s)
    by_model = sorted(rows64, key=lambda r: predicted[(r.method, r.shape)].step_s)
    print("\nTable 1, 64 GPUs, fastest first (forward + backward)")
    print(f"{'rank':>4}  {'paper':<24} {'predicted':<24}")
    for place, (a, b) in enumerate(zip(by_paper, by_model), 1):
        print(f"{place:>4}  {a.method + ' ' + a.shape:<24} {b.method + ' ' + b.shape:<24}")


def print_plan() -> None:
    row = next(r for r in TABLE_1 if r.shape == "[4,4,4]")

    def factory():
        return Block(row.hidden, row.heads), torch.empty(row.batch_used, SEQ, row.hidden)

    print(f"\nPlanner: the Table 1 layer (hidden {row.hidden}, {row.heads} heads, batch {row.batch_used}, "
          f"sequence {SEQ}) on 64 GPUs, 4 per node (tess_compile.plan)")
    print(format_table(plan(factory, 64, gpus_per_node=4, modes=("1d", "2d", "2.5d"))), end="")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=("1", "2", "both"), default="both")
    parser.add_argument("--no-plan", action="store_true", help="skip the planner's table")
    args = parser.parse_args(argv)
    if args.table in ("1", "both"):
        predicted = print_rows("Table 1 (strong scaling)", TABLE_1)
        compare("Table 1", TABLE_1, predicted, [
            (("Tesseract", "[8,8,1]"), ("Tesseract", "[4,4,4]")),
            (("Megatron-LM", "[64]"), ("Tesseract", "[4,4,4]")),
            (("Optimus", "[8,8]"), ("Tesseract", "[4,4,4]")),
            (("Tesseract", "[4,4,1]"), ("Tesseract", "[4,4,2]")),
            (("Tesseract", "[2,2,1]"), ("Tesseract", "[2,2,2]")),
        ])
        rank_64(TABLE_1, predicted)
    if args.table in ("2", "both"):
        predicted = print_rows("Table 2 (weak scaling)", TABLE_2)
        compare("Table 2", TABLE_2, predicted, [
            (("Tesseract", "[8,8,1]"), ("Tesseract", "[4,4,4]")),
            (("Megatron-LM", "[64]"), ("Tesseract", "[4,4,4]")),
            (("Optimus", "[8,8]"), ("Tesseract", "[4,4,4]")),
        ])
    if not args.no_plan:
        print_plan()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
