"""What one rank runs of a parallel spec: `parallelize(model, spec, ...)`.

A `tess_compile.core.parallel_spec.ParallelSpec` is `dp x pp x [q, q, d]`. On every rank of a
world of `spec.world_size`, `parallelize` builds the DeviceMesh `(dp, pp, depth, row, col)`
(`spec_mesh`), cuts the model into its pipeline stages where `pp > 1` (`stage_modules`: at the
boundaries of its repeated blocks, shared out evenly as the planner prices them, by
torch.distributed.pipelining's tracer), and compiles this rank's stage (the whole model without a
pipeline) with the same machinery as the other entries: `shard`'s compile and runtime, its
data-parallel dims averaging the gradients (ZeRO-3: FSDP2, `tess_compile.runtime.zero`), and a
pipeline stage of `tess_compile.scale_out.pipeline` run by torch's `ScheduleGPipe` or
`Schedule1F1B`. The result, a `RankRun`, takes the same global batch on every rank and trains it
(`step`: forward and backward of this rank's part, the step's loss back on every rank), evaluates
it (`loss`), and generates where the tensor part allows (`generate`: a transformers causal LM
compiled with `dynamic=True`, without a pipeline).
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.utils import _pytree as pytree

from tess_compile.analysis.compile_entry import compile_for
from tess_compile.analysis.parallel_plan import num_blocks, repeated_blocks
from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import AXES
from tess_compile.core.parallel_spec import ParallelSpec
from tess_compile.core.program import split_example_inputs
from tess_compile.generation.cache_step import is_causal_lm
from tess_compile.generation.generate import Generation
from tess_compile.runtime.dtensors import full_tensor
from tess_compile.runtime.sharded_module import shard_program
from tess_compile.runtime.zero import REPLICATE
from tess_compile.scale_out.block_units import shard_block_units
from tess_compile.scale_out.data_parallel import check_batch, split_batch
from tess_compile.scale_out.pipeline import PP, pipeline_stage

__all__ = ["DP", "RankRun", "parallelize", "spec_mesh", "stage_modules"]

DP = "dp"  # the data-parallel dim of the DeviceMesh
_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def spec_mesh(spec: ParallelSpec, device_type: str | None = None):
    """The DeviceMesh of `spec` over the whole world: shape `(dp, pp, depth, row, col)` (the tensor-parallel
    group's ranks first, then the stages, then the replicas). ValueError unless the world has
    `spec.world_size` ranks."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{spec.describe()} runs on an initialized process group of {spec.world_size} ranks: call "
                         "torch.distributed.init_process_group first (e.g. under torchrun --nproc-per-node "
                         f"{spec.world_size}), or tess_compile.simulate(model, spec=spec, ...) in one process")
    if dist.get_world_size() != spec.world_size:
        raise ValueError(f"world size {dist.get_world_size()} is not the {spec.world_size} ranks of "
                         f"{spec.describe()}: start {spec.world_size} processes, or pick a spec of "
                         f"{dist.get_world_size()} ranks (tess-compile plan --gpus {dist.get_world_size()})")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (spec.dp, spec.pp, *spec.mesh.shape), mesh_dim_names=(DP, PP, *AXES))


def stage_modules(model: nn.Module, pp: int, example_inputs) -> list[nn.Module]:
    """`model` cut into `pp` pipeline stages at the boundaries of its repeated blocks (the longest
    ModuleList or Sequential of one class, `parallel_plan.repeated_blocks`), each stage an even share
    of them, as the planner prices a pipeline; `[model]` for `pp = 1`. torch.distributed.pipelining's
    `pipeline` traces the model on `example_inputs` (one microbatch): each stage a GraphModule that
    calls the model's own submodules, their parameters under their names in the model."""
    if pp == 1:
        return [model]
    blocks = repeated_blocks(model)
    count = 0 if blocks is None else len(blocks)
    if count % pp or count == 0:
        raise ValueError(f"pp={pp} stages do not split the {count} repeated blocks of {type(model).__name__} "
                         f"evenly: use a pp that divides {count}, or pp=1")
    name = next(path for path, module in model.named_modules() if module is blocks)
    prefix = f"{name}." if name else ""  # the blocks may be the model itself (a Sequential)
    split_spec = {f"{prefix}{k * count // pp}": SplitPoint.BEGINNING for k in range(1, pp)}
    args, kwargs = split_example_inputs(example_inputs)
    with warnings.catch_warnings():  # torch's tracer pickles tree specs by a path it deprecates itself
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        pipe = pipeline(model, tuple(args), kwargs or None, split_spec=split_spec)
    return [pipe.get_stage_module(stage) for stage in range(pp)]


class RankRun:
    """This rank's part of a parallel spec: its stage's sharded `module` (the whole model's without a
    pipeline) and, with `pp > 1`, the `stage` and `schedule` of torch.distributed.pipelining that run it.

    `step(*inputs, target=...)` and `loss(*inputs, target=...)` take the step's global batch, the same
    on every rank: each data-parallel replica takes its part, a pipeline its microbatches. `loss_fn`
    (of `parallelize`) gets the output of a microbatch as full tensors and its target, and returns
    that microbatch's mean loss.
    """

    def __init__(self, spec: ParallelSpec, module: nn.Module, device_mesh, loss_fn, stage=None):
        self.spec, self.module, self.device_mesh, self.loss_fn, self.stage = spec, module, device_mesh, loss_fn, stage
        self.dp_rank, self.pp_rank = device_mesh.get_local_rank(DP), device_mesh.get_local_rank(PP)
        self.schedule, self._no_target = None, False
        if stage is not None:
            self.schedule = _SCHEDULES[spec.schedule](stage, spec.microbatches, loss_fn=self._microbatch_loss)

    def parameters(self):
        """This rank's parameters (its stage's shards), for its optimizer."""
        return self.module.parameters()

    def _microbatch_loss(self, output, target) -> torch.Tensor:
        return self.loss_fn(pytree.tree_map(full_tensor, output), None if self._no_target else target)

    def _part(self, inputs: tuple, target) -> list[tuple[tuple, dict, object]]:
        """This replica's part of the global batch, in its microbatches without a pipeline (a pipeline's
        schedule cuts its own): [(args, kwargs, target)]."""
        if self.loss_fn is None:
            raise ValueError("RankRun's step and loss compute the loss: pass loss_fn=(output, target) -> the "
                             "microbatch's mean loss to tess_compile.parallelize")
        kwargs = inputs[-1] if inputs and isinstance(inputs[-1], dict) else {}
        args = tuple(inputs[:-1] if kwargs else inputs)
        if self.spec.dp > 1:
            with_target, kwargs = split_batch((*args, target), dict(kwargs), self.spec.dp)[self.dp_rank]
            args, target = tuple(with_target[:-1]), with_target[-1]
        parts = 1 if self.stage is not None else self.spec.microbatches
        if parts == 1:
            return [(tuple(args), dict(kwargs), target)]
        arg_chunks, kwarg_chunks = split_args_kwargs_into_chunks((*args, target), dict(kwargs), parts)
        return [(chunk[:-1], chunk_kwargs, chunk[-1]) for chunk, chunk_kwargs in zip(arg_chunks, kwarg_chunks)]

    def step(self, *inputs, target=None) -> torch.Tensor:
        """Forward and backward of this rank's part of the step's batch (`inputs`: positional inputs, then a
        dict of keyword inputs if any; the same on every rank): the gradients of the step's mean loss are
        in this rank's parameters; returns that loss on every rank. The optimizer's step is the caller's."""
        parts = self._part(inputs, target)
        if self.schedule is not None:
            return self._mean_over_replicas(self._piped(self.schedule.step, *parts[0]))
        total = torch.zeros((), dtype=torch.float64)
        for args, kwargs, part_target in parts:  # gradients accumulate to the mean over the parts
            loss = self._microbatch_loss(self.module(*args, **kwargs), part_target) / len(parts)
            loss.backward()
            total += loss.detach().cpu().double()
        return self._mean_over_replicas(total)

    def loss(self, *inputs, target=None) -> torch.Tensor:
        """The step's mean loss on `inputs` and `target` without a backward (evaluation), on every rank."""
        parts = self._part(inputs, target)
        with torch.no_grad():
            if self.schedule is not None:
                return self._mean_over_replicas(self._piped(self.schedule.eval, *parts[0]))
            losses = [self._microbatch_loss(self.module(*args, **kwargs), part_target).cpu().double()
                      for args, kwargs, part_target in parts]
        return self._mean_over_replicas(torch.stack(losses).mean())

    def _piped(self, run, args: tuple, kwargs: dict, target) -> torch.Tensor:
        """A pipeline's step (`run`: the schedule's step or eval): stage 0 feeds the microbatches, the last
        stage takes the targets; the mean of the microbatches' losses, from the last stage to every stage."""
        last = self.pp_rank == self.spec.pp - 1
        losses: list = []
        self._no_target = target is None  # torch's schedules cut a target into the microbatches: give them one
        target = torch.zeros(self.spec.microbatches) if target is None else target
        try:
            run(*(args if self.pp_rank == 0 else ()), **(kwargs if self.pp_rank == 0 else {}),
                **({"target": target, "losses": losses} if last else {}))
        finally:
            self._no_target = False
        total = torch.zeros((), dtype=torch.float64)  # in float64 on every stage (the loss's own dtype or less)
        if last:
            total = torch.stack([loss.detach().cpu().double() for loss in losses]).mean()
        group = self.device_mesh.get_group(PP)
        total = total.to(self.stage.device)
        dist.all_reduce(total, group=group)  # the last stage's loss, on every stage
        return total.cpu()

    def _mean_over_replicas(self, total: torch.Tensor) -> torch.Tensor:
        if self.spec.dp == 1:
            return total
        total = total.to(self._device)
        dist.all_reduce(total, group=self.device_mesh.get_group(DP))
        return (total / self.spec.dp).cpu()

    @property
    def _device(self) -> torch.device:
        return self.stage.device if self.stage is not None else self.module.device

    def __call__(self, *args, **kwargs):
        """The model's outputs on one microbatch of this replica (the inputs `parallelize` compiled for, as
        `shard`'s module gives them); without a pipeline."""
        if self.stage is not None:
            raise ValueError(f"{self.spec.describe()}: a pipeline's outputs are its last stage's; call step or loss, "
                             "or build a spec with pp=1")
        return self.module(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """The model's `generate` on this rank's shards (a transformers causal LM compiled with dynamic=True;
        docs/generation.md), every replica on the prompts it is given."""
        if self.stage is not None:
            raise ValueError(f"{self.spec.describe()}: generation runs without a pipeline: build a spec with pp=1")
        return self.module.generate(*args, **kwargs)


def parallelize(model: nn.Module, spec: ParallelSpec, *, example_inputs, loss_fn=None, device=None,
                timeout: float | timedelta | None = None, cluster: Cluster | str | os.PathLike | None = None,
                compile: bool = False) -> RankRun:
    """What this rank runs of `spec` (a `ParallelSpec`, e.g. a `tess_compile.plan` row's `spec`); call on
    every rank of a world of `spec.world_size`, each with the same model (seed before building it) and
    the same `example_inputs`: the step's global batch, every replica's part and every microbatch
    together. `loss_fn(output, target) -> the microbatch's mean loss` (the output as full tensors) is
    needed with `pp > 1` or `microbatches > 1`, and by `RankRun.step`. "auto" options are priced on
    `cluster` as in `shard`; `device`, `timeout` and `compile` are `shard`'s."""
    if spec.pp > 1 and (loss_fn is None or compile):
        raise ValueError(f"tess_compile.parallelize({spec.describe()}): a pipeline's schedule computes the loss "
                         "(pass loss_fn=) and its stages run eagerly (pass compile=False)")
    device_mesh = spec_mesh(spec, None if device is None else torch.device(device).type)
    check_batch(example_inputs, f"{spec.describe()}", spec.dp * spec.microbatches)
    args, kwargs = split_example_inputs(example_inputs)
    part = split_batch(tuple(args), dict(kwargs), spec.dp * spec.microbatches)[0]  # one microbatch of a replica
    example = part[1] if part[1] else tuple(part[0])
    stage_index = device_mesh.get_local_rank(PP)
    module_mesh = _hsdp_mesh(spec, device_mesh) if spec.zero_shard else device_mesh
    if spec.pp > 1:
        stages = stage_modules(model, spec.pp, example)
        stage = pipeline_stage(stages[stage_index], spec.q, spec.d, stage_index, spec.pp,
                               example_inputs=_stage_example(stages, stage_index, example), options=spec.options,
                               mesh=module_mesh, device=device, timeout=timeout, cluster=cluster, zero=bool(spec.zero))
        return RankRun(spec, stage.submod, device_mesh, loss_fn, stage)
    dp_dims = tuple(name for name in module_mesh.mesh_dim_names if name not in (PP, *AXES)) if spec.dp > 1 else ()
    tp_mesh = module_mesh[(*dp_dims, *AXES)]
    if _block_units(model, spec):
        stages = stage_modules(model, num_blocks(model), example)
        examples = [_stage_example(stages, index, example) for index in range(len(stages))]
        module = shard_block_units(stages, examples, spec, tp_mesh, device=device, timeout=timeout, cluster=cluster,
                                   compile=compile)
        return RankRun(spec, module, device_mesh, loss_fn)
    compiled = compile_for(model, spec.mesh, example, spec.options, cluster)
    module = shard_program(compiled.program, device=device, timeout=timeout, recompile=compiled.recompile,
                           mesh=tp_mesh, zero=bool(spec.zero), compile=compile)
    if compiled.options.dynamic and is_causal_lm(model):
        module.generation = Generation(model, spec.mesh, compiled.options, compiled.cluster)
    return RankRun(spec, module, device_mesh, loss_fn)


def _block_units(model: nn.Module, spec: ParallelSpec) -> bool:
    """Whether ZeRO-3 runs one FSDP2 unit per repeated block (`block_units`): without a pipeline, on a
    model of more than one repeated block, compiled for fixed shapes (a dynamic program, which
    generation needs, is one unit)."""
    return bool(spec.zero) and spec.pp == 1 and not spec.options.dynamic and num_blocks(model) > 1


def _hsdp_mesh(spec: ParallelSpec, device_mesh):
    """`device_mesh` (`spec_mesh`) with its dp dim cut into (dp_replicate, dp_shard): groups of
    `spec.zero_shard` neighbouring replicas that FSDP2 shards over, and the groups it replicates over."""
    shape = (spec.dp // spec.zero_shard, spec.zero_shard, spec.pp, *spec.mesh.shape)
    return init_device_mesh(device_mesh.device_type, shape, mesh_dim_names=(REPLICATE, "dp_shard", PP, *AXES))


def _stage_example(stages: list[nn.Module], index: int, example) -> tuple:
    """Stage `index`'s inputs for one microbatch: `example` for the first stage, else the outputs of the
    stages before it on `example`, computed on fake tensors (their shapes and dtypes, as zeros)."""
    if index == 0:
        return example
    args, kwargs = split_example_inputs(example)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, torch.no_grad():
        values = pytree.tree_map_only(torch.Tensor, fake.from_tensor, (tuple(args), dict(kwargs)))
        outputs = stages[0](*values[0], **values[1])
        for stage in stages[1:index]:
            outputs = stage(*(outputs if isinstance(outputs, tuple) else (outputs,)))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return tuple(torch.zeros(out.shape, dtype=out.dtype) for out in outputs)
