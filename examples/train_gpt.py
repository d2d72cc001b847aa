"""Train a small GPT with tess-compile and check it against the unsharded model.

The model (pre-LN GPT: token and learned position embeddings, fused-QKV
causal attention, GELU MLP, final LayerNorm, untied vocab head) is sharded
with `tess_compile.shard` on a [q, q, d] Tesseract mesh of q*q*d local gloo
processes and trained with AdamW on a synthetic "language", gradients
clipped to a global norm of 1. Every rank also trains an identical
unsharded copy (the oracle) on the same batches, and rank 0 prints both
losses per step, then both losses of an evaluation on a held-out batch: they
agree to float32 rounding.

    python3 examples/train_gpt.py                 # q=2, d=2: 8 processes
    python3 examples/train_gpt.py --simulate      # all 8 ranks in this process
    python3 examples/train_gpt.py --q 2 --d 1 --steps 5
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
from tess_compile.core.mesh import MODES

log = logging.getLogger("train_gpt")

# The synthetic language: the next token is (A * token + B) mod vocab, except
# that with probability NOISE it is a uniformly random token.
A, B, NOISE = 5, 3, 0.1
# Gradients are clipped to this global norm (over the whole model, as unsharded).
MAX_GRAD_NORM = 1.0


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.hidden, self.heads = hidden, heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        hd = h // self.heads
        q, k, v = self.qkv(x).split(h, -1)
        q = q.view(b, s, self.heads, hd).transpose(1, 2)
        k = k.view(b, s, self.heads, hd).transpose(1, 2)
        v = v.view(b, s, self.heads, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, s, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Embeddings, `layers` blocks, final LayerNorm, untied head; returns logits."""

    def __init__(self, vocab: int, seq: int, hidden: int, heads: int, layers: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList([Block(hidden, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, s = idx.shape
        x = self.tokens(idx) + self.positions(torch.arange(s, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------- data


class Batches:
    """Batches of the synthetic language from a seeded generator: the same on every rank."""

    def __init__(self, vocab: int, seq: int, batch: int, seed: int):
        self.vocab, self.seq, self.batch = vocab, seq, batch
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, targets), both (batch, seq): targets[:, t] is the token after idx[:, t]."""
        tokens = torch.empty(self.batch, self.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (self.batch,), generator=self.gen)
        for t in range(1, self.seq + 1):
            follow = (A * tokens[:, t - 1] + B) % self.vocab
            noise = torch.randint(self.vocab, (self.batch,), generator=self.gen)
            noisy = torch.rand(self.batch, generator=self.gen) < NOISE
            tokens[:, t] = torch.where(noisy, noise, follow)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# --------------------------------------------------------------------------- training


def build(args) -> tuple[GPT, GPT, Batches]:
    """The model, an identical unsharded copy (the oracle), and the data stream."""
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.seq, args.hidden, args.heads, args.layers)
    oracle = copy.deepcopy(model)
    return model, oracle, Batches(args.vocab, args.seq, args.batch, args.seed + 1)


def held_out_batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch from another stream than the training batches."""
    return Batches(args.vocab, args.seq, args.batch, args.seed + 2).next()


def train(args, sharded: nn.Module, oracle: GPT, data: Batches, *, to_full, clip, show: bool) -> list[tuple]:
    """Run args.steps AdamW steps (gradients clipped) on both models, then evaluate both
    on a held-out batch; return rows (step, sharded, unsharded, diff).

    `to_full` turns the sharded module's output into the full logits tensor;
    `clip()` clips the sharded module's gradients to MAX_GRAD_NORM over the
    whole model. When `show` is set, print the table as it goes and the
    evaluation after it.
    """
    opt = torch.optim.AdamW(sharded.parameters(), lr=args.lr)
    opt_oracle = torch.optim.AdamW(oracle.parameters(), lr=args.lr)
    if show:
        print_header()
    rows = []
    for step in range(1, args.steps + 1):
        idx, targets = data.next()

        opt.zero_grad(set_to_none=True)
        logits = to_full(sharded(idx))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        clip()
        opt.step()

        opt_oracle.zero_grad(set_to_none=True)
        loss_oracle = F.cross_entropy(oracle(idx).flatten(0, 1), targets.flatten())
        loss_oracle.backward()
        torch.nn.utils.clip_grad_norm_(oracle.parameters(), MAX_GRAD_NORM)
        opt_oracle.step()

        row = (step, loss.item(), loss_oracle.item(), abs(loss.item() - loss_oracle.item()))
        rows.append(row)
        if show:
            print_row(row)

    losses = evaluate(args, sharded, oracle, to_full=to_full)
    if show:
        print_eval(*losses)
    return rows


def evaluate(args, sharded: nn.Module, oracle: GPT, *, to_full) -> tuple[float, float]:
    """Both models' loss on a held-out batch, in eval mode and without gradients."""
    idx, targets = held_out_batch(args)
    sharded.eval()
    oracle.eval()
    with torch.no_grad():
        loss = F.cross_entropy(to_full(sharded(idx)).flatten(0, 1), targets.flatten())
        loss_oracle = F.cross_entropy(oracle(idx).flatten(0, 1), targets.flatten())
    sharded.train()
    oracle.train()
    return loss.item(), loss_oracle.item()


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank stores of a parameter (a DTensor's local shard)."""
    return param.to_local().numel() if hasattr(param, "to_local") else param.numel()


def rank_main(rank: int, world_size: int, args) -> list[tuple]:
    """One process of the distributed run (called by run_local on every rank)."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    model, oracle, data = build(args)
    idx, _ = Batches(args.vocab, args.seq, args.batch, args.seed + 1).next()  # an example batch
    log.info("compiling the model for mesh q=%d d=%d on %d ranks", args.q, args.d, world_size)
    sharded = tess_compile.shard(model, args.q, args.d, example_inputs=(idx,), mode=args.mode, timeout=120)
    log.info("compiled; rank 0 holds %d of the model's %d parameters",
             sum(local_numel(p) for p in sharded.parameters()), sum(p.numel() for p in oracle.parameters()))

    def clip():
        """The parameters are DTensors: torch's clipping takes the whole model's norm."""
        return torch.nn.utils.clip_grad_norm_(sharded.parameters(), MAX_GRAD_NORM)

    return train(args, sharded, oracle, data, to_full=lambda out: out.full_tensor(), clip=clip, show=rank == 0)


def simulate_main(args) -> list[tuple]:
    """Every rank of the mesh in this process, via tess_compile.simulate."""
    model, oracle, data = build(args)
    idx, _ = Batches(args.vocab, args.seq, args.batch, args.seed + 1).next()
    log.info("compiling the model for mesh q=%d d=%d (simulated, %d ranks)", args.q, args.d, args.q * args.q * args.d)
    sim = tess_compile.simulate(model, args.q, args.d, example_inputs=(idx,), mode=args.mode)
    log.info("compiled; training %d steps", args.steps)

    def clip():
        """sim.parameters() holds every rank's shards, replicas included: the simulator's
        own method clips by the whole model's norm, each parameter taken once."""
        return sim.clip_grad_norm_(MAX_GRAD_NORM)

    return train(args, sim, oracle, data, to_full=lambda out: out, clip=clip, show=True)


# --------------------------------------------------------------------------- output


COLUMNS = ("step", "sharded loss", "unsharded loss", "abs diff")


def print_header() -> None:
    print(f"{COLUMNS[0]:>5}  {COLUMNS[1]:>14}  {COLUMNS[2]:>14}  {COLUMNS[3]:>10}", flush=True)


def print_row(row: tuple) -> None:
    step, loss, loss_oracle, diff = row
    print(f"{step:>5d}  {loss:>14.6f}  {loss_oracle:>14.6f}  {diff:>10.3e}", flush=True)


def print_eval(loss: float, loss_oracle: float) -> None:
    print(f"{'eval':>5}  {loss:>14.6f}  {loss_oracle:>14.6f}  {abs(loss - loss_oracle):>10.3e}  (held-out batch)", flush=True)


# --------------------------------------------------------------------------- command line


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train a small GPT sharded by tess-compile on a [q, q, d] mesh and compare "
                    "its loss with the unsharded model's at every step.")
    parser.add_argument("--q", type=int, default=2, help="mesh side: q*q*d ranks (default 2)")
    parser.add_argument("--d", type=int, default=2, help="mesh depth (default 2)")
    parser.add_argument("--mode", choices=MODES, default="2.5d",
                        help="2.5d (Tesseract, default), 2d (d=1), 3d (d=q) or 1d (Megatron-LM over q*q*d ranks)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--vocab", type=int, default=128, help="vocabulary size (default 128)")
    parser.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    parser.add_argument("--batch", type=int, default=8, help="batch size, a multiple of d*q (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data (default 0)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds the whole multi-process run may take (default 600)")
    parser.add_argument("--simulate", action="store_true",
                        help="run every rank in this process (tess_compile.simulate) instead of q*q*d processes")
    args = parser.parse_args(argv)

    for name in ("q", "d", "steps", "layers", "hidden", "heads", "vocab", "seq", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}: "
                     f"use a hidden size that is a multiple of the head count")
    split = args.q * args.q * args.d if args.mode == "1d" else args.q  # the parts heads and vocab split in
    if args.heads % split:
        parser.error(f"--heads {args.heads} is not divisible by {split}: the heads are split "
                     f"in {split} parts in mode {args.mode}; use a head count that is a multiple of {split}")
    if args.vocab % split:
        parser.error(f"--vocab {args.vocab} is not divisible by {split}: the head's output is split "
                     f"in {split} parts in mode {args.mode}; use a vocabulary size that is a multiple of {split}")
    parts = 1 if args.mode == "1d" else args.d * args.q
    if args.batch % parts:
        parser.error(f"--batch {args.batch} is not a multiple of d*q = {args.d}*{args.q} = {parts}: "
                     f"the batch is split over d*q; use e.g. --batch {parts * max(1, args.batch // parts)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    world = args.q * args.q * args.d
    log.info("GPT: %d layers, hidden %d, %d heads, vocab %d, seq %d, batch %d; mesh q=%d d=%d (%d ranks)",
             args.layers, args.hidden, args.heads, args.vocab, args.seq, args.batch, args.q, args.d, world)
    start = time.perf_counter()
    if args.simulate:
        rows = simulate_main(args)
    else:
        log.info("launching %d local gloo processes", world)
        rows = run_local(rank_main, world, args=(args,), backend="gloo",
                         timeout_s=args.timeout, collective_timeout_s=120)[0]
    wall = time.perf_counter() - start
    worst = max(row[3] for row in rows)
    mode = "simulated" if args.simulate else f"{world} processes"
    print(f"max abs diff {worst:.3e} over {len(rows)} steps; wall time {wall:.1f} s ({mode})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
