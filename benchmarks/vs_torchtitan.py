"""Training step time against torchtitan's own tensor parallelism, over 8 gloo processes.

The model is torchtitan's Llama 3 "debugmodel" (`--flavors`; dim 256, 6
layers, 16 heads, FFN 768, vocabulary 2048, complex RoPE, untied output),
built from its config (`torchtitan.models.llama3.llama3_configs`) with its
own initialisation, the same weights on every row (seed 0), fp32; batch 8,
sequences 64, 128 and 256 (`--seqs`, one launch each). torchtitan's
language models attend with FlexAttention, whose block mask the trainer
builds outside the model, so every row's attention is causal SDPA
(`ScaledDotProductAttention`, swapped into each layer's config), and the
RoPE cache is cut to the sequence, as torchtitan's trainer does. The loss is
the mean cross-entropy of the logits (tess-compile's rows: `WithLoss` of
`vs_dtensor.py`; torchtitan's rows: torchtitan's own vocabulary-parallel
`cross_entropy_loss` over the token count). Each step: zero_grad, forward,
backward, AdamW (`fused=True`, torchtitan's default), no gradient clipping
on any row.

Rows, each on all 8 ranks of one launch:

- "torchtitan eager", "torchtitan blocks": the model parallelized by
  torchtitan's `parallelize_llama` with its defaults: the `spmd_types`
  backend (plain local tensors, explicit collectives), tensor parallelism
  over all 8 ranks with sequence parallelism; "blocks" adds its per-block
  compile (`CompileConfig(enable=True)`: `apply_compile`, each transformer
  block `compile(fullgraph=True)`). The step runs in the trainer's SPMD
  context (`get_spmd_context`). Two departures, both forced by this CPU
  and torch, and both free of cost to torchtitan: its device type is set
  to "cpu" (it picks "cuda"); and its `apply_fsdp_to_decoder`, which with a
  shard degree of 1 moves no data, is left out: torch 2.13's `fully_shard`
  refuses the backend's plain-tensor parameters on the TP mesh
  ("When dp_mesh_dims is provided, all parameters must be DTensors").
  Without FSDP nothing in torchtitan's step sums the gradients of the
  parameters replicated over TP (spmd type R, whose gradients are partial:
  the norms' weights under sequence parallelism), so each rank sums them
  after backward in one all-reduce of one flat buffer
  (`TitanWithLoss.reduce_replicated_grads`); without that sum those weights
  drift apart across ranks from the second step on.
- tess-compile: `tess_compile.shard` in mode "1d" (Megatron-LM over p=8)
  and "2.5d" (`[2,2,2]`), eager and with `compile=True`, default options.

The peer rows are torchtitan's; the table gives every row's time over the
fastest of them and over "torchtitan eager", and the first and last
losses (the same weights, batch and steps on every row). The timing,
bytes and CPU columns are those of `vs_dtensor.py` (`step_rows.py`).

    python3 benchmarks/vs_torchtitan.py [--flavors debugmodel] [--seqs 64,128,256] [--rounds 7] [--steps 5]
        [--warmup 3] [--optimizer fused|foreach|for-loop] [--configs NAME,...] [--quick]
        [--out benchmarks/results/vs_torchtitan.json]

`--quick` runs the zoo's tiny Llama 3 (`titan_architectures.llama3_config`:
hidden 32, 4 heads, 2 layers, vocabulary 64; batch 4, sequence 8) on 4
ranks (`[2,2,1]`), eager rows only, for the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import types
import warnings
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

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
from benchmarks.titan_architectures import BATCH, SEQ, llama3_config, sdpa_layers
from benchmarks.vs_dtensor import WithLoss, make_batch

__all__ = ["CONFIGS", "TitanWithLoss", "main", "make_model"]

DEFAULT_SEQS = "64,128,256"
BATCH_SIZE = 8
PEER = "torchtitan at its best"


def make_config(flavor: str, seq: int, tp: int):
    """torchtitan's Llama 3 config of `flavor` ("tiny": the zoo's) with causal SDPA, the RoPE
    cache cut to `seq`, and the sharding its `update_from_config` declares for `tp` ranks with
    its default parallelism (sequence parallelism on)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.llama3 import llama3_configs

    if flavor == "tiny":
        config = llama3_config()
    else:
        config = llama3_configs[flavor](attn_backend="flex")
        sdpa_layers(config.layers)
    for layer in config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq)
    config.update_from_config(config=types.SimpleNamespace(parallelism=ParallelismConfig(tensor_parallel_degree=tp)))
    return config


def make_model(flavor: str, seq: int, tp: int) -> WithLoss:
    """The model of `make_config` with its loss, initialised by torchtitan, the same weights every call."""
    torch.manual_seed(0)
    model = make_config(flavor, seq, tp).build()
    model.init_states()
    return WithLoss(model)


class TitanWithLoss(nn.Module):
    """torchtitan's parallelized decoder and its vocabulary-parallel cross-entropy, the mean over
    tokens; `spmd_context` is where its step runs."""

    def __init__(self, decoder: nn.Module, parallel_dims, vocab: int):
        super().__init__()
        import spmd_types as spmd
        from torchtitan.distributed.utils import get_spmd_context

        self.decoder = decoder
        self.vocab = vocab
        self.spmd_context = get_spmd_context(parallel_dims=parallel_dims)
        self.tp_group = parallel_dims.get_mesh("tp").get_group()
        # parameters replicated over TP: their gradients are partial sums (spmd_types' R)
        self.replicated = [p for p in decoder.parameters()
                           if any(kind == spmd.R for kind in spmd.get_local_type(p).values())]

    def forward(self, tokens, labels):
        from torchtitan.components.loss import cross_entropy_loss

        return cross_entropy_loss(self.decoder(tokens), labels, global_vocab_size=self.vocab) / labels.numel()

    def reduce_replicated_grads(self) -> None:
        """Sum the replicated parameters' gradients over TP, in one all-reduce of one buffer."""
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.tp_group)
        for grad, total in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(total)


def _titan_on_cpu() -> None:
    """torchtitan on this process's CPU: its device type "cpu" (it picks "cuda" at import, and
    some modules copy the name), its default backend, the backend's deprecation warnings quiet."""
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils
    from torchtitan.distributed import parallel_dims

    tools_utils.device_type = parallel_dims.device_type = dist_utils.device_type = "cpu"
    dist_utils.set_spmd_backend("spmd_types")
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def titan(model: WithLoss, batch, q: int, d: int, *, compiled: bool) -> TitanWithLoss:
    """torchtitan's `parallelize_llama` of `model` over all q*q*d ranks (TP with sequence
    parallelism), without its FSDP of shard degree 1; `compiled`: its per-block compile."""
    import torchtitan.models.llama3.parallelize as llama3_parallelize
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    world = q * q * d
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, world_size=world)
    parallel_dims.build_mesh()
    with mock.patch.object(llama3_parallelize, "apply_fsdp_to_decoder", lambda *args, **kwargs: None):
        decoder = llama3_parallelize.parallelize_llama(
            model.model, parallel_dims=parallel_dims, training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=ParallelismConfig(tensor_parallel_degree=world), compile_config=CompileConfig(enable=compiled),
            ac_config=None, dump_folder="")
    return TitanWithLoss(decoder, parallel_dims, model.model.config.vocab_size)


def _spmd_context(module: TitanWithLoss):
    return module.spmd_context()


def _reduce_replicated_grads(module: TitanWithLoss) -> None:
    module.reduce_replicated_grads()


def _titan_config(compiled: bool) -> Config:
    return Config(functools.partial(titan, compiled=compiled), compiled=compiled, peer=True,
                  context=_spmd_context, after_backward=_reduce_replicated_grads)


CONFIGS = {
    "torchtitan eager": _titan_config(compiled=False),
    "torchtitan blocks": _titan_config(compiled=True),
    "tess 1d": Config(functools.partial(tess, mode="1d", compiled=False)),
    "tess 2.5d": Config(functools.partial(tess, mode="2.5d", compiled=False)),
    "tess 1d compiled": Config(functools.partial(tess, mode="1d", compiled=True), compiled=True),
    "tess 2.5d compiled": Config(functools.partial(tess, mode="2.5d", compiled=True), compiled=True),
}


def _worker(rank: int, world_size: int, names: list, sizes: dict, q: int, d: int,
            rounds: int, steps: int, warmup: int, optimizer: str) -> list:
    _titan_on_cpu()
    batch = make_batch(sizes)
    trainers = [Trainer(CONFIGS[name], make_model(sizes["flavor"], sizes["seq"], world_size), batch, q, d, optimizer)
                for name in names]
    return measure(trainers, rounds, steps, warmup)


def _sizes(flavor: str, batch: int, seq: int, tp: int) -> dict:
    """The launch's sizes, read off the model's config."""
    config = make_config(flavor, seq, tp)
    attention = config.layers[0].attention
    return {"flavor": flavor, "dim": config.dim, "layers": len(config.layers), "heads": attention.n_heads,
            "vocab": config.vocab_size, "batch": batch, "seq": seq}


def _describe(sizes: dict, *, optimizer: str, q: int, d: int) -> str:
    return (f"torchtitan's Llama 3 {sizes['flavor']}: dim {sizes['dim']}, {sizes['layers']} layers, "
            f"{sizes['heads']} heads, vocabulary {sizes['vocab']}, causal SDPA, batch {sizes['batch']}, sequence "
            f"{sizes['seq']}, fp32, cross-entropy, AdamW ({optimizer}); {q * q * d} gloo processes on {cores()} "
            f"CPU cores (torchtitan TP+SP and tess 1d over all, tess 2.5d on [{q},{q},{d}])")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", default="debugmodel", help="torchtitan Llama 3 flavors, e.g. debugmodel")
    add_row_arguments(parser, DEFAULT_SEQS, "benchmarks/results/vs_torchtitan.json")
    args = parser.parse_args(argv)
    seqs = parse_ints(parser, "--seqs", args.seqs)
    names = select_rows(parser, args, CONFIGS)
    q, d, repeats = shape_of_launches(args)
    if args.quick:
        runs = [_sizes("tiny", BATCH, SEQ, q * q * d)]
    else:
        runs = [_sizes(flavor.strip(), BATCH_SIZE, seq, q * q * d) for flavor in args.flavors.split(",") for seq in seqs]
    run_launches(_worker, runs, names, args, q=q, d=d, repeats=repeats, configs=CONFIGS,
                 describe=functools.partial(_describe, optimizer=args.optimizer, q=q, d=d), peer=PEER,
                 reference=("torchtitan eager", "tt eager"), script="vs_torchtitan.py", argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
