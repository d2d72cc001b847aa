"""ZeRO over the data-parallel dims of a sharded module's mesh, by FSDP2.

`shard(..., mesh=device_mesh, zero=True)` shards parameters, gradients and
optimizer state over the data-parallel dims with FSDP2 (`fully_shard` on its
SPMD-mesh path: parameters are DTensors on the whole mesh, Replicate on the
data-parallel dims, which FSDP shards as `_StridedShard`); FSDP then averages
the gradients (reduce-scatter) and the module does not. Full state dicts are
gathered and loaded through FSDP's own view of each parameter.

A data-parallel dim named `dp_replicate` (torchtitan's name) is replicated rather than
sharded: FSDP2's HSDP, which shards over the other data-parallel dims (a node's GPUs, say)
and all-reduces the reduce-scattered gradients over this one (`DataParallelMeshDims(shard=...,
replicate="dp_replicate")`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from tess_compile.core.layout import local_block
from tess_compile.core.mesh import AXES
from tess_compile.runtime import state
from tess_compile.runtime.dtensors import contiguous_stride, placements_of
from tess_compile.runtime.groups import check_zero

__all__ = [
    "REPLICATE",
    "fully_shard_over_dp",
    "load_full_over_dp",
    "params_over_whole_mesh",
    "refuse_zero",
    "shard_over_dp",
    "unsharded_over_dp",
]

REPLICATE = "dp_replicate"  # a data-parallel dim FSDP replicates over (HSDP), not shards over


def fully_shard_over_dp(module: nn.Module, **fsdp_options) -> nn.Module:
    """ZeRO over the data-parallel dims with FSDP2: each parameter becomes a DTensor on the
    user's whole mesh (`params_over_whole_mesh`), then `fully_shard(module, mesh=root,
    dp_mesh_dims=...)` shards it, its gradient and (through the optimizer) its state over the
    data-parallel dims (`shard_over_dp`; HSDP where one is named `dp_replicate`).

    Call before making the optimizer. `fsdp_options` go to `fully_shard` (e.g.
    `reshard_after_forward`). Returns `module`, now also an `FSDPModule`.
    """

    check_zero(True, module.groups.root, module.groups.dp_dims, module.mesh)
    params_over_whole_mesh(module)
    return shard_over_dp(module, module.groups.root, module.groups.dp_dims, **fsdp_options)


def params_over_whole_mesh(module: nn.Module) -> None:
    """Make each parameter of a sharded module a DTensor on the user's whole mesh: Replicate on the
    data-parallel dims, its layout on depth, row, col (FSDP2's SPMD-mesh path takes these)."""
    root = module.groups.root
    names = tuple(root.mesh_dim_names)
    program = module.program
    roles = {s.name: s.role for s in program.slots}
    for slot in program.slots:
        if slot.role != "param":
            continue
        current = state.get_tensor(module, slot)
        local = current.detach()
        tp = dict(zip(AXES, placements_of(slot.layout)))
        placements = tuple(tp.get(name, Replicate()) for name in names)
        shape = torch.Size(slot.shape)
        value = DTensor.from_local(local, root, placements, run_check=False, shape=shape, stride=contiguous_stride(shape))
        state._set_tensor(module, slot.name, nn.Parameter(value, requires_grad=current.requires_grad), "param")
    for slot in program.slots:
        if slot.role == "alias" and roles.get(slot.alias_of) == "param":
            state._set_tensor(module, slot.name, state.get_attribute(module, slot.alias_of), "param")


def shard_over_dp(module: nn.Module, root, dp_dims: tuple[str, ...], **fsdp_options) -> nn.Module:
    """`fully_shard(module, mesh=root)` over the data-parallel dims `dp_dims` of `root`: sharded over
    all of them, or replicated over one named `dp_replicate` and sharded over the others (HSDP).
    `module`'s parameters are DTensors on `root` (`params_over_whole_mesh`) or in FSDP modules below it."""
    # New in torch 2.13: imported here, so that this module (and shard, without ZeRO) loads on older torch.
    from torch.distributed.fsdp import DataParallelMeshDims

    sharded = tuple(name for name in dp_dims if name != REPLICATE)
    if not sharded:
        raise ValueError(f"mesh {tuple(root.mesh_dim_names)}: its only data-parallel dim is {REPLICATE!r}, which "
                         "FSDP replicates over: name a dim 'dp_shard' to shard over (HSDP), or 'dp' for plain ZeRO")
    dims = DataParallelMeshDims(shard=sharded[0] if len(sharded) == 1 else sharded,
                                replicate=REPLICATE if REPLICATE in dp_dims else None)
    fully_shard(module, mesh=root, dp_mesh_dims=dims, **fsdp_options)
    return module


def _is_zero(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def unsharded_over_dp(module: nn.Module):
    """A block in which a ZeRO module's parameters are whole over the data-parallel dims
    (FSDP's `unshard()`, then `reshard()`); any other module as it is."""
    if not _is_zero(module):
        yield module
        return
    module.unshard()
    try:
        yield module
    finally:
        module.reshard()


def load_full_over_dp(module: nn.Module, state_dict: dict) -> bool:
    """Load a full state dict into a ZeRO module: each parameter's part of this rank's
    tensor-parallel block, as FSDP cuts it over the data-parallel dims (dim 0, `torch.chunk`).
    False (nothing done) for any other module."""
    if not _is_zero(module):
        return False

    program, rank = module.program, module.world.rank
    param_group = fully_shard.state(module)._fsdp_param_group
    dp_part = {
        id(p.sharded_param): (p.mesh_info.shard_mesh_rank, p.mesh_info.shard_mesh_size)
        for p in (param_group.fsdp_params if param_group is not None else [])
    }
    sources = state.check_state_dict(program, state_dict)
    with torch.no_grad():
        for slot, key in sources.values():
            block = local_block(state_dict[key].detach(), slot.layout, program.mesh, rank)
            target = state.get_attribute(module, slot)
            if id(target) in dp_part:
                index, size = dp_part[id(target)]
                chunks = block.chunk(size, dim=0)
                block = chunks[index] if index < len(chunks) else block[:0]
                target.to_local().copy_(block)
            else:
                state.get_tensor(module, slot).copy_(block)
    return True


def refuse_zero(module: nn.Module, what: str) -> None:
    """ValueError for a state-dict call that a ZeRO module does not support yet."""
    if _is_zero(module):
        raise ValueError(
            f"{what} of a zero=True module (mesh {module.mesh}, parameters sharded by FSDP over the "
            f"data-parallel dims {module.groups.dp_dims}) is not supported: save full_state_dict() "
            "(gathered on every rank) and load it with load_full_state_dict(), or shard with zero=False "
            "for DCP checkpoints"
        )
