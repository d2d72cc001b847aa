"""Bytes saved for backward per rank: 1-D vs 2-D vs 2.5-D vs 3-D, with and without checkpointing.

A pre-LN GPT stack (L blocks of LayerNorm, fused QKV, causal SDPA, output
projection, LayerNorm, GELU MLP 4x; hidden 128, 8 heads, batch 16, sequence
32 by default) runs one forward in the simulator under
`torch.autograd.graph.saved_tensors_hooks`: every tensor autograd keeps is
counted by its storage (views of one storage count once), parameters'
storages left out. The hooks see every rank of the simulator, so that is the
total over ranks; ranks are symmetric, so per rank = total / p. Beside it:

- predicted: `tess_compile.analysis.memory.predict_memory(program).activations`
  (a fake run of one rank's graph);
- total / unsharded: the total over ranks over the unsharded model's saved
  bytes, measured the same way with the same checkpointing (the model's
  blocks under `torch.utils.checkpoint` for "blocks" and "model"; for
  "selective", which torch has no eager twin of that these hooks can see,
  the same compiler option on one rank, mesh [1,1,1]);
- ideal: unsharded / p, what a rank would save if nothing were replicated;
- parameter, gradient and AdamW bytes per rank (`predict_memory`) and the
  bytes a rank moves in one forward and backward
  (`tess_compile.analysis.accounting.predict_bytes`, inputs requiring grad).

Checkpointing: "none"; "blocks" and "selective" are the compiler's
`recompute=` option; "model" is the stack whose own forward wraps each block
in `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`,
compiled with `recompute="none"` (`--checkpoint-model` runs only those).
"+keep" is `keep_blocks=True`.

    python3 benchmarks/memory.py [--layers 4] [--hidden 128] [--heads 8] [--batch 16] [--seq 32] [--checkpoint-model]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile  # noqa: E402
from benchmarks.paper_tables import Block  # noqa: E402
from tess_compile.analysis.accounting import predict_bytes, saved_bytes
from tess_compile.analysis.memory import predict_memory
from tess_compile.ops.collectives import use_comm
from tess_compile.runtime import state
from tess_compile.runtime.simulator import run_lockstep


class Config(NamedTuple):
    """One row: a mode on a mesh, a checkpointing variant, and whether products keep their blocks."""

    mode: str
    q: int
    d: int
    checkpoint: str  # "none", "blocks", "selective" or "model"
    keep_blocks: bool = False

    @property
    def num_ranks(self) -> int:
        return self.q * self.q * self.d

    @property
    def mesh(self) -> str:
        if self.mode == "1d":
            return f"p={self.num_ranks}"
        return f"[{self.q},{self.q},{self.d}]"


MESHES = [("1d", 1, 8), ("2d", 4, 1), ("2.5d", 2, 2), ("2.5d", 4, 2), ("3d", 2, 2)]


class Stack(nn.Module):
    """`layers` blocks; with `checkpoint_blocks` the forward runs each under torch's checkpoint."""

    def __init__(self, layers: int, hidden: int, heads: int, checkpoint_blocks: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([Block(hidden, heads) for _ in range(layers)])
        self.checkpoint_blocks = checkpoint_blocks

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        return x


def forward_own_inputs(sim, *args) -> list:
    """One forward of every rank of `sim`, each rank given its own copy of the inputs.

    `sim(*args)` hands all ranks the same input tensors: an input that every
    rank saves (replicated in 1-D) would be one storage and counted once, not
    p times. Real ranks each hold their own copy.
    """
    program = sim.program
    rank_inputs = []
    for module in sim.ranks:
        flat = [t.clone() if isinstance(t, torch.Tensor) else t for t in program.flatten_inputs(args, {})]
        rank_inputs.append(state.graph_inputs(program, module, flat))
    with use_comm(sim.comm):
        return run_lockstep(program.runnable, sim.comm, rank_inputs)


def make_stack(args, checkpoint_blocks: bool) -> Stack:
    """The stack of the sizes in `args`, the same weights every call."""
    torch.manual_seed(0)
    return Stack(args.layers, args.hidden, args.heads, checkpoint_blocks)


def unsharded_bytes(args, x: torch.Tensor, variant: str) -> int:
    """Saved bytes of the unsharded stack with the checkpointing of `variant`."""
    model = make_stack(args, checkpoint_blocks=variant in ("blocks", "model"))
    if variant == "selective":
        sim = tess_compile.simulate(model, 1, 1, example_inputs=(x,), recompute="selective")
        return saved_bytes(lambda: forward_own_inputs(sim, x), sim.parameters())
    return saved_bytes(lambda: model(x), model.parameters())


def measure(args, config: Config, x: torch.Tensor) -> dict:
    """Measured and predicted bytes per rank of one configuration."""
    model = make_stack(args, checkpoint_blocks=config.checkpoint == "model")
    compiler_checkpoint = "none" if config.checkpoint == "model" else config.checkpoint
    sim = tess_compile.simulate(model, config.q, config.d, example_inputs=(x,), mode=config.mode,
                                keep_blocks=config.keep_blocks, recompute=compiler_checkpoint)
    total = saved_bytes(lambda: forward_own_inputs(sim, x), sim.parameters())
    memory = predict_memory(sim.program)
    moved = predict_bytes(sim.program, inputs_require_grad=True)
    return {
        "total": total,
        "measured": total // config.num_ranks,
        "predicted": memory.activations,
        "params": memory.params,
        "grads": memory.grads,
        "optimizer": memory.optimizer,
        "moved": sum(sum(by_key.values()) for by_key in moved.values()),
    }


def configs(checkpoint_model_only: bool) -> list[Config]:
    variants = ("model",) if checkpoint_model_only else ("none", "blocks", "selective", "model")
    rows = [Config(mode, q, d, variant) for mode, q, d in MESHES for variant in variants]
    if not checkpoint_model_only:
        rows.insert(rows.index(Config("2.5d", 2, 2, "blocks")), Config("2.5d", 2, 2, "none", keep_blocks=True))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--checkpoint-model", action="store_true",
                        help="only the stack whose forward checkpoints each block")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bytes, not time: one thread keeps tiny kernels fast on a shared CPU
    try:
        print_table(args)
    finally:
        torch.set_num_threads(threads)
    return 0


def print_table(args) -> None:
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.hidden)
    rows = configs(args.checkpoint_model)
    unsharded = {variant: unsharded_bytes(args, x, variant) for variant in dict.fromkeys(c.checkpoint for c in rows)}

    print(f"GPT stack: {args.layers} blocks, hidden {args.hidden}, {args.heads} heads, batch {args.batch}, "
          f"sequence {args.seq}, fp32; bytes per rank unless marked")
    print("unsharded saved bytes: " + ", ".join(f"{variant} {num}" for variant, num in unsharded.items()))
    print(f"{'mode':<5} {'mesh':<8} {'ranks':>5} {'checkpoint':<11} {'measured':>9} {'predicted':>9} "
          f"{'total/unsh':>10} {'ideal':>8} {'params':>8} {'grads':>8} {'AdamW':>8} {'moved':>9}")
    for config in rows:
        row = measure(args, config, x)
        reference = unsharded[config.checkpoint]
        variant = config.checkpoint + ("+keep" if config.keep_blocks else "")
        same = "" if row["measured"] == row["predicted"] else " (differ)"
        print(f"{config.mode:<5} {config.mesh:<8} {config.num_ranks:>5} {variant:<11} {row['measured']:>9} "
              f"{row['predicted']:>9} {row['total'] / reference:>10.3f} {reference // config.num_ranks:>8} "
              f"{row['params']:>8} {row['grads']:>8} {row['optimizer']:>8} {row['moved']:>9}{same}")


if __name__ == "__main__":
    raise SystemExit(main())
