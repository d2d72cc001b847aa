"""ZeRO-3 with one FSDP2 unit per repeated block, as torchtitan applies `fully_shard`.

A sharded module runs its whole per-rank graph in one call, on every parameter's local tensor at
once, so FSDP2 over it (`tess_compile.runtime.zero`) is one unit: it gathers every parameter
before the forward and reduce-scatters every gradient after the backward, with nothing to
overlap them with. Here the model is cut at the boundaries of its repeated blocks (the pipeline's
cut, `rank_run.stage_modules`, one block a part), each part compiled as a pipeline stage on the
same ranks (local blocks in and out, `pipeline.compile_stage`) and sharded over the data-parallel
dims by its own `fully_shard`, then the root over them. FSDP2's own hooks then gather a block's
parameters before it starts (the next block's gather issued as this block starts, each way:
`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`) and reduce-scatter its
gradients as its backward ends, while the block before it runs its backward.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch
from torch import nn

from tess_compile.core.cluster import Cluster
from tess_compile.core.parallel_spec import ParallelSpec
from tess_compile.runtime.sharded_module import ShardedModule, shard_program
from tess_compile.runtime.zero import params_over_whole_mesh, shard_over_dp
from tess_compile.scale_out.pipeline import compile_stage

__all__ = ["BlockUnits", "shard_block_units"]


class BlockUnits(nn.Module):
    """A model cut at its repeated blocks, each part a `ShardedModule` and an FSDP2 unit, run one
    after another on the same ranks: each part but the last hands its local blocks to the next;
    the last returns DTensors, as `shard`'s module does. Its parameters are the parts'."""

    def __init__(self, parts: list[ShardedModule]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.compile = parts[0].compile

    def feeding_leaves(self):
        """`tess_compile.train_step`'s hook, refused as a ZeRO module's (FSDP shards its gradients itself)."""
        return self.parts[0].feeding_leaves()

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def forward(self, *args, **kwargs):
        out = self.parts[0](*args, **kwargs)
        for part in self.parts[1:]:
            out = part(*(out if isinstance(out, tuple) else (out,)))
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **options) -> torch.Tensor:
        """Scale the gradients of every part so that their norm over the whole model is at most
        `max_norm` (`ShardedModule.clip_grad_norm_` over all parts' parameters); the norm before."""
        return ShardedModule.clip_grad_norm_(self, max_norm, norm_type, **options)

    def generate(self, *args, **kwargs):
        raise ValueError("generation runs on a program compiled with dynamic=True, which ZeRO-3 runs as one FSDP2 "
                         "unit: build the spec with CompileOptions(dynamic=True) (docs/generation.md)")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict, gathered on every rank, under the model's names."""
        return {name: value for part in self.parts for name, value in part.full_state_dict().items()}

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict; each part takes its tensors, this rank its blocks."""
        for part in self.parts:
            part.load_full_state_dict(state_dict)


def shard_block_units(stages: list[nn.Module], examples: list, spec: ParallelSpec, device_mesh, *, device=None,
                      timeout: float | timedelta | None = None, cluster: Cluster | None = None,
                      compile: bool = False) -> BlockUnits:
    """This rank's `BlockUnits` of `stages` (the model cut at its blocks; `examples[i]`: stage i's inputs
    for one microbatch), each compiled with `spec.options` for `spec.mesh` and sharded over the
    data-parallel dims of `device_mesh` (depth, row, col and those dims) by its own FSDP2 unit, then
    the root (see the module docstring); `compile`: each part through inductor."""
    parts = []
    for index, (stage, example) in enumerate(zip(stages, examples)):
        compiled = compile_stage(stage, spec.mesh, example, index, len(stages), spec.options, cluster)
        part = shard_program(compiled.program, device=device, timeout=timeout, mesh=device_mesh,
                             wrap_outputs=index == len(stages) - 1, recompile=compiled.recompile, compile=compile)
        params_over_whole_mesh(part)
        parts.append(shard_over_dp(part, part.groups.root, part.groups.dp_dims))
    for before, after in itertools.pairwise(parts):  # FSDP2's explicit prefetch: the next unit's gather, each way
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])
    return shard_over_dp(BlockUnits(parts), parts[0].groups.root, parts[0].groups.dp_dims)
