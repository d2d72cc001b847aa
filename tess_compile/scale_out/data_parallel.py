"""Data parallelism around the [q, q, d] mesh: every data-parallel group in one process,
and the batch checks of scale-out.

On a cluster, `tess_compile.shard(..., mesh=device_mesh)` runs one
tensor-parallel module per data-parallel group: its groups come from
`tess_compile.runtime.groups`, and each parameter's gradient is averaged over
the data-parallel dims in backward, as DDP averages (ZeRO:
`tess_compile.runtime.zero`). `SimulatedDataParallel` runs every group in one
process (`tess_compile.simulate(..., dp=N)`), each with shards of its own;
`check_batch` and `split_batch` say how a batch splits over the groups.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree

from tess_compile.core.mesh import Mesh
from tess_compile.core.program import Program, input_name, split_example_inputs

__all__ = ["SimulatedDataParallel", "check_batch", "split_batch"]


def check_batch(example_inputs, where: str, num_groups: int) -> None:
    """ValueError unless every input tensor's batch (dim 0) splits over `num_groups` data-parallel
    groups (each group's batch then splits as the compile's `batch_split` takes it)."""
    args, kwargs = split_example_inputs(example_inputs)
    for path, value in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        batch = value.shape[0]
        if batch % num_groups:
            raise ValueError(
                f"example {input_name(path)} of shape {list(value.shape)} has a batch of {batch}, not divisible by "
                f"dp = {num_groups} ({where}): use a global batch that is a multiple of {num_groups}, or another dp"
            )


def split_batch(args: tuple, kwargs: dict, num_groups: int) -> list[tuple[tuple, dict]]:
    """`(args, kwargs)` of each data-parallel group: every tensor with a batch dim cut along dim 0
    into `num_groups` equal parts (the module's inputs all lead with the batch, as `place` assumes);
    other values go to every group. ValueError for a batch that does not split."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    per_group: list[list] = [[] for _ in range(num_groups)]
    for path, value in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape[0] % num_groups:
                raise ValueError(
                    f"{input_name(path)} of shape {list(value.shape)} has a batch of "
                    f"{value.shape[0]}, not divisible by dp = {num_groups}: the simulated call takes the "
                    f"concatenated batch of the {num_groups} data-parallel groups, a multiple of dp*d*q"
                )
            parts = value.chunk(num_groups, dim=0)
        else:
            parts = [value] * num_groups
        for group, part in zip(per_group, parts):
            group.append(part)
    return [pytree.tree_unflatten(group, spec) for group in per_group]


class _SumOverReplicas(torch.autograd.Function):
    """Replicas of one tensor in; the same values out; every replica's gradient is the sum of
    all of theirs (the adjoint of holding one parameter in every data-parallel group)."""

    @staticmethod
    def forward(ctx, *replicas):
        return tuple(r.view_as(r) for r in replicas)

    @staticmethod
    def backward(ctx, *grads):
        present = [g for g in grads if g is not None]
        if not present:
            return grads
        total = present[0].clone()
        for g in present[1:]:
            total += g
        return tuple(total.clone() for _ in grads)


class SimulatedDataParallel(nn.Module):
    """`num_groups` data-parallel groups of one simulated module, in this process.

    `replicas[g]` is group g's module (a `SimulatedModule`: every rank of its
    [q, q, d] mesh), with shards of its own, as on a real cluster. Called with
    the concatenated batch of all groups, it gives group g the g-th slice of
    every input's dim 0 (`split_batch`), and returns the groups' outputs
    concatenated along dim 0 (an output that does not lead with the group's
    batch: scalars averaged over the groups, other values as a list, one per
    group).

    Gradients: each parameter's gradient is summed over its replicas in
    backward, so every replica holds the unsharded model's gradient of the
    global computation and stays equal to the others under any optimizer. With
    a mean loss over the concatenated output this is exactly what DDP's
    average of per-group mean losses gives on a cluster. Global ranks are
    `g * q*q*d + tensor-parallel rank` (the mesh `(dp, depth, row, col)`).

    The replicas need only be modules that take a group's batch and hold
    parameters of the same names and order, so a group may hold another
    simulated engine (e.g. pipeline stages) in place of one `SimulatedModule`.
    """

    def __init__(self, replicas: list[nn.Module], batch_of_group: int | None = None):
        super().__init__()
        self.replicas = nn.ModuleList(replicas)
        self.batch_of_group = batch_of_group
        first = replicas[0]
        for replica in replicas[1:]:
            if hasattr(first, "programs"):  # one program per mode for all groups, compiled once
                replica.programs = first.programs

    @property
    def num_groups(self) -> int:
        return len(self.replicas)

    @property
    def program(self) -> Program:
        return self.replicas[0].program

    @property
    def mesh(self) -> Mesh:
        return self.replicas[0].mesh

    def forward(self, *args, **kwargs):
        chunks = split_batch(args, dict(kwargs), self.num_groups)
        tied = self._tied_parameters()
        outs = []
        for group, (replica, (group_args, group_kwargs)) in enumerate(zip(self.replicas, chunks)):
            params = {name: values[group] for name, values in tied.items()}
            outs.append(torch.func.functional_call(replica, params, tuple(group_args), dict(group_kwargs), strict=False))
        return self._combine(outs, chunks)

    def _tied_parameters(self) -> dict[str, tuple]:
        """{name: each replica's parameter, through one `_SumOverReplicas`}, for grad-requiring ones."""
        named = [dict(replica.named_parameters()) for replica in self.replicas]  # a tied name once
        tied = {}
        for name, first in named[0].items():
            if first.requires_grad and torch.is_grad_enabled():
                tied[name] = _SumOverReplicas.apply(*(params[name] for params in named))
        return tied

    def _combine(self, outs: list, chunks: list):
        flat = [pytree.tree_flatten(out) for out in outs]
        leaves0, spec = flat[0]
        batch = _group_batch(chunks[0])
        combined = []
        for index, first in enumerate(leaves0):
            values = [leaves[index] for leaves, _ in flat]
            if isinstance(first, torch.Tensor) and first.dim() > 0 and batch is not None and first.shape[0] == batch:
                combined.append(torch.cat(values, dim=0))
            elif isinstance(first, torch.Tensor) and first.dim() == 0 and first.is_floating_point():
                combined.append(torch.stack(values).mean())
            else:
                combined.append(values)
        return pytree.tree_unflatten(combined, spec)

    # What a SimulatedModule offers, over the groups (all replicas are equal: group 0 answers).

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Each parameter's full gradient (the same in every group), keyed like the model's."""
        return self.replicas[0].full_grads()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.replicas[0].full_state_dict()

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict into every group."""
        for replica in self.replicas:
            replica.load_full_state_dict(state_dict)

    def generate(self, *args, **kwargs):
        """Group 0's `generate` (every group holds the same weights, so each would give the same tokens)."""
        return self.replicas[0].generate(*args, **kwargs)

    def rank_tensor(self, name: str, rank: int) -> torch.Tensor:
        """The local shard of `name` on global `rank` = group * q*q*d + tensor-parallel rank."""
        group, tp_rank = divmod(rank, self.mesh.num_ranks)
        return self.replicas[group].rank_tensor(name, tp_rank)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` of the unsharded model: the norm of one group's full
        gradients, every replica scaled alike. Returns the total norm."""
        grads = [grad for grad in self.full_grads().values() if grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(self.parameters(), max_norm, total, foreach)
        return total


def _group_batch(chunk) -> int | None:
    for value in pytree.tree_leaves(chunk):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None
