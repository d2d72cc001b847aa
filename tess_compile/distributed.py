"""The distributed runtime: one rank of a compiled program on torch.distributed.

Groups come from a DeviceMesh of shape `(d, q, q)` named
`("depth", "row", "col")`. gloo on CPU, NCCL on CUDA. A collective that
cannot complete (a peer stopped, or took another path) fails after the
process group's timeout with a message that names the op, the axis, this
rank and its peers.
"""

from __future__ import annotations

import functools
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
from tess_compile.layout import Layout, Partial, Shard, assemble, put_blocks, take_block
from tess_compile.mesh import AXES, Mesh

__all__ = ["DEFAULT_TIMEOUT", "DistComm", "ShardedModule", "check_world"]

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
    """Collectives of this rank over the mesh's process groups."""

    def __init__(self, mesh: Mesh, device_mesh, timeout: timedelta):
        super().__init__()
        self.mesh = mesh
        self.timeout = timeout
        self.rank = dist.get_rank()
        self.groups = {axis: device_mesh.get_group(axis) for axis in AXES}
        self.pending: dict[int, tuple] = {}  # storage pointer -> (work, axis) of a broadcast_start

    def run(self, op: str, x: torch.Tensor, axis: str, *args) -> torch.Tensor:
        self.record(op, axis, x)
        return self._guard(op, axis, getattr(self, "_" + op), x.contiguous(), axis, *args)

    def _guard(self, op: str, axis: str, call, *args):
        """`call(*args)`, a collective's failure or timeout told with the rank, the axis and the peers."""
        try:
            return call(*args)
        except RuntimeError as err:
            peers = self.mesh.group(self.rank, axis)
            raise RuntimeError(
                f"tess collective {op} along {axis} failed on rank {self.rank} "
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

    def wait(self, x: torch.Tensor) -> None:
        work, axis = self.pending.pop(x.untyped_storage().data_ptr(), (None, None))
        if work is not None:
            self._guard("broadcast_start", axis, work.wait)

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
        blocks = [torch.empty_like(x) for _ in range(parts)]
        dist.all_gather(blocks, x, group=self.groups[axis])
        return put_blocks(blocks, dim, groups)

    def _reduce_scatter(self, x, axis, parts, dim, groups):
        # gloo has no reduce-scatter; an all-reduce then this rank's block is exact.
        return take_block(self._all_reduce(x, axis), dim, groups, parts, self._coord(axis)).contiguous()

    def _shard_slice(self, x, axis, parts, dim, groups):
        return take_block(x, dim, groups, parts, self._coord(axis)).clone()

    def _shard_pad(self, x, axis, parts, dim, groups):
        coord = self._coord(axis)
        return put_blocks([x if t == coord else torch.zeros_like(x) for t in range(parts)], dim, groups)


@functools.cache
def _device_mesh(device_type: str, mesh: Mesh, timeout: timedelta):
    """The (d, q, q) DeviceMesh, its groups timing out after `timeout`."""
    backend = dist.get_backend()
    options = Backend.Options(backend, timeout)
    overrides = {axis: (backend, options) for axis in AXES}
    return init_device_mesh(device_type, mesh.shape, mesh_dim_names=AXES, backend_override=overrides)


class _SumGradOverWorld(torch.autograd.Function):
    """Identity; the gradient is summed over every rank.

    An input that arrives whole (a weight on the torch.compile path, or any
    input that requires grad) gets each rank's share of its gradient; the sum
    is the full gradient, the same on every rank.
    """

    @staticmethod
    def forward(ctx, weight):
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total)
        return total


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ShardedModule(nn.Module):
    """This rank's part of a compiled model: its shards are its parameters.

    Takes the model's global inputs; returns DTensors on the mesh (plain
    tensors for scalars such as a loss). `named_parameters()` gives the local
    shards; `state_dict()` gives DTensors, for torch.distributed.checkpoint.
    Of a model built on the meta device the shards are uninitialised until a
    checkpoint is loaded (`tess_compile.checkpoint`).
    """

    def __init__(
        self,
        program: Program,
        *,
        device: torch.device | str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        wrap_outputs: bool = True,
    ):
        super().__init__()
        self.wrap_outputs = wrap_outputs
        mesh = program.mesh
        self.device = torch.device(device) if device is not None else _default_device()
        self.program = state.off_meta(program, self.device)
        self.device_mesh = _device_mesh(self.device.type, mesh, timeout)
        self.comm = DistComm(mesh, self.device_mesh, timeout)
        state.add_local_tensors(self, self.program, dist.get_rank(), device=self.device)
        self.to(self.device)

    @property
    def mesh(self) -> Mesh:
        return self.program.mesh

    def forward(self, *args, **kwargs):
        flat = self.program.flatten_inputs(args, kwargs)
        flat = [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in flat]
        for slot in self.program.slots:
            value = flat[int(slot.name)] if slot.role in INPUT_ROLES else None
            if isinstance(value, torch.Tensor) and value.requires_grad:
                flat[int(slot.name)] = _SumGradOverWorld.apply(value)
        with use_comm(self.comm):
            outs = self.program.graph(*state.graph_inputs(self.program, self, flat))
        wrapped = [self._wrap(out, layout) for out, layout in zip(outs, self.program.output_layouts)]
        return pytree.tree_unflatten(wrapped, self.program.out_spec)

    def _wrap(self, out, layout):
        if not self.wrap_outputs or layout is None or not isinstance(out, torch.Tensor) or out.dim() == 0:
            return out
        return DTensor.from_local(out, self.device_mesh, layout.to_dtensor(), run_check=False)

    def _gather(self, slot: Slot) -> torch.Tensor:
        local = state.get_tensor(self, slot).detach().contiguous()
        blocks = [torch.empty_like(local) for _ in range(self.mesh.num_ranks)]
        dist.all_gather(blocks, local)
        return assemble(blocks, slot.layout, self.mesh)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict, gathered on every rank."""
        return state.full_tensors(self.program, self._gather)

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict; this rank takes its blocks."""
        state.load_shards(self.program, {dist.get_rank(): self}, state_dict)

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """This rank's state as DTensors of the model's global shapes, keyed like the model's state dict.

        A shard that is one box of the full tensor is a DTensor with the
        layout's placements; a grouped split (`Shard(dim, groups=g)`: g boxes)
        is a DTensor whose local tensor is a `LocalShardsWrapper` of its boxes,
        which torch.distributed.checkpoint saves and reshards box by box
        (see docs/checkpoints.md). The local tensors are this module's own.
        """
        out = {} if destination is None else destination
        for slot in state.state_slots(self.program):
            out[prefix + slot.name] = self._dtensor(slot, keep_vars)
        return out

    def _dtensor(self, slot: Slot, keep_vars: bool) -> DTensor:
        local = state.get_tensor(self, slot)
        local = local if keep_vars else local.detach()
        rank = dist.get_rank()
        if len(state.pieces(slot, self.mesh, rank)) > 1:
            local = state.pieces_wrapper(local, slot, self.mesh, rank)
        shape = torch.Size(slot.shape)
        return DTensor.from_local(
            local, self.device_mesh, _placements(slot.layout), run_check=False, shape=shape, stride=_contiguous_stride(shape)
        )

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Load what `state_dict()` gives (DTensors with this rank's boxes), or this rank's local tensors.

        DCP loads in place into `state_dict()`'s tensors; this copies. A
        DTensor of other boxes (another mesh) is refused: load such a
        checkpoint with `torch.distributed.checkpoint.load(module.state_dict(), ...)`.
        """
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
        boxes = state.pieces(slot, self.mesh, dist.get_rank())
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
