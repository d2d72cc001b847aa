"""The planner's predicted step time against measured, over 8 local gloo processes.

Each round, a launch of 8 local processes first profiles this machine
(`tess_compile.profile_cluster`: every rank busy at once, so the profile
holds the contention of 8 processes on this machine's cores); then, for three
model sizes (a stack of GPT blocks, `benchmarks.paper_tables.Block`), a
launch of its own trains each configuration the planner lists for 8 ranks,
its products in the schedules summa="auto" picks on the profile (in one
launch, the process groups and modules of earlier configurations slowed
later ones by up to 2x), and this process plans each configuration with
`tess_compile.plan(..., cluster=profiled)`. A round's rows are priced by the
profile taken just before them (one profile for a whole run had drifted up to
15% from rows timed minutes later); the medians over `--rounds` rounds of
the predicted and of the measured time are compared. The configurations:

- 1-D p=8 (Megatron-LM), [2,2,2] in 2.5-D and in 3-D;
- data parallel 2 x [2,2,1] (2-D) and 2 x 1-D p=4 (`shard(..., mesh=)`);
- pipeline 2 x [2,2,1] (`pipeline_stage`, GPipe, the planner's microbatches);
- README's loop (`--only readme` runs these beside the first two rows, their meshes' own step):
  1-D p=8 and 2.5-D [2,2,2], with and without recompute="blocks".

A step is zero_grad, forward, backward of the mean square of this rank's
output block, and AdamW (priced with that tail: `StepTail(gather=False)`); README's loop gathers
the output whole on every rank (`tess_compile.full_tensor`) and takes the mean square of that
(`step_tail.square_mean`; priced with `README_STEP`: the gather's all-gather and the loss's kernels); its time is the slowest rank's (a barrier before
and after), the median over `--steps` steps after `--warmup`. The table
prints predicted against measured per row, the mean absolute percentage
error, Kendall's tau-b over the rows, and whether the predicted fastest row
is within 10% of the measured fastest. `--summa all` runs (and plans)
every configuration in every fixed schedule instead.

    python3 benchmarks/plan_accuracy.py [--steps 5] [--warmup 2] [--rounds 3] [--sizes small,large]
                                        [--summa auto|all] [--quick] [--profile-out cluster.json]
                                        [--only all|readme]

`--profile-out` writes the first round's profiled cluster with `time_error`, the worst model's
mean absolute error, which `tess-compile plan --cluster` reads to mark rows closer than it as ties.

`--quick` runs one tiny size and two configurations, one round, for the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import ScheduleGPipe

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile  # noqa: E402
from benchmarks.paper_tables import Block  # noqa: E402
from tess_compile.analysis.parallel_plan import default_microbatches  # noqa: E402
from tess_compile.analysis.profiling import profile_cluster  # noqa: E402
from tess_compile.analysis.rank_timing import step_seconds  # noqa: E402
from tess_compile.analysis.schedule_choice import has_summa_steps  # noqa: E402
from tess_compile.analysis.step_tail import README_STEP, StepTail, square_mean  # noqa: E402
from tess_compile.core.options import SCHEDULES  # noqa: E402
from tess_compile.runtime.launch import run_local  # noqa: E402

WORLD = 8

SIZES = {
    "small": {"layers": 2, "hidden": 128, "heads": 8, "batch": 16, "seq": 64},
    "large": {"layers": 2, "hidden": 256, "heads": 8, "batch": 16, "seq": 128},
    # other proportions, which nothing was fitted to: deeper, narrower, a short sequence, a larger batch
    "deep": {"layers": 4, "hidden": 64, "heads": 8, "batch": 32, "seq": 32},
}
QUICK_SIZES = {"tiny": {"layers": 2, "hidden": 32, "heads": 8, "batch": 8, "seq": 8}}

# (label, mode, q, d, dp, pp, recompute, step): step "local" (the loss of the local block) or "readme"
CONFIGS = [
    ("1-D p=8", "1d", 1, 8, 1, 1, "none", "local"),
    ("2.5-D [2,2,2]", "2.5d", 2, 2, 1, 1, "none", "local"),
    ("3-D [2,2,2]", "3d", 2, 2, 1, 1, "none", "local"),
    ("dp 2 x [2,2,1]", "2d", 2, 1, 2, 1, "none", "local"),
    ("dp 2 x 1-D p=4", "1d", 1, 4, 2, 1, "none", "local"),
    ("pp 2 x [2,2,1]", "2d", 2, 1, 1, 2, "none", "local"),
]
README_CONFIGS = [(f"README {label}{' blocks' if recompute == 'blocks' else ''}", mode, q, d, 1, 1, recompute, "readme")
                  for label, mode, q, d in (("1-D p=8", "1d", 1, 8), ("2.5-D [2,2,2]", "2.5d", 2, 2))
                  for recompute in ("none", "blocks")]
QUICK_CONFIGS = [CONFIGS[0], CONFIGS[3]]
TAILS = {"local": StepTail(gather=False), "readme": README_STEP}  # the step of each row, as the planner prices it


def schedules_of(mode: str, q: int, d: int, summa: str) -> tuple[str, ...]:
    """The schedules to run a mesh in: "auto", or with `summa="all"` every fixed one where
    products take SUMMA steps (the others run alike in each)."""
    if summa == "auto":
        return ("auto",)
    return SCHEDULES if has_summa_steps(tess_compile.Mesh(q, d, mode)) else ("broadcast",)


def make_model(size: dict) -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(size["hidden"], size["heads"]) for _ in range(size["layers"])])
    return model, torch.randn(size["batch"], size["seq"], size["hidden"])


def _loss(out) -> torch.Tensor:
    return out.to_local().square().mean()


def _tensor_parallel_step(model, x, mode, q, d, dp, summa, cluster, recompute="none", readme=False):
    mesh = None
    if dp > 1:
        shape = tess_compile.Mesh(q, d, mode).shape
        mesh = init_device_mesh("cpu", (dp, *shape), mesh_dim_names=("dp", "depth", "row", "col"))
        rows = x.shape[0] // dp
        group = mesh.get_local_rank("dp")
        x = x[group * rows:(group + 1) * rows]
    sharded = tess_compile.shard(model, q, d, example_inputs=(x,), mode=mode, summa=summa, mesh=mesh, timeout=300,
                                 cluster=cluster, recompute=recompute)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)

    def step():
        opt.zero_grad()
        _loss(sharded(x)).backward()
        opt.step()

    def readme_step():  # README's loop
        loss = square_mean(tess_compile.full_tensor(sharded(x)))
        loss.backward()
        opt.step()
        opt.zero_grad()

    return readme_step if readme else step


def _pipeline_step(model, x, q, d, summa, microbatches, cluster):
    stage_index = dist.get_rank() // (q * q * d)
    half = len(model) // 2
    part = model[:half] if stage_index == 0 else model[half:]
    rows = x.shape[0] // microbatches
    example = (x[:rows],) if stage_index == 0 else (torch.zeros_like(x[:rows]),)
    stage = tess_compile.pipeline_stage(part, q, d, stage_index, 2, example_inputs=example, mode="2d",
                                        summa=summa, timeout=300, cluster=cluster)
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=lambda out, _: _loss(out))
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-4)
    target = torch.zeros(x.shape[0])

    def step():
        opt.zero_grad()
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=target)
        opt.step()

    return step


def _profile_worker(rank: int, world: int):
    return profile_cluster()


def _config_worker(rank: int, world: int, size: dict, config: tuple, summa: str, steps: int, warmup: int,
                   cluster) -> float:
    _, mode, q, d, dp, pp, recompute, kind = config
    model, x = make_model(size)
    if pp > 1:
        step = _pipeline_step(model, x, q, d, summa, default_microbatches(x.shape[0], pp), cluster)
    else:
        step = _tensor_parallel_step(model, x, mode, q, d, dp, summa, cluster, recompute, kind == "readme")
    return step_seconds(step, steps, warmup)


def measure(sizes: dict, configs: list, steps: int, warmup: int, summa: str, cluster) -> dict:
    """{(size, label, schedule): seconds}: each configuration in a launch of its own, so that
    no process group or module of another configuration lingers beside it."""
    times = {}
    for size_name, size in sizes.items():
        for config in configs:
            for schedule in schedules_of(*config[1:4], summa):
                args = (size, config, schedule, steps, warmup, cluster)
                times[(size_name, config[0], schedule)] = run_local(
                    _config_worker, WORLD, args=args, timeout_s=900, collective_timeout_s=600)[0]
    return times


def run_rounds(sizes: dict, configs: list, steps: int, warmup: int, rounds: int, summa: str):
    """Each round: a profile, every configuration measured, and each predicted on that profile.
    Returns the first profile, {key: median measured seconds} and {key: the StepTime of the round
    whose predicted step time is the median (the lower one of an even count)}."""
    profiles, measured, predicted = [], {}, {}
    for _ in range(rounds):
        cluster = run_local(_profile_worker, WORLD, timeout_s=600)[0]
        profiles.append(cluster)
        for key, seconds in measure(sizes, configs, steps, warmup, summa, cluster).items():
            measured.setdefault(key, []).append(seconds)
        for key, step in predict(sizes, configs, cluster, summa).items():
            predicted.setdefault(key, []).append(step)
    medians = {key: statistics.median(values) for key, values in measured.items()}
    middle = {}
    for key, steps_ in predicted.items():
        low = statistics.median_low([step.step_s for step in steps_])
        middle[key] = next(step for step in steps_ if step.step_s == low)
    return profiles[0], medians, middle


def predict(sizes: dict, configs: list, cluster, summa: str) -> dict:
    """{(size, label, schedule): StepTime} from `tess_compile.plan` on the profiled cluster."""
    predicted = {}
    for size_name, size in sizes.items():
        model, x = make_model(size)
        for label, mode, q, d, dp, pp, recompute, kind in configs:
            for schedule in schedules_of(mode, q, d, summa):
                rows = tess_compile.plan(model, WORLD, example_inputs=(x,), cluster=cluster, modes=(mode,),
                                         dp=dp, pp=pp, summa=schedule, keep_blocks=False, recompute=recompute,
                                         tail=TAILS[kind])
                row = next(r for r in rows if r.mesh.q == q and r.mesh.d == d)
                predicted[(size_name, label, schedule)] = row.time
    return predicted


def kendall_tau_b(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b of two equally long lists (ties counted as neither order)."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif dx * dy > 0:
                concordant += 1
            else:
                discordant += 1
    denominator = ((concordant + discordant + ties_x) * (concordant + discordant + ties_y)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0


def report(sizes: dict, measured: dict, predicted: dict) -> dict:
    """Print the table per size; return {size: (MAPE %, tau-b, pick ok)}."""
    summary = {}
    for size_name, size in sizes.items():
        keys = [key for key in measured if key[0] == size_name]
        print(f"\n{size_name}: {size['layers']} GPT blocks, hidden {size['hidden']}, {size['heads']} heads, "
              f"batch {size['batch']}, sequence {size['seq']}, fp32")
        print(f"{'configuration':<18} {'summa':<10} {'fwd ms':>7} {'bwd ms':>7} {'opt ms':>7} "
              f"{'predicted ms':>12} {'measured ms':>11} {'error':>7}")
        errors = []
        for key in keys:
            time_, real = predicted[key], measured[key]
            error = (time_.step_s - real) / real
            errors.append(abs(error))
            print(f"{key[1]:<18} {key[2]:<10} {time_.forward_s * 1e3:7.1f} {time_.backward_s * 1e3:7.1f} "
                  f"{time_.optimizer_s * 1e3:7.1f} {time_.step_s * 1e3:12.1f} {real * 1e3:11.1f} {error:+7.1%}")
        guess = [predicted[key].step_s for key in keys]
        real = [measured[key] for key in keys]
        pick = keys[guess.index(min(guess))]
        pick_ok = measured[pick] <= 1.10 * min(real)
        mape = 100 * statistics.mean(errors)
        tau = kendall_tau_b(guess, real)
        print(f"mean absolute error {mape:.1f}%, Kendall tau-b {tau:.2f}; predicted fastest {pick[1]} {pick[2]} "
              f"measured at {measured[pick] * 1e3:.1f} ms, the fastest {min(real) * 1e3:.1f} ms: "
              f"{'within' if pick_ok else 'NOT within'} 10%")
        summary[size_name] = (mape, tau, pick_ok)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of a profile and a launch of every configuration")
    parser.add_argument("--summa", choices=("auto", "all"), default="auto",
                        help="auto: each configuration in the schedules auto picks; all: in every fixed schedule")
    parser.add_argument("--quick", action="store_true", help="one tiny size, two configurations (for the tests)")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"model sizes to run, of {', '.join(SIZES)}")
    parser.add_argument("--only", choices=("all", "readme"), default="all",
                        help="all: every configuration and README's loop; readme: README's loop beside the "
                             "1-D and 2.5-D rows")
    parser.add_argument("--profile-out", help="also write the profiled cluster, with the measured error as its "
                        "time_error, to this JSON file")
    args = parser.parse_args(argv)
    logging.getLogger("tess_compile").setLevel(logging.WARNING)
    sizes, configs, rounds = (QUICK_SIZES, QUICK_CONFIGS, 1) if args.quick else (SIZES, CONFIGS, args.rounds)
    if not args.quick:
        configs = CONFIGS[:2] + README_CONFIGS if args.only == "readme" else CONFIGS + README_CONFIGS
    if not args.quick:
        unknown = [name for name in args.sizes.split(",") if name not in SIZES]
        if unknown:
            parser.error(f"unknown size {unknown[0]!r}: use {', '.join(SIZES)}")
        sizes = {name: SIZES[name] for name in args.sizes.split(",")}
    start = time.perf_counter()
    cluster, measured, predicted = run_rounds(sizes, configs, args.steps, args.warmup, rounds, args.summa)
    print(f"{WORLD} gloo processes on {os.cpu_count()} CPU cores; step: zero_grad, forward, backward, AdamW; "
          f"median of {args.steps} steps after {args.warmup}, the slowest rank's; medians over {rounds} rounds, "
          f"each priced on its own profile")
    summary = report(sizes, measured, predicted)
    if args.profile_out:  # the profile with the error measured here: the planner marks closer rows as ties
        worst = max(mape for mape, _, _ in summary.values()) / 100
        dataclasses.replace(cluster, time_error=worst).save(args.profile_out)
    print(f"(wall time of the whole run {time.perf_counter() - start:.0f} s)")
    return 0 if summary else 1


if __name__ == "__main__":
    raise SystemExit(main())
