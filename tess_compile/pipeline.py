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

from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn
from torch.utils import _pytree as pytree

from tess_compile import state
from tess_compile.compiler import INPUT_ROLES, Program, split_example_inputs
from tess_compile.layout import Layout, Shard, assemble
from tess_compile.mesh import AXES, Mesh

__all__ = [
    "Port",
    "SimulatedPipeline",
    "StagePorts",
    "check_boundaries",
    "pipeline_mesh",
    "pipeline_stage",
    "simulate_pipeline",
    "stage_compiler",
    "stage_ports",
]


def stage_compiler(module: nn.Module, mesh: Mesh, example_inputs, stage_index: int, num_stages: int, **options):
    """`compile(training)` of stage `stage_index` of `num_stages` (see `tess_compile.train_eval`):
    local inputs unless it is the first stage, local outputs unless it is the last."""
    from tess_compile.train_eval import mode_compiler

    return mode_compiler(
        module,
        mesh,
        example_inputs,
        local_inputs=stage_index > 0,
        local_outputs=stage_index < num_stages - 1,
        **options,
    )


# ---------------------------------------------------------------------------
# Stage boundaries: what crosses them, and the check that they match
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Port:
    """One tensor that crosses a stage boundary: its global shape (one microbatch),
    dtype and layout; each rank sends or takes its block."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout

    def local_shape(self, mesh: Mesh) -> list[int]:
        return self.layout.local_shape(self.shape, mesh)

    def describe(self, mesh: Mesh) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{list(self.shape)} {dtype} in layout {self.layout} (blocks {self.local_shape(mesh)})"


@dataclass(frozen=True)
class StagePorts:
    """What stage `stage` takes from the previous stage and gives to the next; `problem`
    says why its inputs or outputs cannot cross a boundary at all."""

    stage: int
    mesh: Mesh
    inputs: tuple[Port, ...]  # positional tensor inputs (stage 0: whole, not blocks)
    outputs: tuple[Port, ...]
    problem: str | None = None


def stage_ports(program: Program, stage_index: int, num_stages: int) -> StagePorts:
    """The ports of a compiled stage: its positional inputs and its outputs."""
    mesh = program.mesh
    num_positional = program.in_spec.child(0).num_leaves
    is_first, is_last = stage_index == 0, stage_index == num_stages - 1
    inputs, problems = [], []
    for slot in program.slots:
        if slot.role not in INPUT_ROLES or int(slot.name) >= num_positional:
            continue
        if slot.dtype is None:
            if not is_first:
                problems.append(f"its positional input {slot.name} is not a tensor (pass such values as keywords)")
            continue
        inputs.append(Port(slot.shape, slot.dtype, slot.layout if slot.role == "local input" else Layout.replicated()))
    out_spec = program.out_spec
    flat = out_spec.is_leaf() or (out_spec.type in (tuple, list) and all(c.is_leaf() for c in out_spec.children()))
    if not is_last and not flat:
        problems.append("it returns a nested structure, not a tensor or a flat tuple of tensors")
    outputs = []
    for value, layout in zip(_output_values(program), program.output_layouts):
        if not isinstance(value, torch.Tensor):
            if not is_last:
                problems.append(f"it returns {type(value).__name__} {value!r}, not a tensor")
            continue
        outputs.append(Port(_global_shape(value.shape, layout, mesh), value.dtype, layout))
    problem = "; ".join(problems) if problems else None
    return StagePorts(stage_index, mesh, tuple(inputs), tuple(outputs), problem)


def _output_values(program: Program) -> list:
    """Each output's local value on rank 0 (fake tensors from a fake run of the per-rank graph)."""
    from tess_compile.accounting import fake_run

    values = fake_run(program.graph, program.mesh)
    output = next(n for n in program.graph.graph.nodes if n.op == "output")
    return pytree.tree_leaves(values[output])


def _global_shape(local: torch.Size, layout: Layout | None, mesh: Mesh) -> tuple[int, ...]:
    shape = list(local)
    for axis in AXES:
        placement = layout.on(axis) if layout is not None else None
        if isinstance(placement, Shard):
            shape[placement.dim] *= mesh.size(axis)
    return tuple(shape)


_FIX = (
    "cut the model where stage {a}'s outputs are exactly stage {b}'s positional inputs (the same number, "
    "in order, of the same shapes and dtypes for one microbatch; values that are not activations go as "
    "keywords of step()), and compile stage {b} with example_inputs of those shapes"
)


def check_boundaries(stages: list[StagePorts]) -> None:
    """ValueError unless, for every stage s, stage s's outputs are stage s+1's inputs:
    the same count, shapes, dtypes, layouts and mesh, so that rank (k, i, j) of stage s
    sends exactly the blocks that rank (k, i, j) of stage s+1 takes."""
    stages = sorted(stages, key=lambda ports: ports.stage)
    for ports in stages:
        if ports.problem is not None:
            raise ValueError(
                f"pipeline stage {ports.stage} on mesh {ports.mesh} cannot be a stage: "
                f"{ports.problem}; a stage takes its activations as positional tensors and returns a tensor "
                "or a flat tuple of tensors"
            )
    for first, second in zip(stages, stages[1:]):
        a, b = first.stage, second.stage
        where = f"the pipeline split does not match the boundary of stage {a} and stage {b}"
        fix = _FIX.format(a=a, b=b)
        if first.mesh != second.mesh:
            raise ValueError(
                f"{where}: stage {a} runs on mesh {first.mesh} and stage {b} on mesh {second.mesh}, so their "
                f"blocks differ: give every stage the same q, d and mode"
            )
        mesh = first.mesh
        if len(first.outputs) != len(second.inputs):
            raise ValueError(
                f"{where} on mesh {mesh}: stage {a} returns {len(first.outputs)} tensor(s) "
                f"({', '.join(p.describe(mesh) for p in first.outputs) or 'none'}) but stage {b} takes "
                f"{len(second.inputs)} positional input(s) ({', '.join(p.describe(mesh) for p in second.inputs) or 'none'}): "
                f"{fix}"
            )
        for index, (out, inp) in enumerate(zip(first.outputs, second.inputs)):
            if out != inp:
                raise ValueError(
                    f"{where} on mesh {mesh}: stage {a}'s output {index} is {out.describe(mesh)} but stage {b}'s "
                    f"input {index} is {inp.describe(mesh)}, so rank (k, i, j) of stage {a} would send a block that "
                    f"rank (k, i, j) of stage {b} cannot take: {fix}"
                )


def _example_blocks(ports: StagePorts, device=None) -> tuple[torch.Tensor, ...]:
    """Empty tensors of this stage's outputs' global shapes: the next stage's example inputs."""
    return tuple(torch.zeros(p.shape, dtype=p.dtype, device=device) for p in ports.outputs)


# ---------------------------------------------------------------------------
# One stage on torch.distributed: this rank's PipelineStage
# ---------------------------------------------------------------------------

PP = "pp"  # the pipeline dim of the DeviceMesh


def pipeline_mesh(q: int, d: int, num_stages: int, *, mode: str = "2.5d", device_type: str | None = None):
    """The DeviceMesh of a pipeline of `num_stages` stages of `[q, q, d]` over the whole world:
    shape `(num_stages, d, q, q)` named `("pp", "depth", "row", "col")` (mode "1d":
    `(num_stages, 1, 1, q*q*d)`); stage s is ranks `s*q*q*d ... (s+1)*q*q*d - 1`.
    ValueError unless the world has `num_stages * q*q*d` ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

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


def pipeline_stage(
    module: nn.Module,
    q: int,
    d: int,
    stage_index: int,
    num_stages: int,
    *,
    example_inputs,
    mesh=None,
    mode: str = "2.5d",
    summa: str = "broadcast",
    keep_blocks: bool = False,
    checkpoint: str = "none",
    strict: bool = False,
    verify: bool | None = None,
    device=None,
    timeout: float | timedelta | None = None,
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
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from tess_compile import shard_program

    tess_mesh = Mesh(q, d, mode)
    _check_stages(stage_index, num_stages)
    root = mesh if mesh is not None else pipeline_mesh(q, d, num_stages, mode=mode, device_type=_device_type(device))
    names = tuple(root.mesh_dim_names or ())
    if PP not in names or root.size(names.index(PP)) != num_stages:
        have = f"a '{PP}' dim of size {root.size(names.index(PP))}" if PP in names else f"no '{PP}' dim"
        raise ValueError(
            f"mesh (DeviceMesh of shape {tuple(root.shape)} with dims {names}) has {have}, but the pipeline has "
            f"{num_stages} stages: build it with init_device_mesh(device, ({num_stages}, {', '.join(map(str, tess_mesh.shape))}), "
            f"mesh_dim_names=('{PP}', 'depth', 'row', 'col')) (tess_compile.pipeline.pipeline_mesh)"
        )
    coordinate = root.get_local_rank(PP)
    if coordinate != stage_index:
        raise ValueError(
            f"rank {dist.get_rank()} is in stage {coordinate} of the mesh ('{PP}' coordinate {coordinate}), but was "
            f"given stage_index={stage_index}: pass stage_index={coordinate} (mesh.get_local_rank('{PP}')), with "
            "that stage's module"
        )
    options = dict(strict=strict, verify=verify, summa=summa, keep_blocks=keep_blocks, checkpoint=checkpoint)
    compile_in = stage_compiler(module, tess_mesh, example_inputs, stage_index, num_stages, **options)
    program = compile_in(module.training)
    ports = stage_ports(program, stage_index, num_stages)
    pp_group = root.get_group(PP)
    every_stage: list = [None] * num_stages
    dist.all_gather_object(every_stage, ports, group=pp_group)
    check_boundaries(every_stage)
    is_last = stage_index == num_stages - 1
    stage_mesh = root[tuple(name for name in names if name != PP)]
    sharded = shard_program(program, device=device, timeout=timeout, wrap_outputs=is_last, recompile=compile_in,
                            mesh=stage_mesh)
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


# ---------------------------------------------------------------------------
# Every rank of every stage in this process
# ---------------------------------------------------------------------------


def _split_microbatches(args: tuple, kwargs: dict, microbatches: int, what: str) -> list[tuple[tuple, dict]]:
    """The microbatches as torch.distributed.pipelining's schedules cut them: tensors along dim 0,
    other values repeated. ValueError unless every tensor's batch divides evenly."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} is not a positive number of microbatches: pass e.g. 2")
    for path, value in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] % microbatches):
            batch = "a scalar" if value.dim() == 0 else f"batch {value.shape[0]}"
            raise ValueError(
                f"{what} {pytree.keystr(path)} of shape {list(value.shape)} has {batch}, which does not split into "
                f"{microbatches} equal microbatches: use a batch that is a multiple of {microbatches}, or fewer "
                "microbatches"
            )
    args_split, kwargs_split = split_args_kwargs_into_chunks(args, kwargs, microbatches)
    return list(zip(args_split, kwargs_split))


def _merge_microbatches(outputs: list):
    """The outputs of the microbatches as one: tensors concatenated along dim 0, scalars
    (a loss per microbatch) stacked into a tensor of the microbatches' values."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(out)[0] for out in outputs]
    spec = pytree.tree_structure(outputs[0])
    merged = []
    for values in zip(*flat):
        if isinstance(values[0], torch.Tensor):
            merged.append(torch.stack(values) if values[0].dim() == 0 else torch.cat(values))
        else:
            merged.append(values[0])
    return pytree.tree_unflatten(merged, spec)


class SimulatedPipeline(nn.Module):
    """Every rank of every stage in this process: global inputs in, global outputs out.

    A call cuts the batch into the microbatches (as the pipeline schedules do)
    and runs each through the stages: stage 0 on the microbatch's global inputs,
    each later stage on the blocks that the ranks of the same coordinates in
    the stage before returned (nothing is gathered between stages), the last
    stage's outputs assembled. The outputs of the microbatches are
    concatenated along dim 0 (a scalar output, such as a loss, comes back as
    a tensor of one value per microbatch). Autograd runs through every stage,
    so `backward()` on a loss of the output gives the unsharded model's
    gradients. `parameters()` yields every rank's shards of every stage.
    Names (`full_grads`, `full_state_dict`) are those of
    `nn.Sequential(*stages)`: `"0.weight"`, `"1.blocks.0.wq.weight"`, ...
    """

    def __init__(self, stages: list, microbatches: int = 1):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.microbatches = microbatches

    @property
    def mesh(self) -> Mesh:
        return self.stages[0].mesh

    def forward(self, *args, **kwargs):
        chunks = _split_microbatches(args, kwargs, self.microbatches, "input")
        return _merge_microbatches([self._run_microbatch(a, k) for a, k in chunks])

    def _run_microbatch(self, args: tuple, kwargs: dict):
        from tess_compile.collectives import use_comm
        from tess_compile.simulator import run_lockstep

        first = self.stages[0].program
        flat = first.flatten_inputs(args, kwargs)
        rank_inputs = [state.graph_inputs(first, module, flat) for module in self.stages[0].ranks]
        for index, stage in enumerate(self.stages):
            program = stage.program
            if index > 0:  # rank r takes the blocks that rank r of the stage before returned
                rank_inputs = [
                    state.graph_inputs(program, module, program.flatten_inputs(tuple(blocks[rank]), {}))
                    for rank, module in enumerate(stage.ranks)
                ]
            with use_comm(stage.comm):
                outs = run_lockstep(program.runnable, stage.comm, rank_inputs)
            blocks = [list(out) for out in outs]
        last = self.stages[-1]
        flat_out = [
            assemble([outs[r][i] for r in range(len(outs))], layout, last.mesh) if layout is not None else outs[0][i]
            for i, layout in enumerate(last.program.output_layouts)
        ]
        return pytree.tree_unflatten(flat_out, last.program.out_spec)

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Each parameter's full gradient, keyed like `nn.Sequential(*stages).named_parameters()`."""
        return {f"{s}.{name}": grad for s, stage in enumerate(self.stages) for name, grad in stage.full_grads().items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict, keyed like `nn.Sequential(*stages).state_dict()`."""
        return {f"{s}.{name}": value for s, stage in enumerate(self.stages) for name, value in stage.full_state_dict().items()}

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict of `nn.Sequential(*stages)`; every rank of every stage takes its blocks."""
        for s, stage in enumerate(self.stages):
            prefix = f"{s}."
            stage.load_full_state_dict({k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)})

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` of the unsharded model, over every stage; returns the total norm
        (see `SimulatedModule.clip_grad_norm_`)."""
        grads = [grad for grad in self.full_grads().values() if grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(self.parameters(), max_norm, total, foreach)
        return total


def simulate_pipeline(
    stages: list[nn.Module],
    q: int,
    d: int,
    *,
    example_inputs,
    microbatches: int = 1,
    dp: int = 1,
    mode: str = "2.5d",
    summa: str = "broadcast",
    keep_blocks: bool = False,
    checkpoint: str = "none",
    strict: bool = False,
    verify: bool | None = None,
):
    """Compile each module of `stages` as a pipeline stage on its own `[q, q, d]` mesh and run every
    rank of every stage in this process.

    `example_inputs` are stage 0's inputs for the whole batch, as the result
    is called; each stage is compiled for one microbatch (the batch over
    `microbatches`), a later stage for the outputs of the stage before it.
    Positional inputs go to stage 0, and each later stage takes the previous
    stage's outputs as its positional inputs; keyword inputs go to stage 0.
    A stage that cannot take the previous stage's outputs raises a ValueError
    naming both stages, the shapes and the fix. Returns a `SimulatedPipeline`.

    `dp=N` runs N data-parallel groups of the whole pipeline
    (`N * len(stages) * q*q*d` ranks, as `simulate(..., dp=N)` does for one
    module): the batch is the concatenation of the groups' batches, group g
    pipelines the g-th slice, and each parameter's gradient is summed over the
    groups' replicas. Returns a `tess_compile.data_parallel.SimulatedDataParallel`
    of `SimulatedPipeline`s.
    """
    from tess_compile.simulator import SimulatedModule

    if not stages:
        raise ValueError("stages is empty: pass the model cut into a list of modules, one per pipeline stage")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r} is not a number of data-parallel groups: pass an int >= 1, e.g. dp=2")
    mesh = Mesh(q, d, mode)
    args, kwargs = split_example_inputs(example_inputs)
    if dp > 1:  # each group pipelines its slice of the batch
        from tess_compile.data_parallel import split_batch

        args, kwargs = split_batch(args, kwargs, dp)[0]
    example_args, example_kwargs = _split_microbatches(tuple(args), dict(kwargs), microbatches, "example input")[0]
    example = example_kwargs if example_kwargs else example_args  # as example_inputs takes them
    options = dict(strict=strict, verify=verify, summa=summa, keep_blocks=keep_blocks, checkpoint=checkpoint)
    compiled, ports = [], []
    for index, module in enumerate(stages):
        compile_in = stage_compiler(module, mesh, example, index, len(stages), **options)
        try:
            program = compile_in(module.training)
        except ValueError:
            raise
        except Exception as err:
            if index == 0:
                raise
            outputs = ", ".join(p.describe(mesh) for p in ports[-1].outputs) or "nothing"
            raise ValueError(
                f"the pipeline split does not match the boundary of stage {index - 1} and stage {index} on mesh "
                f"{mesh}: stage {index - 1} returns {outputs} per microbatch, and stage {index} cannot take that "
                f"as its positional inputs ({type(err).__name__}: {_first_line(err)}): "
                + _FIX.format(a=index - 1, b=index)
            ) from err
        ports.append(stage_ports(program, index, len(stages)))
        check_boundaries(ports)
        compiled.append((program, compile_in))
        example = _example_blocks(ports[-1])
    groups = []
    for _ in range(dp):
        group = SimulatedPipeline([SimulatedModule(program, recompile=compile_in) for program, compile_in in compiled],
                                  microbatches)
        if groups:  # one program per mode and stage for every group, compiled once
            for mine, first in zip(group.stages, groups[0].stages):
                mine.programs = first.programs
        groups.append(group)
    if dp == 1:
        return groups[0]
    from tess_compile.data_parallel import SimulatedDataParallel

    return SimulatedDataParallel(groups)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
