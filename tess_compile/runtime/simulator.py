"""The in-process simulator: all p ranks of a per-rank graph in one process.

The graph runs in lockstep, node by node, on a list of p local values.
Local ops run once per rank; collectives combine the list exactly. Each
collective is one autograd node over all ranks: its result is its record's
`group_results` and its backward its `adjoint`, from
`tess_compile.core.collective_table`, the same table the distributed runtime
uses, so a backward through the simulator checks those formulas.

With `compile=True` the simulator runs the very program the distributed
runtime compiles, each rank in its own thread (`tess_compile.runtime.threaded`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from tess_compile.core.autocast import without_autocast
from tess_compile.core.collective_table import COLLECTIVES
from tess_compile.core.layout import assemble
from tess_compile.core.mesh import Mesh
from tess_compile.core.program import Program
from tess_compile.ops.collectives import COLLECTIVE_NAMES, COLLECTIVE_OPS, Comm, current_comm, use_comm
from tess_compile.ops.dropout import LOCKSTEP as RANDOM_LOCKSTEP
from tess_compile.ops.context_attention import context_attention, lockstep_context_attention
from tess_compile.ops.fetched_product import fetched_product, lockstep_product
from tess_compile.ops.ring_attention import lockstep_ring_attention, ring_attention
from tess_compile.ops.grad_bucket import grad_bucket, lockstep_bucket
from tess_compile.ops.recompute_region import checkpointed
from tess_compile.ops.split_norm import lockstep_norm, split_norm
from tess_compile.runtime import state
from tess_compile.runtime.programs_by_mode import ModeModule, ProgramsByMode
from tess_compile.runtime.threaded import run_compiled

__all__ = ["SimComm", "SimulatedModule", "run_lockstep"]


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
            for index, value in enumerate(COLLECTIVES[op].group_results(members, *args)):
                out[group[index]] = value
        return out


class _Collective(torch.autograd.Function):
    """One collective over all ranks; its backward is the adjoint collective."""

    @staticmethod
    def forward(ctx, comm: SimComm, op: str, args: tuple, *xs):
        ctx.comm, ctx.op, ctx.args = comm, op, args
        return tuple(comm.run_all(op, list(xs), *args))

    @staticmethod
    def backward(ctx, *grads):
        with use_comm(ctx.comm, phase="backward"):
            out = ctx.comm.run_all(COLLECTIVES[ctx.op].adjoint, [g.contiguous() for g in grads], *ctx.args)
        return (None, None, None, *out)


# Graph targets that communicate in backward, or draw random numbers once for all ranks,
# by their versions over every rank's tensors.
_LOCKSTEP = {fetched_product: lockstep_product, split_norm: lockstep_norm, grad_bucket: lockstep_bucket,
             context_attention: lockstep_context_attention, ring_attention: lockstep_ring_attention,
             **RANDOM_LOCKSTEP}


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
            env[node] = list(_Collective.apply(comm, COLLECTIVE_NAMES[node.target], tuple(node.args[1:]), *xs))
        elif node.op == "call_function" and node.target in _LOCKSTEP:
            env[node] = _LOCKSTEP[node.target](comm, *map_arg(node.args, lambda n: _lockstep_arg(env[n])))
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


def _lockstep_arg(values: list):
    """An argument of a lockstep op (`_LOCKSTEP`): every rank's tensor, or the one size that every
    rank computed alike (a dynamic program's global shape)."""
    if not isinstance(values[0], int):
        return values
    if any(v != values[0] for v in values):
        raise AssertionError(f"a size argument of a lockstep op differs between ranks: {values}")
    return values[0]


def _run_region(region: GraphModule, comm: SimComm, inputs: list[list]) -> list:
    """A recompute region of every rank, checkpointed as one (`tess_compile.ops.recompute_region`)."""
    num_ranks, num_inputs = comm.mesh.num_ranks, len(inputs)

    def run(*flat):
        rank_inputs = [[flat[i * num_ranks + r] for i in range(num_inputs)] for r in range(num_ranks)]
        outs = run_lockstep(region, comm, rank_inputs)
        return tuple(outs[r][k] for k in range(len(outs[0])) for r in range(num_ranks))

    flat_out = checkpointed(run, *(x for values in inputs for x in values))
    num_outputs = len(flat_out) // num_ranks
    return [tuple(flat_out[k * num_ranks + r] for k in range(num_outputs)) for r in range(num_ranks)]


class SimulatedModule(ModeModule):
    """Every rank of a compiled model in this process; global inputs in, global outputs out.

    `parameters()` yields every rank's shards, so an optimizer steps them all.
    Of a model built on the meta device the shards are uninitialised, on the
    default device, until a checkpoint is loaded (`tess_compile.training.shard_loading`).
    It starts in the model's mode; after `train()` / `eval()` it runs the
    program of that mode, compiled by `recompile(training)` on first use
    (`tess_compile.runtime.programs_by_mode`). `compile=True` runs the program through
    inductor, each rank in its own thread (see the module docstring).
    """

    def __init__(self, program: Program, recompile=None, compile: bool = False):
        super().__init__(ProgramsByMode(program, recompile), compile)
        self.device = torch.get_default_device()
        self.comm = SimComm(program.mesh)
        self.ranks = nn.ModuleList([state.add_local_tensors(nn.Module(), program, r) for r in range(program.mesh.num_ranks)])
        self.train(program.training)

    def forward(self, *args, **kwargs):
        flat = self.program.flatten_inputs(args, kwargs)
        shapes = self.program.call_output_shapes(flat)
        rank_inputs = [state.graph_inputs(self.program, module, flat) for module in self.ranks]
        outs = self._run(self.program, rank_inputs)
        return pytree.tree_unflatten(state.global_outputs(self.program, outs, shapes), self.program.out_spec)

    def rank_modules(self) -> dict[int, nn.Module]:
        """Every rank's module of shards."""
        return dict(enumerate(self.ranks))

    def run_program(self, program: Program, rank_flats: dict[int, list]) -> dict[int, list]:
        """Run `program` (one `adopt` readied for these shards) on each rank's flat inputs (a local
        input: that rank's block); each rank's outputs as the per-rank graph gives them."""
        rank_inputs = [state.graph_inputs(program, module, rank_flats[r]) for r, module in enumerate(self.ranks)]
        return dict(enumerate(self._run(program, rank_inputs)))

    def _run(self, program: Program, rank_inputs: list[list]) -> list[list]:
        """Every rank's outputs of `program` on its graph inputs: in lockstep, or through inductor with
        `compile` (each rank in a thread)."""
        with without_autocast(program.autocast):  # the program holds autocast's casts
            if self.compile:
                return run_compiled(self.compiled_program(current_comm, program, threaded=True), self.comm,
                                    rank_inputs)
            with use_comm(self.comm):
                return run_lockstep(program.runnable, self.comm, rank_inputs)

    def global_output(self, program: Program, index: int, rank_values: dict[int, torch.Tensor], shape) -> torch.Tensor:
        """Output `index` of `program` as a global tensor of `shape`, from every rank's value."""
        return state.global_output(program, index, [rank_values[r] for r in range(self.mesh.num_ranks)], shape)

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
