"""Checkpoints: loading shard by shard, DTensor state dicts for DCP, meta-device models.

A small GPT-2 (`hf_models.build`, tied embeddings, a fused QKV whose weight
and bias are grouped splits `S(dim,g=3)`) is built on the meta device, so
its shards start uninitialised and of local size, and then takes its
weights from each kind of checkpoint (`tess_compile.training.shard_loading`): a
`save_pretrained` directory (one file, and sharded with an index), one
`.safetensors` file, a `torch.save` file (memory-mapped), and
torch.distributed.checkpoint (DCP) directories saved unsharded and sharded.

Bit-exact where the arithmetic is the same: a module loaded from a
checkpoint against the same program loaded from the full state dict. The
sharded logits against the unsharded model's within 1e-6 (measured: 4.5e-8).

Simulation checks every source, that loading a file allocates nothing of
full size (a dispatch mode records what each op allocates), the round trips
full -> load -> full and `full_state_dict()` -> `save_pretrained` ->
`from_pretrained`, and the errors. Two gloo launches: (q=2, d=2) on 8
processes checks `ShardedModule.state_dict()` (DTensors), saves it with
`dcp.save` and loads it back into a meta-built module on the same mesh
(identical shards), and loads the other sources; (q=2, d=1) on 4 processes
loads that checkpoint on the other mesh. The simulator loads it too.
"""

from __future__ import annotations

import json
import logging
import math
import warnings

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hf_models import build
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPT2LMHeadModel

import tess_compile
from tess_compile.passes.driver import compile_model
from tess_compile.core.layout import local_block
from tess_compile.core.mesh import Mesh
from tess_compile.runtime import state
from tess_compile.runtime.launch import run_local
from tess_compile.runtime.simulator import SimulatedModule
from tess_compile.training.shard_loading import load_pretrained_shards, load_shards_from

ATOL = 1e-6  # sharded against unsharded logits
QKV = "transformer.h.0.attn.c_attn.weight"  # a grouped split: S(1,g=3) over col


def meta_gpt2(config) -> GPT2LMHeadModel:
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def quiet_compile(model, mesh: Mesh, kwargs):
    """compile_model without the "runs replicated" warnings (GPT-2's position index)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return compile_model(model, mesh, kwargs)
        finally:
            logging.disable(logging.NOTSET)


def local_numel(slot, mesh: Mesh) -> int:
    return math.prod(slot.layout.local_shape(slot.shape, mesh))


def shard_problems(modules: dict[int, torch.nn.Module], program) -> list[str]:
    """Shards that are not real tensors of exactly their local shape."""
    problems = []
    for rank, module in modules.items():
        for slot in state.state_slots(program):
            local = state.get_tensor(module, slot)
            expected = slot.layout.local_shape(slot.shape, program.mesh)
            if local.is_meta or list(local.shape) != expected:
                problems.append(f"rank {rank} {slot.name}: {local.device} {list(local.shape)} != local {expected}")
    return problems


def write_checkpoints(model: torch.nn.Module, root) -> dict[str, str]:
    """The model's weights as every kind of file checkpoint; returns their paths
    (and that of the DCP directory that the (q=2, d=2) launch writes)."""
    paths = {
        "pretrained": root / "pretrained",
        "pretrained sharded": root / "pretrained-sharded",
        "safetensors file": root / "pretrained" / "model.safetensors",
        "torch file": root / "state.pt",
        "dcp unsharded": root / "dcp-unsharded",
        "dcp": root / "dcp-q2d2",
    }
    model.save_pretrained(paths["pretrained"])
    model.save_pretrained(paths["pretrained sharded"], max_shard_size="3KB")
    torch.save(model.state_dict(), paths["torch file"])
    save_without_process_group(model.state_dict(), paths["dcp unsharded"])
    return {name: str(path) for name, path in paths.items()}


def save_without_process_group(state_dict: dict, path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state_dict, checkpoint_id=path, no_dist=True)


class AllocationRecorder(TorchDispatchMode):
    """Records the largest tensor that an op produced anew (not a view, not in place)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            for value in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(value, torch.Tensor):
                    self.largest = max(self.largest, value.numel())
        return out


# ---------------------------------------------------------------------------
# Workers (module level, for spawned processes)
# ---------------------------------------------------------------------------


def _differing_shards(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of the local shards (of the DTensor parameters) that differ between two modules of one program."""
    bp = dict(b.named_parameters())
    return [name for name, p in a.named_parameters() if not torch.equal(p.to_local(), bp[name].to_local())]


def _q2d2_worker(rank, world_size, paths):
    """state_dict() as DTensors; DCP save, and load into a meta-built module; the file sources."""
    torch.set_num_threads(1)
    model, kwargs = build("gpt2", 2, 2)
    out = {"problems": []}
    problems = out["problems"]
    sm = tess_compile.shard(meta_gpt2(model.config), 2, 2, example_inputs=kwargs, timeout=60)
    problems += shard_problems({rank: sm}, sm.program)
    sm.load_full_state_dict(model.state_dict())  # the reference: loaded from the full tensors
    logits = sm(**kwargs).logits.full_tensor()

    sd = sm.state_dict()
    if list(sd) != list(model.state_dict()):
        problems.append(f"state_dict keys {list(sd)} != the model's")
    for name, value in sd.items():
        if not isinstance(value, DTensor) or value.shape != model.state_dict()[name].shape:
            problems.append(f"state_dict()[{name!r}] is {type(value).__name__} {list(value.shape)}")
    if not any(isinstance(p, _StridedShard) for p in sd[QKV].placements):
        problems.append(f"{QKV} placements {sd[QKV].placements} have no _StridedShard")
    if sd["transformer.wpe.weight"].to_local().data_ptr() != sm.transformer.wpe.weight.to_local().data_ptr():
        problems.append("state_dict() does not share the local shards' storage")
    dcp.save(sd, checkpoint_id=paths["dcp"])

    # DCP back into a module built on the meta device: the same shards, bit for bit.
    loaded = tess_compile.shard_program(sm.program, timeout=60)
    target = loaded.state_dict()
    dcp.load(target, checkpoint_id=paths["dcp"])
    loaded.load_state_dict(target)
    out["dcp mismatches"] = _differing_shards(sm, loaded)

    copied = tess_compile.shard_program(sm.program, timeout=60)
    copied.load_state_dict(sm.state_dict())
    out["load_state_dict mismatches"] = _differing_shards(sm, copied)
    whole = DTensor.from_local(model.state_dict()[QKV], sm.device_mesh, [Replicate()] * 3, run_check=False)
    try:
        copied.load_state_dict({QKV: whole}, strict=False)
        out["other boxes"] = "UNEXPECTED: no error"
    except ValueError as err:
        out["other boxes"] = str(err)

    for source in ("pretrained sharded", "torch file"):
        module = tess_compile.shard_program(sm.program, timeout=60)
        load_shards_from(module, paths[source])
        out[f"{source} mismatches"] = _differing_shards(sm, module)
        if not torch.equal(module(**kwargs).logits.full_tensor(), logits):
            problems.append(f"{source}: logits differ from the module loaded from the full state dict")
    out["logits"] = logits if rank == 0 else None
    return out


def _q2d1_worker(rank, world_size, paths):
    """The DCP checkpoint saved at (q=2, d=2) loaded at (q=2, d=1), two ways."""
    torch.set_num_threads(1)
    model, _ = build("gpt2", 2, 2)  # the weights that were saved
    _, kwargs = build("gpt2", 2, 1)  # a batch for this mesh
    sm = tess_compile.shard(meta_gpt2(model.config), 2, 1, example_inputs=kwargs, timeout=60)
    load_shards_from(sm, paths["dcp"])
    user = tess_compile.shard_program(sm.program, timeout=60)
    target = user.state_dict()
    dcp.load(target, checkpoint_id=paths["dcp"])
    user.load_state_dict(target)
    reference = tess_compile.shard_program(sm.program, timeout=60)
    reference.load_full_state_dict(model.state_dict())
    logits = sm(**kwargs).logits.full_tensor()
    return {
        "load_shards_from mismatches": _differing_shards(reference, sm),
        "dcp.load mismatches": _differing_shards(reference, user),
        "same logits": torch.equal(logits, reference(**kwargs).logits.full_tensor()),
        "logits": logits if rank == 0 else None,
        "world": dist.get_world_size(),
    }


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2():
    return build("gpt2", 2, 2)


@pytest.fixture(scope="module")
def paths(gpt2, tmp_path_factory):
    return write_checkpoints(gpt2[0], tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def meta_program(gpt2):
    """The (q=2, d=2) program of the meta-device GPT-2."""
    model, kwargs = gpt2
    return quiet_compile(meta_gpt2(model.config), Mesh(2, 2), kwargs)


@pytest.fixture(scope="module")
def reference(gpt2, meta_program):
    """The meta program loaded from the full state dict, and its logits."""
    model, kwargs = gpt2
    sim = SimulatedModule(meta_program)
    sim.load_full_state_dict(model.state_dict())
    return sim, sim(**kwargs).logits


@pytest.fixture(scope="module")
def saved_at_q2d2(paths):
    """Launch 1: 8 gloo processes on (q=2, d=2); writes paths["dcp"]."""
    return run_local(_q2d2_worker, 8, args=(paths,), timeout_s=240, collective_timeout_s=120)


# ---------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------


def test_pieces_are_the_local_block(gpt2, meta_program):
    model, _ = gpt2
    mesh = meta_program.mesh
    full = model.state_dict()
    for slot in state.state_slots(meta_program):
        for rank in range(mesh.num_ranks):
            boxes = state.pieces(slot, mesh, rank)
            local = torch.empty(slot.layout.local_shape(slot.shape, mesh))
            for box in boxes:
                local[box.local] = full[slot.name][box.full]
            assert torch.equal(local, local_block(full[slot.name], slot.layout, mesh, rank)), (slot.name, rank)
            assert len(boxes) == (3 if "c_attn" in slot.name else 1), (slot.name, slot.layout, len(boxes))


def test_meta_model_matches_the_real_one(gpt2, reference):
    model, kwargs = gpt2
    sim, logits = reference
    assert shard_problems(dict(enumerate(sim.ranks)), sim.program) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = tess_compile.simulate(model, 2, 2, example_inputs=kwargs)
    assert torch.equal(real(**kwargs).logits, logits), "meta-built and real-built programs compute differently"
    assert (logits - model(**kwargs).logits).abs().max().item() <= ATOL


SOURCES = ["pretrained", "pretrained sharded", "safetensors file", "torch file", "dcp unsharded", "state dict"]


@pytest.mark.parametrize("source", SOURCES)
def test_meta_model_loads_shard_by_shard(source, gpt2, paths, meta_program, reference):
    model, kwargs = gpt2
    sim = SimulatedModule(meta_program)
    assert shard_problems(dict(enumerate(sim.ranks)), meta_program) == []
    recorder = AllocationRecorder()
    with recorder:
        load_shards_from(sim, model.state_dict() if source == "state dict" else paths[source])
    largest_local = max(local_numel(s, meta_program.mesh) for s in state.state_slots(meta_program))
    smallest_full = min(math.prod(s.shape) for s in meta_program.params if "c_attn.weight" in s.name or "wte" in s.name)
    assert largest_local < smallest_full
    if source != "dcp unsharded":  # DCP reads each stored chunk whole, here whole tensors (docs/checkpoints.md)
        assert 0 < recorder.largest <= largest_local, f"{source}: an op allocated {recorder.largest} elements"
    assert torch.equal(sim(**kwargs).logits, reference[1]), f"{source}: logits differ"
    full = sim.full_state_dict()
    for name, value in model.state_dict().items():  # full -> load -> full, bit for bit
        assert torch.equal(full[name], value), f"{source}: {name} does not round-trip"
    assert full["lm_head.weight"] is full["transformer.wte.weight"], "tied weights are one tensor, as in the model"


def test_full_state_dict_round_trips_through_save_pretrained(gpt2, meta_program, tmp_path):
    model, kwargs = gpt2
    gen = torch.Generator().manual_seed(7)
    changed = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    changed["lm_head.weight"] = changed["transformer.wte.weight"]
    sim = SimulatedModule(meta_program)
    sim.load_full_state_dict(changed)
    full = sim.full_state_dict()
    unsharded = GPT2LMHeadModel(model.config)
    unsharded.load_state_dict(full)
    unsharded.save_pretrained(tmp_path, state_dict=full)
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert torch.equal(reloaded(**kwargs).logits, unsharded(**kwargs).logits)
    again = SimulatedModule(meta_program)
    load_pretrained_shards(again, tmp_path)
    assert all(torch.equal(again.full_state_dict()[k], v) for k, v in full.items())


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [Mesh(2, 1), Mesh(1, 4, "1d")], ids=["q2d1", "1d-p4"])
def test_dcp_checkpoint_of_q2d2_loads_into_simulator_q2d1(gpt2, saved_at_q2d2, paths, mesh):
    """A DCP checkpoint saved at [2,2,2] loads by DTensor resharding into another mesh,
    of 2-D or of 1-D layouts."""
    model, _ = gpt2
    _, kwargs = build("gpt2", 2, 1)
    program = quiet_compile(meta_gpt2(model.config), mesh, kwargs)
    sim = SimulatedModule(program)
    load_shards_from(sim, paths["dcp"])
    full = model.state_dict()
    for slot in state.state_slots(program):
        for rank, module in enumerate(sim.ranks):
            expected = local_block(full[slot.name], slot.layout, program.mesh, rank)
            assert torch.equal(state.get_tensor(module, slot), expected), (slot.name, rank)


def _safetensors_dir(path, tensors: dict):
    path.mkdir()
    safetensors.torch.save_file({k: v.contiguous().clone() for k, v in tensors.items()}, path / "model.safetensors")
    return path


def test_bad_checkpoints_are_refused(gpt2, meta_program, tmp_path):
    model, _ = gpt2
    sim = SimulatedModule(meta_program)
    good = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    cases = {
        "missing": ({k: v for k, v in good.items() if k != QKV}, ["missing", QKV]),
        "unexpected": ({**good, "transformer.h.0.attn.masked_bias": torch.zeros(1)}, ["unexpected", "masked_bias"]),
        "shape": ({**good, QKV: torch.zeros(16, 47)}, [QKV, "[16, 47]", "[16, 48]", "mesh [q=2, q=2, d=2]"]),
    }
    for label, (tensors, words) in cases.items():
        with pytest.raises(ValueError) as info:
            load_pretrained_shards(sim, _safetensors_dir(tmp_path / label, tensors))
        assert all(w in str(info.value) for w in words), f"{label}: {info.value}"
    with pytest.raises(ValueError, match="not a torch.distributed.checkpoint directory"):
        load_shards_from(sim, tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="tess_compile.shard or tess_compile.simulate"):
        load_shards_from(model, model.state_dict())
    save_without_process_group({**good, QKV: torch.zeros(16, 47)}, tmp_path / "dcp")
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn.c_attn.weight' has shape \[16, 47\].*mesh"):
        load_shards_from(sim, tmp_path / "dcp")
    index = {"weight_map": {k: "model.safetensors" for k in good}}
    (tmp_path / "shape" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="mesh"):
        load_shards_from(sim, tmp_path / "shape")


class WithTable(torch.nn.Module):
    """A non-persistent buffer: no checkpoint holds it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.proj(x) + self.table


def test_meta_constant_is_refused():
    with torch.device("meta"):
        model = WithTable()
    with pytest.raises(ValueError, match="constant 'table'.*meta device.*outside"):
        tess_compile.simulate(model, 2, 1, example_inputs=(torch.randn(2, 3, 4, device="meta"),))


# ---------------------------------------------------------------------------
# gloo
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_dcp_and_file_sources_on_q2d2(gpt2, saved_at_q2d2):
    model, kwargs = gpt2
    for rank, res in enumerate(saved_at_q2d2):
        assert res["problems"] == [], f"rank {rank}: {res['problems']}"
        for key in ("dcp", "load_state_dict", "pretrained sharded", "torch file"):
            assert res[f"{key} mismatches"] == [], f"rank {rank} {key}: shards differ: {res[f'{key} mismatches']}"
        assert "holds the boxes" in res["other boxes"] and "torch.distributed.checkpoint.load" in res["other boxes"]
    logits = saved_at_q2d2[0]["logits"]
    assert (logits - model(**kwargs).logits).abs().max().item() <= ATOL


@pytest.mark.slow
def test_dcp_q2d2_checkpoint_loads_on_q2d1(gpt2, saved_at_q2d2, paths):
    model, _ = gpt2
    _, kwargs = build("gpt2", 2, 1)
    results = run_local(_q2d1_worker, 4, args=(paths,), timeout_s=240, collective_timeout_s=120)
    for rank, res in enumerate(results):
        assert res["world"] == 4
        assert res["load_shards_from mismatches"] == [] and res["dcp.load mismatches"] == [], f"rank {rank}: {res}"
        assert res["same logits"], f"rank {rank}: logits differ from the module loaded from the full state dict"
    assert (results[0]["logits"] - model(**kwargs).logits).abs().max().item() <= ATOL
