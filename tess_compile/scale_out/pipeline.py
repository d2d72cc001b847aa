"""Pipeline parallelism: a model cut into stages, each stage tess-sharded on its own [q, q, d] group.

A world of `num_stages * q*q*d` ranks is a DeviceMesh of shape
`(num_stages, d, q, q)` named `("pp", "depth", "row", "col")`: stage `s` is
the ranks `s*q*q*d ... (s+1)*q*q*d - 1`, and the pipeline group of a rank is
the ranks of the same `(k, i, j)` in every stage. Each stage is compiled by
the same passes as `shard`, with its boundary made of local blocks
(`compile_model(..., local_inputs=..., local_outputs=...)`):

- stage 0 takes the microbatch's global inputs, as `shard` does (every rank
  of the stage the same; the program slices its block);
- a stage before the last returns this rank's blocks of its outputs in the
  home layout of their shapes (`S(0)S(0)S(2)` for hidden states `[b, s, h]`:
  batch over depth and row, hidden over col), and the next stage takes
  exactly those blocks as its positional inputs: rank `(k, i, j)` of stage
  `s` sends its block to rank `(k, i, j)` of stage `s + 1`, and nothing is
  gathered; in backward the gradient blocks go the other way;
- the last stage returns DTensors, as `shard` does.

`pipeline_stage` builds this rank's `torch.distributed.pipelining.PipelineStage`
(run it with `ScheduleGPipe`, `Schedule1F1B`, ...); `simulate_pipeline` runs
every rank of every stage in this process. Both check that each stage's
outputs are the next stage's inputs (count, shapes, dtypes, layouts; one
microbatch) and raise a ValueError naming the stages, the shapes and the fix.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage

from tess_compile.analysis.compile_entry import Compiled, compile_for
from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.options import CompileOptions, takes_compile_options
from tess_compile.core.program import split_example_inputs
from tess_compile.runtime.sharded_module import shard_program
from tess_compile.scale_out.stage_ports import Port, check_boundaries, stage_ports

__all__ = ["PP", "compile_stage", "pipeline_mesh", "pipeline_stage"]

PP = "pp"  # the pipeline dim of the DeviceMesh


def compile_stage(module: nn.Module, mesh: Mesh, example_inputs, stage_index: int, num_stages: int,
                  options: CompileOptions, cluster: Cluster | str | os.PathLike | None = None) -> Compiled:
    """Stage `stage_index` of `num_stages` compiled (`compile_for`, "auto" priced on `cluster`): local
    inputs unless it is the first stage, local outputs unless it is the last."""
    return compile_for(module, mesh, example_inputs, options, cluster, local_inputs=stage_index > 0,
                       local_outputs=stage_index < num_stages - 1)


def pipeline_mesh(q: int, d: int, num_stages: int, *, mode: str = "2.5d", device_type: str | None = None):
    """The DeviceMesh of a pipeline of `num_stages` stages of `[q, q, d]` over the whole world:
    shape `(num_stages, d, q, q)` named `("pp", "depth", "row", "col")` (mode "1d":
    `(num_stages, 1, 1, q*q*d)`); stage s is ranks `s*q*q*d ... (s+1)*q*q*d - 1`.
    ValueError unless the world has `num_stages * q*q*d` ranks."""

    mesh = Mesh(q, d, mode)
    _check_stages(0, num_stages)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"a pipeline of {num_stages} stages on mesh {mesh} needs an initialized process group of "
            f"{num_stages * mesh.num_ranks} ranks: call torch.distributed.init_process_group first (e.g. under "
            f"torchrun --nproc-per-node {num_stages * mesh.num_ranks}), or use tess_compile.simulate_pipeline in one process"
        )
    world = dist.get_world_size()
    if world != num_stages * mesh.num_ranks:
        raise ValueError(
            f"world size {world} is not num_stages * q*q*d = {num_stages} * {mesh.num_ranks} = "
            f"{num_stages * mesh.num_ranks} for {num_stages} pipeline stages on mesh {mesh}: start "
            f"{num_stages * mesh.num_ranks} processes, or pass mesh= with a 'pp' dim (other dims data parallel)"
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (num_stages, *mesh.shape), mesh_dim_names=(PP, *AXES))


def _check_stages(stage_index: int, num_stages: int) -> None:
    for name, value in (("num_stages", num_stages), ("stage_index", stage_index)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} is not an int: pass e.g. stage_index=0, num_stages=2")
    if num_stages < 1 or not 0 <= stage_index < num_stages:
        raise ValueError(
            f"stage_index={stage_index} is not a stage of num_stages={num_stages}: pass 0 <= stage_index < "
            "num_stages, num_stages >= 1"
        )


@takes_compile_options
def pipeline_stage(
    module: nn.Module,
    q: int,
    d: int,
    stage_index: int,
    num_stages: int,
    *,
    example_inputs,
    options: CompileOptions | None = None,
    mesh=None,
    device=None,
    timeout: float | timedelta | None = None,
    cluster: Cluster | str | os.PathLike | None = None,
    zero: bool = False,
):
    """This rank's stage of a pipeline: `module` (stage `stage_index` of `num_stages`, the same on
    every rank of the stage) tess-sharded on the stage's `[q, q, d]` ranks, as a
    `torch.distributed.pipelining.PipelineStage` to run with a schedule
    (`ScheduleGPipe(stage, n_microbatches, loss_fn=...)`, `Schedule1F1B`, ...).

    Call on every rank of the world. `mesh` is a DeviceMesh with a "pp" dim of
    size `num_stages` and dims "depth", "row", "col" of sizes `(d, q, q)`; its
    other dims are data parallel (`shard(..., mesh=...)`); by default
    `pipeline_mesh(q, d, num_stages)`, stage s on ranks `s*q*q*d` onwards.
    `stage_index` must be this rank's coordinate on "pp". `example_inputs` are
    the stage's inputs for ONE microbatch, global shapes: stage 0's as the
    schedule's `step(x)` gives them (the batch over the number of
    microbatches), a later stage's the previous stage's outputs. Every stage
    then checks, over its pipeline group, that each stage's outputs are the
    next stage's inputs, and raises a ValueError naming the stages, the
    shapes and the fix if not.

    Stage 0 takes the microbatch's global inputs (every rank of the stage the
    same); a stage before the last sends this rank's blocks of its outputs to
    the rank of the same (k, i, j) in the next stage, which takes them as its
    inputs (nothing gathered; gradients come back as blocks); the last stage
    returns DTensors, so a loss function may gather them with
    `tess_compile.full_tensor`. `stage.submod` is the sharded module
    (parameters: DTensors; make the optimizer from its `parameters()`).
    summa="auto" prices each product's schedule on `cluster` (a `Cluster`, the path of a
    JSON file `Cluster.save` wrote, or None for `CALIBRATED_CLUSTER`). `zero=True` shards the
    stage's parameters, gradients and optimizer state over `mesh`'s data-parallel dims with
    FSDP2, as `shard(..., zero=True)` does.
    """

    tess_mesh = options.mesh(q, d)
    _check_stages(stage_index, num_stages)
    root = mesh if mesh is not None else pipeline_mesh(q, d, num_stages, mode=options.mode, device_type=_device_type(device))
    names = tuple(root.mesh_dim_names or ())
    if PP not in names or root.size(names.index(PP)) != num_stages:
        have = f"a '{PP}' dim of size {root.size(names.index(PP))}" if PP in names else f"no '{PP}' dim"
        raise ValueError(
            f"mesh (DeviceMesh of shape {tuple(root.shape)} with dims {names}) has {have}, but the pipeline has "
            f"{num_stages} stages: build it with init_device_mesh(device, ({num_stages}, {', '.join(map(str, tess_mesh.shape))}), "
            f"mesh_dim_names=('{PP}', 'depth', 'row', 'col')) (tess_compile.scale_out.pipeline.pipeline_mesh)"
        )
    coordinate = root.get_local_rank(PP)
    if coordinate != stage_index:
        raise ValueError(
            f"rank {dist.get_rank()} is in stage {coordinate} of the mesh ('{PP}' coordinate {coordinate}), but was "
            f"given stage_index={stage_index}: pass stage_index={coordinate} (mesh.get_local_rank('{PP}')), with "
            "that stage's module"
        )
    compiled = compile_stage(module, tess_mesh, example_inputs, stage_index, num_stages, options, cluster)
    program = compiled.program
    ports = stage_ports(program, stage_index, num_stages)
    pp_group = root.get_group(PP)
    every_stage: list = [None] * num_stages
    dist.all_gather_object(every_stage, ports, group=pp_group)
    check_boundaries(every_stage)
    is_last = stage_index == num_stages - 1
    stage_mesh = root[tuple(name for name in names if name != PP)]
    sharded = shard_program(program, device=device, timeout=timeout, wrap_outputs=is_last, recompile=compiled.recompile,
                            mesh=stage_mesh, zero=zero)
    # The blocks each rank sends and takes (static metadata: nothing to infer at the first step);
    # floating ones carry gradients back.
    on = sharded.device
    if stage_index == 0:
        args, _ = split_example_inputs(example_inputs)
        input_args = tuple(x.to(on) for x in args if isinstance(x, torch.Tensor))
    else:
        input_args = tuple(_block(p, tess_mesh, on) for p in ports.inputs)
    output_args = tuple(_block(p, tess_mesh, on) for p in ports.outputs)
    return PipelineStage(sharded, stage_index, num_stages, on, input_args=input_args, output_args=output_args,
                         group=pp_group)


def _block(port: Port, mesh: Mesh, device) -> torch.Tensor:
    """An empty block of `port` as PipelineStage's metadata: floating blocks require grad."""
    block = torch.empty(port.local_shape(mesh), dtype=port.dtype, device=device)
    return block.requires_grad_(port.dtype.is_floating_point or port.dtype.is_complex)


def _device_type(device) -> str | None:
    return None if device is None else torch.device(device).type
