"""Compiled programs whose collectives are torch's functional collectives (docs/compiled.md).

Under a real process group, `shard(..., compile=True)` lowers every `tess::` collective of the
compiled forward and backward graphs to `torch.ops._c10d_functional` ops
(`tess_compile.runtime.functional_collectives`), which inductor compiles with the rest.

Fast (no processes):
1. Every record with a custom op has a lowering (its `functional`), the identities none; each
   lowering, the `*_alike` ones included, on every rank of a group of three (threads that meet at
   the functional collectives, run by an FX interpreter) gives bit for bit what the record's
   `group_results` gives that rank (the simulator's exact collectives), contiguous as the op's fake
   kernel; the lowered graph holds functional collectives and no `tess::` op, and dead-code
   elimination keeps each collective (a reduce's sum that ranks other than its destination drop).
2. A world of one gloo process in this process: a `CompiledRank` of a program with every
   collective, forward and backward, in mode "reduce-overhead" (CUDA graphs, ignored on a CPU) and
   with inductor's communication passes, bucketing included (set for gloo, which runs none by
   default): the graphs inductor got hold functional collectives and no `tess::` op, and outputs
   and gradients are the eager program's in float64. The same on CUDA (NCCL), where CUDA graphs run: skipped without a GPU.
3. The compile modes: inductor's options for each, a clear error for another.
Slow: 8 gloo processes, [2, 2, 2] (products overlapped: broadcasts, broadcast_start and wait,
reduces; and gathered: all-gathers and reduce-scatters along dims other than 0) and 1-D over 8 ranks, a GPT block with its loss, compile=True against compile=False and the unsharded model:
loss, every gradient and the weights after an SGD step, float64 to 1e-12; the graphs inductor got
hold functional collectives and no `tess::` op, and as many collectives per phase as the eager
program runs; a dynamic program on [2, 2, 1] (symbolic sizes in the lowered graphs).
"""

from __future__ import annotations

import copy
import functools
import threading
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from functorch.compile import aot_function, make_boxed_func
from models import GPTBlock, TinyGPT
from torch.distributed.device_mesh import init_device_mesh
from torch.fx.experimental.proxy_tensor import make_fx

import tess_compile
from tess_compile.core.collective_table import COLLECTIVES
from tess_compile.core.functional_lowerings import AxisGroup
from tess_compile.core.layout import local_block
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.ops import collectives
from tess_compile.ops.collectives import use_comm
from tess_compile.runtime import inductor
from tess_compile.runtime.dist_comm import DistComm
from tess_compile.runtime.functional_collectives import lower_collectives
from tess_compile.runtime.inductor import COMPILE_MODES, CompiledRank, compile_mode_options
from tess_compile.runtime.launch import run_local

TOL = 1e-12
tess = torch.ops.tess
c10d = torch.ops._c10d_functional


# 1. Each lowering against the record's exact result, on every rank of a group of three.

GROUP_SIZE = 3


class _Meeting:
    """The ranks of one process group, threads that meet at each collective and each see all tensors."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots = [None] * size

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x
        self.barrier.wait()
        xs = list(self.slots)
        self.barrier.wait()
        return xs


def _total(xs):
    return functools.reduce(torch.add, xs)  # the order of the records' own sums


class _RankInterpreter(torch.fx.Interpreter):
    """Runs a lowered graph as rank `rank` of the group `meeting`: the functional collectives meet the
    other ranks' threads and combine their tensors as the records' `group_results` do."""

    def __init__(self, gm, meeting: _Meeting, rank: int):
        super().__init__(gm)
        self.meeting, self.rank = meeting, rank

    def call_function(self, target, args, kwargs):
        if target == c10d.wait_tensor.default:
            return args[0]
        if target == c10d.broadcast.default:
            return self.meeting.exchange(self.rank, args[0])[args[1]].clone()
        if target == c10d.all_reduce.default:
            return _total(self.meeting.exchange(self.rank, args[0]))
        if target == c10d.all_gather_into_tensor.default:
            return torch.cat(self.meeting.exchange(self.rank, args[0]))
        if target == c10d.reduce_scatter_tensor.default:
            return _total(self.meeting.exchange(self.rank, args[0])).chunk(args[2])[self.rank].clone()
        assert "_c10d_functional" not in str(target), target
        return super().call_function(target, args, kwargs)


def _ranks_in_threads(run, size: int) -> list:
    results, errors = [None] * size, []

    def body(rank):
        try:
            results[rank] = run(rank)
        except BaseException as err:  # noqa: BLE001  (reported below, with the rank)
            errors.append((rank, err))

    threads = [threading.Thread(target=body, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


# (id, collective, its own arguments, input shape, input transposed): every op, every layout of blocks.
CASES = [
    ("broadcast", "broadcast", (2,), (4, 6), False),
    ("broadcast-strided", "broadcast", (1,), (4, 6), True),
    ("broadcast_start-wait", "broadcast_start", (1,), (4, 6), False),
    ("broadcast_start-strided", "broadcast_start", (2,), (4, 6), True),
    ("reduce", "reduce", (1,), (4, 6), False),
    ("reduce-strided", "reduce", (0,), (4, 6), True),
    ("all_reduce", "all_reduce", (), (4, 6), True),
    ("all_reduce_alike", "all_reduce_alike", (), (4, 6), False),
    ("keep_first", "keep_first", (), (4, 6), False),
    ("keep_first-strided", "keep_first", (), (4, 6), True),
    ("keep_first_alike", "keep_first_alike", (), (4, 6), True),
    ("all_gather-dim0", "all_gather", (GROUP_SIZE, 0, 1), (4, 6), False),
    ("all_gather-dim1", "all_gather", (GROUP_SIZE, 1, 1), (4, 6), False),
    ("all_gather-groups", "all_gather", (GROUP_SIZE, 1, 2), (2, 4, 6), True),
    ("all_gather-dim2-groups", "all_gather", (GROUP_SIZE, 2, 3), (2, 4, 6), False),
    ("all_gather_alike-groups", "all_gather_alike", (GROUP_SIZE, 1, 2), (2, 4, 6), True),
    ("reduce_scatter-dim0", "reduce_scatter", (GROUP_SIZE, 0, 1), (6, 4), False),
    ("reduce_scatter-dim1", "reduce_scatter", (GROUP_SIZE, 1, 1), (4, 6), False),
    ("reduce_scatter-groups", "reduce_scatter", (GROUP_SIZE, 1, 2), (2, 4, 6), True),
    ("reduce_scatter-dim2-groups", "reduce_scatter", (GROUP_SIZE, 2, 2), (2, 4, 12), False),
    ("shard_slice", "shard_slice", (GROUP_SIZE, 1, 1), (4, 6), False),
    ("shard_slice-groups", "shard_slice", (GROUP_SIZE, 0, 2), (4, 6), True),
    ("shard_pad", "shard_pad", (GROUP_SIZE, 1, 1), (4, 2), False),
    ("shard_pad-groups", "shard_pad", (GROUP_SIZE, 2, 2), (2, 4, 3), True),
]
# Functional collectives a lowering issues (rank-local ops: none).
ISSUES = {"broadcast": ["broadcast"], "broadcast_start": ["broadcast"], "reduce": ["all_reduce"],
          "all_reduce": ["all_reduce"], "all_gather": ["all_gather_into_tensor"],
          "reduce_scatter": ["reduce_scatter_tensor"], "keep_first": [], "shard_slice": [], "shard_pad": [],
          "all_reduce_alike": ["all_reduce"], "keep_first_alike": [], "all_gather_alike": ["all_gather_into_tensor"]}


def test_every_custom_op_has_a_lowering_and_a_case():
    """A record with a custom op lowers by its `functional`, checked below on a group of three; an identity
    (no custom op: AOTAutograd traces it away) has none."""
    with_ops = [name for name, record in COLLECTIVES.items() if record.schema is not None]
    assert all(COLLECTIVES[name].functional is not None for name in with_ops)
    assert all(record.functional is None for record in COLLECTIVES.values() if record.schema is None)
    assert sorted({case[1] for case in CASES}) == sorted(with_ops) == sorted(ISSUES)


def _tess_program(name: str, own: tuple, transposed: bool):
    """The per-rank function of one collective along "col" (on its input transposed: a strided input)."""
    op = getattr(tess, name).default

    def program(x):
        x = x.transpose(-2, -1) if transposed else x
        out = op(x, "col", *own)
        return tess.wait.default(out) if name == "broadcast_start" else out

    return program


@pytest.mark.parametrize("name, own, shape, transposed", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_lowering_is_the_records_collective(name, own, shape, transposed):
    torch.manual_seed(0)
    xs = [torch.randn(shape, dtype=torch.float64) for _ in range(GROUP_SIZE)]
    program = _tess_program(name, own, transposed)
    traced = make_fx(program, tracing_mode="fake")(xs[0])  # the custom ops' fake kernels give the shapes
    (tess_node,) = [n for n in traced.graph.nodes if str(n.target) == f"tess.{name}.default"]
    fake = tess_node.meta["val"]
    inputs = [x.transpose(-2, -1) if transposed else x for x in xs]
    expected = COLLECTIVES[name].group_results(inputs, *own)

    def rank_graph(rank):
        gm = copy.deepcopy(traced)
        groups = {axis: AxisGroup(f"{axis}-group", GROUP_SIZE, rank) for axis in AXES}
        lower_collectives(gm, groups)
        gm.graph.eliminate_dead_code()  # as inductor's post-grad passes do first
        gm.recompile()
        return gm

    graphs = [rank_graph(rank) for rank in range(GROUP_SIZE)]
    for gm in graphs:
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        assert not [t for t in targets if t.startswith("tess.")], targets
        issued = [t.split(".")[1] for t in targets if t.startswith("_c10d_functional.") and "wait" not in t]
        assert issued == ISSUES[name], targets
        assert targets.count("_c10d_functional.wait_tensor.default") >= len(issued), targets
        # Every rank's graph has the same ops, whatever its coordinate: inductor schedules them alike.
        assert targets == [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    meeting = _Meeting(GROUP_SIZE)
    results = _ranks_in_threads(lambda rank: _RankInterpreter(graphs[rank], meeting, rank).run(xs[rank]), GROUP_SIZE)
    for rank, (result, want) in enumerate(zip(results, expected)):
        assert result.shape == want.shape and torch.equal(result, want), (rank, result, want)
        assert result.stride() == fake.stride(), (rank, result.stride(), fake.stride())


def test_forward_graphs_hold_no_identity_collectives():
    """grad_sync and seed_once are identities in forward: AOTAutograd traces them away, their
    backward (all_reduce, keep_first) is in the backward graph as `tess::` ops, which are lowered."""
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    graphs = {}

    def keep(phase):
        def compiler(gm, _):
            graphs[phase] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm)
        return compiler

    function = aot_function(lambda x: collectives.seed_once(collectives.grad_sync(x, "row"), "col").sin(),
                            fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    with use_comm(inductor.TracingComm()):  # traces forward and backward
        y = function(x)
    with use_comm(collectives.ShapeComm()):  # runs the backward graph's ops (the graph is all this test reads)
        y.sum().backward()
    assert not [t for t in graphs["forward"] if t.startswith("tess.")]
    assert [t for t in graphs["backward"] if t.startswith("tess.")] == ["tess.keep_first.default",
                                                                        "tess.all_reduce.default"]


# 2. A world of one real gloo process group: CompiledRank through inductor, forward and backward.


def _program(x, w, b):
    """A rank's program with every collective (along axes of one rank, the world being one)."""
    h = tess.broadcast.default(x @ w, "col", 0)
    h = tess.all_gather.default(h, "row", 1, 1, 1)
    h = tess.reduce.default(h.t(), "depth", 0).t() + b
    h = tess.reduce_scatter.default(h.tanh(), "col", 1, 0, 1)
    h = tess.keep_first.default(h, "row")
    h = collectives.wait(tess.broadcast_start.default(h * 2, "depth", 0))
    h = tess.shard_pad.default(tess.shard_slice.default(h, "col", 1, 1, 1), "col", 1, 1, 1)
    return (tess.all_reduce.default((h * h).sum(), "row"),)


def _program_of_one():
    """`_program` as a program's graph (what `CompiledRank` reads of a `Program`)."""
    tracer = torch.fx.Tracer(autowrap_functions=(collectives.wait,))  # a graph target, as in per-rank graphs
    graph = torch.fx.GraphModule(torch.nn.Module(), tracer.trace(_program))
    return types.SimpleNamespace(graph=graph, dynamic=None)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """This process as a world of one (gloo; NCCL beside it where CUDA is), and its DistComm of mesh [1, 1, 1]."""
    if dist.is_initialized():
        pytest.skip("a process group is initialized already in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("world") / "store"), 1)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        comms = {}
        for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            device_mesh = init_device_mesh(device, (1, 1, 1), mesh_dim_names=AXES)
            comms[device] = DistComm(Mesh(1, 1), device_mesh, timedelta(seconds=60))
        yield comms
    finally:
        dist.destroy_process_group()


def _check_compiled_rank(comm: DistComm, device: str, mode: str) -> CompiledRank:
    torch.manual_seed(0)
    inputs = [torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
              for shape in [(4, 3), (3, 5), (5,)]]
    program = _program_of_one()
    with use_comm(comm):
        (expected,) = program.graph(*inputs)
    expected_grads = torch.autograd.grad(expected, inputs)
    comm.records.clear()
    compiled = CompiledRank(program, backward_comm=lambda: comm, mode=mode)
    for _ in range(2):  # the second call runs the compiled code as it is (CUDA graphs: replayed)
        (out,) = compiled(comm, inputs)
        grads = torch.autograd.grad(out, inputs)
        assert abs(out.item() - expected.item()) <= TOL * abs(expected.item())
        for grad, want in zip(grads, expected_grads):
            assert (grad - want).abs().max().item() <= TOL * want.abs().max().item()
    assert comm.records == []  # the lowered collectives do not call the communicator
    assert [(g.phase, g.lowered) for g in compiled.graphs] == [("forward", True), ("backward", True)]
    for graph in compiled.graphs:
        assert not [op for op in graph.ops if op.startswith("tess.")], graph.ops
        assert {"_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default"} <= set(graph.ops)
    forward, backward = compiled.graphs
    assert [(r.op, r.axis, r.num_bytes) for r in forward.collectives] == [
        ("broadcast", "col", 160), ("all_gather", "row", 160), ("reduce", "depth", 160),
        ("reduce_scatter", "col", 160), ("broadcast", "depth", 160), ("all_reduce", "row", 8)]
    # the adjoints, in reverse
    assert [(r.op, r.axis) for r in backward.collectives] == [
        ("all_reduce", "row"), ("reduce", "depth"), ("all_gather", "col"), ("broadcast", "depth"),
        ("reduce_scatter", "row"), ("reduce", "col")]
    return compiled


def test_compiled_rank_in_a_world_of_one(world_of_one, monkeypatch):
    monkeypatch.setitem(inductor.COMMUNICATION_PASSES, "gloo", {**inductor.OVERLAP_PASSES, **inductor.BUCKETING_PASSES})
    _check_compiled_rank(world_of_one["cpu"], "cpu", "reduce-overhead")


def test_communication_passes_by_backend(world_of_one, monkeypatch):
    """None over gloo by default (it hung with several collectives of a group in flight); as set, where set."""
    comm, inputs = world_of_one["cpu"], [torch.ones(2)]
    assert inductor.communication_passes(comm, inputs) == {}
    assert inductor.COMMUNICATION_PASSES["nccl"] == inductor.OVERLAP_PASSES
    monkeypatch.setitem(inductor.COMMUNICATION_PASSES, "gloo", inductor.BUCKETING_PASSES)
    assert inductor.communication_passes(comm, inputs) == inductor.BUCKETING_PASSES
    monkeypatch.delitem(inductor.COMMUNICATION_PASSES, "gloo")
    assert inductor.communication_passes(comm, inputs) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and NCCL need a GPU")
def test_compiled_rank_reduce_overhead_on_cuda(world_of_one):
    from torch._dynamo.utils import counters

    counters.clear()
    _check_compiled_rank(world_of_one["cuda"], "cuda", "reduce-overhead")
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


# 3. The compile modes.


def test_compile_modes():
    assert compile_mode_options(True) == compile_mode_options("default") == {}
    assert compile_mode_options("reduce-overhead") == {"triton.cudagraphs": True}
    assert compile_mode_options("reduce-overhead", threaded=True) == {"triton.cudagraphs": False}
    assert compile_mode_options("max-autotune-no-cudagraphs")["max_autotune"] is True
    assert set(COMPILE_MODES) <= set(torch._inductor.list_mode_options())
    with pytest.raises(ValueError, match=r"compile='fast' is not an inductor mode: pass compile=True .*'reduce-overhead'"):
        compile_mode_options("fast")


# Slow: 8 gloo processes, compile=True against compile=False and the unsharded model.

HIDDEN, HEADS, SEQ, BATCH = 16, 8, 4, 4


class BlockWithLoss(torch.nn.Module):
    """A GPT block and its mean squared error: the loss is the program's output."""

    def __init__(self):
        super().__init__()
        self.block = GPTBlock(HIDDEN, HEADS)

    def forward(self, x, target):
        return (self.block(x) - target).pow(2).mean()


def _case():
    torch.manual_seed(3)
    model = BlockWithLoss().double()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    target = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    return model, x, target


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.detach() - expected.detach()).abs().max().item() / max(expected.abs().max().item(), 1e-300)


def _trained(module, x, target, local) -> tuple[float, dict, dict]:
    """The loss, each parameter's gradient and its value after one SGD step, as this rank holds them
    (`local`: a parameter as its local tensor)."""
    loss = module(x, target)
    loss.backward()
    grads = {name: local(p.grad).clone() for name, p in module.named_parameters()}
    torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9).step()
    return loss.item(), grads, {name: local(p.detach()).clone() for name, p in module.named_parameters()}


def _gloo_worker(rank, world_size, q, d, mode, summa):
    torch.set_num_threads(1)
    mesh = Mesh(q, d, mode)
    model, x, target = _case()
    oracle = _trained(copy.deepcopy(model), x, target, lambda t: t)
    options = {"example_inputs": (x, target), "mode": mode, "summa": summa, "timeout": 300}
    eager = tess_compile.shard(copy.deepcopy(model), q, d, **options)
    compiled = tess_compile.shard(copy.deepcopy(model), q, d, compile=True, **options)
    eager_run = _trained(eager, x, target, lambda t: t.to_local())
    compiled_run = _trained(compiled, x, target, lambda t: t.to_local())
    slots = {slot.name: slot for slot in compiled.program.params}

    def errors(run, reference, block):
        out = {"loss": abs(run[0] - reference[0]) / abs(reference[0])}
        for kind, index in (("grad", 1), ("weight", 2)):
            for name, value in run[index].items():
                out[f"{kind} {name}"] = _rel_err(value, block(name, reference[index][name]))
        return out

    to_block = lambda name, full: local_block(full, slots[name].layout, mesh, rank)
    (rank_program,) = compiled._compiled.values()
    graphs = {g.phase: g for g in rank_program.graphs}
    counts = {phase: {} for phase in graphs}
    for phase, graph in graphs.items():
        for record in graph.collectives:
            counts[phase][(record.op, record.axis)] = counts[phase].get((record.op, record.axis), 0) + 1
    return {
        "vs oracle": errors(compiled_run, oracle, to_block),
        "vs eager": errors(compiled_run, eager_run, lambda name, value: value),
        "eager vs oracle": errors(eager_run, oracle, to_block),
        "graphs": {phase: (g.lowered, sorted({op for op in g.ops if op.startswith(("tess.", "_c10d_functional."))}))
                   for phase, g in graphs.items()},
        "compiled counts": counts,
        "eager counts": {phase: eager.comm.counts(phase) for phase in ("forward", "backward")},
        "compiled records": len(compiled.comm.records),
    }


@pytest.mark.slow  # SUMMA's overlap schedule's records: each lowered against its group result in the fast tier
@pytest.mark.parametrize("q, d, mode, summa", [(2, 2, "2.5d", "gather"), (2, 2, "1d", "auto")],
                         ids=["q2d2-gather", "1d-p8"])
def test_gloo_lowered_parity(q, d, mode, summa):
    results = run_local(_gloo_worker, Mesh(q, d, mode).num_ranks, args=(q, d, mode, summa), timeout_s=1200,
                        collective_timeout_s=600)
    for rank, result in enumerate(results):
        for name in ("vs oracle", "vs eager", "eager vs oracle"):
            assert max(result[name].values()) <= TOL, (rank, name, result[name])
        for phase, (lowered, ops) in result["graphs"].items():
            assert lowered and ops and not [op for op in ops if op.startswith("tess.")], (rank, phase, ops)
        assert result["compiled counts"] == result["eager counts"], rank
        assert result["compiled records"] == 0  # the communicator carried none of them
        assert result["compiled counts"] == results[0]["compiled counts"]


def _dynamic_worker(rank, world_size):
    """A dynamic program (one compile for every batch and length of 2 or more) lowered on [2, 2, 1]: the
    largest error of outputs and gradients over a few sizes, the compiles, and what the graphs hold."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(32, 16, 4, 1, 24).double()
    sharded = tess_compile.shard(copy.deepcopy(model), 2, 1, example_inputs=(torch.randint(0, 32, (4, 12)),),
                                 dynamic=True, compile=True, timeout=300)
    worst = 0.0
    for batch, length in ((4, 12), (4, 7), (8, 5)):
        torch.manual_seed(length)
        ids = torch.randint(0, 32, (batch, length))
        expected, actual = model(ids), sharded(ids)
        expected.square().sum().backward()
        actual.square().sum().backward()
        pairs = [(actual.full_tensor(), expected)]
        grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
        pairs += [(grads[name], p.grad) for name, p in model.named_parameters()]
        worst = max(worst, *(_rel_err(a, e) for a, e in pairs))
        model.zero_grad()
        sharded.zero_grad()
    (compiled,) = sharded._compiled.values()
    return worst, compiled.compiles(), [(g.lowered, any(op.startswith("tess.") for op in g.ops)) for g in compiled.graphs]


@pytest.mark.slow
def test_gloo_lowered_dynamic():
    for worst, compiles, graphs in run_local(_dynamic_worker, 4, timeout_s=900, collective_timeout_s=300):
        assert worst <= TOL and compiles == 1
        assert graphs == [(True, False), (True, False)]
