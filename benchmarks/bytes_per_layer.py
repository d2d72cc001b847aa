"""Bytes each rank moves per transformer layer: 1-D vs 2-D vs 2.5-D.

Part 1, predicted at the paper's scale: one `Block` per row of the Tesseract
paper's Tables 1 and 2, compiled on the meta device for that row's method
and mesh; the per-rank bytes of one forward and one backward (the layer's
input requires grad, as inside a network) come from the per-rank graph
(`tess_compile.analysis.accounting.predict_bytes`: the bytes of each tensor a rank
passes to a collective).

Part 2, measured at small scale: the same meshes run in the simulator on a
small layer (hidden 128, 64 heads, batch 16, sequence 8); the bytes the run
recorded are printed beside the prediction for the same layer.

    python3 benchmarks/bytes_per_layer.py [--table 1|2|both] [--no-measure]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.paper_tables import SEQ, TABLE_1, TABLE_2, Block, compile_layer  # noqa: E402
from tess_compile.passes.driver import compile_model
from tess_compile.analysis.accounting import bytes_by_phase, bytes_from_records, collective_costs, predict_bytes
from tess_compile.analysis.cost_model import ring_wire_bytes
from tess_compile.runtime.simulator import SimulatedModule

MB = 1e6
SMALL = {"hidden": 128, "heads": 64, "batch": 16, "seq": 8}


def _totals(by_phase: dict) -> tuple[int, int, int, int]:
    """(forward bytes, backward bytes, forward collectives' kinds, backward's) of one phase dict."""
    fwd, bwd = by_phase["forward"], by_phase["backward"]
    return sum(fwd.values()), sum(bwd.values()), len(fwd), len(bwd)


def predicted(mesh, batch: int, hidden: int, heads: int, seq: int) -> tuple[dict, dict]:
    """(payload by phase and collective, ring wire bytes by phase) per rank of one forward and
    backward of a `Block` compiled on the meta device."""
    program = compile_layer(mesh, batch, hidden, heads, seq)
    costs = collective_costs(program.graph, mesh, inputs_require_grad=True)
    return bytes_by_phase(costs), ring_wire_bytes(costs, mesh)


def measured(mesh) -> tuple[dict, dict]:
    """(recorded, predicted) bytes of the small layer run in the simulator."""
    torch.manual_seed(0)
    block = Block(SMALL["hidden"], SMALL["heads"])
    x = torch.randn(SMALL["batch"], SMALL["seq"], SMALL["hidden"], requires_grad=True)
    sim = SimulatedModule(compile_model(block, mesh, (x,)))
    sim(x).sum().backward()
    return bytes_from_records(sim.comm.records), predict_bytes(sim.program, inputs_require_grad=True)


def print_predicted(title: str, rows) -> None:
    print(f"\n{title}: predicted MB per rank per layer (sequence {SEQ}, fp32)")
    print(f"{'':<45} {'payload':^29}  {'ring wire':^29}")
    print(f"{'method':<12} {'shape':<10} {'GPUs':>4} {'batch':>5} {'hidden':>6} {'heads':>5} "
          f"{'forward':>9} {'backward':>9} {'total':>9}  {'forward':>9} {'backward':>9} {'total':>9}")
    for row in rows:
        payload, wire = predicted(row.mesh, row.batch_used, row.hidden, row.heads, SEQ)
        fwd, bwd, _, _ = _totals(payload)
        wf, wb = wire["forward"], wire["backward"]
        print(f"{row.method:<12} {row.shape:<10} {row.mesh.num_ranks:>4} {row.batch_used:>5} {row.hidden:>6} "
              f"{row.heads:>5} {fwd / MB:9.1f} {bwd / MB:9.1f} {(fwd + bwd) / MB:9.1f}  "
              f"{wf / MB:9.1f} {wb / MB:9.1f} {(wf + wb) / MB:9.1f}")


def print_measured(rows) -> None:
    print(f"\nMeasured in the simulator, small layer (hidden {SMALL['hidden']}, {SMALL['heads']} heads, "
          f"batch {SMALL['batch']}, sequence {SMALL['seq']}): bytes per rank, recorded vs predicted")
    print(f"{'method':<12} {'shape':<10} {'fwd recorded':>13} {'fwd predicted':>14} "
          f"{'bwd recorded':>13} {'bwd predicted':>14} {'equal':>6}")
    seen = set()
    for row in rows:
        if row.mesh in seen:
            continue
        seen.add(row.mesh)
        recorded, predicted_bytes = measured(row.mesh)
        rf, rb, _, _ = _totals(recorded)
        pf, pb, _, _ = _totals(predicted_bytes)
        same = "yes" if recorded == predicted_bytes else "NO"
        print(f"{row.method:<12} {row.shape:<10} {rf:>13} {pf:>14} {rb:>13} {pb:>14} {same:>6}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=("1", "2", "both"), default="both")
    parser.add_argument("--no-measure", action="store_true", help="skip the simulator runs")
    args = parser.parse_args(argv)
    if args.table in ("1", "both"):
        print_predicted("Table 1 (strong scaling)", TABLE_1)
    if args.table in ("2", "both"):
        print_predicted("Table 2 (weak scaling)", TABLE_2)
    if not args.no_measure:
        print_measured(TABLE_1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
