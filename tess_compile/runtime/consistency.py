"""Rank consistency: every rank must start from the same model and take the same inputs.

A sharded module checks at construction that every rank compiled the same
weights (by `fingerprint`) and example-input shapes, and with
`TESS_COMPILE_DEBUG=1` that every call's inputs are the same on every rank of
its tensor-parallel group; a ValueError on every rank names the ranks and the
tensors that differ.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from tess_compile.core.program import INPUT_ROLES, Program, input_name
from tess_compile.runtime.groups import World

__all__ = ["check_same_inputs", "check_same_model", "fingerprint"]

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
    return [input_name(path) for path, _ in pytree.tree_flatten_with_path(numbered)[0]]


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


def check_same_model(program: Program, world: World, everyone: World | None = None) -> None:
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


def check_same_inputs(program: Program, flat: list, world: World) -> None:
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
