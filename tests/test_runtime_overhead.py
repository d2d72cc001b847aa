"""The distributed runtime's per-call shortcuts give what the general paths give.

- `local_tensors`: one autograd node for all DTensor parameters of a call,
  whose gradients equal `DTensor.to_local()`'s (values, placements, specs);
- `DistComm`'s all-gather and reduce-scatter: blocks already in rank order
  skip the copies, with the same results as `put_blocks` / `take_block`;
- `Comm.records` stays bounded over a long loop;
- a program of a world of one holds no collective (every axis has size 1);
- `eager_graph`: the collectives called without custom-op dispatch run the
  same collectives, records and gradients as the custom ops;
- `graph_inputs` resolves a module's tensors once per program and still reads
  a parameter replaced since; `output_dtensor` is `DTensor.from_local`'s DTensor;
  `Program.flatten_inputs`'s fast path gives what the general one gives.

The DTensor tests run on torch's fake process group (a mesh of 8 in this
process, no data moved); one test trains on a gloo world of one process.
Nothing here times anything (benchmarks/overhead.py does).
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import assert_close_rel, null_gradients, trained_error
from models import GPTBlock, TinyGPT
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import tess_compile
from tess_compile.core.layout import in_rank_order, pad_block, put_blocks, take_block
from tess_compile.core.mesh import Mesh
from tess_compile.core.program import INPUT_ROLES
from tess_compile.ops.collectives import COLLECTIVE_OPS, EAGER_TARGETS, Comm, use_comm
from tess_compile.ops.recompute_region import RecomputeRegion
from tess_compile.passes.driver import compile_model
from tess_compile.runtime import state
from tess_compile.runtime.dist_comm import DistComm
from tess_compile.runtime.dtensors import local_tensors, output_dtensor, output_spec
from tess_compile.runtime.launch import run_local
from tess_compile.runtime.sharded_module import eager_graph

PLACEMENTS = [
    (Replicate(), Shard(0), Shard(1)),
    (Replicate(), Replicate(), _StridedShard(0, split_factor=2)),
    (Partial(), Shard(1), Replicate()),  # to_local's gradient: Replicate in place of Partial
]


def _params(mesh) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [nn.Parameter(DTensor.from_local(torch.randn(4, 6, dtype=torch.float64, generator=generator), mesh,
                                            placements, run_check=False)) for placements in PLACEMENTS]


def _loss(locals_: list[torch.Tensor]) -> torch.Tensor:
    """Gradients of both layouts: dense, and transposed (a strided local gradient)."""
    weight = torch.linspace(-1, 1, 24, dtype=torch.float64).view(6, 4)
    return sum(((x @ weight) ** 2).sum() + (x.t() * weight).sum() for x in locals_)


def test_local_tensors_one_node_with_to_local_gradients(fake_mesh):
    params = _params(fake_mesh)
    locals_ = local_tensors(params)
    assert all(type(x) is torch.Tensor for x in locals_)
    assert len({id(x.grad_fn) for x in locals_}) == 1, "one autograd node for all parameters"
    grads = torch.autograd.grad(_loss(locals_), params)
    expected = torch.autograd.grad(_loss([p.to_local() for p in params]), params)
    for grad, reference, param in zip(grads, expected, params):
        assert isinstance(grad, DTensor) and grad.shape == param.shape
        assert grad.placements == reference.placements and grad._spec == reference._spec
        assert grad._spec is not param._spec
        assert grad.stride() == reference.stride()
        assert torch.equal(grad._local_tensor, reference._local_tensor)
    assert grads[2].placements == (Replicate(), Shard(1), Replicate())


def test_local_tensors_accumulate_like_to_local(fake_mesh):
    """Gradients accumulated on the parameters over two backwards equal `to_local()`'s."""
    params, reference = _params(fake_mesh), _params(fake_mesh)
    for _ in range(2):
        _loss(local_tensors(params)).backward()
        _loss([p.to_local() for p in reference]).backward()
    for param, other in zip(params, reference):
        assert param.grad.placements == other.grad.placements
        assert torch.equal(param.grad.to_local(), other.grad.to_local())


def test_local_tensors_without_grad(fake_mesh):
    params = _params(fake_mesh)
    params[1].requires_grad_(False)
    plain = torch.ones(3, requires_grad=True)
    locals_ = local_tensors([*params, plain])
    assert locals_[3] is plain
    assert locals_[1].grad_fn is None and not locals_[1].requires_grad
    _loss(locals_[:3]).backward()
    assert params[1].grad is None and params[0].grad is not None
    with torch.no_grad():
        locals_ = local_tensors(params)
    for local, param in zip(locals_, params):  # the storage itself: copying into it loads the parameter
        assert local.grad_fn is None and local.data_ptr() == param._local_tensor.data_ptr()


def test_world_of_one_trains_exactly(world_of_one):
    """A sharded TinyGPT on a gloo world of one: output, gradients (DTensors placed like their
    parameters) and weights after AdamW (where no gradient is mathematically zero) equal the
    unsharded model's in float64; a frozen parameter gets no gradient; under no_grad the
    program reads the parameters' storage."""
    model = TinyGPT(vocab=16, hidden=8, heads=2, layers=1, seq=4).double()
    model.positions.weight.requires_grad_(False)  # frozen before sharding: frozen in the sharded module
    ids = torch.randint(0, 16, (2, 4))
    sharded = tess_compile.shard(copy.deepcopy(model), 1, 1, example_inputs=(ids,), timeout=60)
    assert not sharded.get_parameter("positions.weight").requires_grad
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, sharded)]
    out = sharded(ids)
    assert_close_rel(out.full_tensor(), model(ids), 1e-12, "output")
    out.to_local().square().sum().backward()
    model(ids).square().sum().backward()
    for name, param in sharded.named_parameters():
        expected = model.get_parameter(name).grad
        if expected is None:
            assert param.grad is None, name
            continue
        assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements, name
        assert_close_rel(param.grad.full_tensor(), expected, 1e-12, f"grad {name}")
    null = null_gradients(model)  # the key bias's: rounding noise, which AdamW turns into lr-sized steps
    for opt in opts:
        opt.step()
    for name, value in sharded.full_state_dict().items():
        error = trained_error(value, model.state_dict()[name], null.get(name))
        assert error <= 1e-12, f"{name} after AdamW: {error:.2e}"
    with torch.no_grad():
        inputs = state.graph_inputs(sharded.program, sharded, sharded.program.flatten_inputs((ids,), {}))
    storages = {p.to_local().data_ptr() for p in sharded.parameters()}
    params = [x for x, s in zip(inputs, sharded.program.slots) if s.role == "param"]
    assert params and all(x.data_ptr() in storages for x in params)
    # What each call needs is made on the first: one feed, one output spec, and the graph itself
    # as the eager graph (no collective to call), however many calls.
    again = sharded(ids)
    assert len(sharded.__dict__["_tess_feeds"]) == 1 and len(sharded._output_specs) == 1
    assert again._spec is sharded(ids)._spec
    assert [graph for _, graph in sharded._eager_graphs.values()] == [sharded.program.runnable]


class _DeviceMesh:
    """What DistComm reads of a DeviceMesh: rank 1 of a col axis of 2."""

    mesh = torch.tensor([[[0, 1]]])

    def get_coordinate(self):
        return [0, 0, 1]


SPLITS = [  # shape of this rank's block, dim, groups, blocks in rank order
    ((6, 4), 0, 1, True),
    ((1, 6, 4), 1, 1, True),
    ((1, 1, 2, 4), 2, 1, True),
    ((3, 6, 4), 1, 1, False),
    ((6, 4), 1, 1, False),
    ((8, 4), 0, 2, False),
    ((1, 8, 4), 1, 2, False),
    ((2, 4, 6), 2, 3, False),
    ((6, 1), 1, 1, False),  # the gathered blocks' order a view could give: the result must still be contiguous
]


@pytest.fixture
def stub_comm(monkeypatch):
    """A DistComm of rank 1 along col (2 ranks) whose gloo calls are stubs: rank t's block in an
    all-gather is the own block plus 100 t; a reduce-scatter returns block 1 of the sent buffer.
    `sent` lists the buffers handed to the stubs."""
    sent = []

    def all_gather_single(out, x, group):
        sent.append(out)
        out.copy_(torch.cat([x + 100 * t for t in range(2)]))

    def reduce_scatter_single(out, x, group):
        sent.append(x)
        out.copy_(x.view(2, -1)[1])

    monkeypatch.setattr(dist, "all_gather_single", all_gather_single)
    monkeypatch.setattr(dist, "reduce_scatter_single", reduce_scatter_single)
    comm = DistComm(Mesh(1, 2, "1d"), _DeviceMesh(), timedelta(seconds=1),
                    groups=dict.fromkeys(("depth", "row", "col")))
    return comm, sent


@pytest.mark.parametrize("shape, dim, groups, in_order", SPLITS)
def test_all_gather_in_rank_order_is_the_gathered_buffer(stub_comm, shape, dim, groups, in_order):
    comm, sent = stub_comm
    assert in_rank_order(torch.Size(shape), dim, groups) == in_order
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    out = comm.run("all_gather", x, "col", 2, dim, groups)
    assert torch.equal(out, put_blocks([x + 100 * t for t in range(2)], dim, groups))
    assert out.is_contiguous() and (out.data_ptr() == sent[0].data_ptr()) == in_order


@pytest.mark.parametrize("shape, dim, groups, in_order", SPLITS)
def test_reduce_scatter_in_rank_order_sends_the_input(stub_comm, shape, dim, groups, in_order):
    comm, sent = stub_comm
    gathered = list(shape)
    gathered[dim] *= 2
    assert in_rank_order(torch.Size(gathered), dim, groups) == in_order
    x = torch.arange(torch.Size(gathered).numel(), dtype=torch.float32).view(gathered)
    out = comm.run("reduce_scatter", x, "col", 2, dim, groups)
    assert torch.equal(out, take_block(x, dim, groups, 2, 1)) and out.shape == torch.Size(shape)
    assert (sent[0].data_ptr() == x.data_ptr()) == in_order


def _splits_worker(rank, world):
    mesh = Mesh(1, 2, "1d")
    comm = DistComm(mesh, init_device_mesh("cpu", mesh.shape, mesh_dim_names=("depth", "row", "col")),
                    timedelta(seconds=60))
    errors = []
    for shape, dim, groups, _ in SPLITS:
        blocks = [torch.randn(shape, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        gathered = comm.run("all_gather", blocks[rank], "col", 2, dim, groups)
        if not torch.equal(gathered, put_blocks(blocks, dim, groups)):
            errors.append(("all_gather", shape, dim, groups))
        full = [put_blocks([b, 2 * b], dim, groups) for b in blocks]
        expected = take_block(full[0], dim, groups, 2, rank) + take_block(full[1], dim, groups, 2, rank)
        if not torch.equal(comm.run("reduce_scatter", full[rank], "col", 2, dim, groups), expected):
            errors.append(("reduce_scatter", shape, dim, groups))
    return errors


@pytest.mark.slow
def test_splits_over_gloo_match_the_blocks():
    assert run_local(_splits_worker, 2, timeout_s=120) == [[], []]


def test_records_keep_the_latest_within_the_bound():
    comm = Comm(max_records=8)
    x = torch.zeros(1)
    for n in range(1, 101):
        comm.record("all_reduce", "col", x.expand(n))
        assert len(comm.records) <= 8
    assert [r.num_bytes for r in comm.records][-6:] == [4 * n for n in range(95, 101)]


def test_records_stay_bounded_over_a_training_loop():
    sim = tess_compile.simulate(GPTBlock(8, 2), 2, 1, example_inputs=(torch.randn(2, 4, 8),))
    x = torch.randn(2, 4, 8)
    sim(x).sum().backward()
    per_step = sim.comm.counts()
    steps = len(sim.comm.records)
    sim.comm.max_records = 4 * steps
    for _ in range(20):
        sim(x).sum().backward()
        assert len(sim.comm.records) <= 4 * steps
    sim.comm.records.clear()
    sim(x).sum().backward()
    assert sim.comm.counts() == per_step


# World of one, eager collectives, the per-call caches -----------------------------------------------


def _has_collective(gm: torch.fx.GraphModule) -> bool:
    targets = (*COLLECTIVE_OPS, *EAGER_TARGETS.values())
    return any(node.op == "call_function" and node.target in targets for node in gm.graph.nodes) or any(
        _has_collective(module.graph_module) for module in gm.children() if isinstance(module, RecomputeRegion))


@pytest.mark.parametrize("mode", ["2.5d", "1d"])
def test_a_world_of_one_holds_no_collective(mode):
    """Every axis of a world of one has size 1: its program calls no collective (not even the
    identities whose backward would communicate), and the eager graph is the program's own."""
    tiny = compile_model(TinyGPT(vocab=16, hidden=8, heads=2, layers=1, seq=4), Mesh(1, 1, mode),
                         (torch.randint(0, 16, (2, 4)),))
    blocks = compile_model(nn.Sequential(GPTBlock(8, 2), GPTBlock(8, 2)), Mesh(1, 1, mode), (torch.randn(2, 4, 8),),
                           recompute="blocks")
    assert any(isinstance(m, RecomputeRegion) for m in blocks.runnable.children())
    for program in (tiny, blocks):
        assert not _has_collective(program.graph) and not _has_collective(program.runnable)
        assert not _has_collective(eager_graph(program.runnable))
    assert eager_graph(tiny.runnable) is tiny.runnable


@pytest.fixture(scope="module")
def block_program():
    """Two GPT blocks on [2,2,2], in float64, each block a recompute region."""
    torch.manual_seed(0)
    model = nn.Sequential(GPTBlock(8, 2), GPTBlock(8, 2)).double()
    x = torch.randn(4, 4, 8, dtype=torch.float64)
    return compile_model(model, Mesh(2, 2), (x,), recompute="blocks"), x


def test_eager_graph_runs_the_custom_ops_collectives(fake_mesh, block_program):
    """The eager graph calls no custom op, as many collectives as the program (in its recompute
    regions too), and gives rank 0 the custom ops' outputs, gradients and records, forward and
    backward (recomputation included)."""
    program, x = block_program
    eager = eager_graph(program.runnable)
    regions = [m for m in eager.children() if isinstance(m, RecomputeRegion)]
    assert len(regions) == 2

    def targets(gm, kinds):
        here = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in kinds]
        return here + [t for m in gm.children() if isinstance(m, RecomputeRegion) for t in targets(m.graph_module, kinds)]

    custom = targets(program.runnable, EAGER_TARGETS)
    assert custom and not targets(eager, EAGER_TARGETS)
    assert targets(eager, set(EAGER_TARGETS.values())) == [EAGER_TARGETS[t] for t in custom]
    runs = []
    for graph in (program.runnable, eager):
        comm = DistComm(program.mesh, fake_mesh, timedelta(seconds=60))
        module = state.add_local_tensors(nn.Module(), program, 0)
        inputs = state.graph_inputs(program, module, [x.clone().requires_grad_()])
        with use_comm(comm):
            (out,) = graph(*inputs)
        out.square().sum().backward()
        runs.append((out.detach(), [p.grad for p in module.parameters()], list(comm.records)))
    (out, grads, records), (eager_out, eager_grads, eager_records) = runs
    assert torch.equal(out, eager_out) and all(torch.equal(a, b) for a, b in zip(grads, eager_grads))
    assert records == eager_records and {r.phase for r in records} == {"forward", "backward"}


def test_graph_inputs_resolves_a_module_once_and_reads_replaced_tensors():
    """One feed per (module, program), made on the first call; the values are the general path's
    (uneven blocks padded), and a parameter registered anew since is the one the program gets."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 37), nn.GELU(), nn.Linear(37, 8))  # an MLP width of 37 over 2: uneven
    x = torch.randn(4, 3, 8)
    program = compile_model(model, Mesh(2, 1), (x,))
    module = state.add_local_tensors(nn.Module(), program, 1)  # the short blocks
    inputs = state.graph_inputs(program, module, [x])
    feed = state._feed(module, program)
    assert state._feed(module, program) is feed and feed.uneven
    expected = [x if s.role in INPUT_ROLES else pad_block(state.get_attribute(module, s), s.layout, s.shape, program.mesh)
                for s in program.slots]
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(inputs, expected))
    new = nn.Parameter(torch.ones_like(module.get_parameter("0.bias")))
    module.get_submodule("0").register_parameter("bias", new)
    index = [s.name for s in program.slots].index("0.bias")
    assert torch.equal(state.graph_inputs(program, module, [x])[index], pad_block(new, *_where(program, index)))


def _where(program, index):
    slot = program.slots[index]
    return slot.layout, slot.shape, program.mesh


@pytest.mark.parametrize("placements", PLACEMENTS)
def test_output_dtensor_is_from_locals(fake_mesh, placements):
    """`output_dtensor` gives `DTensor.from_local`'s DTensor (spec, shape, stride) and gradient."""
    shape = torch.Size(_global_shape(placements))
    local = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    ours = output_dtensor(local, output_spec(fake_mesh, placements, shape, local.dtype))
    theirs = DTensor.from_local(local, fake_mesh, placements, run_check=False, shape=shape,
                                stride=tuple(torch.empty(shape).stride()))
    assert ours._spec == theirs._spec and ours.shape == theirs.shape and ours.stride() == theirs.stride()
    assert torch.equal(ours.to_local(), theirs.to_local()) and ours.requires_grad
    weight = torch.linspace(-1, 1, 24, dtype=torch.float64).view(4, 6)
    (grad,) = torch.autograd.grad((ours.to_local() * weight).sum(), local)
    (expected,) = torch.autograd.grad((theirs.to_local() * weight).sum(), local)
    assert torch.equal(grad, expected)
    with torch.no_grad():
        unrecorded = DTensor.from_local(local, fake_mesh, placements, run_check=False, shape=shape, stride=theirs.stride())
        assert output_dtensor(local, ours._spec).requires_grad is unrecorded.requires_grad is False


def _global_shape(placements) -> list[int]:
    shape = [4, 6]
    for axis, placement in enumerate(placements):
        if placement.is_shard():
            shape[placement.dim] *= 2  # every axis of the fake mesh has 2 ranks
    return shape


def test_flatten_inputs_fast_path_gives_the_general_paths_leaves():
    """Positional tensors take the fast path; keywords and other values the general one; both
    give the same leaves and refuse a tensor of another shape with the same message."""
    model = GPTBlock(8, 2)
    x = torch.randn(2, 4, 8)
    program = compile_model(model, Mesh(1, 1), (x,))
    assert program._num_positional_leaves == 1
    assert program.flatten_inputs((x,), {})[0] is x
    with pytest.raises(ValueError, match=r"positional input 0 has shape \[2, 4, 9\], but the module was compiled"):
        program.flatten_inputs((torch.randn(2, 4, 9),), {})
    with pytest.raises(ValueError, match="has dtype torch.float64, but the module was compiled for torch.float32"):
        program.flatten_inputs((x.double(),), {})
