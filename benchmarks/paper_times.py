"""The calibrated cost model against the Tesseract paper's measured times (Tables 1 and 2).

Every row of the paper's Tables 1 and 2 is compiled once, on the meta
device, for its method and mesh, as the paper most likely ran it (fp16, each
layer recomputed in backward; `benchmarks.paper_tables.compile_paper_layer`),
and profiled (`cost_model.profile_program`). The gradient all-reduces of
replicated parameters are left out of the predicted backward: the paper's
timed backward does not hold them (see docs/planner.md). Then:

- the cost model's constants are fitted to one table and the other is held
  out, both ways (`tess_compile.analysis.calibration.fit_cluster`; the scale, i.e. the
  number of layers behind the paper's seconds per batch, is fitted per
  table: Kendall's tau does not depend on it);
- the Kendall tau (tau-b) of predicted against measured forward + backward
  seconds, per table, for the uncalibrated cluster and both fits, beside the
  largest tau any model of these programs can reach (rows with the same
  program, such as Optimus [q,q] and Tesseract [q,q,1], are predicted equal
  whatever the constants);
- the fitted constants, and per row the predictions beside the measurements;
- the comparisons the paper draws, and the 64-GPU ranking, with the
  calibrated cluster that `tess_compile.plan` uses (`CALIBRATED_CLUSTER`,
  the fit to Table 1), and the planner's table for the Table 1 layer.

    python3 benchmarks/paper_times.py [--table 1|2|both] [--no-plan] [--seq 512]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.paper_tables import PAPER_DTYPE, SEQ, TABLE_1, TABLE_2, Block, compile_paper_layer  # noqa: E402
from tess_compile.analysis.calibration import (
    BOUNDS,
    FIT_PARAMETERS,
    Observation,
    fit_cluster,
    format_constant,
    kendall_tau,
    max_kendall_tau,
    predicted_seconds,
)
from tess_compile.analysis.cost_model import profile_program, time_terms
from tess_compile.analysis.plan_table import format_table
from tess_compile.analysis.planner import plan
from tess_compile.core.cluster import CALIBRATED_CLUSTER, PAPER_CLUSTER

TABLES = {"1": ("Table 1 (strong scaling)", TABLE_1), "2": ("Table 2 (weak scaling)", TABLE_2)}
GRAD_SYNC = False  # the paper's timed backward holds no gradient all-reduce of replicated parameters
# The fit starts from the paper's cluster at the A100's fp16 peak (the products' rate is
# flops * m / (m + matmul_half_size)); FIT_PARAMETERS are fitted, flops stays.
FIT_BASE = replace(PAPER_CLUSTER, flops=312e12)


def observations(rows, seq: int = SEQ) -> list[Observation]:
    """Each row's profile (one layer, compiled once per process) beside its measured seconds."""
    return [Observation(f"{row.method} {row.shape}",
                        profile_program(compile_paper_layer(row, seq), inputs_require_grad=True),
                        row.forward_s, row.backward_s) for row in rows]


def fit_table(table: str):
    """`calibration.fit_cluster` on one table's rows, as CALIBRATED_CLUSTER was fitted."""
    return fit_cluster(observations(TABLES[table][1]), FIT_BASE, grad_sync=GRAD_SYNC)


def tau(cluster, obs) -> float:
    predicted = predicted_seconds(obs, cluster, grad_sync=GRAD_SYNC)
    return kendall_tau([f + b for f, b in predicted], [o.step_s for o in obs])


def best_tau(obs) -> float:
    """The largest tau-b of any prediction that gives rows of equal profiles equal times."""
    def key(o):
        terms = time_terms(o.profile, FIT_BASE, grad_sync=GRAD_SYNC)
        return tuple(round(value, 6) for phase in terms.values() for value in phase.values())
    return max_kendall_tau([key(o) for o in obs], [o.step_s for o in obs])


def typical_error(cluster, obs) -> float:
    """exp(rms of log(measured / predicted)) over forward and backward, at the best scale."""
    logs = [math.log(m / p) for o, pair in zip(obs, predicted_seconds(obs, cluster, grad_sync=GRAD_SYNC))
            for m, p in zip((o.forward_s, o.backward_s), pair)]
    mean = sum(logs) / len(logs)
    return math.exp(math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs)))


def scale_of(cluster, obs) -> float:
    """Measured seconds per predicted second (geometric mean): the layers behind a batch."""
    logs = [math.log(m / p) for o, pair in zip(obs, predicted_seconds(obs, cluster, grad_sync=GRAD_SYNC))
            for m, p in zip((o.forward_s, o.backward_s), pair)]
    return math.exp(sum(logs) / len(logs))


def print_taus(obs: dict, fits: dict, seq: int = SEQ) -> None:
    print("\nKendall tau (tau-b) of predicted against measured forward + backward seconds;")
    print("error: typical factor between predicted and measured seconds (forward and backward, best scale)")
    print(f"{'cluster':<40} {'Table 1':>8} {'Table 2':>8} {'error T1':>9} {'error T2':>9}")
    print(f"{'best any model of these programs can do':<40} {best_tau(obs['1']):8.3f} {best_tau(obs['2']):8.3f}")
    rows = [("uncalibrated (PAPER_CLUSTER)", PAPER_CLUSTER)]
    shipped = " (CALIBRATED_CLUSTER)" if seq == SEQ else ""
    rows += [(f"fitted to Table {t}{shipped if t == '1' else ''}", fits[t].cluster) for t in ("1", "2")]
    for label, cluster in rows:
        print(f"{label:<40} {tau(cluster, obs['1']):8.3f} {tau(cluster, obs['2']):8.3f} "
              f"{typical_error(cluster, obs['1']):9.2f} {typical_error(cluster, obs['2']):9.2f}")


def print_constants(fits: dict) -> None:
    print("\nFitted constants (flops fixed at the A100's fp16 peak; * at an end of its range)")
    print(f"{'':<17} {'fit to Table 1':>15} {'fit to Table 2':>15}   range")
    for name in ("flops", *FIT_PARAMETERS):
        cells = [format_constant(name, getattr(fits[t].cluster, name)) + ("*" if name in fits[t].at_bounds else " ")
                 for t in ("1", "2")]
        low, high = BOUNDS[name]
        print(f"{name:<17} {cells[0]:>15} {cells[1]:>15}   {format_constant(name, low)} .. {format_constant(name, high)}")
    for t in ("1", "2"):
        fit = fits[t]
        print(f"fit to Table {t}: scale {fit.scale:.1f} (layers per batch), sum of squared log errors {fit.loss:.3f} "
              f"over {fit.num_points} times")
    same = all(math.isclose(getattr(fits["1"].cluster, n), getattr(CALIBRATED_CLUSTER, n), rel_tol=1e-3)
               for n in ("flops", *FIT_PARAMETERS))
    print(f"CALIBRATED_CLUSTER {'holds' if same else 'DIFFERS FROM'} the fit to Table 1")


def print_rows(title: str, rows, obs, fits: dict, seq: int) -> None:
    """Per row: the paper's seconds per batch beside each fit's prediction at that fit's
    scale for this table (its layers per batch)."""
    print(f"\n{title}: measured seconds per batch beside the predicted (one layer, sequence {seq}, "
          f"times the layers that fit this table best)")
    header = f"{'method':<12} {'shape':<8} {'batch':>5} {'paper fwd':>9} {'bwd':>7} {'sum':>7}"
    for t in ("1", "2"):
        header += f" | {'fit T' + t + ' fwd':>10} {'bwd':>7} {'sum':>7}"
    print(header)
    columns = {}
    for t in ("1", "2"):
        scale = scale_of(fits[t].cluster, obs)
        columns[t] = [(scale * f, scale * b) for f, b in predicted_seconds(obs, fits[t].cluster, grad_sync=GRAD_SYNC)]
    for k, row in enumerate(rows):
        line = (f"{row.method:<12} {row.shape:<8} {row.batch_used:>5} {row.forward_s:9.4f} {row.backward_s:7.4f} "
                f"{row.forward_s + row.backward_s:7.4f}")
        for t in ("1", "2"):
            f, b = columns[t][k]
            line += f" | {f:10.4f} {b:7.4f} {f + b:7.4f}"
        print(line)


def compare(title: str, rows, obs, pairs) -> None:
    """Forward speedups of `pairs` ((slower method, shape), (faster method, shape)),
    measured and predicted with CALIBRATED_CLUSTER."""
    by_key = {(row.method, row.shape): row for row in rows}
    predicted = dict(zip([(row.method, row.shape) for row in rows],
                         predicted_seconds(obs, CALIBRATED_CLUSTER, grad_sync=GRAD_SYNC)))
    print(f"\n{title}: forward-time speedup, paper measured vs predicted (CALIBRATED_CLUSTER)")
    print(f"{'comparison':<40} {'paper':>7} {'predicted':>10} {'same direction':>15}")
    for slow, fast in pairs:
        measured = by_key[slow].forward_s / by_key[fast].forward_s
        model = predicted[slow][0] / predicted[fast][0]
        same = "yes" if (measured > 1) == (model > 1) else "NO"
        label = f"{fast[0]} {fast[1]} over {slow[0]} {slow[1]}"
        print(f"{label:<40} {measured:7.3f} {model:10.3f} {same:>15}")


def rank_64(rows, obs) -> None:
    """The 64-GPU rows ranked by the paper's forward+backward time and by the prediction."""
    predicted = dict(zip([(row.method, row.shape) for row in rows],
                         predicted_seconds(obs, CALIBRATED_CLUSTER, grad_sync=GRAD_SYNC)))
    rows64 = [row for row in rows if row.mesh.num_ranks == 64]
    by_paper = sorted(rows64, key=lambda r: r.forward_s + r.backward_s)
    by_model = sorted(rows64, key=lambda r: sum(predicted[(r.method, r.shape)]))
    print("\nTable 1, 64 GPUs, fastest first (forward + backward; CALIBRATED_CLUSTER)")
    print(f"{'rank':>4}  {'paper':<24} {'predicted':<24}")
    for place, (a, b) in enumerate(zip(by_paper, by_model), 1):
        print(f"{place:>4}  {a.method + ' ' + a.shape:<24} {b.method + ' ' + b.shape:<24}")


def print_plan() -> None:
    row = next(r for r in TABLE_1 if r.shape == "[4,4,4]")

    def factory():
        return Block(row.hidden, row.heads).to(PAPER_DTYPE), torch.empty(row.batch_used, SEQ, row.hidden,
                                                                         dtype=PAPER_DTYPE)

    print(f"\nPlanner: the Table 1 layer (hidden {row.hidden}, {row.heads} heads, batch {row.batch_used}, "
          f"sequence {SEQ}, fp16) on 64 GPUs, 4 per node (tess_compile.plan, CALIBRATED_CLUSTER)")
    print(format_table(plan(factory, 64, gpus_per_node=4, modes=("1d", "2d", "2.5d"))), end="")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=("1", "2", "both"), default="both",
                        help="the tables whose rows and comparisons to print (both are fitted and scored)")
    parser.add_argument("--no-plan", action="store_true", help="skip the planner's table")
    parser.add_argument("--seq", type=int, default=SEQ,
                        help=f"the sequence length to assume (default {SEQ}; CALIBRATED_CLUSTER is fitted at {SEQ})")
    args = parser.parse_args(argv)
    print(f"Assumed for the paper's runs: sequence {args.seq}, {str(PAPER_DTYPE).replace('torch.', '')}, each layer "
          "recomputed in backward, no gradient all-reduce of replicated parameters in the timed backward, "
          "a batch the mesh does not divide raised to a multiple of d*q")
    obs = {t: observations(rows, args.seq) for t, (_, rows) in TABLES.items()}
    fits = {t: fit_cluster(obs[t], FIT_BASE, grad_sync=GRAD_SYNC) for t in TABLES}
    print_taus(obs, fits, args.seq)
    print_constants(fits)
    for t in ("1", "2"):
        if args.table in (t, "both"):
            print_rows(TABLES[t][0], TABLES[t][1], obs[t], fits, args.seq)
    if args.table in ("1", "both"):
        compare("Table 1", TABLE_1, obs["1"], [
            (("Tesseract", "[8,8,1]"), ("Tesseract", "[4,4,4]")),
            (("Megatron-LM", "[64]"), ("Tesseract", "[4,4,4]")),
            (("Optimus", "[8,8]"), ("Tesseract", "[4,4,4]")),
            (("Tesseract", "[4,4,1]"), ("Tesseract", "[4,4,2]")),
            (("Tesseract", "[2,2,1]"), ("Tesseract", "[2,2,2]")),
        ])
        rank_64(TABLE_1, obs["1"])
    if args.table in ("2", "both"):
        compare("Table 2", TABLE_2, obs["2"], [
            (("Tesseract", "[8,8,1]"), ("Tesseract", "[4,4,4]")),
            (("Megatron-LM", "[64]"), ("Tesseract", "[4,4,4]")),
            (("Optimus", "[8,8]"), ("Tesseract", "[4,4,4]")),
        ])
    if not args.no_plan:
        print_plan()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
