"""Every rank of every pipeline stage in this process: `simulate_pipeline`.

Each stage is compiled by the same passes as `shard`, with its boundary made
of local blocks (`tess_compile.scale_out.stage_ports`), and every rank of
every stage runs in the simulator: stage 0 on the microbatch's global inputs,
each later stage on the blocks that the ranks of the same coordinates in the
stage before returned (nothing is gathered between stages).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.utils import _pytree as pytree

from tess_compile.core.autocast import without_autocast
from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import Mesh
from tess_compile.core.options import CompileOptions, takes_compile_options
from tess_compile.core.program import split_example_inputs
from tess_compile.ops.collectives import use_comm
from tess_compile.runtime import state
from tess_compile.runtime.simulator import SimulatedModule, run_lockstep
from tess_compile.scale_out.data_parallel import SimulatedDataParallel, split_batch
from tess_compile.scale_out.pipeline import compile_stage
from tess_compile.scale_out.stage_ports import BOUNDARY_FIX, check_boundaries, example_blocks, stage_ports

__all__ = ["SimulatedPipeline", "simulate_pipeline"]


def _split_microbatches(args: tuple, kwargs: dict, microbatches: int, what: str) -> list[tuple[tuple, dict]]:
    """The microbatches as torch.distributed.pipelining's schedules cut them: tensors along dim 0,
    other values repeated. ValueError unless every tensor's batch divides evenly."""

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
        first = self.stages[0].program
        flat = first.flatten_inputs(args, kwargs)
        rank_inputs = [state.graph_inputs(first, module, flat) for module in self.stages[0].ranks]
        outs = None
        for stage in self.stages:
            program = stage.program
            if outs is not None:  # rank r takes the blocks that rank r of the stage before returned
                rank_inputs = [
                    state.graph_inputs(program, module, program.flatten_inputs(tuple(outs[rank]), {}))
                    for rank, module in enumerate(stage.ranks)
                ]
            with use_comm(stage.comm), without_autocast(program.autocast):
                outs = run_lockstep(program.runnable, stage.comm, rank_inputs)
        last = self.stages[-1].program
        return pytree.tree_unflatten(state.global_outputs(last, outs), last.out_spec)

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


@takes_compile_options
def simulate_pipeline(
    stages: list[nn.Module],
    q: int,
    d: int,
    *,
    example_inputs,
    options: CompileOptions | None = None,
    microbatches: int = 1,
    dp: int = 1,
    cluster: Cluster | str | os.PathLike | None = None,
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
    groups' replicas. Returns a `tess_compile.scale_out.data_parallel.SimulatedDataParallel`
    of `SimulatedPipeline`s. The compile options are those of `CompileOptions`;
    summa="auto" prices each product's schedule on `cluster` (a `Cluster`, the path of a JSON
    file `Cluster.save` wrote, or None: `CALIBRATED_CLUSTER`), as `pipeline_stage` does.
    """
    if not stages:
        raise ValueError("stages is empty: pass the model cut into a list of modules, one per pipeline stage")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r} is not a number of data-parallel groups: pass an int >= 1, e.g. dp=2")
    mesh = options.mesh(q, d)
    args, kwargs = split_example_inputs(example_inputs)
    if dp > 1:  # each group pipelines its slice of the batch
        args, kwargs = split_batch(args, kwargs, dp)[0]
    example_args, example_kwargs = _split_microbatches(tuple(args), dict(kwargs), microbatches, "example input")[0]
    example = example_kwargs if example_kwargs else example_args  # as example_inputs takes them
    compiled, ports = [], []
    for index, module in enumerate(stages):
        try:
            stage = compile_stage(module, mesh, example, index, len(stages), options, cluster)
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
                + BOUNDARY_FIX.format(a=index - 1, b=index)
            ) from err
        ports.append(stage_ports(stage.program, index, len(stages)))
        check_boundaries(ports)
        compiled.append((stage.program, stage.recompile))
        example = example_blocks(ports[-1])
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

    return SimulatedDataParallel(groups)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
