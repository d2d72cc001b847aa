"""The process groups of a sharded module: one owner for every group a rank uses.

Without a user mesh, the whole world is one `(d, q, q)` DeviceMesh named
`("depth", "row", "col")`, with flattened meshes over `(depth, row)`,
`(row, col)` and all ranks, so that DTensor gathers and reduces over two axes
in one collective. With `shard(..., mesh=device_mesh)`, the user's mesh holds
dims "depth", "row" and "col" of sizes `(d, q, q)`; its other named dims (e.g.
"dp") are data parallel, and `MeshGroups` holds the tensor-parallel submesh,
its groups per axis, the data-parallel group and the user's mesh. Every group
here is made with the module's timeout; a collective that cannot complete
fails after it with a message (`World`). The user's own groups are not changed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import Backend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.program import INPUT_ROLES, Program

__all__ = [
    "DEFAULT_TIMEOUT",
    "MeshGroups",
    "World",
    "check_device_mesh",
    "check_world",
    "check_zero",
    "describe_mesh",
    "dp_size",
    "mesh_groups",
    "reduced_grad",
    "world_of",
]

# How long a collective waits for its peers before it fails.
DEFAULT_TIMEOUT = timedelta(minutes=10)


def check_world(mesh: Mesh) -> None:
    """ValueError unless an initialized world has exactly `q*q*d` ranks."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"tess_compile.shard needs an initialized process group of {mesh.num_ranks} ranks for mesh "
            f"{mesh}: call torch.distributed.init_process_group first (e.g. under torchrun "
            f"--nproc-per-node {mesh.num_ranks}), or use tess_compile.simulate in one process"
        )
    world = dist.get_world_size()
    if world != mesh.num_ranks:
        raise ValueError(
            f"world size {world} is not q*q*d = {mesh.num_ranks} for mesh {mesh}: start "
            f"{mesh.num_ranks} process(es), or pick q and d with q*q*d = {world}"
        )


@dataclass(frozen=True, eq=False)
class World:
    """Every rank of the mesh in one process group whose collectives time out after
    `timeout`; a failure is told with the op, this rank and the timeout.

    `ranks` are the members' global ranks in mesh order (rank `k*q*q + i*q + j`
    of the tensor-parallel mesh first; with `shard(..., mesh=...)` the mesh's
    own order); None: ranks 0..p-1 of the default group. Gathers come back in
    that order.
    """

    mesh: Mesh
    group: dist.ProcessGroup
    timeout: timedelta
    ranks: tuple[int, ...] | None = None

    @property
    def members(self) -> tuple[int, ...]:
        return self.ranks if self.ranks is not None else tuple(range(self.mesh.num_ranks))

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        """This rank's index among the members (its rank in the tensor-parallel mesh)."""
        return self.members.index(dist.get_rank())

    def _in_order(self, values: list) -> list:
        if self.ranks is None:
            return values
        by_group = dist.get_process_group_ranks(self.group)
        return [values[by_group.index(rank)] for rank in self.ranks]

    def all_gather(self, x: torch.Tensor, op: str) -> list[torch.Tensor]:
        blocks = [torch.empty_like(x) for _ in range(self.size)]
        self._guard(op, dist.all_gather, blocks, x.contiguous(), group=self.group)
        return self._in_order(blocks)

    def all_gather_object(self, value, op: str) -> list:
        values = [None] * self.size
        self._guard(op, dist.all_gather_object, values, value, group=self.group)
        return self._in_order(values)

    def all_reduce(self, x: torch.Tensor, op: str, reduce_op=dist.ReduceOp.SUM) -> torch.Tensor:
        total = x.contiguous().clone()
        self._guard(op, dist.all_reduce, total, reduce_op, group=self.group)
        return total

    def _guard(self, op: str, call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except RuntimeError as err:
            raise RuntimeError(
                f"tess {op} over all {self.size} ranks failed on rank {dist.get_rank()}"
                f"{f' {self.mesh.coords(self.rank)}' if self.size == self.mesh.num_ranks else ''} of mesh {self.mesh}: "
                "a peer rank stopped, or did not reach the "
                f"same call within {self.timeout.total_seconds():g}s (tess_compile.shard(..., timeout=...)). "
                f"Cause: {err}"
            ) from err


# id(DeviceMesh) -> (that mesh, its World): what `full_tensor` gathers a DTensor over.
_WORLDS: dict[int, tuple] = {}


def world_of(device_mesh) -> World | None:
    """The World of a sharded module's (depth, row, col) DeviceMesh; None for any other mesh."""
    known = _WORLDS.get(id(device_mesh))
    return known[1] if known is not None and known[0] is device_mesh else None


def _backend_override(timeout: timedelta) -> tuple[str, object]:
    """The default group's backend with options that time a group out after `timeout`:
    NCCL takes only its own options class (it refuses the generic one); torch's fake group
    (nothing moves, nothing waits) takes none."""
    backend = dist.get_backend()
    if backend == dist.Backend.FAKE:
        return backend, None
    if backend == dist.Backend.NCCL:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return backend, options
    return backend, Backend.Options(backend, timeout)


@functools.cache
def _device_mesh(device_type: str, mesh: Mesh, timeout: timedelta, default_group):
    """The (d, q, q) DeviceMesh and its World, every group timing out after `timeout`, under the
    default process group `default_group` (a new one, after destroy and init, builds new groups).

    Flattened `(depth, row)` and `(row, col)` meshes let DTensor gather an
    activation split over depth and row, or reduce a norm over row and col,
    in one collective (otherwise it runs one per axis and logs a warning on
    every rank); the flattened mesh of all ranks is the World.
    """
    override = _backend_override(timeout)
    device_mesh = init_device_mesh(
        device_type, mesh.shape, mesh_dim_names=AXES, backend_override={axis: override for axis in AXES}
    )
    for pair in (("depth", "row"), ("row", "col")):
        if all(mesh.size(axis) > 1 for axis in pair):
            device_mesh[pair]._flatten("_".join(pair), backend_override=override)
    world = World(mesh, device_mesh._flatten("world", backend_override=override).get_group(), timeout)
    _WORLDS[id(device_mesh)] = (device_mesh, world)
    return device_mesh, world


def _wait_for_every_rank(mesh: Mesh) -> None:
    """A barrier on the default group (and its timeout): ranks reach a new module at different
    times (compiling takes longer on some), which the module's own, possibly short, timeout
    should not count."""
    try:
        dist.barrier()
    except RuntimeError as err:
        raise RuntimeError(
            f"tess_compile.shard on rank {dist.get_rank()} of mesh {mesh}: the other ranks did not all reach "
            "it within the default process group's timeout (init_process_group(timeout=...)): a rank stopped "
            f"or took another path. Cause: {err}"
        ) from err


_BUILD = "init_device_mesh(device, (dp, d, q, q), mesh_dim_names=(\"dp\", \"depth\", \"row\", \"col\"))"


def describe_mesh(device_mesh) -> str:
    names = tuple(device_mesh.mesh_dim_names or ())
    return f"DeviceMesh of shape {tuple(device_mesh.shape)} with dims {names}"


def check_device_mesh(device_mesh, mesh: Mesh) -> tuple[str, ...]:
    """The data-parallel dims of `device_mesh` (its dims other than depth, row and col), after
    a ValueError that names the mesh and the fix unless it can run `mesh` on this rank."""

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
            f"mesh ({describe_mesh(device_mesh)}) has no dim named {', '.join(map(repr, missing))}: "
            f"tess_compile.shard needs dims named 'depth', 'row' and 'col' ({sizes} for {mesh}); "
            f"its other dims are data parallel. Build it with {build}"
        )
    positions = [names.index(axis) for axis in AXES]
    if positions != sorted(positions):
        raise ValueError(
            f"mesh ({describe_mesh(device_mesh)}) has the dims 'depth', 'row' and 'col' out of order: "
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
            f"mesh ({describe_mesh(device_mesh)}) has {got}, but q={mesh.q}, d={mesh.d} ({mesh}) need "
            f"{sizes}: {fix}"
        )
    if device_mesh.get_coordinate() is None:
        raise ValueError(
            f"rank {dist.get_rank()} is not in mesh ({describe_mesh(device_mesh)}, ranks "
            f"{device_mesh.mesh.flatten().tolist()}): call tess_compile.shard only on the mesh's ranks"
        )
    return tuple(name for name in names if name not in AXES)


def check_zero(zero: bool, device_mesh, dp_dims: tuple[str, ...], mesh: Mesh) -> None:
    """ValueError unless `zero` is a bool and, if True, `device_mesh` has data-parallel dims."""
    if not isinstance(zero, bool):
        raise ValueError(f"zero={zero!r} is not a bool: pass zero=True (ZeRO over the data-parallel dims) or False")
    if zero and not dp_dims:
        where = "no mesh was given (the whole world is one mesh)" if device_mesh is None else (
            f"mesh ({describe_mesh(device_mesh)}) has none")
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


class _ReducedGrad(torch.autograd.Function):
    """Identity; the gradient is all-reduced over a `World`: summed, or averaged with `mean`."""

    @staticmethod
    def forward(ctx, x, world, what, mean):
        ctx.world, ctx.what, ctx.mean = world, what, mean
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        total = ctx.world.all_reduce(grad, ctx.what)
        return (total.div_(ctx.world.size) if ctx.mean else total), None, None, None


def reduced_grad(x: torch.Tensor, world, what: str, *, mean: bool = False) -> torch.Tensor:
    """`x`, whose gradient is summed over `world`'s ranks in backward (averaged with `mean`);
    `what` names the all-reduce in a failure's message."""
    return _ReducedGrad.apply(x, world, what, mean)


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

        if isinstance(module, FSDPModule):
            return inputs
        return [
            reduced_grad(value, self.dp, "gradient mean over the data-parallel dims", mean=True)
            if slot.role not in INPUT_ROLES and isinstance(value, torch.Tensor) and value.requires_grad
            else value
            for slot, value in zip(program.slots, inputs)
        ]


_GROUPS: dict = {}  # (id(user mesh), mesh, timeout, device type) -> (user mesh, MeshGroups)


def mesh_groups(device_type: str, mesh: Mesh, timeout: timedelta, device_mesh=None) -> MeshGroups:
    """The groups of a module of `mesh` on this rank: the whole world as one `(d, q, q)` mesh
    without `device_mesh`; with it, its `(depth, row, col)` submesh and its data-parallel dims."""

    if device_mesh is None:
        _wait_for_every_rank(mesh)
        tp_mesh, world = _device_mesh(device_type, mesh, timeout, dist.group.WORLD)
        return MeshGroups(tp_mesh, world, world)
    dp_dims = check_device_mesh(device_mesh, mesh)
    key = (id(device_mesh), mesh, timeout, device_type)
    known = _GROUPS.get(key)
    if known is not None and known[0] is device_mesh:
        return known[1]
    override = _backend_override(timeout)
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
