"""Data parallelism around the [q, q, d] mesh: the runtime's half of scale-out.

`tess_compile.shard(..., mesh=device_mesh)` takes a torch DeviceMesh whose
dims include "depth", "row" and "col" of sizes (d, q, q); its other named
dims (e.g. "dp") are data parallel. Each data-parallel group (the ranks that
share the coordinates on those other dims) is one tensor-parallel module:

- the per-rank program runs on the `(depth, row, col)` submesh; a rank's
  coordinates (and its rank in the program) come from that submesh, never
  from the global rank;
- every group feeds its own batch, of one shape; the call's inputs are that
  group's batch, and the outputs are DTensors on the submesh;
- each parameter's gradient is averaged over the data-parallel dims in
  backward, right where the per-rank program hands it to the parameter (one
  all-reduce per parameter and backward, as DDP averages): with a mean loss
  over each group's batch, training is exactly that of the unsharded model on
  the concatenated batch;
- `zero=True` shards parameters, gradients and optimizer state over the
  data-parallel dims with FSDP2 (`fully_shard` on its SPMD-mesh path:
  parameters are DTensors on the whole mesh, Replicate on the data-parallel
  dims, which FSDP shards as `_StridedShard`); FSDP then averages the
  gradients (reduce-scatter) and this module does not.

Collectives of the program run on process groups of their own (flattened from
the user's mesh), whose timeout is the module's; the user's groups are not
changed. `SimulatedDataParallel` runs every data-parallel group in one
process (`tess_compile.simulate(..., dp=N)`).

This file is the runtime stage of scale-out; the compiler is unchanged (one
program per tensor-parallel group).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from tess_compile import state
from tess_compile.compiler import INPUT_ROLES, Program
from tess_compile.mesh import AXES, Mesh

__all__ = [
    "MeshGroups",
    "SimulatedDataParallel",
    "check_batch",
    "check_device_mesh",
    "check_zero",
    "dp_size",
    "fully_shard_over_dp",
    "load_full_over_dp",
    "mesh_groups",
    "refuse_zero",
    "split_batch",
    "unsharded_over_dp",
]

_BUILD = "init_device_mesh(device, (dp, d, q, q), mesh_dim_names=(\"dp\", \"depth\", \"row\", \"col\"))"


def _describe_mesh(device_mesh) -> str:
    names = tuple(device_mesh.mesh_dim_names or ())
    return f"DeviceMesh of shape {tuple(device_mesh.shape)} with dims {names}"


def check_device_mesh(device_mesh, mesh: Mesh) -> tuple[str, ...]:
    """The data-parallel dims of `device_mesh` (its dims other than depth, row and col), after
    a ValueError that names the mesh and the fix unless it can run `mesh` on this rank."""
    from torch.distributed.device_mesh import DeviceMesh

    expected = dict(zip(AXES, mesh.shape))
    build = _BUILD.replace("d, q, q", ", ".join(map(str, mesh.shape)))
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(
            f"mesh={device_mesh!r} is a {type(device_mesh).__name__}, not a torch DeviceMesh: pass "
            f"mesh={build} (data parallel over 'dp'), or leave mesh out to use the whole world as one {mesh} mesh"
        )
    names = tuple(device_mesh.mesh_dim_names or ())
    missing = [axis for axis in AXES if axis not in names]
    sizes = ", ".join(f"{axis}={size}" for axis, size in expected.items())
    if missing:
        raise ValueError(
            f"mesh ({_describe_mesh(device_mesh)}) has no dim named {', '.join(map(repr, missing))}: "
            f"tess_compile.shard needs dims named 'depth', 'row' and 'col' ({sizes} for {mesh}); "
            f"its other dims are data parallel. Build it with {build}"
        )
    positions = [names.index(axis) for axis in AXES]
    if positions != sorted(positions):
        raise ValueError(
            f"mesh ({_describe_mesh(device_mesh)}) has the dims 'depth', 'row' and 'col' out of order: "
            f"they must come in that order (data-parallel dims may come anywhere), e.g. {build}"
        )
    actual = {axis: device_mesh.size(names.index(axis)) for axis in AXES}
    if actual != expected:
        got = ", ".join(f"{axis}={size}" for axis, size in actual.items())
        if mesh.mode == "1d":
            fix = f"mode '1d' puts all q*q*d = {mesh.num_ranks} ranks on 'col': build the mesh with {build}"
        else:
            fix = (f"pass q={actual['row']}, d={actual['depth']} to match the mesh" if actual["row"] == actual["col"]
                   else "row and col must have the same size q")
            fix += f", or build the mesh with {build}"
        raise ValueError(
            f"mesh ({_describe_mesh(device_mesh)}) has {got}, but q={mesh.q}, d={mesh.d} ({mesh}) need "
            f"{sizes}: {fix}"
        )
    if device_mesh.get_coordinate() is None:
        raise ValueError(
            f"rank {dist.get_rank()} is not in mesh ({_describe_mesh(device_mesh)}, ranks "
            f"{device_mesh.mesh.flatten().tolist()}): call tess_compile.shard only on the mesh's ranks"
        )
    return tuple(name for name in names if name not in AXES)


def check_zero(zero: bool, device_mesh, dp_dims: tuple[str, ...], mesh: Mesh) -> None:
    """ValueError unless `zero` is a bool and, if True, `device_mesh` has data-parallel dims."""
    if not isinstance(zero, bool):
        raise ValueError(f"zero={zero!r} is not a bool: pass zero=True (ZeRO over the data-parallel dims) or False")
    if zero and not dp_dims:
        where = "no mesh was given (the whole world is one mesh)" if device_mesh is None else (
            f"mesh ({_describe_mesh(device_mesh)}) has none")
        build = _BUILD.replace("d, q, q", ", ".join(map(str, mesh.shape)))
        raise ValueError(
            f"zero=True shards parameters, gradients and optimizer state over the data-parallel dims of "
            f"mesh=, and {where}: pass mesh={build}, or zero=False"
        )


def dp_size(device_mesh, dp_dims: tuple[str, ...]) -> int:
    size = 1
    for name in dp_dims:
        size *= device_mesh.size(device_mesh.mesh_dim_names.index(name))
    return size


def check_batch(example_inputs, mesh: Mesh, where: str, num_groups: int = 1, device_mesh=None) -> None:
    """ValueError unless every input tensor's batch (dim 0) splits over `num_groups` data-parallel
    groups and then over d*q (mode "1d" replicates inputs: only the groups split them)."""
    from tess_compile.compiler import split_example_inputs

    args, kwargs = split_example_inputs(example_inputs)
    parts = mesh.d * mesh.q if mesh.mode != "1d" else 1
    for path, value in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        name = _leaf_name(path)
        batch = value.shape[0]
        if device_mesh is not None and batch % parts:
            raise ValueError(
                f"{name} of shape {list(value.shape)} has a per-group batch of {batch}, not divisible by "
                f"d*q = {parts} on mesh {mesh} ({where}: {_describe_mesh(device_mesh)}, each of its "
                f"{num_groups} data-parallel group(s) passes its own batch): give each group a batch that "
                f"is a multiple of {parts} (a global batch that is a multiple of {num_groups * parts})"
            )
        if device_mesh is None and batch % (num_groups * parts):
            raise ValueError(
                f"{name} of shape {list(value.shape)} has a batch of {batch}, not divisible by "
                f"dp*d*q = {num_groups}*{parts} = {num_groups * parts} ({where}: {num_groups} data-parallel "
                f"group(s) of mesh {mesh}, each takes batch/dp = {batch / num_groups:g} rows, split over "
                f"d*q = {parts}): use a global batch that is a multiple of {num_groups * parts}, or a smaller dp"
            )


def _leaf_name(path) -> str:
    top, key, *inside = path
    name = f"example positional input {key.idx}" if top.idx == 0 else f"example keyword input {key.key!r}"
    return name + "".join(str(k) for k in inside)


# ---------------------------------------------------------------------------
# Distributed: the groups of a sharded module.
# ---------------------------------------------------------------------------


class _MeanGradOverDP(torch.autograd.Function):
    """Identity; the gradient is averaged over the data-parallel group (DDP's mean)."""

    @staticmethod
    def forward(ctx, local, dp):
        ctx.dp = dp
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        return ctx.dp.all_reduce(grad, "gradient mean over the data-parallel dims").div_(ctx.dp.size), None


@dataclass(frozen=True, eq=False)
class MeshGroups:
    """Where a sharded module's collectives run.

    `tp_mesh` is the `(depth, row, col)` DeviceMesh (parameters and outputs
    are DTensors on it), `world` its ranks in one group (gathers, the input
    check), `everyone` every rank of the user's mesh (the weight check), `dp`
    the ranks holding the same blocks in other data-parallel groups (None
    without data parallelism), `axis_groups` the program's groups per axis
    (None: the tp mesh's own). `root` is the user's mesh (None without `mesh=`).
    """

    tp_mesh: object
    world: object
    everyone: object
    dp: object | None = None
    dp_dims: tuple[str, ...] = ()
    root: object | None = None
    axis_groups: dict | None = None

    def mean_grads_over_dp(self, module: nn.Module, program: Program, inputs: list) -> list:
        """The per-rank graph's inputs, each parameter's local tensor made to average its gradient
        over the data-parallel group in backward; unchanged under FSDP, which reduces itself."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(module, FSDPModule):
            return inputs
        return [
            _MeanGradOverDP.apply(value, self.dp)
            if slot.role not in INPUT_ROLES and isinstance(value, torch.Tensor) and value.requires_grad
            else value
            for slot, value in zip(program.slots, inputs)
        ]


_GROUPS: dict = {}  # (id(user mesh), mesh, timeout, device type) -> (user mesh, MeshGroups)


def mesh_groups(device_type: str, mesh: Mesh, timeout: timedelta, device_mesh=None) -> MeshGroups:
    """The groups of a module of `mesh` on this rank: the whole world as one `(d, q, q)` mesh
    without `device_mesh`; with it, its `(depth, row, col)` submesh and its data-parallel dims."""
    from tess_compile.distributed import _WORLDS, World, _device_mesh, _wait_for_every_rank

    if device_mesh is None:
        _wait_for_every_rank(mesh)
        tp_mesh, world = _device_mesh(device_type, mesh, timeout)
        return MeshGroups(tp_mesh, world, world)
    dp_dims = check_device_mesh(device_mesh, mesh)
    key = (id(device_mesh), mesh, timeout, device_type)
    known = _GROUPS.get(key)
    if known is not None and known[0] is device_mesh:
        return known[1]
    backend = dist.get_backend()
    from torch._C._distributed_c10d import Backend

    override = (backend, Backend.Options(backend, timeout))
    # torch keeps one flattened mesh per name (a second _flatten of a name returns the first's
    # groups), so the name carries the timeout: modules with other timeouts get groups of their own.
    prefix = f"tess{round(timeout.total_seconds() * 1000)}ms_"

    def flat(sub, *names):  # a group of our own over `names` of `sub`, timing out after `timeout`
        return (sub[names] if len(names) > 1 else sub[names[0]])._flatten(prefix + "_".join(names), backend_override=override)

    tp_mesh = device_mesh[AXES] if dp_dims else device_mesh
    axis_groups = {axis: flat(tp_mesh, axis).get_group() for axis in AXES}
    for pair in (("depth", "row"), ("row", "col")):  # DTensor's one-collective gathers (see _device_mesh)
        if all(mesh.size(axis) > 1 for axis in pair):
            flat(tp_mesh, *pair)
    tp_ranks = tuple(tp_mesh.mesh.flatten().tolist())
    world = World(mesh, flat(tp_mesh, *AXES).get_group(), timeout, tp_ranks)
    names = tuple(device_mesh.mesh_dim_names)
    all_ranks = tuple(device_mesh.mesh.flatten().tolist())
    everyone = World(mesh, flat(device_mesh, *names).get_group(), timeout, all_ranks) if dp_dims else world
    dp = None
    if dp_dims and dp_size(device_mesh, dp_dims) > 1:
        dp_mesh = device_mesh[dp_dims]
        dp = World(mesh, flat(device_mesh, *dp_dims).get_group(), timeout, tuple(dp_mesh.mesh.flatten().tolist()))
    # Ranks reach a new module at different times (compiling takes longer on some): wait for the
    # mesh's ranks under the default process group's timeout, not the module's (a whole-world
    # mesh waits on the default group, as without mesh=).
    if len(all_ranks) == dist.get_world_size():
        _wait_for_every_rank(mesh)
    else:
        dist.barrier(group=everyone.group)
    groups = MeshGroups(tp_mesh, world, everyone, dp, dp_dims, device_mesh, axis_groups)
    _WORLDS[id(tp_mesh)] = (tp_mesh, world)
    _GROUPS[key] = (device_mesh, groups)
    return groups


def fully_shard_over_dp(module: nn.Module, **fsdp_options) -> nn.Module:
    """ZeRO over the data-parallel dims with FSDP2: each parameter becomes a DTensor on the
    user's whole mesh (Replicate on the data-parallel dims, its layout on depth, row, col), then
    `fully_shard(module, mesh=root, dp_mesh_dims=DataParallelMeshDims(shard=dp dims))` shards it,
    its gradient and (through the optimizer) its state over the data-parallel dims.

    Call before making the optimizer. `fsdp_options` go to `fully_shard` (e.g.
    `reshard_after_forward`). Returns `module`, now also an `FSDPModule`.
    """
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import DTensor, Replicate

    from tess_compile.distributed import _contiguous_stride, _placements

    groups = module.groups
    check_zero(True, groups.root, groups.dp_dims, module.mesh)
    root = groups.root
    names = tuple(root.mesh_dim_names)
    program = module.program
    roles = {s.name: s.role for s in program.slots}
    for slot in program.slots:
        if slot.role != "param":
            continue
        local = state.get_tensor(module, slot).detach()
        tp = dict(zip(AXES, _placements(slot.layout)))
        placements = tuple(tp.get(name, Replicate()) for name in names)
        shape = torch.Size(slot.shape)
        value = DTensor.from_local(local, root, placements, run_check=False, shape=shape, stride=_contiguous_stride(shape))
        state._set_tensor(module, slot.name, nn.Parameter(value), "param")
    for slot in program.slots:
        if slot.role == "alias" and roles.get(slot.alias_of) == "param":
            state._set_tensor(module, slot.name, state.get_attribute(module, slot.alias_of), "param")
    shard = groups.dp_dims[0] if len(groups.dp_dims) == 1 else groups.dp_dims
    fully_shard(module, mesh=root, dp_mesh_dims=DataParallelMeshDims(shard=shard), **fsdp_options)
    return module


def _is_zero(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

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
    from torch.distributed.fsdp import fully_shard

    from tess_compile.layout import local_block

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


# ---------------------------------------------------------------------------
# Simulation: every data-parallel group in this process.
# ---------------------------------------------------------------------------


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
                    f"{_leaf_name(path).replace('example ', '')} of shape {list(value.shape)} has a batch of "
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
