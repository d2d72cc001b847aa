"""The in-process simulator: all p ranks of a per-rank graph in one process.

The graph runs in lockstep, node by node, on a list of p local values.
Local ops run once per rank; collectives combine the list exactly. Each
collective is one autograd node over all ranks whose backward is its
adjoint from `collectives.ADJOINT`, the same table the distributed runtime
uses, so a backward through the simulator checks those formulas.

With `compile=True` the simulator runs the very program the distributed
runtime compiles (`tess_compile.compiled`: one inductor compile, forward and
backward, shared by all ranks): each rank calls it in its own thread, and
its collectives meet the other threads of their group (`ThreadComm`), which
combine the group's tensors with the lockstep functions above, so the
results are those of the eager simulator. Backward runs every rank's
compiled backward in its thread likewise. Lockstep execution cannot run a
compiled graph (its collectives are inside the compiled code), and
compiling the local kernels between collectives one piece at a time would
compile dozens of pieces.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.fx import GraphModule
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from tess_compile import state
from tess_compile.collectives import ADJOINT, ASYNC_OF, COLLECTIVE_OPS, Comm, current_comm, use_comm
from tess_compile.compiler import Program
from tess_compile.grad_buckets import grad_bucket, lockstep_bucket
from tess_compile.layout import assemble, put_blocks, take_block
from tess_compile.mesh import Mesh
from tess_compile.norms import lockstep_norm, split_norm
from tess_compile.products import fetched_product, lockstep_product
from tess_compile.regions import checkpointed
from tess_compile.train_eval import ProgramsByMode

__all__ = ["SimComm", "SimulatedModule", "ThreadComm", "run_lockstep"]


class SimComm(Comm):
    """Collectives over the list of every rank's tensor."""

    def __init__(self, mesh: Mesh):
        super().__init__()
        self.mesh = mesh
        self._groups = {axis: mesh.groups(axis) for axis in ("depth", "row", "col")}

    def run_all(self, op: str, xs: list[torch.Tensor], axis: str, *args) -> list[torch.Tensor]:
        self.record(op, axis, xs[0])
        out: list = [None] * len(xs)
        for group in self._groups[axis]:
            members = [xs[r] for r in group]
            for index, value in enumerate(getattr(self, "_" + op)(members, *args)):
                out[group[index]] = value
        return out

    # Each takes one group's tensors (by coordinate) and returns theirs.

    @staticmethod
    def _broadcast(xs, src):
        return [xs[src].clone() for _ in xs]

    @staticmethod
    def _reduce(xs, dst):
        total = functools.reduce(torch.add, xs)
        return [total if t == dst else torch.zeros_like(x) for t, x in enumerate(xs)]

    @staticmethod
    def _all_reduce(xs):
        total = functools.reduce(torch.add, xs)
        return [total.clone() for _ in xs]

    @staticmethod
    def _keep_first(xs):
        return [x.clone() if t == 0 else torch.zeros_like(x) for t, x in enumerate(xs)]

    @staticmethod
    def _all_gather(xs, parts, dim, groups):
        full = put_blocks(xs, dim, groups)
        return [full.clone() for _ in xs]

    @staticmethod
    def _reduce_scatter(xs, parts, dim, groups):
        total = functools.reduce(torch.add, xs)
        return [take_block(total, dim, groups, parts, t).contiguous() for t in range(parts)]

    @staticmethod
    def _shard_slice(xs, parts, dim, groups):
        return [take_block(x, dim, groups, parts, t).contiguous() for t, x in enumerate(xs)]

    @staticmethod
    def _shard_pad(xs, parts, dim, groups):
        return [put_blocks([x if s == t else torch.zeros_like(x) for s in range(parts)], dim, groups) for t, x in enumerate(xs)]

    @staticmethod
    def _grad_sync(xs):
        return [x.view_as(x) for x in xs]

    _seed_once = _grad_sync


class _Collective(torch.autograd.Function):
    """One collective over all ranks; its backward is the adjoint collective."""

    @staticmethod
    def forward(ctx, comm: SimComm, op: str, args: tuple, *xs):
        ctx.comm, ctx.op, ctx.args = comm, op, args
        return tuple(comm.run_all(op, list(xs), *args))

    @staticmethod
    def backward(ctx, *grads):
        with use_comm(ctx.comm, phase="backward"):
            out = ctx.comm.run_all(ADJOINT[ctx.op], [g.contiguous() for g in grads], *ctx.args)
        return (None, None, None, *out)


# Graph targets that communicate in backward, by their versions over every rank's tensors.
_LOCKSTEP = {fetched_product: lockstep_product, split_norm: lockstep_norm, grad_bucket: lockstep_bucket}


def run_lockstep(graph: GraphModule, comm: SimComm, rank_inputs: list[list]) -> list:
    """Run the per-rank `graph` for every rank at once; return each rank's outputs."""
    num_ranks = comm.mesh.num_ranks
    env: dict = {}
    placeholders = iter(range(len(rank_inputs[0])))
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            index = next(placeholders)
            env[node] = [rank_inputs[r][index] for r in range(num_ranks)]
        elif node.op == "call_function" and node.target in COLLECTIVE_OPS:
            xs = env[node.args[0]]
            env[node] = list(_Collective.apply(comm, COLLECTIVE_OPS[node.target], tuple(node.args[1:]), *xs))
        elif node.op == "call_function" and node.target in _LOCKSTEP:
            env[node] = _LOCKSTEP[node.target](comm, *map_arg(node.args, lambda n: env[n]))
        elif node.op == "call_module":
            region = graph.get_submodule(node.target)
            env[node] = _run_region(region.graph_module, comm, [env[n] for n in node.args])
        elif node.op == "call_function":
            env[node] = [
                node.target(*map_arg(node.args, lambda n: env[n][r]), **map_arg(node.kwargs, lambda n: env[n][r]))
                for r in range(num_ranks)
            ]
        elif node.op == "output":
            return [map_arg(node.args[0], lambda n: env[n][r]) for r in range(num_ranks)]
    raise AssertionError("graph has no output")


def _run_region(region: GraphModule, comm: SimComm, inputs: list[list]) -> list:
    """A recompute region of every rank, checkpointed as one (`tess_compile.regions`)."""
    num_ranks, num_inputs = comm.mesh.num_ranks, len(inputs)

    def run(*flat):
        rank_inputs = [[flat[i * num_ranks + r] for i in range(num_inputs)] for r in range(num_ranks)]
        outs = run_lockstep(region, comm, rank_inputs)
        return tuple(outs[r][k] for k in range(len(outs[0])) for r in range(num_ranks))

    flat_out = checkpointed(run, *(x for values in inputs for x in values))
    num_outputs = len(flat_out) // num_ranks
    return [tuple(flat_out[k * num_ranks + r] for k in range(num_outputs)) for r in range(num_ranks)]


class _Meeting:
    """Where the threads of one group meet for each collective; every member issues the
    group's collectives in the same order, so one slot serves them one after another."""

    def __init__(self, size: int, timeout: float):
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.values: list = [None] * size
        self.results: list = []

    def exchange(self, index: int, x: torch.Tensor, combine) -> torch.Tensor:
        self.values[index] = x
        if self.barrier.wait() == 0:
            self.results = combine(list(self.values))
        self.barrier.wait()
        out = self.results[index]
        self.barrier.wait()  # everyone has read before the slot is used again
        return out


class ThreadComm(Comm):
    """The collectives of one rank whose program runs in its own thread: the group's
    threads meet and combine their tensors as `SimComm` does. Rank 0 records into `shared`."""

    def __init__(self, mesh: Mesh, rank: int, meetings: dict, shared: Comm):
        super().__init__()
        self.mesh, self.rank, self.meetings, self.shared = mesh, rank, meetings, shared

    def run(self, op: str, x: torch.Tensor, axis: str, *args) -> torch.Tensor:
        if self.rank == 0:
            self.shared.record(op, axis, x)
        group = self.mesh.group(self.rank, axis)
        meeting = self.meetings[(axis, tuple(group))]
        combine = getattr(SimComm, "_" + ASYNC_OF.get(op, op))  # broadcast_start arrives at once
        out = meeting.exchange(group.index(self.rank), x.contiguous(), lambda xs: combine(xs, *args))
        return out.clone()  # the ops' own blocks may be views of x, which a custom op may not return


def _in_threads(work, num_ranks: int, meetings: dict) -> list:
    """`work(r)` for every rank r, each in its own thread. A failure breaks the others'
    meetings and is raised (the first that is not a broken meeting)."""

    def guarded(rank):
        try:
            return work(rank)
        except BaseException:
            for meeting in meetings.values():
                meeting.barrier.abort()
            raise

    with ThreadPoolExecutor(max_workers=num_ranks) as pool:
        futures = [pool.submit(guarded, r) for r in range(num_ranks)]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return [f.result() for f in futures]


class _ThreadedRun:
    """One call of a `CompiledRank` on every rank, each in its own thread, and its backward."""

    def __init__(self, compiled, mesh: Mesh, shared: Comm, timeout: float = 600.0):
        self.compiled = compiled
        self.meetings = {(axis, tuple(group)): _Meeting(len(group), timeout)
                         for axis in ("depth", "row", "col") for group in mesh.groups(axis)}
        self.comms = [ThreadComm(mesh, r, self.meetings, shared) for r in range(mesh.num_ranks)]
        self.in_slots: list[tuple[int, int]] = []
        self.out_slots: list[tuple[int, int]] = []

    def forward(self, rank_inputs: list[list]) -> list[list]:
        """Each rank's outputs, under the caller's grad mode."""
        grad = torch.is_grad_enabled()
        function = self.compiled.compiled_for(rank_inputs[0])

        def rank_forward(r):
            with torch.set_grad_enabled(grad), use_comm(self.comms[r]):
                return list(function(*rank_inputs[r]))

        return _in_threads(rank_forward, len(self.comms), self.meetings)

    def backward(self, inputs: list, outputs: list, grads) -> list:
        """Gradients of the flat `inputs` (the tensors at `in_slots`) from those of `outputs`."""

        def rank_backward(r):
            pairs = [(out, g) for (s, _), out, g in zip(self.out_slots, outputs, grads) if s == r and out.requires_grad]
            wanted = [n for n, ((s, _), x) in enumerate(zip(self.in_slots, inputs)) if s == r and x.requires_grad]
            if not pairs or not wanted:
                return {}
            with use_comm(self.comms[r], phase="backward"):
                found = torch.autograd.grad([o for o, _ in pairs], [inputs[n] for n in wanted], [g for _, g in pairs],
                                            allow_unused=True)
            return dict(zip(wanted, found))

        out: list = [None] * len(inputs)
        for found in _in_threads(rank_backward, len(self.comms), self.meetings):
            for index, grad in found.items():
                out[index] = grad
        return out


class _CompiledRanks(torch.autograd.Function):
    """A `_ThreadedRun` as one autograd node: inputs and outputs are the flat tensors of
    all ranks' (its `in_slots`, `out_slots`)."""

    @staticmethod
    def forward(ctx, run: _ThreadedRun, rank_inputs: list[list], *tensors):
        ctx.run = run
        ctx.inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        inputs = [list(values) for values in rank_inputs]
        for (r, i), value in zip(run.in_slots, ctx.inputs):
            inputs[r][i] = value
        with torch.enable_grad():
            outs = run.forward(inputs)
        run.out_slots = [(r, k) for r, values in enumerate(outs) for k, v in enumerate(values) if isinstance(v, torch.Tensor)]
        ctx.outputs = [outs[r][k] for r, k in run.out_slots]
        run.outputs = outs
        return tuple(out.detach() for out in ctx.outputs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.run.backward(ctx.inputs, ctx.outputs, grads))


def run_compiled(compiled, shared: SimComm, rank_inputs: list[list]) -> list[list]:
    """Each rank's outputs of the `CompiledRank` `compiled`, every rank in its own thread,
    differentiable through all of them; `shared` records the collectives."""
    run = _ThreadedRun(compiled, shared.mesh, shared)
    if not torch.is_grad_enabled():
        return run.forward(rank_inputs)
    run.in_slots = [(r, i) for r, values in enumerate(rank_inputs) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    flat = _CompiledRanks.apply(run, rank_inputs, *(rank_inputs[r][i] for r, i in run.in_slots))
    outs = [list(values) for values in run.outputs]
    for (r, k), value in zip(run.out_slots, flat):
        outs[r][k] = value
    return outs


class SimulatedModule(nn.Module):
    """Every rank of a compiled model in this process; global inputs in, global outputs out.

    `parameters()` yields every rank's shards, so an optimizer steps them all.
    Of a model built on the meta device the shards are uninitialised, on the
    default device, until a checkpoint is loaded (`tess_compile.checkpoint`).
    It starts in the model's mode; after `train()` / `eval()` it runs the
    program of that mode, compiled by `recompile(training)` on first use
    (`tess_compile.train_eval`). `compile=True` runs the program through
    inductor, each rank in its own thread (see the module docstring).
    """

    def __init__(self, program: Program, recompile=None, compile: bool = False):
        super().__init__()
        self.compile = compile
        self._compiled: dict[int, object] = {}  # id(program) -> its CompiledRank
        device = torch.get_default_device()
        program = state.off_meta(program, device)
        self.programs = ProgramsByMode(program, recompile, lambda other: state.off_meta(other, device))
        self.training = program.training  # `program` is this mode's until train() / eval()
        self.comm = SimComm(program.mesh)
        self.ranks = nn.ModuleList([state.add_local_tensors(nn.Module(), program, r) for r in range(program.mesh.num_ranks)])
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
        rank_inputs = [state.graph_inputs(self.program, module, flat) for module in self.ranks]
        if self.compile:
            outs = run_compiled(self._compiled_program(), self.comm, rank_inputs)
        else:
            with use_comm(self.comm):
                outs = run_lockstep(self.program.runnable, self.comm, rank_inputs)
        flat_out = [
            assemble([outs[r][i] for r in range(len(outs))], layout, self.mesh) if layout is not None else outs[0][i]
            for i, layout in enumerate(self.program.output_layouts)
        ]
        return pytree.tree_unflatten(flat_out, self.program.out_spec)

    def _compiled_program(self):
        from tess_compile.compiled import CompiledRank  # imports inductor: only when asked for

        program = self.program
        if id(program) not in self._compiled:
            self._compiled[id(program)] = CompiledRank(program, backward_comm=current_comm)
        return self._compiled[id(program)]

    def _gather(self, slot, grad: bool = False) -> torch.Tensor | None:
        tensors = [state.get_tensor(module, slot) for module in self.ranks]
        if grad:
            tensors = [t.grad for t in tensors]
            if any(t is None for t in tensors):
                return None
        return assemble([t.detach() for t in tensors], slot.layout, self.mesh).clone()

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Each parameter's gradient as a full tensor, keyed like `model.named_parameters()`."""
        return {s.name: self._gather(s, grad=True) for s in self.program.params}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict, as the unsharded model would give it."""
        return state.full_tensors(self.program, self._gather)

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict; every rank takes its blocks."""
        state.load_shards(self.program, dict(enumerate(self.ranks)), state_dict)

    def rank_tensor(self, name: str, rank: int) -> torch.Tensor:
        """The local shard of parameter or buffer `name` on `rank`."""
        slot = next(s for s in self.program.slots if s.name == name)
        return state.get_tensor(self.ranks[rank], slot)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
    ) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` of the unsharded model, exactly; returns the total norm.

        The norm is taken over the full gradients (`full_grads()`), each
        parameter once, and every rank's local gradient is scaled by the same
        coefficient `min(1, max_norm / (total + 1e-6))`, as torch does.
        `norm_type` may be `inf`. Use this method, not
        `torch.nn.utils.clip_grad_norm_(sim.parameters(), ...)`: `parameters()`
        yields every rank's shards, replicas included, so torch's function would
        count a replicated block once per replica and sum shards as if they
        were separate tensors.
        """
        grads = [grad for grad in self.full_grads().values() if grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(self.parameters(), max_norm, total, foreach)
        return total
