"""tess-compile: a compiler-style Tesseract (2.5-D) tensor-parallel sharding pass for PyTorch.

`shard` runs a model on an initialized world of `q*q*d` ranks; `simulate`
runs every rank in this process. Both take the model's own inputs.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from tess_compile.backend import backend
from tess_compile.compiler import compile_model
from tess_compile.graph_dump import dump
from tess_compile.mesh import Mesh
from tess_compile.simulator import SimulatedModule

__all__ = [
    "Mesh",
    "backend",
    "dump",
    "load_pretrained_shards",
    "load_shards_from",
    "shard",
    "shard_program",
    "simulate",
]


def __getattr__(name: str):
    """Checkpoint loaders, imported on first use (they pull in torch.distributed.checkpoint)."""
    if name in ("load_shards_from", "load_pretrained_shards"):
        from tess_compile import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'tess_compile' has no attribute {name!r}")


def simulate(model: torch.nn.Module, q: int, d: int, *, example_inputs, strict: bool = False, verify: bool | None = None) -> SimulatedModule:
    """Compile `model` for the `[q, q, d]` mesh and run all `q*q*d` ranks in this process.

    Called with the model's global inputs it returns the model's global outputs.
    After `backward()`, `full_grads()` gives every parameter's full gradient.
    """
    program = compile_model(model, Mesh(q, d), example_inputs, strict=strict, verify=verify)
    return SimulatedModule(program)


def shard(
    model: torch.nn.Module,
    q: int,
    d: int,
    *,
    example_inputs,
    strict: bool = False,
    verify: bool | None = None,
    device=None,
    timeout: float | timedelta | None = None,
):
    """Compile `model` for the `[q, q, d]` mesh; call on every rank of a world of `q*q*d`.

    Returns a module holding this rank's shards as its parameters; it takes
    the model's global inputs and returns DTensors on the mesh (plain tensors
    for scalars). `device` defaults to the current CUDA device under NCCL and
    the CPU otherwise; a collective whose peers do not arrive within `timeout`
    (seconds or a timedelta; default 10 minutes) fails with a message.
    """
    program = compile_model(model, Mesh(q, d), example_inputs, strict=strict, verify=verify)
    return shard_program(program, device=device, timeout=timeout)


def shard_program(program, *, device=None, timeout: float | timedelta | None = None, wrap_outputs: bool = True):
    """This rank's module of an already compiled `Program` (see `shard`)."""
    from tess_compile.distributed import DEFAULT_TIMEOUT, ShardedModule, check_world

    check_world(program.mesh)
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=timeout)
    return ShardedModule(program, device=device, timeout=timeout, wrap_outputs=wrap_outputs)
