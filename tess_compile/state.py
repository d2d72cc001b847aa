"""Per-rank state of a compiled program: the module of local shards, and
conversions between full tensors and shards (state dicts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from tess_compile.compiler import INPUT_ROLES, Program, Slot

__all__ = ["check_state_dict", "full_tensors", "get_tensor", "graph_inputs", "load_shards", "add_local_tensors", "state_slots"]


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


def add_local_tensors(root: nn.Module, program: Program, rank: int) -> nn.Module:
    """Give `root` the shards that `rank` holds, under the model's own names."""
    for slot in program.slots:
        if slot.role not in INPUT_ROLES and slot.role != "alias":
            _set_tensor(root, slot.name, program.local_tensor(slot, rank), slot.role)
    roles = {s.name: s.role for s in program.slots}
    for slot in program.slots:
        if slot.role == "alias":  # tied: the very same tensor under a second name
            _set_tensor(root, slot.name, get_tensor(root, slot.alias_of), roles[slot.alias_of])
    return root


def get_tensor(module: nn.Module, slot: Slot | str) -> torch.Tensor:
    """The parameter or buffer of `module` at the slot's (or a) dotted name."""
    name = slot if isinstance(slot, str) else slot.name
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf)


def graph_inputs(program: Program, module: nn.Module, flat_inputs: Sequence) -> list:
    """The per-rank graph's placeholder values, in order."""
    return [flat_inputs[int(s.name)] if s.role in INPUT_ROLES else get_tensor(module, s) for s in program.slots]


def state_slots(program: Program) -> list[Slot]:
    """Slots that a state dict holds (parameters, persistent buffers), in the model's order."""
    slots = {s.name: s for s in program.slots if s.role in ("param", "buffer", "alias")}
    return [slots[key] for key in program.state_keys if key in slots]


def check_state_dict(program: Program, state_dict: dict) -> None:
    """ValueError unless `state_dict` has exactly the model's tensors, at full shapes."""
    expected = {s.name: s for s in state_slots(program)}
    missing = [n for n in expected if n not in state_dict]
    unexpected = [n for n in state_dict if n not in expected]
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model: missing {missing}, unexpected {unexpected}; "
            "pass the unsharded model's state_dict()"
        )
    for name, slot in expected.items():
        if tuple(state_dict[name].shape) != slot.shape:
            raise ValueError(
                f"state dict tensor {name!r} has shape {list(state_dict[name].shape)}, the model's is "
                f"{list(slot.shape)}: pass the unsharded model's state_dict()"
            )


def load_shards(program: Program, modules: dict[int, nn.Module], state_dict: dict) -> None:
    """Copy each rank's block of every full tensor in `state_dict` into its module."""
    check_state_dict(program, state_dict)
    with torch.no_grad():
        for slot in state_slots(program):
            for rank, module in modules.items():
                get_tensor(module, slot).copy_(program.local_tensor(slot, rank, state_dict[slot.name]))


def full_tensors(program: Program, gather: Callable[[Slot], torch.Tensor]) -> dict[str, torch.Tensor]:
    """`{name: gather(slot)}` over the state-dict slots, in the model's order."""
    return {s.name: gather(s) for s in state_slots(program)}
