"""tess-compile: a compiler-style Tesseract (2.5-D) tensor-parallel sharding pass for PyTorch.

`shard` runs a model on an initialized world of `q*q*d` ranks; `simulate`
runs every rank in this process. Both take the model's own inputs, a
`mode`: "2.5d" (Tesseract, the default), "2d" (Optimus, d=1), "3d" (d=q)
or "1d" (Megatron-LM over the same q*q*d ranks; see `tess_compile.mesh`),
and a `summa` schedule of the matrix products: "broadcast" (the papers' q
steps, the default), "overlap" (step t+1's broadcasts in flight during
step t's product) or "gather" (one all-gather per operand, one product).
`plan` ranks the modes and meshes of a model on a cluster by predicted time.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from tess_compile.mesh import Mesh

__all__ = [
    "Mesh",
    "backend",
    "clip_grad_norm_",
    "dump",
    "for_dcp",
    "full_tensor",
    "load_pretrained_shards",
    "load_shards_from",
    "plan",
    "shard",
    "shard_program",
    "simulate",
]


# Names imported on first use: the compiler imports `passes`, whose rules import
# `tess_compile.layout`, so importing them here would make a cycle for anyone
# who imports `passes` first; the checkpoint loaders pull in torch.distributed.checkpoint.
_LAZY = {
    "backend": "tess_compile.dynamo_backend",
    "clip_grad_norm_": "tess_compile.training",
    "dump": "tess_compile.graph_dump",
    "for_dcp": "tess_compile.checkpoint",
    "full_tensor": "tess_compile.distributed",
    "load_shards_from": "tess_compile.checkpoint",
    "load_pretrained_shards": "tess_compile.checkpoint",
    "plan": "tess_compile.planner",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'tess_compile' has no attribute {name!r}")


def simulate(
    model: torch.nn.Module,
    q: int,
    d: int,
    *,
    example_inputs,
    mode: str = "2.5d",
    summa: str = "broadcast",
    keep_blocks: bool = False,
    checkpoint: str = "none",
    strict: bool = False,
    verify: bool | None = None,
):
    """Compile `model` for the `[q, q, d]` mesh in `mode` and run all `q*q*d` ranks in this process.

    Called with the model's global inputs it returns the model's global outputs.
    After `backward()`, `full_grads()` gives every parameter's full gradient.
    Returns a `tess_compile.simulator.SimulatedModule`.
    """
    from tess_compile.simulator import SimulatedModule
    from tess_compile.train_eval import mode_compiler

    compile_in = mode_compiler(model, Mesh(q, d, mode), example_inputs, strict=strict, verify=verify, summa=summa,
                               keep_blocks=keep_blocks, checkpoint=checkpoint)
    return SimulatedModule(compile_in(model.training), recompile=compile_in)


def shard(
    model: torch.nn.Module,
    q: int,
    d: int,
    *,
    example_inputs,
    mode: str = "2.5d",
    summa: str = "broadcast",
    keep_blocks: bool = False,
    checkpoint: str = "none",
    strict: bool = False,
    verify: bool | None = None,
    device=None,
    timeout: float | timedelta | None = None,
):
    """Compile `model` for the `[q, q, d]` mesh in `mode`; call on every rank of a world of `q*q*d`.

    Every rank must pass the same model weights and example inputs (a
    ValueError on every rank names the ranks and tensors that differ).
    Returns a module whose parameters are DTensors holding this rank's shards;
    it takes the model's global inputs (the same batch on every rank) and
    returns DTensors on the mesh (plain tensors for scalars). `device`
    defaults to the current CUDA device under NCCL and the CPU otherwise; a
    collective whose peers do not arrive within `timeout` (seconds or a
    timedelta; default 10 minutes) fails with a message.
    """
    from tess_compile.train_eval import mode_compiler

    compile_in = mode_compiler(model, Mesh(q, d, mode), example_inputs, strict=strict, verify=verify, summa=summa,
                               keep_blocks=keep_blocks, checkpoint=checkpoint)
    return shard_program(compile_in(model.training), device=device, timeout=timeout, recompile=compile_in)


def shard_program(program, *, device=None, timeout: float | timedelta | None = None, wrap_outputs: bool = True,
                  recompile=None):
    """This rank's module of an already compiled `Program` (see `shard`); `recompile(training)`
    compiles the program of the other mode on first use (`tess_compile.train_eval`)."""
    from tess_compile.distributed import DEFAULT_TIMEOUT, ShardedModule, check_world

    check_world(program.mesh)
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=timeout)
    return ShardedModule(program, device=device, timeout=timeout, wrap_outputs=wrap_outputs, recompile=recompile)
