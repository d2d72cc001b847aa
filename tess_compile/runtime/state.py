"""Per-rank state of a compiled program: the module of local shards, and
conversions between full tensors and shards (state dicts, checkpoint pieces).

A rank's shard of a tensor is, per dim, a list of ranges of the full tensor:
one range for a plain split, `g` ranges for `Shard(dim, groups=g)`. Their
products are the *pieces* (boxes of the full tensor, contiguous per dim)
that checkpoint readers and writers address.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from tess_compile.core.layout import Layout, Shard, assemble, chunk, local_block, pad_block, take_block, unpad_block
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.program import INPUT_ROLES, Program, Slot
from tess_compile.runtime.dtensors import local_tensors

__all__ = [
    "Piece",
    "add_constants",
    "add_local_tensors",
    "boxes",
    "boxes_wrapper",
    "check_shape",
    "check_state_dict",
    "full_tensors",
    "get_attribute",
    "get_tensor",
    "global_output",
    "global_outputs",
    "graph_inputs",
    "load_shards",
    "pieces",
    "pieces_wrapper",
    "source_keys",
    "state_slots",
]

def _set_tensor(root: nn.Module, name: str, tensor: torch.Tensor, role: str) -> None:
    """Register `tensor` at dotted `name` under `root`, creating empty submodules on the way."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if role == "param":
        module.register_parameter(leaf, tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor))
    else:
        module.register_buffer(leaf, tensor, persistent=role == "buffer")


def add_local_tensors(
    root: nn.Module,
    program: Program,
    rank: int,
    device=None,
    wrap_param: Callable[[Slot, torch.Tensor], torch.Tensor] | None = None,
) -> nn.Module:
    """Give `root` the shards that `rank` holds, under the model's own names.

    `wrap_param(slot, local)` makes a parameter's registered value (the
    distributed runtime's DTensors); tied names register that very object.
    Of a model built on the meta device the shards are uninitialised, of local
    size, on `device`, until a checkpoint is loaded (`tess_compile.training.shard_loading`).
    """
    for slot in program.slots:
        if slot.role == "constant" and program.tensors[slot.name].is_meta:
            raise ValueError(
                f"constant {slot.name!r} (shape {list(slot.shape)}; a non-persistent buffer or tensor constant) "
                f"is on the meta device, no checkpoint holds it, and the module that owns it has no code that "
                "recomputes it (torchtitan's `_init_self_buffers`, a transformers `config`, or "
                f"`init_weights(buffer_device=...)`), so mesh {program.mesh} cannot run: give it its values before "
                "sharding, e.g. build the submodule that owns it outside `torch.device('meta')`"
            )
        if slot.role not in INPUT_ROLES and slot.role != "alias":
            local = program.local_tensor(slot, rank, device=device)
            if slot.role == "param" and wrap_param is not None:
                local = wrap_param(slot, local)
            _set_tensor(root, slot.name, local, slot.role)
            if slot.role == "param":  # a parameter the model froze stays frozen
                get_attribute(root, slot.name).requires_grad_(program.tensors[slot.name].requires_grad)
    roles = {s.name: s.role for s in program.slots}
    for slot in program.slots:
        if slot.role == "alias":  # tied: the very same tensor under a second name
            _set_tensor(root, slot.name, get_attribute(root, slot.alias_of), roles[slot.alias_of])
    return root


def add_constants(program: Program, known: dict[str, torch.Tensor], modules: dict[int, nn.Module],
                  device=None) -> Program:
    """Give `modules` (rank -> module of a program's shards) the constants of `program`, another program
    of the same model (a generation step's). `known` (name -> full tensor, updated here) is what the
    modules hold; a constant of a name they hold with another tensor is renamed (export numbers
    lifted constants per capture). Returns `program` with those names."""
    slots, tensors = [], dict(program.tensors)
    for slot in program.slots:
        if slot.role == "constant":
            value, name, k = program.tensors[slot.name], slot.name, 0
            while name in known and not _same_tensor(known[name], value):
                name, k = f"{slot.name}_{k}", k + 1
            if name not in known:
                known[name] = value
                for rank, module in modules.items():
                    _set_tensor(module, name, program.local_tensor(slot, rank, device=device), "constant")
            if name != slot.name:
                tensors[name] = value
                slot = dataclasses.replace(slot, name=name)
        slots.append(slot)
    return dataclasses.replace(program, slots=slots, tensors=tensors)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and not a.is_meta and torch.equal(a, b.to(a.device))


def get_attribute(module: nn.Module, slot: Slot | str) -> torch.Tensor:
    """The parameter or buffer of `module` at the slot's (or a) dotted name, as registered."""
    name = slot if isinstance(slot, str) else slot.name
    for part in name.split("."):  # not get_submodule: its checks double the cost, paid per slot every call
        module = getattr(module, part)
    return module


def get_tensor(module: nn.Module, slot: Slot | str) -> torch.Tensor:
    """This rank's local tensor of the parameter or buffer at the slot's (or a) dotted name.

    Of a DTensor parameter: its local tensor, connected to the parameter by
    autograd where grad mode is on (`DTensor.to_local`); under `torch.no_grad()`
    the very storage, so copying into it loads the parameter.
    """
    tensor = get_attribute(module, slot)
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def graph_inputs(program: Program, module: nn.Module, flat_inputs: Sequence, leaf_of: dict | None = None) -> list:
    """The per-rank graph's placeholder values, in order: DTensor parameters as their
    local tensors, whose gradients arrive on the parameters as DTensors of the same placements
    (`local_tensors`: one autograd node for all); the true chunks of uneven splits padded with
    zeros to the program's block size (`pad_block`); inputs as they are. `leaf_of`
    (id(parameter) -> leaf, `tess_compile.runtime.grad_buffers`): those parameters as their
    leaves instead, whose gradients autograd accumulates into the leaves' `.grad`.

    Runs on every call, so what it can know once is resolved once per (module, program)
    (`_Feed`): where each tensor is registered, which slots are inputs, which need padding."""
    feed = _feed(module, program)
    tensors = feed.tensors()
    if leaf_of is not None:
        tensors = [leaf_of.get(id(tensor), tensor) for tensor in tensors]
        if any(isinstance(tensor, DTensor) and tensor.requires_grad for tensor in tensors):
            raise ValueError("a parameter of the sharded module was replaced after its gradient buffers were made "
                             "(tess_compile.runtime.grad_buffers): build the train step again "
                             "(tess_compile.train_step) after replacing parameters")
    held = local_tensors(tensors)
    for index, slot in feed.uneven:
        held[index] = pad_block(held[index], slot.layout, slot.shape, program.mesh)
    values = [None] * feed.num_slots
    for position, index in feed.held_at:
        values[position] = held[index]
    for position, index in feed.inputs_at:
        values[position] = flat_inputs[index]
    return values


class _Feed:
    """What `graph_inputs` reads of one module for one program, resolved once.

    `owners`: for each held slot (parameters, buffers, constants, aliases, in slot
    order) the submodule it is registered on, the name of its table
    (`_parameters` or `_buffers`) and its leaf name; the tensor itself is read
    from the table on every call, so a parameter replaced there (FSDP's
    unsharded parameters, a load with `assign=True`) is the one the program
    gets. `uneven`: the held slots whose blocks are padded (`pad_block`).
    """

    def __init__(self, program: Program, module: nn.Module):
        self.program = program  # held: keeps id(program), the cache key, unique
        slots = program.slots
        self.num_slots = len(slots)
        self.inputs_at = [(pos, int(s.name)) for pos, s in enumerate(slots) if s.role in INPUT_ROLES]
        held = [(pos, s) for pos, s in enumerate(slots) if s.role not in INPUT_ROLES]
        self.held_at = [(pos, index) for index, (pos, _) in enumerate(held)]
        self.uneven = [(index, s) for index, (_, s) in enumerate(held) if s.layout.uneven_dims(s.shape, program.mesh)]
        self.owners = [_owner(module, s.name) for _, s in held]

    def tensors(self) -> list[torch.Tensor]:
        """The held slots' tensors as registered now (an attribute no longer in its table: as
        `getattr` finds it)."""
        out = []
        for owner, table, leaf in self.owners:
            tensor = getattr(owner, table).get(leaf)
            out.append(getattr(owner, leaf) if tensor is None else tensor)
        return out


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str, str]:
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, "_parameters" if leaf in module._parameters else "_buffers", leaf


def _feed(module: nn.Module, program: Program) -> _Feed:
    """The module's `_Feed` for `program`, made on its first call."""
    feeds = module.__dict__.setdefault("_tess_feeds", {})
    feed = feeds.get(id(program))
    if feed is None or feed.program is not program:
        if len(feeds) >= _MAX_FEEDS:
            feeds.clear()
        feed = feeds[id(program)] = _Feed(program, module)
    return feed


_MAX_FEEDS = 16  # programs per module (a mode's, a generation step's, ...): more are made again


def global_outputs(program: Program, rank_outputs: Sequence[Sequence], shapes: Sequence | None = None) -> list:
    """The global value of each output from every rank's outputs of the per-rank graph (the
    padding of uneven splits cut off, `unpad_block`); an output without a layout as rank 0 has it.
    `shapes`: the outputs' global shapes in this call (`Program.call_output_shapes`), default the compiled."""
    shapes = program.output_shapes if shapes is None else shapes
    return [global_output(program, index, [outputs[index] for outputs in rank_outputs], shape)
            for index, shape in enumerate(shapes)]


def global_output(program: Program, index: int, values: Sequence, shape: Sequence[int] | None):
    """The global value of output `index` of global `shape` from every rank's value of it."""
    layout = program.output_layouts[index]
    if layout is None:
        return values[0]
    return assemble([unpad_block(v, layout, shape, program.mesh, r) for r, v in enumerate(values)], layout, program.mesh)


def state_slots(program: Program) -> list[Slot]:
    """Slots that a state dict holds (parameters, persistent buffers), in the model's order."""
    slots = {s.name: s for s in program.slots if s.role in ("param", "buffer", "alias")}
    return [slots[key] for key in program.state_keys if key in slots]


def source_keys(program: Program, keys: Iterable[str], source: str) -> dict[str, tuple[Slot, str]]:
    """For each tensor to load (state slots but aliases): `{name: (slot, key it is stored under)}`.

    A tied tensor may be stored under any of its names (save_pretrained keeps
    one). ValueError for a tensor stored under none, or a key the model lacks.
    """
    keys = list(keys)
    slots = state_slots(program)
    names = {s.name: [s.name] for s in slots if s.role != "alias"}
    for slot in slots:
        if slot.role == "alias":
            names[slot.alias_of].append(slot.name)
    missing = [name for name, aliases in names.items() if not any(a in keys for a in aliases)]
    known = {s.name for s in slots}
    unexpected = [k for k in keys if k not in known]
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match the model compiled for mesh {program.mesh}: missing {missing}, "
            f"unexpected {unexpected}; pass the unsharded model's state (same names), or load the "
            "model it was saved from"
        )
    by_name = {s.name: s for s in slots}
    return {name: (by_name[name], next(a for a in aliases if a in keys)) for name, aliases in names.items()}


def check_state_dict(program: Program, state_dict: dict) -> dict[str, tuple[Slot, str]]:
    """`source_keys` of a full state dict, the shapes of all its tensors checked (ValueError)."""
    sources = source_keys(program, state_dict, "state dict")
    for slot in state_slots(program):
        if slot.name in state_dict:
            check_shape(program, slot, slot.name, state_dict[slot.name].shape, "state dict")
    return sources


def check_shape(program: Program, slot: Slot, key: str, shape: Sequence[int], source: str) -> None:
    """ValueError unless the full tensor stored under `key` has the slot's shape."""
    if tuple(shape) != slot.shape:
        raise ValueError(
            f"{source} tensor {key!r} has shape {list(shape)}, the model's {slot.name!r} is "
            f"{list(slot.shape)} (mesh {program.mesh}): pass the state of the model that was compiled"
        )


def load_shards(program: Program, modules: dict[int, nn.Module], state_dict: dict) -> None:
    """Copy each rank's block of every full tensor in `state_dict` into its module.

    Reads only the blocks (a memory-mapped `torch.load` stays unread elsewhere).
    """
    sources = check_state_dict(program, state_dict)
    with torch.no_grad():
        for slot, key in sources.values():
            full = state_dict[key].detach()
            for rank, module in modules.items():
                get_tensor(module, slot).copy_(local_block(full, slot.layout, program.mesh, rank))


def full_tensors(program: Program, gather: Callable[[Slot], torch.Tensor]) -> dict[str, torch.Tensor]:
    """`{name: gather(slot)}` over the state-dict slots, in the model's order; a tied
    name maps to the very tensor of its first name, as in the model's state dict."""
    gathered = {s.name: gather(s) for s in state_slots(program) if s.role != "alias"}
    return {s.name: gathered[s.alias_of or s.name] for s in state_slots(program)}


@dataclasses.dataclass(frozen=True)
class Piece:
    """A box of the full tensor that a rank holds: where it lies in the local tensor and in the full one."""

    local: tuple[slice, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def full(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes))


def pieces(slot: Slot, mesh: Mesh, rank: int) -> list[Piece]:
    """The boxes of the full tensor that `rank` holds under the slot's layout, in local order."""
    return boxes(slot.layout, slot.shape, mesh, rank)


def boxes(layout: Layout, shape: Sequence[int], mesh: Mesh, rank: int) -> list[Piece]:
    """The boxes of a full tensor of `shape` that `rank` holds under `layout`, in local order."""
    runs = [_runs(_held_indices(layout, shape, mesh, rank, dim)) for dim in range(len(shape))]
    return [
        Piece(tuple(slice(at, at + n) for at, _, n in box), tuple(o for _, o, _ in box), tuple(n for *_, n in box))
        for box in itertools.product(*runs)
    ]


def _held_indices(layout: Layout, shape: Sequence[int], mesh: Mesh, rank: int, dim: int) -> torch.Tensor:
    """Indices along `dim` of the full tensor that `rank` holds, in local order (splits left to right)."""
    index = torch.arange(shape[dim])
    for axis in AXES:
        placement = layout.on(axis)
        if isinstance(placement, Shard) and placement.dim == dim and mesh.size(axis) > 1:
            parts, coord = mesh.size(axis), mesh.coord(rank, axis)
            index = chunk(index, 0, parts, coord) if placement.groups == 1 else take_block(index, 0, placement.groups, parts, coord)
    return index


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local start, full start, length) of each run of consecutive indices."""
    if index.numel() == 0:
        return [(0, 0, 0)]
    starts = [0, *(torch.nonzero(index.diff() != 1).flatten() + 1).tolist()]
    ends = [*starts[1:], index.numel()]
    return [(start, int(index[start]), end - start) for start, end in zip(starts, ends)]


def pieces_wrapper(local: torch.Tensor, slot: Slot, mesh: Mesh, rank: int):
    """`local` as the pieces torch.distributed.checkpoint addresses: a `LocalShardsWrapper` of
    views into `local` at their offsets in the full tensor (loading writes into `local`)."""
    return boxes_wrapper(local, slot.layout, slot.shape, mesh, rank)


def boxes_wrapper(local: torch.Tensor, layout: Layout, shape: Sequence[int], mesh: Mesh, rank: int):
    """`local`, of a tensor of `shape` laid out by `layout`, as its boxes (see `pieces_wrapper`)."""

    held = boxes(layout, shape, mesh, rank)
    return LocalShardsWrapper([local[p.local] for p in held], [p.offsets for p in held])
