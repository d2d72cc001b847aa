"""Loading checkpoints shard by shard: each rank reads only the blocks it holds.

A module from `shard` (this rank) or `simulate` (every rank) takes its
shards from:

- a full state dict in memory (`load_full_state_dict`);
- a file of `torch.save(model.state_dict())`, memory-mapped: each rank
  copies its blocks, the rest of the file is never read;
- a `save_pretrained` directory (`model.safetensors`, or the shards that
  `model.safetensors.index.json` lists) or one `.safetensors` file: each
  rank reads its boxes with `safe_open(...).get_slice(name)[...]`;
- a torch.distributed.checkpoint directory (`.metadata`) saved on any mesh,
  or unsharded: each rank reads the stored chunks that overlap its boxes.

A rank's block is one box of the full tensor per dim range (`state.pieces`):
one box for plain splits, `g` boxes for `Shard(dim, groups=g)`. With a model
built on the meta device nothing of full size is allocated. Tied weights are
loaded once, from whichever of their names the checkpoint stores.

`for_dcp` readies other state for torch.distributed.checkpoint: a DTensor of
a grouped split (a parameter, or optimizer state shaped like one) becomes the
DTensor of the boxes this rank holds, as `ShardedModule.state_dict()` gives.
"""

from __future__ import annotations

import json
import os
import pathlib
import warnings
from collections.abc import Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

from tess_compile.core.program import Program
from tess_compile.runtime import state
from tess_compile.runtime.dtensors import layout_of, tess_mesh
from tess_compile.runtime.sharded_module import ShardedModule
from tess_compile.runtime.simulator import SimulatedModule

__all__ = [
    "SAFETENSORS_FILE",
    "SAFETENSORS_INDEX",
    "for_dcp",
    "load_dcp_shards",
    "load_pretrained_shards",
    "load_shards_from",
    "load_torch_file_shards",
]

SAFETENSORS_FILE = "model.safetensors"


SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_shards_from(module: nn.Module, source) -> None:
    """Load `source` into a sharded or simulated module, each rank reading only its blocks.

    `source`: a full state dict; a torch.distributed.checkpoint directory; a
    `save_pretrained` directory or a `.safetensors` file; or a file of
    `torch.save(state_dict)`.
    """
    if isinstance(source, Mapping):
        state.load_shards(*_shards_of(module), source)
        return
    path = pathlib.Path(source)
    if (path / ".metadata").is_file():
        load_dcp_shards(module, path)
    elif (path / SAFETENSORS_INDEX).is_file() or (path / SAFETENSORS_FILE).is_file() or path.suffix == ".safetensors":
        load_pretrained_shards(module, path)
    elif path.is_file():
        load_torch_file_shards(module, path)
    else:
        raise ValueError(
            f"checkpoint {str(path)!r} is not a torch.distributed.checkpoint directory (.metadata), a "
            f"save_pretrained directory ({SAFETENSORS_FILE} or {SAFETENSORS_INDEX}), a .safetensors file "
            "or a torch.save file: pass one of those, or a full state dict"
        )


def load_torch_file_shards(module: nn.Module, path: str | os.PathLike) -> None:
    """Load a file of `torch.save(model.state_dict())`, memory-mapped: each rank copies its blocks."""
    program, ranks = _shards_of(module)
    state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    state.load_shards(program, ranks, state_dict)


def load_pretrained_shards(module: nn.Module, path: str | os.PathLike) -> None:
    """Load a `save_pretrained` directory (or a `.safetensors` file): each rank reads only its boxes."""
    program, ranks = _shards_of(module)
    stored = _safetensors_names(pathlib.Path(path))
    by_file: dict[pathlib.Path, list] = {}
    for slot, key in state.source_keys(program, stored, f"checkpoint {str(path)!r}").values():
        by_file.setdefault(stored[key], []).append((slot, key))
    with torch.no_grad():
        for file, entries in by_file.items():
            with _safe_open(file) as handle:
                for slot, key in entries:
                    stored_slice = handle.get_slice(key)
                    state.check_shape(program, slot, key, stored_slice.get_shape(), f"checkpoint {str(file)!r}")
                    for rank, rank_module in ranks.items():
                        local = state.get_tensor(rank_module, slot)
                        for box in state.pieces(slot, program.mesh, rank):
                            local[box.local].copy_(stored_slice[box.full])


def _safetensors_names(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """`{tensor name: file}` of a save_pretrained directory or a `.safetensors` file."""
    if (path / SAFETENSORS_INDEX).is_file():
        weight_map = json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    file = path / SAFETENSORS_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"{str(path)!r} holds neither {SAFETENSORS_INDEX} nor {SAFETENSORS_FILE}: pass the directory "
            "that save_pretrained wrote, or a .safetensors file"
        )
    with _safe_open(file) as handle:
        return {name: file for name in handle.keys()}


def _safe_open(file: pathlib.Path):
    """`safetensors.safe_open` (imported here: safetensors is needed for these checkpoints only)."""
    from safetensors import safe_open

    return safe_open(file, framework="pt")


class _BoxesLoadPlanner(DefaultLoadPlanner):
    """Reads one rank's boxes into a state dict of `LocalShardsWrapper`s.

    DefaultLoadPlanner checks each value's size against the stored size; a
    wrapper's size is not the full tensor's, so `load_dcp_shards` checks the
    shapes and this plan skips that check.
    """

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        return LoadPlan(
            [item for key, boxes in self.state_dict.items() for item in create_read_items_for_chunk_list(key, stored[key], boxes.local_chunks)]
        )


def load_dcp_shards(module: nn.Module, path: str | os.PathLike) -> None:
    """Load a torch.distributed.checkpoint directory saved on any mesh (or unsharded).

    Each rank reads the stored chunks that overlap its boxes, with no
    collective: the ranks need not load together.
    """
    program, ranks = _shards_of(module)
    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    sources = state.source_keys(program, stored, f"checkpoint {str(path)!r}").values()
    for slot, key in sources:
        if not isinstance(stored[key], TensorStorageMetadata):
            raise ValueError(
                f"checkpoint {str(path)!r} stores {key!r} as bytes, not a tensor of shape {list(slot.shape)} "
                f"(mesh {program.mesh}): save the module's state_dict() of tensors"
            )
        state.check_shape(program, slot, key, stored[key].size, f"checkpoint {str(path)!r}")
    with torch.no_grad():
        for rank, rank_module in ranks.items():
            boxes = {key: state.pieces_wrapper(state.get_tensor(rank_module, slot).detach(), slot, program.mesh, rank) for slot, key in sources}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(boxes, checkpoint_id=path, planner=_BoxesLoadPlanner(), no_dist=True)


def for_dcp(state_dict):
    """`state_dict` (nested dicts and lists, e.g. `get_optimizer_state_dict(module, optimizer)`)
    ready for torch.distributed.checkpoint, on this rank.

    DCP addresses a DTensor by one box of the full tensor per rank; a grouped
    split (`_StridedShard`, the fused QKV layout) holds several. Each such
    DTensor on a sharded module's mesh becomes a DTensor of the same value
    whose local tensor is a `LocalShardsWrapper` of views into its own local
    tensor, so `dcp.save` writes the boxes and `dcp.load` fills them in place
    (then the original state dict holds what was loaded). Other values stay.
    """
    return pytree.tree_map_only(DTensor, _boxes_of, state_dict)


def _boxes_of(value: DTensor) -> DTensor:
    mesh = tess_mesh(value.device_mesh)
    if mesh is None or not any(isinstance(p, _StridedShard) for p in value.placements):
        return value
    with torch.no_grad():
        local = value.to_local()  # the very storage (no autograd view)
    if isinstance(local, LocalShardsWrapper):
        return value
    rank = mesh.rank(*value.device_mesh.get_coordinate())
    boxes = state.boxes_wrapper(local, layout_of(value.placements), value.shape, mesh, rank)
    return DTensor.from_local(boxes, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())


def _shards_of(module: nn.Module) -> tuple[Program, dict[int, nn.Module]]:
    """The program of a sharded or simulated module, and `{rank: module holding that rank's shards}`."""
    if isinstance(module, SimulatedModule):
        return module.program, dict(enumerate(module.ranks))
    if isinstance(module, ShardedModule):
        return module.program, {module.world.rank: module}  # its rank in the (depth, row, col) mesh
    raise ValueError(
        f"a {type(module).__name__} holds no shards: pass the module that tess_compile.shard or "
        "tess_compile.simulate returned"
    )
