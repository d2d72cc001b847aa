"""Training step time against PyTorch's DTensor tensor parallelism at its best, over 8 gloo processes.

The model is PyTorch's own test Transformer
(`torch.testing._internal.distributed._tensor.common_dtensor`, which needs
the `expecttest` package: `pip install -e '.[bench]'`): dim 128 (`--dims`),
2 layers, 8 heads, vocabulary 512, tied embedding and output weights, no
dropout; batch 16, sequences 32, 64 and 128 (`--seqs`, one launch each, with
`max_seq_len` the sequence), fp32. `WithLoss` adds the loss, the
cross-entropy of the logits against random targets, so every row runs the
same module and the loss is part of what each one shards. Each step:
zero_grad, forward, backward, AdamW in torchtitan's default implementation,
`fused=True` (`--optimizer`; torch's CPU default is the for-loop one), on
every row. A fused or foreach step refuses plain tensors beside DTensors
in one call, and the plans that leave some parameters plain (the norms of
a plan without sequence parallelism) are such; so every row's AdamW holds
two parameter groups, its DTensors and its plain tensors, and each group
takes one fused step (`make_adamw`).

Configurations (`CONFIGS`), each on all 8 ranks of one launch:

- "DTensor eager", "DTensor compiled": PyTorch's own plan
  `Transformer.parallelize` on a 1-D DeviceMesh of 8
  (`local_output_for_attn=True`, the plan's CPU path: DTensor has no
  sharding rule for the CPU flash attention kernel; attention then runs on
  local tensors in every DTensor row), the logits gathered (its output
  layout is Replicate) for the loss; eager, and the whole module under
  `torch.compile`. Kept for reference.
- DTensor at its best, torchtitan's recipe (`torchtitan.models.llama3` and
  `torchtitan.distributed.compile.apply_compile`) on the same module
  (`titan_plan`): the same Megatron plan, but the output projection leaves
  the logits vocabulary-sharded (`ColwiseParallel(output_layouts=Shard(-1),
  use_local_output=False)`) and the cross-entropy runs under
  `torch.distributed.tensor.parallel.loss_parallel()` (forward and
  backward), so the logits are never gathered; then each transformer block
  compiled on its own (`block.compile(fullgraph=True)`, as `apply_compile`).
  The tied weights stay tied: the embedding's `RowwiseParallel` and the
  output's `ColwiseParallel` both shard the one weight on the vocabulary
  (`Shard(0)`), which is what `loss_parallel` needs. Rows: "DTensor lp
  eager" (the plan and loss_parallel, nothing compiled), "DTensor lp
  blocks" (each block compiled) and "DTensor lp+sp blocks" (with sequence
  parallelism as well, torchtitan's default `enable_sequence_parallel`:
  norms and residuals sharded on the sequence, all-gathers and
  reduce-scatters in place of the all-reduces). Async TP (torchtitan's
  `enable_async_tensor_parallel`: inductor's `_micro_pipeline_tp` pass over
  symmetric memory, `torch.distributed._symmetric_memory`) needs CUDA and
  NCCL: it does not apply on gloo and CPU tensors, and no row pretends to
  run it.
- tess-compile: `tess_compile.shard(model, 2, 2, mode="1d")` (Megatron-LM
  over p=8, the loss over the vocab-split logits) and mode "2.5d" (the
  `[2,2,2]` mesh), eager and with `compile=True` (each rank's program
  through inductor, every collective lowered to torch's functional
  collectives: docs/compiled.md), each with its default options
  (`summa="auto"`). `--schedules` adds 2.5d eagerly in each fixed schedule
  of its products: the papers' (q broadcasts of each operand), "overlap"
  (the next step's broadcasts in flight) and "gather" (one all-gather of
  each operand).

"DTensor at its best" is, per sequence, the fastest DTensor row of that
launch; the table names it, and gives every row's time over it.

Every configuration is built and runs `--warmup` steps (compilation
included), then two measured steps, then `--rounds` rounds: round r runs
`--steps` steps of each configuration in turn, between barriers. Per-step
time of a round is the slowest rank's; the table gives the median over
rounds. Alternating rounds spread the machine's drift over all rows.

Columns: ms/step; its ratio to DTensor at its best and to DTensor eager;
the loss of the first step and of the last (every row starts from the same
weights and batch and takes the same steps: a row whose losses differ from
the others' beyond float rounding is a bug); bytes saved for backward per
rank in one forward (`tess_compile.analysis.accounting.saved_bytes`:
storages autograd keeps, each once, parameters' left out, a DTensor by its
local tensor); bytes moved per rank per step: the payload a rank hands each
collective (its input tensor's bytes, the convention of
`tess_compile.analysis.accounting`). For eager tess these are the runtime's
`comm.records`; for compiled tess, the collectives its compiled graphs hold
(`CompiledRank.graphs`); for DTensor, the collectives that `CommDebugMode`
counts (`CommBytes` adds their input bytes). Under a dispatch mode such as
CommDebugMode dynamo cannot trace, so the compiled DTensor rows' bytes are
counted on an eager step (`torch.compiler.set_stance("force_eager")`); the
CPU time a rank spends per step (`time.process_time`, all of its threads:
the program, gloo's workers, inductor's kernels; a blocked wait spends
none), the mean over ranks, and the CPU-bound step, every rank's CPU over
the cores: the least step time the machine allows for that work. What a
step takes beyond it is waiting: a rank blocked on a peer that is not
running. CPU cores are shared by all 8 processes: the times rank
configurations on this machine, they are not GPU predictions.

    python3 benchmarks/vs_dtensor.py [--dims 128,256] [--seqs 32,64,128] [--rounds 7] [--steps 5]
        [--warmup 3] [--optimizer fused|foreach|for-loop] [--configs NAME,...] [--schedules] [--quick]
        [--out benchmarks/results/vs_dtensor.json]

`--quick` runs tiny sizes (one sequence, 8) on 4 ranks (`[2,2,1]`), eager
rows only (compiling costs minutes), for the tests.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.step_rows import (
    Config,
    Trainer,
    add_row_arguments,
    cores,
    measure,
    parse_ints,
    run_launches,
    select_rows,
    shape_of_launches,
    tess,
)
from tess_compile.core.options import SCHEDULES

__all__ = ["CONFIGS", "WithLoss", "main", "make_model", "titan_plan"]

SIZES = {"dim": 128, "layers": 2, "heads": 8, "vocab": 512, "batch": 16, "seq": 32}
QUICK_SIZES = {"dim": 32, "layers": 1, "heads": 8, "vocab": 64, "batch": 8, "seq": 8}
DEFAULT_SEQS = "32,64,128"


class WithLoss(nn.Module):
    """The model's logits and the cross-entropy against `targets`, as one module."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets):
        logits = self.model(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(sizes: dict) -> WithLoss:
    """PyTorch's test Transformer of `sizes` with its loss, the same weights every call."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    args = ModelArgs(dim=sizes["dim"], n_layers=sizes["layers"], n_heads=sizes["heads"],
                     vocab_size=sizes["vocab"], max_seq_len=sizes["seq"], dropout_p=0.0)
    return WithLoss(Transformer(args))


def make_batch(sizes: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and targets, the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    shape = (sizes["batch"], sizes["seq"])
    return (torch.randint(0, sizes["vocab"], shape, generator=generator),
            torch.randint(0, sizes["vocab"], shape, generator=generator))


def dtensor(model: WithLoss, batch, q: int, d: int, *, compiled: bool) -> nn.Module:
    """PyTorch's own tensor-parallel plan of the Transformer on a 1-D mesh of all q*q*d ranks,
    the logits gathered; `compiled`: the whole module under torch.compile."""
    from torch.testing._internal.distributed._tensor.common_dtensor import Transformer

    mesh = init_device_mesh("cpu", (q * q * d,))
    Transformer.parallelize(model.model, mesh, use_seq_parallel=False, local_output_for_attn=True)
    return torch.compile(model) if compiled else model


def titan_plan(transformer: nn.Module, mesh, *, sequence_parallel: bool) -> nn.Module:
    """torchtitan's tensor-parallel plan of PyTorch's test Transformer on the 1-D `mesh`:
    `Transformer.parallelize`'s Megatron plan (attention on local tensors, its CPU path) with the
    logits left vocabulary-sharded, a `Shard(-1)` DTensor, for `loss_parallel`;
    `sequence_parallel`: norms and residuals sharded on the sequence (torchtitan's default)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    residual = Shard(1) if sequence_parallel else Replicate()  # layout of the activations between blocks
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        # positions are [seq, dim]: the sequence is their dim 0
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=Shard(0) if sequence_parallel else Replicate()),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(transformer, mesh, root_plan)
    for block in transformer.layers:
        block_plan = {
            "attention.wq": ColwiseParallel(use_local_output=True),
            "attention.wk": ColwiseParallel(use_local_output=True),
            "attention.wv": ColwiseParallel(use_local_output=True),
            "attention.wo": RowwiseParallel(output_layouts=residual),
            "feed_forward.w1": ColwiseParallel(input_layouts=residual),
            "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        }
        if sequence_parallel:
            block_plan["attention"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
            block_plan["attention_norm"] = SequenceParallel()
            block_plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, mesh, block_plan)
        block.attention.n_heads //= mesh.size()  # each rank's heads, on local tensors
    if transformer.model_args.weight_tying:
        # both plans shard the one weight on the vocabulary (Shard(0)): tie the two DTensors again
        transformer.output.weight = transformer.tok_embeddings.weight
    return transformer


def dtensor_titan(model: WithLoss, batch, q: int, d: int, *, sequence_parallel: bool, compiled: str) -> nn.Module:
    """torchtitan's recipe on a 1-D mesh of all q*q*d ranks: `titan_plan`, then `compiled`:
    "blocks", each transformer block compiled on its own (`apply_compile`), "model", the whole
    Transformer (the loss stays outside), or "" nothing; the step runs the loss under `loss_parallel`."""
    mesh = init_device_mesh("cpu", (q * q * d,))
    titan_plan(model.model, mesh, sequence_parallel=sequence_parallel)
    if compiled == "blocks":
        for block in model.model.layers:
            block.compile(fullgraph=True)
    elif compiled == "model":
        model.model.compile()
    return model


def _loss_parallel(module: nn.Module):
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


CONFIGS = {
    "DTensor eager": Config(functools.partial(dtensor, compiled=False), peer=True),
    "DTensor compiled": Config(functools.partial(dtensor, compiled=True), compiled=True, peer=True),
    "DTensor lp eager": Config(functools.partial(dtensor_titan, sequence_parallel=False, compiled=""),
                               peer=True, context=_loss_parallel),
    "DTensor lp blocks": Config(functools.partial(dtensor_titan, sequence_parallel=False, compiled="blocks"),
                                compiled=True, peer=True, context=_loss_parallel),
    "DTensor lp+sp blocks": Config(functools.partial(dtensor_titan, sequence_parallel=True, compiled="blocks"),
                                   compiled=True, peer=True, context=_loss_parallel),
    "DTensor lp model": Config(functools.partial(dtensor_titan, sequence_parallel=False, compiled="model"),
                               compiled=True, peer=True, context=_loss_parallel),
    "tess 1d": Config(functools.partial(tess, mode="1d", compiled=False)),
    "tess 2.5d": Config(functools.partial(tess, mode="2.5d", compiled=False)),
    **{f"tess 2.5d {summa}": Config(functools.partial(tess, mode="2.5d", compiled=False, summa=summa), extra=True)
       for summa in SCHEDULES},
    "tess 1d compiled": Config(functools.partial(tess, mode="1d", compiled=True), compiled=True),
    "tess 2.5d compiled": Config(functools.partial(tess, mode="2.5d", compiled=True), compiled=True),
}


def _worker(rank: int, world_size: int, names: list, sizes: dict, q: int, d: int,
            rounds: int, steps: int, warmup: int, optimizer: str) -> list:
    trainers = [Trainer(CONFIGS[name], make_model(sizes), make_batch(sizes), q, d, optimizer) for name in names]
    return measure(trainers, rounds, steps, warmup)


PEER = "DTensor at its best"


def _describe(sizes: dict, *, optimizer: str, q: int, d: int) -> str:
    return (f"PyTorch's test Transformer: dim {sizes['dim']}, {sizes['layers']} layers, {sizes['heads']} heads, "
            f"vocabulary {sizes['vocab']} (tied), batch {sizes['batch']}, sequence {sizes['seq']}, fp32, "
            f"cross-entropy, AdamW ({optimizer}); {q * q * d} gloo processes on {cores()} CPU cores (DTensor and "
            f"tess 1d over all, tess 2.5d on [{q},{q},{d}])")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default=str(SIZES["dim"]), help="model dims, e.g. 128,256")
    add_row_arguments(parser, DEFAULT_SEQS, "benchmarks/results/vs_dtensor.json")
    parser.add_argument("--schedules", action="store_true", help="also tess 2.5d in each fixed schedule")
    args = parser.parse_args(argv)
    dims = parse_ints(parser, "--dims", args.dims)
    seqs = parse_ints(parser, "--seqs", args.seqs)
    names = select_rows(parser, args, CONFIGS, extra=args.schedules)
    q, d, repeats = shape_of_launches(args)
    runs = [QUICK_SIZES] if args.quick else [dict(SIZES, dim=dim, seq=seq) for dim in dims for seq in seqs]
    run_launches(_worker, runs, names, args, q=q, d=d, repeats=repeats, configs=CONFIGS,
                 describe=functools.partial(_describe, optimizer=args.optimizer, q=q, d=d), peer=PEER,
                 reference=("DTensor eager", "DT eager"), script="vs_dtensor.py", argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
