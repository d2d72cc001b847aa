"""The distributed runtime: one rank of a compiled program on torch.distributed.

`ShardedModule` runs this rank's per-rank graph with a `DistComm` over the
mesh's groups; eagerly, its collectives are called without the custom ops'
dispatch (`eager_graph`), and what each call needs (the parameters' places,
the outputs' DTensor specs) is made once. Parameters are DTensors whose
placements are their layouts; the per-rank program takes their local
tensors. At construction every rank
checks that all ranks hold the same weights and example-input shapes
(`tess_compile.runtime.consistency`); `TESS_COMPILE_DEBUG=1` also checks
every call's inputs. `shard_program` builds one from a compiled `Program`.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from tess_compile.core.autocast import without_autocast
from tess_compile.core.layout import unpad_block
from tess_compile.core.program import Program, Slot
from tess_compile.ops.collectives import EAGER_TARGETS, use_comm
from tess_compile.ops.recompute_region import RecomputeRegion
from tess_compile.runtime import state
from tess_compile.runtime.consistency import check_same_inputs, check_same_model
from tess_compile.runtime.dist_comm import DistComm
from tess_compile.runtime.dtensors import (
    claim_output_gradient,
    contiguous_stride,
    full_from_local,
    gather_blocks,
    output_dtensor,
    output_spec,
    placements_of,
)
from tess_compile.runtime.grad_buffers import GradBuffers
from tess_compile.runtime.groups import (
    DEFAULT_TIMEOUT,
    check_device_mesh,
    check_world,
    check_zero,
    mesh_groups,
    reduced_grad,
)
from tess_compile.runtime.programs_by_mode import ModeModule, ProgramsByMode
from tess_compile.runtime.zero import fully_shard_over_dp, load_full_over_dp, refuse_zero, unsharded_over_dp

__all__ = ["ShardedModule", "eager_graph", "shard_program"]

_MAX_OUTPUT_SPECS = 256  # (layout, shape, dtype) of outputs (a dynamic program's shapes vary): more are made again
_MAX_EAGER_GRAPHS = 16  # programs a module runs (a mode's, a generation step's, ...): more are made again


def eager_graph(gm: GraphModule) -> GraphModule:
    """A per-rank graph (`Program.runnable`: recompute regions outlined) whose collectives call
    their `EAGER_TARGETS` in place of their custom ops, in the regions too: the same collectives,
    records and gradients, without a `torch.library` dispatch through autograd per call. `gm`
    itself where it calls no collective."""
    if not any(node.target in EAGER_TARGETS for node in gm.graph.nodes if node.op == "call_function") and not any(
            isinstance(module, RecomputeRegion) for module in gm.children()):
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    attributes = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in EAGER_TARGETS:
            node.target = EAGER_TARGETS[node.target]
        elif node.op in ("call_module", "get_attr"):
            value = gm.get_submodule(node.target) if node.op == "call_module" else getattr(gm, node.target)
            if isinstance(value, RecomputeRegion):
                value = RecomputeRegion(value.name, eager_graph(value.graph_module))
            attributes[node.target] = value
    out = GraphModule(attributes, graph)
    out.meta.update(gm.meta)
    return out


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ShardedModule(ModeModule):
    """This rank's part of a compiled model: its shards are its parameters.

    Takes the model's global inputs, the same on every rank; returns DTensors
    on the mesh (plain tensors for scalars such as a loss). Parameters are
    DTensors of the model's global shapes whose placements are their layouts
    (this rank's shard is `to_local()`), so torch's own tools see the whole
    model: `torch.nn.utils.clip_grad_norm_`, optimizers, DCP. Buffers are
    this rank's local tensors. `state_dict()` gives DTensors that DCP saves.
    Of a model built on the meta device the shards are uninitialised until a
    checkpoint is loaded (`tess_compile.training.shard_loading`). It starts in the model's
    mode; after `train()` / `eval()` it runs the program of that mode, compiled
    by `recompile(training)` on first use (`tess_compile.runtime.programs_by_mode`).
    `compile=True` runs the program, forward and backward, through inductor
    (`tess_compile.runtime.inductor`).
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
        device = torch.device(device) if device is not None else _default_device()
        super().__init__(ProgramsByMode(program, recompile), compile)
        self.device, self.wrap_outputs = device, wrap_outputs
        mesh = program.mesh
        # `device_mesh`: the user's mesh (shard(..., mesh=...)); its (depth, row, col) submesh
        # runs the program, its other dims are data parallel (tess_compile.scale_out.data_parallel).
        self.groups = mesh_groups(self.device.type, mesh, timeout, device_mesh)
        self.device_mesh, self.world = self.groups.tp_mesh, self.groups.world
        self.comm = DistComm(mesh, self.device_mesh, timeout, groups=self.groups.axis_groups)
        check_same_model(self.program, self.world, self.groups.everyone)
        self.check_inputs = os.environ.get("TESS_COMPILE_DEBUG", "") not in ("", "0")
        self._output_specs: dict[tuple, tuple] = {}  # (layout, shape, dtype) -> (true block shape, spec)
        self._eager_graphs: dict[int, tuple] = {}  # id(program) -> (program, its eager_graph)
        state.add_local_tensors(self, self.program, self.world.rank, device=self.device, wrap_param=self._as_dtensor)
        self.grad_buffers: GradBuffers | None = None  # made by `feeding_leaves`, for a whole training step
        self._leaf_of: dict | None = None  # while `feeding_leaves`: the program takes these leaves
        self.train(program.training)

    @contextlib.contextmanager
    def feeding_leaves(self):
        """Within it, the program takes the parameters' leaves (`tess_compile.runtime.grad_buffers`),
        whose gradients autograd adds into one flat buffer per dtype, viewed by the parameters' `.grad`;
        yields the module's `GradBuffers`, made on first use (`tess_compile.training.train_step`)."""
        if isinstance(self, FSDPModule):
            raise ValueError(f"tess_compile.train_step of a zero=True module (mesh {self.mesh}; FSDP shards its "
                             "gradients itself) is not supported: step it with your own loop (forward, backward, "
                             "optimizer), or shard with zero=False")
        if self.grad_buffers is None:
            self.grad_buffers = GradBuffers([p for p in self.parameters() if p.requires_grad])
        self._leaf_of = self.grad_buffers.leaf_of
        try:
            yield self.grad_buffers
        finally:
            self._leaf_of = None

    def forward(self, *args, **kwargs):
        program, outs, shapes = self._local_outputs(args, kwargs)
        wrapped = [self._wrap(out, layout, shape) for out, layout, shape in
                   zip(outs, program.output_layouts, shapes)]
        return pytree.tree_unflatten(wrapped, program.out_spec)

    def full_outputs(self, *args, **kwargs):
        """The outputs as full tensors, the same on every rank: `tess_compile.full_tensor` of each
        output of `forward`, without making their DTensors (a whole step's loss takes them)."""
        program, outs, shapes = self._local_outputs(args, kwargs)
        rank = self.world.rank
        full = [out if layout is None or not isinstance(out, torch.Tensor) or out.dim() == 0 else
                full_from_local(unpad_block(out, layout, shape, self.mesh, rank), self.world, layout, shape)
                for out, layout, shape in zip(outs, program.output_layouts, shapes)]
        return pytree.tree_unflatten(full, program.out_spec)

    def _local_outputs(self, args: tuple, kwargs: dict) -> tuple[Program, list, list]:
        """The program this call runs, this rank's outputs of its per-rank graph, their global shapes."""
        program = self.program
        flat = program.flatten_inputs(args, kwargs)
        shapes = program.call_output_shapes(flat)
        flat = [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in flat]
        if self.check_inputs:
            check_same_inputs(program, flat, self.world)
        for index in program.whole_inputs:
            value = flat[index]
            # A pipeline stage's local input is this rank's block: its gradient is this rank's.
            # An input that arrives whole (a weight on the torch.compile path, or any input that
            # requires grad) gets each rank's share of its gradient; their sum is its gradient.
            if isinstance(value, torch.Tensor) and value.requires_grad:
                flat[index] = reduced_grad(value, self.world, "gradient sum of an input")
        inputs = state.graph_inputs(program, self, flat, self._leaf_of)
        if self.groups.dp is not None:
            inputs = self.groups.mean_grads_over_dp(self, program, inputs)
        return program, self._run(program, inputs), shapes

    def rank_modules(self) -> dict[int, nn.Module]:
        """This rank's module of shards: itself."""
        return {self.world.rank: self}

    def run_program(self, program: Program, rank_flats: dict[int, list]) -> dict[int, list]:
        """Run `program` (one `adopt` readied for these shards) on this rank's flat inputs (a local
        input: this rank's block); its outputs as the per-rank graph gives them."""
        flat = [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in rank_flats[self.world.rank]]
        return {self.world.rank: list(self._run(program, state.graph_inputs(program, self, flat)))}

    def _run(self, program: Program, inputs: list) -> list:
        """This rank's outputs of `program` on its graph inputs: through inductor with `compile`, else
        its graph with the collectives called without custom-op dispatch (`eager_graph`); autocast off
        where the program holds its casts."""
        if self.compile:
            with without_autocast(program.autocast):
                return self.compiled_program(lambda: self.comm, program)(self.comm, inputs)
        known = self._eager_graphs.get(id(program))
        if known is None or known[0] is not program:
            if len(self._eager_graphs) >= _MAX_EAGER_GRAPHS:
                self._eager_graphs.clear()
            known = self._eager_graphs[id(program)] = (program, eager_graph(program.runnable))
        with use_comm(self.comm), without_autocast(program.autocast):
            return known[1](*inputs)

    def global_output(self, program: Program, index: int, rank_values: dict[int, torch.Tensor], shape) -> torch.Tensor:
        """Output `index` of `program` as a global tensor of `shape`, gathered from every rank."""
        local = rank_values[self.world.rank]
        layout = program.output_layouts[index]
        if layout is None or local.dim() == 0:
            return local
        return gather_blocks(self.world, local, layout, shape, f"gather of output {index}")

    def _wrap(self, out, layout, shape):
        """An output as the DTensor of its global `shape`: this rank's true block of it
        (`DTensor.from_local`'s DTensor, its spec made once per layout, shape and dtype)."""
        if not self.wrap_outputs or layout is None or not isinstance(out, torch.Tensor) or out.dim() == 0:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(claim_output_gradient)  # its gradient comes from outside the program
            return out
        key = (layout, tuple(shape), out.dtype)
        known = self._output_specs.get(key)
        if known is None:
            if len(self._output_specs) >= _MAX_OUTPUT_SPECS:
                self._output_specs.clear()
            true = layout.chunk_shape(shape, self.mesh, self.world.rank)
            spec = output_spec(self.device_mesh, placements_of(layout), shape, out.dtype)
            known = self._output_specs[key] = (true, spec)
        true, spec = known
        if list(out.shape) != true:
            out = unpad_block(out, layout, shape, self.mesh, self.world.rank)
        return output_dtensor(out, spec)

    def _as_dtensor(self, slot: Slot, local: torch.Tensor) -> nn.Parameter:
        """A parameter's local tensor as the DTensor of the model's global shape, placed by its layout."""
        shape = torch.Size(slot.shape)
        value = DTensor.from_local(
            local, self.device_mesh, placements_of(slot.layout), run_check=False, shape=shape, stride=contiguous_stride(shape)
        )
        return nn.Parameter(value)

    def _gather(self, slot: Slot) -> torch.Tensor:
        local = state.get_tensor(self, slot).detach()
        return gather_blocks(self.world, local, slot.layout, slot.shape, f"gather of {slot.name!r}")

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

        with unsharded_over_dp(self):
            return state.full_tensors(self.program, self._gather)

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict; this rank takes its blocks."""

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
            local, self.device_mesh, placements_of(slot.layout), run_check=False, shape=shape, stride=contiguous_stride(shape)
        )

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load what `state_dict()` gives (DTensors with this rank's boxes), DTensors placed like the
        parameters, or this rank's local tensors.

        DCP loads in place into `state_dict()`'s tensors; this copies (also
        with `assign=True`: the shards stay this module's own). A DTensor of
        other boxes (another mesh) is refused: load such a checkpoint with
        `torch.distributed.checkpoint.load(module.state_dict(), ...)`.
        """

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
        if (value.device_mesh is self.device_mesh and tuple(value.placements) == placements_of(slot.layout)
                and value.shape == torch.Size(slot.shape) and not isinstance(value.to_local(), LocalShardsWrapper)):
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


def shard_program(program, *, device=None, timeout: float | timedelta | None = None, wrap_outputs: bool = True,
                  recompile=None, mesh=None, zero: bool = False, compile: bool = False):
    """This rank's module of an already compiled `Program` (see `shard`); `recompile(training)`
    compiles the program of the other mode on first use (`tess_compile.runtime.programs_by_mode`)."""

    if mesh is None and not zero:
        check_world(program.mesh)
    else:

        check_zero(zero, mesh, check_device_mesh(mesh, program.mesh) if mesh is not None else (), program.mesh)
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=timeout)
    module = ShardedModule(program, device=device, timeout=timeout, wrap_outputs=wrap_outputs, recompile=recompile,
                           device_mesh=mesh, compile=compile)
    if zero:

        fully_shard_over_dp(module)
    return module
