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
    "pipeline_stage",
    "plan",
    "shard",
    "shard_program",
    "simulate",
    "simulate_pipeline",
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
    "pipeline_stage": "tess_compile.pipeline",
    "plan": "tess_compile.planner",
    "simulate_pipeline": "tess_compile.pipeline",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'tess_compile' has no attribute {name!r}")


def _check_compile(compile, where: str) -> None:
    if not isinstance(compile, bool):
        raise ValueError(
            f"{where}(compile={compile!r}): compile is True (run each rank's program through inductor) "
            "or False (run it as it is)"
        )


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
    dp: int = 1,
    compile: bool = False,
):
    """Compile `model` for the `[q, q, d]` mesh in `mode` and run all `q*q*d` ranks in this process.

    Called with the model's global inputs it returns the model's global outputs.
    After `backward()`, `full_grads()` gives every parameter's full gradient.
    Returns a `tess_compile.simulator.SimulatedModule`.

    `dp=N` runs N data-parallel groups of that mesh (`N*q*q*d` ranks, the mesh
    `(dp, depth, row, col)`): `example_inputs` and each call take the
    concatenated batch of all groups (a multiple of `N*d*q`), group g computes on
    its g-th slice, outputs are concatenated again, and each parameter's
    gradient is summed over the groups' replicas (exactly the unsharded model's
    on the whole batch). Returns a `tess_compile.data_parallel.SimulatedDataParallel`.

    `compile=True` runs the per-rank program, forward and backward, through
    inductor, as `shard(..., compile=True)` does, each rank in its own thread
    (docs/compiled.md).
    """
    from tess_compile.simulator import SimulatedModule
    from tess_compile.train_eval import mode_compiler

    _check_compile(compile, "tess_compile.simulate")
    mesh = Mesh(q, d, mode)
    if dp != 1:
        from tess_compile.compiler import split_example_inputs
        from tess_compile.data_parallel import SimulatedDataParallel, check_batch, split_batch

        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"dp={dp!r} is not a number of data-parallel groups: pass an int >= 1, e.g. dp=2")
        check_batch(example_inputs, mesh, "tess_compile.simulate(dp=...)", num_groups=dp)
        group_args, group_kwargs = split_batch(*split_example_inputs(example_inputs), dp)[0]
        compile_in = mode_compiler(model, mesh, group_kwargs if group_kwargs else tuple(group_args),
                                   strict=strict, verify=verify, summa=summa, keep_blocks=keep_blocks,
                                   checkpoint=checkpoint)
        program = compile_in(model.training)
        return SimulatedDataParallel([SimulatedModule(program, recompile=compile_in, compile=compile) for _ in range(dp)])
    compile_in = mode_compiler(model, mesh, example_inputs, strict=strict, verify=verify, summa=summa,
                               keep_blocks=keep_blocks, checkpoint=checkpoint)
    return SimulatedModule(compile_in(model.training), recompile=compile_in, compile=compile)


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
    mesh=None,
    zero: bool = False,
    compile: bool = False,
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

    `mesh`: a torch DeviceMesh whose dims include "depth", "row" and "col" of
    sizes `(d, q, q)`; its other named dims (e.g. "dp") are data parallel
    (docs/scale_out.md). Call on every rank of the mesh; each data-parallel
    group passes its own batch (`example_inputs` and the calls: that group's
    batch, of one shape everywhere, a multiple of d*q), every rank of a group
    the same. Parameters and outputs are DTensors on `mesh["depth", "row",
    "col"]`; gradients are averaged over the data-parallel dims, as DDP does.
    `zero=True` also shards parameters, gradients and optimizer state over the
    data-parallel dims with FSDP2 (`fully_shard`; parameters become DTensors on
    the whole mesh). Without `mesh`, the whole world is one `[q, q, d]` mesh.

    `compile=True` runs this rank's program, forward and backward, through
    inductor (torch.compile's compiler), the collectives as custom ops in the
    compiled graphs, on the first call (docs/compiled.md).
    """
    from tess_compile.train_eval import mode_compiler

    _check_compile(compile, "tess_compile.shard")
    if mesh is not None or zero:
        from tess_compile.data_parallel import check_batch, check_device_mesh, check_zero, dp_size

        dp_dims = check_device_mesh(mesh, Mesh(q, d, mode)) if mesh is not None else ()
        check_zero(zero, mesh, dp_dims, Mesh(q, d, mode))
        if mesh is not None:
            check_batch(example_inputs, Mesh(q, d, mode), "mesh=", dp_size(mesh, dp_dims), device_mesh=mesh)
    compile_in = mode_compiler(model, Mesh(q, d, mode), example_inputs, strict=strict, verify=verify, summa=summa,
                               keep_blocks=keep_blocks, checkpoint=checkpoint)
    return shard_program(compile_in(model.training), device=device, timeout=timeout, recompile=compile_in,
                         mesh=mesh, zero=zero, compile=compile)


def shard_program(program, *, device=None, timeout: float | timedelta | None = None, wrap_outputs: bool = True,
                  recompile=None, mesh=None, zero: bool = False, compile: bool = False):
    """This rank's module of an already compiled `Program` (see `shard`); `recompile(training)`
    compiles the program of the other mode on first use (`tess_compile.train_eval`)."""
    from tess_compile.distributed import DEFAULT_TIMEOUT, ShardedModule, check_world

    if mesh is None and not zero:
        check_world(program.mesh)
    else:
        from tess_compile.data_parallel import check_device_mesh, check_zero

        check_zero(zero, mesh, check_device_mesh(mesh, program.mesh) if mesh is not None else (), program.mesh)
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=timeout)
    module = ShardedModule(program, device=device, timeout=timeout, wrap_outputs=wrap_outputs, recompile=recompile,
                           device_mesh=mesh, compile=compile)
    if zero:
        from tess_compile.data_parallel import fully_shard_over_dp

        fully_shard_over_dp(module)
    return module
