"""Train a small GPT cut into pipeline stages, each stage tess-sharded on its own [q, q, d] group.

The GPT of examples/train_gpt.py is cut into `--stages` stages (the first
holds the embeddings, the last the final LayerNorm and the head, the blocks
are shared out in order). Each stage runs on its own q*q*d gloo processes,
sharded by tess-compile; torch.distributed.pipelining runs the microbatches
through the stages (GPipe or 1F1B). Between two stages, each rank sends its
block of the hidden states [b, s, h] (layout S(0)S(0)S(2): batch over depth
and row, hidden over col) to the rank of the same (k, i, j) in the next stage;
nothing is gathered. Every rank of the last stage also trains an identical
unsharded copy (the oracle) on the same batches, and the first of them
prints both losses per step: they agree to float32 rounding.

    python3 examples/train_pipeline.py                       # 2 stages x [2, 2, 1]: 8 processes
    python3 examples/train_pipeline.py --schedule 1f1b --microbatches 4
    python3 examples/train_pipeline.py --simulate            # every rank of every stage in this process
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

try:
    import tess_compile
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tess_compile
from tess_compile import run_local

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, Batches, print_header, print_row  # noqa: E402  (the model and data of train_gpt)

log = logging.getLogger("train_pipeline")


# --------------------------------------------------------------------------- the stages


class FirstStage(nn.Module):
    """Token and position embeddings, then the first blocks; returns hidden states [b, s, h]."""

    def __init__(self, gpt: GPT, blocks: list[nn.Module]):
        super().__init__()
        self.tokens, self.positions = gpt.tokens, gpt.positions
        self.blocks = nn.ModuleList(blocks)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x


class MiddleStage(nn.Module):
    """Blocks only: hidden states in, hidden states out."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """The last blocks, the final LayerNorm and the head; returns logits [b, s, vocab]."""

    def __init__(self, gpt: GPT, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def cut(gpt: GPT, num_stages: int) -> list[nn.Module]:
    """The model as `num_stages` stages, the blocks shared out in order (the first stages get one more)."""
    blocks = list(gpt.blocks)
    sizes = [len(blocks) // num_stages + (s < len(blocks) % num_stages) for s in range(num_stages)]
    parts, start = [], 0
    for size in sizes:
        parts.append(blocks[start : start + size])
        start += size
    if num_stages == 1:
        return [nn.Sequential(FirstStage(gpt, parts[0]), LastStage(gpt, []))]
    middle = [MiddleStage(part) for part in parts[1:-1]]
    return [FirstStage(gpt, parts[0]), *middle, LastStage(gpt, parts[-1])]


# --------------------------------------------------------------------------- training


def build(args):
    """The model, an identical unsharded copy (the oracle), and the data stream."""
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.seq, args.hidden, args.heads, args.layers)
    return model, copy.deepcopy(model), Batches(args.vocab, args.seq, args.batch, args.seed + 1)


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def oracle_step(oracle: GPT, opt: torch.optim.Optimizer, idx, targets) -> float:
    opt.zero_grad(set_to_none=True)
    loss = loss_of(oracle(idx), targets)
    loss.backward()
    opt.step()
    return loss.item()


def rank_main(rank: int, world_size: int, args) -> list[tuple]:
    """One process of the distributed run (called by run_local on every rank)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    group = args.q * args.q * args.d
    stage_index = rank // group
    first_of_last = rank == (args.stages - 1) * group
    logging.basicConfig(level=logging.INFO if first_of_last else logging.WARNING,
                        format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    model, oracle, data = build(args)
    microbatch = args.batch // args.microbatches
    if stage_index == 0:
        example = (torch.zeros(microbatch, args.seq, dtype=torch.long),)
    else:  # the hidden states the stage before returns, for one microbatch
        example = (torch.zeros(microbatch, args.seq, args.hidden),)
    log.info("compiling stage %d of %d on mesh q=%d d=%d", stage_index, args.stages, args.q, args.d)
    stage = tess_compile.pipeline_stage(cut(model, args.stages)[stage_index], args.q, args.d, stage_index,
                                        args.stages, example_inputs=example, timeout=120)

    def loss_fn(logits, targets):  # the last stage returns DTensors: gather the logits of the microbatch
        return loss_of(tess_compile.full_tensor(logits), targets)

    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = schedule_cls(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=args.lr)
    opt_oracle = torch.optim.AdamW(oracle.parameters(), lr=args.lr)
    if first_of_last:
        print_header()
    rows = []
    for step in range(1, args.steps + 1):
        idx, targets = data.next()  # the same batch on every rank: stage 0 takes idx, the last stage targets
        opt.zero_grad(set_to_none=True)
        if stage_index == 0 and args.stages > 1:
            schedule.step(idx)
        elif stage_index == args.stages - 1:
            losses = []
            if args.stages > 1:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step(idx, target=targets, losses=losses)
            # Each microbatch's loss is its mean; the schedule divides the gradients by the
            # number of microbatches, so this is the whole batch's mean loss and gradient.
            loss = torch.stack([x.detach() for x in losses]).mean().item()
            expected = oracle_step(oracle, opt_oracle, idx, targets)
            rows.append((step, loss, expected, abs(loss - expected)))
            if first_of_last:
                print_row(rows[-1])
        else:
            schedule.step()
        opt.step()
    return rows


def simulate_main(args) -> list[tuple]:
    """Every rank of every stage in this process, via tess_compile.simulate_pipeline."""
    model, oracle, data = build(args)
    idx, _ = Batches(args.vocab, args.seq, args.batch, args.seed + 1).next()
    sim = tess_compile.simulate_pipeline(cut(model, args.stages), args.q, args.d, example_inputs=(idx,),
                                         microbatches=args.microbatches)
    opt = torch.optim.AdamW(sim.parameters(), lr=args.lr)
    opt_oracle = torch.optim.AdamW(oracle.parameters(), lr=args.lr)
    print_header()
    rows = []
    for step in range(1, args.steps + 1):
        idx, targets = data.next()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(sim(idx), targets)
        loss.backward()
        opt.step()
        expected = oracle_step(oracle, opt_oracle, idx, targets)
        rows.append((step, loss.item(), expected, abs(loss.item() - expected)))
        print_row(rows[-1])
    return rows


# --------------------------------------------------------------------------- command line


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train a small GPT cut into pipeline stages, each tess-sharded on its own [q, q, d] "
                    "group, and compare its loss with the unsharded model's at every step.")
    parser.add_argument("--q", type=int, default=2, help="mesh side of each stage (default 2)")
    parser.add_argument("--d", type=int, default=1, help="mesh depth of each stage (default 1)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages: stages*q*q*d ranks (default 2)")
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per step (default 2)")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe", help="pipeline schedule")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks, at least --stages (default 2)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--vocab", type=int, default=128, help="vocabulary size (default 128)")
    parser.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    parser.add_argument("--batch", type=int, default=8, help="batch, a multiple of microbatches*d*q (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data (default 0)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the whole run may take (default 600)")
    parser.add_argument("--simulate", action="store_true",
                        help="run every rank of every stage in this process (tess_compile.simulate_pipeline)")
    args = parser.parse_args(argv)
    for name in ("q", "d", "stages", "microbatches", "steps", "layers", "hidden", "heads", "vocab", "seq", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.layers < args.stages:
        parser.error(f"--layers {args.layers} is fewer than --stages {args.stages}: give every stage a block")
    if args.hidden % args.heads or args.heads % args.q or args.vocab % args.q or args.hidden % args.q:
        parser.error(f"--hidden {args.hidden}, --heads {args.heads} and --vocab {args.vocab} must split: hidden "
                     f"a multiple of heads, and heads, vocab and hidden multiples of q = {args.q}")
    parts = args.microbatches * args.d * args.q
    if args.batch % parts:
        parser.error(f"--batch {args.batch} is not a multiple of microbatches*d*q = {parts}: each microbatch is "
                     f"split over d*q; use e.g. --batch {parts * max(1, args.batch // parts)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    world = args.stages * args.q * args.q * args.d
    log.info("GPT: %d layers, hidden %d, %d heads, vocab %d, seq %d, batch %d in %d microbatches; "
             "%d stages x mesh q=%d d=%d (%d ranks), schedule %s", args.layers, args.hidden, args.heads, args.vocab,
             args.seq, args.batch, args.microbatches, args.stages, args.q, args.d, world, args.schedule)
    start = time.perf_counter()
    if args.simulate:
        rows = simulate_main(args)
    else:
        results = run_local(rank_main, world, args=(args,), backend="gloo", timeout_s=args.timeout,
                            collective_timeout_s=120)
        rows = results[(args.stages - 1) * args.q * args.q * args.d]
    wall = time.perf_counter() - start
    worst = max(row[3] for row in rows)
    mode = "simulated" if args.simulate else f"{world} processes"
    print(f"max abs diff {worst:.3e} over {len(rows)} steps; wall time {wall:.1f} s ({mode})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
