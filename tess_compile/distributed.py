"""The distributed runtime: one rank of a compiled program on torch.distributed.

Groups come from a DeviceMesh of shape `(d, q, q)` named
`("depth", "row", "col")`, with flattened meshes over `(depth, row)`,
`(row, col)` and all ranks, so that DTensor gathers and reduces over two
axes in one collective. gloo on CPU, NCCL on CUDA. A collective that cannot
complete (a peer stopped, or took another path) fails after the module's
timeout with a message that names the op, the axis, this rank and its peers.

Parameters are DTensors whose placements are their layouts; the per-rank
program takes their local tensors. At construction every rank checks that
all ranks hold the same weights and example-input shapes;
`TESS_COMPILE_DEBUG=1` also checks every call's inputs.
"""

from __future__ import annotations

import functools
import os
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend
from torch import nn
from torch.distributed import tensor as dt
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

from tess_compile import state
from tess_compile.collectives import Comm, use_comm
from tess_compile.compiler import INPUT_ROLES, Program, Slot
from tess_compile.layout import Layout, Partial, Replicate, Shard, assemble, local_block, put_blocks, take_block
from tess_compile.mesh import AXES, Mesh
from tess_compile.train_eval import ProgramsByMode

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistComm",
    "ShardedModule",
    "World",
    "check_world",
    "fingerprint",
    "full_tensor",
    "layout_of",
    "tess_mesh",
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


class DistComm(Comm):
    """Collectives of this rank over the mesh's process groups.

    `device_mesh` is the `(depth, row, col)` DeviceMesh (with `shard(..., mesh=...)`,
    the tensor-parallel submesh of the user's mesh): this rank's coordinates,
    hence `rank` (its rank within the tensor-parallel group), come from it, not
    from the global rank. `groups` (axis -> process group) overrides its groups.
    """

    def __init__(self, mesh: Mesh, device_mesh, timeout: timedelta, groups: dict | None = None):
        super().__init__()
        self.mesh = mesh
        self.timeout = timeout
        self.rank = mesh.rank(*device_mesh.get_coordinate())
        self.global_ranks = device_mesh.mesh.flatten().tolist()  # global rank of each tensor-parallel rank
        self.groups = groups or {axis: device_mesh.get_group(axis) for axis in AXES}
        self.pending: dict[int, tuple] = {}  # storage pointer -> (work, axis) of a broadcast_start

    def run(self, op: str, x: torch.Tensor, axis: str, *args) -> torch.Tensor:
        self.record(op, axis, x)
        return self._guard(op, axis, getattr(self, "_" + op), x.contiguous(), axis, *args)

    def _guard(self, op: str, axis: str, call, *args):
        """`call(*args)`, a collective's failure or timeout told with the rank, the axis and the peers."""
        try:
            return call(*args)
        except RuntimeError as err:
            peers = [self.global_ranks[r] for r in self.mesh.group(self.rank, axis)]
            raise RuntimeError(
                f"tess collective {op} along {axis} failed on rank {self.global_ranks[self.rank]} "
                f"{self.mesh.coords(self.rank)} of mesh {self.mesh} (peers {peers}): a peer rank stopped, "
                f"or did not reach the same collective within {self.timeout.total_seconds():g}s "
                f"(tess_compile.shard(..., timeout=...)). Cause: {err}"
            ) from err

    def _coord(self, axis: str) -> int:
        return self.mesh.coord(self.rank, axis)

    def _broadcast(self, x, axis, src):
        out = x.clone()
        dist.broadcast(out, group=self.groups[axis], group_src=src)
        return out

    def _broadcast_start(self, x, axis, src):
        out = x.clone()
        work = dist.broadcast(out, group=self.groups[axis], group_src=src, async_op=True)
        self.pending[out.untyped_storage().data_ptr()] = (work, axis)
        return out

    def wait(self, x: torch.Tensor) -> torch.Tensor:
        work, axis = self.pending.pop(x.untyped_storage().data_ptr(), (None, None))
        if work is not None:
            self._guard("broadcast_start", axis, work.wait)
        return x

    def _reduce(self, x, axis, dst):
        out = x.clone()
        dist.reduce(out, group=self.groups[axis], group_dst=dst)
        return out if self._coord(axis) == dst else torch.zeros_like(x)

    def _all_reduce(self, x, axis):
        out = x.clone()
        dist.all_reduce(out, group=self.groups[axis])
        return out

    def _keep_first(self, x, axis):
        return x.clone() if self._coord(axis) == 0 else torch.zeros_like(x)

    def _all_gather(self, x, axis, parts, dim, groups):
        """One `all_gather_single` of the flattened blocks (NCCL's native all-gather into
        one tensor; gloo takes only the concatenated form)."""
        flat = x.reshape(-1)
        gathered = flat.new_empty(parts * flat.numel())
        dist.all_gather_single(gathered, flat, group=self.groups[axis])
        return put_blocks([block.view(x.shape) for block in gathered.chunk(parts)], dim, groups)

    def _reduce_scatter(self, x, axis, parts, dim, groups):
        """One `reduce_scatter_single` of the blocks flattened in rank order (NCCL's native call)."""
        blocks = [take_block(x, dim, groups, parts, t) for t in range(parts)]
        out = blocks[0].new_empty(blocks[0].numel())
        dist.reduce_scatter_single(out, torch.cat([block.reshape(-1) for block in blocks]), group=self.groups[axis])
        return out.view(blocks[0].shape)

    def _shard_slice(self, x, axis, parts, dim, groups):
        return take_block(x, dim, groups, parts, self._coord(axis)).clone()

    def _shard_pad(self, x, axis, parts, dim, groups):
        coord = self._coord(axis)
        return put_blocks([x if t == coord else torch.zeros_like(x) for t in range(parts)], dim, groups)


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

    def all_reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        total = x.contiguous().clone()
        self._guard(op, dist.all_reduce, total, group=self.group)
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


@functools.cache
def _device_mesh(device_type: str, mesh: Mesh, timeout: timedelta):
    """The (d, q, q) DeviceMesh and its World, every group timing out after `timeout`.

    Flattened `(depth, row)` and `(row, col)` meshes let DTensor gather an
    activation split over depth and row, or reduce a norm over row and col,
    in one collective (otherwise it runs one per axis and logs a warning on
    every rank); the flattened mesh of all ranks is the World.
    """
    backend = dist.get_backend()
    override = (backend, Backend.Options(backend, timeout))
    device_mesh = init_device_mesh(
        device_type, mesh.shape, mesh_dim_names=AXES, backend_override={axis: override for axis in AXES}
    )
    for pair in (("depth", "row"), ("row", "col")):
        if all(mesh.size(axis) > 1 for axis in pair):
            device_mesh[pair]._flatten("_".join(pair), backend_override=override)
    world = World(mesh, device_mesh._flatten("world", backend_override=override).get_group(), timeout)
    _WORLDS[id(device_mesh)] = (device_mesh, world)
    return device_mesh, world


class _SumGradOverWorld(torch.autograd.Function):
    """Identity; the gradient is summed over every rank.

    An input that arrives whole (a weight on the torch.compile path, or any
    input that requires grad) gets each rank's share of its gradient; the sum
    is the full gradient, the same on every rank.
    """

    @staticmethod
    def forward(ctx, weight, world):
        ctx.world = world
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return ctx.world.all_reduce(grad, "gradient sum of an input"), None


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


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ShardedModule(nn.Module):
    """This rank's part of a compiled model: its shards are its parameters.

    Takes the model's global inputs, the same on every rank; returns DTensors
    on the mesh (plain tensors for scalars such as a loss). Parameters are
    DTensors of the model's global shapes whose placements are their layouts
    (this rank's shard is `to_local()`), so torch's own tools see the whole
    model: `torch.nn.utils.clip_grad_norm_`, optimizers, DCP. Buffers are
    this rank's local tensors. `state_dict()` gives DTensors that DCP saves.
    Of a model built on the meta device the shards are uninitialised until a
    checkpoint is loaded (`tess_compile.checkpoint`). It starts in the model's
    mode; after `train()` / `eval()` it runs the program of that mode, compiled
    by `recompile(training)` on first use (`tess_compile.train_eval`).
    `compile=True` runs the program, forward and backward, through inductor
    (`tess_compile.compiled`).
    """

    def __init__(
        self,
        program: Program,
        *,
        device: torch.device | str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        wrap_outputs: bool = True,
        recompile=None,
        device_mesh=None,
        compile: bool = False,
    ):
        super().__init__()
        from tess_compile.data_parallel import mesh_groups

        self.wrap_outputs = wrap_outputs
        self.compile = compile
        self._compiled: dict[int, object] = {}  # id(program) -> its CompiledRank
        mesh = program.mesh
        self.device = torch.device(device) if device is not None else _default_device()
        prepare = functools.partial(state.off_meta, device=self.device)
        self.programs = ProgramsByMode(prepare(program), recompile, prepare)
        self.training = program.training  # `program` is this mode's until train() / eval()
        # `device_mesh`: the user's mesh (shard(..., mesh=...)); its (depth, row, col) submesh
        # runs the program, its other dims are data parallel (tess_compile.data_parallel).
        self.groups = mesh_groups(self.device.type, mesh, timeout, device_mesh)
        self.device_mesh, self.world = self.groups.tp_mesh, self.groups.world
        self.comm = DistComm(mesh, self.device_mesh, timeout, groups=self.groups.axis_groups)
        _check_same_model(self.program, self.world, self.groups.everyone)
        self.check_inputs = os.environ.get("TESS_COMPILE_DEBUG", "") not in ("", "0")
        state.add_local_tensors(self, self.program, self.world.rank, device=self.device, wrap_param=self._as_dtensor)
        self.train(program.training)

    @property
    def program(self) -> Program:
        """The program of the mode this module is in."""
        return self.programs.get(self.training)

    @property
    def mesh(self) -> Mesh:
        return self.program.mesh

    def forward(self, *args, **kwargs):
        flat = self.program.flatten_inputs(args, kwargs)
        flat = [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in flat]
        if self.check_inputs:
            _check_same_inputs(self.program, flat, self.world)
        for slot in self.program.slots:
            value = flat[int(slot.name)] if slot.role in INPUT_ROLES else None
            # A pipeline stage's local input is this rank's block: its gradient is this rank's.
            if isinstance(value, torch.Tensor) and value.requires_grad and slot.role != "local input":
                flat[int(slot.name)] = _SumGradOverWorld.apply(value, self.world)
        inputs = state.graph_inputs(self.program, self, flat)
        if self.groups.dp is not None:
            inputs = self.groups.mean_grads_over_dp(self, self.program, inputs)
        if self.compile:
            outs = self._compiled_program()(self.comm, inputs)
        else:
            with use_comm(self.comm):
                outs = self.program.runnable(*inputs)
        wrapped = [self._wrap(out, layout) for out, layout in zip(outs, self.program.output_layouts)]
        return pytree.tree_unflatten(wrapped, self.program.out_spec)

    def _compiled_program(self):
        from tess_compile.compiled import CompiledRank  # imports inductor: only when asked for

        program = self.program
        if id(program) not in self._compiled:
            self._compiled[id(program)] = CompiledRank(program, backward_comm=lambda: self.comm)
        return self._compiled[id(program)]

    def _wrap(self, out, layout):
        if not self.wrap_outputs or layout is None or not isinstance(out, torch.Tensor) or out.dim() == 0:
            return out
        return DTensor.from_local(out, self.device_mesh, layout.to_dtensor(), run_check=False)

    def _as_dtensor(self, slot: Slot, local: torch.Tensor) -> nn.Parameter:
        """A parameter's local tensor as the DTensor of the model's global shape, placed by its layout."""
        shape = torch.Size(slot.shape)
        value = DTensor.from_local(
            local, self.device_mesh, _placements(slot.layout), run_check=False, shape=shape, stride=_contiguous_stride(shape)
        )
        return nn.Parameter(value)

    def _gather(self, slot: Slot) -> torch.Tensor:
        local = state.get_tensor(self, slot).detach()
        return assemble(self.world.all_gather(local, f"gather of {slot.name!r}"), slot.layout, self.mesh)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
        """Scale the gradients so that their norm over the whole model is at most `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` does on the unsharded model (replicas counted once).

        Returns the total norm before clipping, a plain tensor, the same on every rank.
        `norm_type` may be `inf`.
        """
        total = torch.nn.utils.clip_grad_norm_(
            self.parameters(), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
        )
        return total.full_tensor() if isinstance(total, DTensor) else total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict, gathered on every rank."""
        from tess_compile.data_parallel import unsharded_over_dp

        with unsharded_over_dp(self):
            return state.full_tensors(self.program, self._gather)

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict; this rank takes its blocks."""
        from tess_compile.data_parallel import load_full_over_dp

        if not load_full_over_dp(self, state_dict):
            state.load_shards(self.program, {self.world.rank: self}, state_dict)

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """This rank's state as DTensors of the model's global shapes, keyed like the model's state dict.

        A shard that is one box of the full tensor is a DTensor with the
        layout's placements; a grouped split (`Shard(dim, groups=g)`: g boxes)
        is a DTensor whose local tensor is a `LocalShardsWrapper` of its boxes,
        which torch.distributed.checkpoint saves and reshards box by box
        (see docs/checkpoints.md). The local tensors are this module's own,
        so DCP loads into them in place. `get_model_state_dict(module)` gives the same.
        """
        from tess_compile.data_parallel import refuse_zero

        refuse_zero(self, "state_dict()")
        out = {} if destination is None else destination
        for slot in state.state_slots(self.program):
            out[prefix + slot.name] = self._dtensor(slot, keep_vars)
        return out

    def _dtensor(self, slot: Slot, keep_vars: bool) -> DTensor:
        rank = self.world.rank
        grouped = len(state.pieces(slot, self.mesh, rank)) > 1
        if keep_vars and not grouped and isinstance(state.get_attribute(self, slot), DTensor):
            return state.get_attribute(self, slot)
        local = state.get_tensor(self, slot)
        local = local if keep_vars else local.detach()
        if grouped:
            local = state.pieces_wrapper(local, slot, self.mesh, rank)
        shape = torch.Size(slot.shape)
        return DTensor.from_local(
            local, self.device_mesh, _placements(slot.layout), run_check=False, shape=shape, stride=_contiguous_stride(shape)
        )

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load what `state_dict()` gives (DTensors with this rank's boxes), DTensors placed like the
        parameters, or this rank's local tensors.

        DCP loads in place into `state_dict()`'s tensors; this copies (also
        with `assign=True`: the shards stay this module's own). A DTensor of
        other boxes (another mesh) is refused: load such a checkpoint with
        `torch.distributed.checkpoint.load(module.state_dict(), ...)`.
        """
        from tess_compile.data_parallel import refuse_zero

        refuse_zero(self, "load_state_dict()")
        slots = state.state_slots(self.program)
        names = [s.name for s in slots]
        missing = [name for name in names if name not in state_dict]
        unexpected = [key for key in state_dict if key not in names]
        if strict and (missing or unexpected):
            raise ValueError(
                f"state dict does not match the model compiled for mesh {self.mesh}: missing {missing}, "
                f"unexpected {unexpected}; pass what this module's state_dict() gives, or strict=False"
            )
        with torch.no_grad():
            for slot in slots:
                if slot.name in state_dict:
                    self._load_local(slot, state_dict[slot.name])
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _load_local(self, slot: Slot, value: torch.Tensor) -> None:
        local = state.get_tensor(self, slot)
        if not isinstance(value, DTensor):
            if value.shape != local.shape:
                raise ValueError(
                    f"state dict tensor {slot.name!r} has shape {list(value.shape)}, not this rank's local "
                    f"shape {list(local.shape)} on mesh {self.mesh}: pass state_dict()'s DTensors or local "
                    "shards, or load full tensors with load_full_state_dict"
                )
            local.copy_(value)
            return
        if value.device_mesh is self.device_mesh and tuple(value.placements) == _placements(slot.layout):
            if value.shape == torch.Size(slot.shape) and not isinstance(value.to_local(), LocalShardsWrapper):
                local.copy_(value.to_local())  # a parameter-like DTensor (grouped splits as _StridedShard)
                return
        boxes = state.pieces(slot, self.mesh, self.world.rank)
        theirs = [(tuple(c.offsets), tuple(c.sizes)) for c in value.__create_chunk_list__()]
        if value.shape != torch.Size(slot.shape) or theirs != [(p.offsets, p.sizes) for p in boxes]:
            raise ValueError(
                f"state dict DTensor {slot.name!r} (shape {list(value.shape)}) holds the boxes {theirs} on this "
                f"rank, not this module's {[(p.offsets, p.sizes) for p in boxes]} of shape {list(slot.shape)} on "
                f"mesh {self.mesh}: load a checkpoint of another mesh with "
                "torch.distributed.checkpoint.load(module.state_dict(), ...)"
            )
        source = value.to_local()
        parts = source.local_shards() if isinstance(source, LocalShardsWrapper) else [source]
        for box, part in zip(boxes, parts):
            local[box.local].copy_(part)


def _placements(layout: Layout) -> tuple:
    """DTensor placements of `layout`. A grouped split `S(dim,g=g)` over n ranks is
    `_StridedShard(dim, split_factor=g)`: both give coordinate i the chunks i, n+i, ...
    of the dim cut into n*g."""

    def convert(placement):
        if isinstance(placement, Shard):
            return dt.Shard(placement.dim) if placement.groups == 1 else _StridedShard(placement.dim, split_factor=placement.groups)
        return dt.Partial() if isinstance(placement, Partial) else dt.Replicate()

    return tuple(convert(p) for p in layout.placements)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))


def layout_of(placements) -> Layout:
    """The Layout of DTensor placements on the (depth, row, col) mesh (inverse of `_placements`)."""

    def convert(placement):
        if isinstance(placement, _StridedShard):
            return Shard(placement.dim, groups=placement.split_factor)
        if isinstance(placement, dt.Shard):
            return Shard(placement.dim)
        return Partial() if placement.is_partial() else Replicate()

    return Layout(*(convert(p) for p in placements))


def tess_mesh(device_mesh) -> Mesh | None:
    """The Mesh of a sharded module's DeviceMesh; None for any other DeviceMesh."""
    known = _WORLDS.get(id(device_mesh))
    return known[1].mesh if known is not None and known[0] is device_mesh else None


def full_tensor(x):
    """The global value of `x`, a DTensor output of a sharded module, on every rank.

    One all-gather over all ranks, under the module's timeout (a failure names
    the op and this rank), where `x.full_tensor()` runs one per split dim (on a
    mesh without the flattened axes, one per axis, and torch logs a warning on
    every rank). Differentiable like `x.full_tensor()`: each rank's gradient is
    its block of the (replicated) gradient. A DTensor on another mesh goes
    through `x.full_tensor()`; other values come back as they are.
    """
    if not isinstance(x, DTensor):
        return x
    known = _WORLDS.get(id(x.device_mesh))
    if known is None or known[0] is not x.device_mesh:
        return x.full_tensor()
    return _GatherFull.apply(x.to_local(), known[1], layout_of(x.placements))


class _GatherFull(torch.autograd.Function):
    """Every rank's local tensor gathered and assembled; backward: this rank's block."""

    @staticmethod
    def forward(ctx, local, world, layout):
        ctx.world, ctx.layout = world, layout
        return assemble(world.all_gather(local, "full_tensor"), layout, world.mesh)

    @staticmethod
    def backward(ctx, grad):
        summed = [Replicate() if isinstance(p, Partial) else p for p in ctx.layout.placements]
        return local_block(grad, Layout(*summed), ctx.world.mesh, ctx.world.rank).contiguous(), None, None


# ---------------------------------------------------------------------------
# Rank consistency: every rank must start from the same model and take the same inputs.
# ---------------------------------------------------------------------------

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements at a time off an accelerator


def fingerprint(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes: equal bits give equal values on every machine, and a
    changed element changes it (but for a 2**-32 chance). Reads a CPU tensor in place."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    ints = flat.contiguous().view(_INT_OF_SIZE[flat.element_size()])
    crc = 0
    for start in range(0, ints.numel(), _CHUNK):
        crc = zlib.crc32(ints[start : start + _CHUNK].cpu().numpy(), crc)
    return crc


def _input_names(program: Program) -> list[str]:
    """Readable names of the flat inputs: "positional input 0", "keyword input 'mask'", then any index inside."""
    numbered = pytree.tree_unflatten(list(range(program.in_spec.num_leaves)), program.in_spec)
    names = []
    for path, _ in pytree.tree_flatten_with_path(numbered)[0]:
        top, key, *inside = path
        name = f"positional input {key.idx}" if top.idx == 0 else f"keyword input {key.key!r}"
        names.append(name + "".join(str(k) for k in inside))
    return names


def _differences(per_rank: list[dict], show_values: bool = False, ranks=None) -> list[str]:
    """One line per key whose value is not the same on every rank: which ranks differ
    from the largest group (with `show_values`: each value and the ranks that hold it).
    `ranks`: the global rank of each entry (default: its index)."""
    lines = []
    keys = list(dict.fromkeys(key for values in per_rank for key in values))
    ranks = list(range(len(per_rank))) if ranks is None else list(ranks)
    for key in keys:
        holders: dict = {}
        for rank, values in zip(ranks, per_rank):
            holders.setdefault(values.get(key, "missing"), []).append(rank)
        if len(holders) == 1:
            continue
        groups = sorted(holders.items(), key=lambda item: (-len(item[1]), item[1][0]))
        if show_values:
            lines.append(f"{key}: " + ", ".join(f"{value} on rank(s) {ranks}" for value, ranks in groups))
        else:
            odd = sorted(rank for _, ranks in groups[1:] for rank in ranks)
            lines.append(f"{key}: rank(s) {odd} differ from rank(s) {groups[0][1]}")
    return lines


def _describe(lines: list[str], limit: int = 8) -> str:
    more = f"; and {len(lines) - limit} more" if len(lines) > limit else ""
    return "; ".join(lines[:limit]) + more


def _check_same_model(program: Program, world: World, everyone: World | None = None) -> None:
    """ValueError on every rank unless all ranks compiled the same weights and example-input shapes.

    Weights are compared by `fingerprint` (a meta tensor, of a model built on
    the meta device, has nothing to compare); example inputs by shape and dtype.
    Both over `everyone` (with `shard(..., mesh=...)`, every rank of the mesh:
    the data-parallel groups feed their own batches, of one shape), by default `world`.
    """
    everyone = everyone or world
    names = _input_names(program)
    weights, inputs = {}, {}
    for slot in program.slots:
        if slot.role in INPUT_ROLES:
            inputs[f"example {names[int(slot.name)]}"] = f"shape {list(slot.shape)} {slot.dtype}"
        elif slot.role != "alias" and not program.tensors[slot.name].is_meta:
            tensor = program.tensors[slot.name]
            weights[f"{slot.name!r} {list(slot.shape)}"] = (str(tensor.dtype), fingerprint(tensor))
    gathered = everyone.all_gather_object((weights, inputs), "check that every rank holds the same model")
    weight_lines = _differences([w for w, _ in gathered], ranks=everyone.members)
    input_lines = _differences([i for _, i in gathered], show_values=True, ranks=everyone.members)
    problems = []
    if weight_lines:
        problems.append(
            f"the ranks hold different weights: {_describe(weight_lines)}. Every rank must start from the "
            "same model: seed before building the model (torch.manual_seed), or load one checkpoint on every rank"
        )
    if input_lines:
        per_group = " (with mesh=, each data-parallel group's batch, of one shape)" if everyone is not world else ""
        problems.append(
            f"the ranks passed different example inputs: {_describe(input_lines)}. Pass the same "
            f"example_inputs (the global batch's shape{per_group}) on every rank"
        )
    if problems:
        raise ValueError(f"tess_compile.shard on mesh {program.mesh}, rank {dist.get_rank()}: " + "; ".join(problems))


def _check_same_inputs(program: Program, flat: list, world: World) -> None:
    """(TESS_COMPILE_DEBUG=1) ValueError on every rank of `world` (the tensor-parallel group)
    unless they all got the same inputs."""
    names = _input_names(program)
    local = {int(s.name) for s in program.slots if s.role == "local input"}  # blocks differ by rank
    values = {
        f"{names[index]} {list(value.shape)}": fingerprint(value)
        for index, value in enumerate(flat)
        if isinstance(value, torch.Tensor) and index not in local
    }
    gathered = world.all_gather_object(values, "check that every rank got the same inputs")
    lines = _differences(gathered, ranks=world.members)
    if lines:
        group = "" if world.ranks is None else f" of the tensor-parallel group {list(world.members)}"
        raise ValueError(
            f"the ranks{group} called the sharded module (mesh {program.mesh}) with different inputs: "
            f"{_describe(lines)} (checked on rank {dist.get_rank()} because TESS_COMPILE_DEBUG=1). The module "
            "takes the global batch on every rank: pass the same batch on every rank"
            f"{group} (load or draw it identically, e.g. seeded), not a per-rank slice"
        )
