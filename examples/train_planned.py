"""From plan to launch with one parallel spec: plan, launch, train, checkpoint and resume a small GPT.

1. plan: `tess_compile.plan` prices every layout of `--gpus` ranks for the GPT of
   examples/train_gpt.py (data-parallel replicas, pipeline stages, and the meshes of each mode,
   `--gpus` GPUs a node), and its fastest row that fits gives the spec (`PlanRow.spec`, a
   `tess_compile.ParallelSpec`), written to OUT/spec.json, as `tess-compile plan --pick` writes it;
2. launch: `--gpus` local gloo processes, each running what `tess_compile.parallelize` gives it
   for the spec (its pipeline stage, its replica's part of each batch);
3. train `--steps` AdamW steps on train_gpt's synthetic language, saving a checkpoint of the
   model and the optimizer (torch.distributed.checkpoint) after step `--checkpoint-step`;
4. resume: fresh processes load that checkpoint and train the remaining steps.

It prints each step's loss beside the unsharded model's (trained in this process on the same
batches: they agree to float32 rounding), and checks that the resumed steps give the losses of
the first run.

    python3 examples/train_planned.py                        # plan for 8 processes, then run
    python3 examples/train_planned.py --spec spec.json       # run a spec planned before
    python3 examples/train_planned.py --modes 1d --steps 4 --checkpoint-step 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

try:
    import tess_compile
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tess_compile
from tess_compile import ParallelSpec, run_local
from tess_compile.analysis.plan_table import format_table
from tess_compile.analysis.planner import pick

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, Batches, print_header, print_row  # noqa: E402  (the model and data of train_gpt)

TOLERANCE = 1e-4  # the largest relative difference of a sharded step's loss from the unsharded one's


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A microbatch's mean cross-entropy (the spec's replicas and microbatches average to the batch's)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(args) -> GPT:
    torch.manual_seed(args.seed)  # the same weights on every rank
    return GPT(args.vocab, args.seq, args.hidden, args.heads, args.layers)


def batches(args, skip: int = 0) -> Batches:
    """The training batches, the same on every rank, after the first `skip` (a resumed run's)."""
    data = Batches(args.vocab, args.seq, args.batch, args.seed + 1)
    for _ in range(skip):
        data.next()
    return data


# --------------------------------------------------------------------------- plan


def plan_spec(args) -> ParallelSpec:
    """The planner's pick for `--gpus` ranks, its table printed."""

    def factory():  # called on the meta device: no weight is allocated
        return make_model(args), torch.zeros(args.batch, args.seq, dtype=torch.long)

    # zero=False: the checkpoints are DCP's, which a ZeRO module refuses (docs/scale_out.md)
    rows = tess_compile.plan(factory, args.gpus, gpus_per_node=args.gpus, modes=args.modes.split(","), dp="auto",
                             pp="auto", zero=False)
    print(format_table(rows), end="", flush=True)
    chosen = pick(rows)
    if chosen is None:
        raise SystemExit("train_planned.py: no layout of the model fits the cluster's memory")
    return chosen.spec


# --------------------------------------------------------------------------- the ranks


def save_checkpoint(run, opt, path: str) -> None:
    """This rank's part of the model and optimizer state, saved by DCP (README's training loop)."""
    state = {"model": get_model_state_dict(run.module),
             "optim": tess_compile.for_dcp(get_optimizer_state_dict(run.module, opt))}
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(run, opt, path: str) -> None:
    """The state `save_checkpoint` saved, loaded into this rank's part of the model and the optimizer
    (`for_dcp`'s views are loaded in place, into the state dicts the setters then take)."""
    model_state, optim_state = get_model_state_dict(run.module), get_optimizer_state_dict(run.module, opt)
    dcp.load({"model": model_state, "optim": tess_compile.for_dcp(optim_state)}, checkpoint_id=path)
    set_model_state_dict(run.module, model_state)
    set_optimizer_state_dict(run.module, opt, optim_state)


def rank_main(rank: int, world_size: int, args, spec_dict: dict, first: int, last: int, resume_from: str | None,
              save_to: str | None) -> list[float]:
    """One process: steps `first`..`last` (1-based) of the spec's training, from the checkpoint at
    `resume_from` if given, saving one to `save_to` after `args.checkpoint_step`; the steps' losses."""
    spec = ParallelSpec.from_dict(spec_dict)
    data = batches(args, skip=first - 1)
    example, _ = batches(args).next()
    run = tess_compile.parallelize(make_model(args), spec, example_inputs=(example,), loss_fn=loss_of,
                                   timeout=args.timeout)
    opt = torch.optim.AdamW(run.parameters(), lr=args.lr)
    if resume_from is not None:
        load_checkpoint(run, opt, resume_from)
    losses = []
    for step in range(first, last + 1):
        idx, targets = data.next()
        losses.append(run.step(idx, target=targets).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if save_to is not None and step == args.checkpoint_step:
            save_checkpoint(run, opt, save_to)
    return losses


def launch(args, spec: ParallelSpec, first: int, last: int, resume_from=None, save_to=None) -> list[float]:
    """The spec's processes for steps `first`..`last`: rank 0's losses (every rank returns the same)."""
    job = (args, spec.to_dict(), first, last, resume_from, save_to)
    return run_local(rank_main, spec.world_size, args=job, timeout_s=args.timeout, collective_timeout_s=args.timeout)[0]


def oracle_losses(args) -> list[float]:
    """The unsharded model's losses over the same steps and batches, in this process."""
    model, data = make_model(args), batches(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.steps):
        idx, targets = data.next()
        loss = loss_of(model(idx), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# --------------------------------------------------------------------------- command line


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Plan a small GPT's layout for --gpus local processes, then "
                                                 "train it with that one spec, checkpoint and resume.")
    parser.add_argument("--gpus", type=int, default=8, help="local gloo processes to plan for and launch (default 8)")
    parser.add_argument("--modes", default="1d,2d,2.5d", help="the modes to plan in (default 1d,2d,2.5d)")
    parser.add_argument("--spec", metavar="FILE.json", help="run this parallel spec instead of planning one")
    parser.add_argument("--out", help="folder for spec.json and the checkpoint (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    parser.add_argument("--checkpoint-step", type=int, default=3, help="the step after which to checkpoint and "
                                                                        "resume from (default 3)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--hidden", type=int, default=32, help="hidden size (default 32)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64)")
    parser.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    parser.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data (default 0)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each launch may take (default 600)")
    args = parser.parse_args(argv)
    if not 1 <= args.checkpoint_step < args.steps:
        parser.error(f"--checkpoint-step {args.checkpoint_step} must be at least 1 and below --steps {args.steps}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="train_planned_")
    os.makedirs(out, exist_ok=True)
    start = time.perf_counter()
    if args.spec is not None:
        spec = ParallelSpec.load(args.spec)
    else:
        spec = plan_spec(args)
        spec.save(os.path.join(out, "spec.json"))
    print(f"spec: {spec.describe()} ({spec.world_size} processes), in {args.spec or os.path.join(out, 'spec.json')}",
          flush=True)
    checkpoint = os.path.join(out, f"step{args.checkpoint_step}")
    losses = launch(args, spec, 1, args.steps, save_to=checkpoint)
    resumed = launch(args, spec, args.checkpoint_step + 1, args.steps, resume_from=checkpoint)
    expected = oracle_losses(args)
    print_header()
    for step, (loss, loss_oracle) in enumerate(zip(losses, expected), 1):
        print_row((step, loss, loss_oracle, abs(loss - loss_oracle)))
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    again = max(abs(a - b) for a, b in zip(resumed, losses[args.checkpoint_step:]))
    print(f"resumed from {checkpoint} after step {args.checkpoint_step}: steps {args.checkpoint_step + 1}.."
          f"{args.steps} differ from the first run's by {again:.3e}", flush=True)
    print(f"max rel diff {worst:.3e} over {args.steps} steps; wall time {time.perf_counter() - start:.1f} s "
          f"({spec.world_size} processes)", flush=True)
    return 0 if worst <= TOLERANCE and again <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
