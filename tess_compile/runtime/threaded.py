"""Compiled per-rank programs of every rank in one process, each rank in its own thread.

With `simulate(..., compile=True)` the simulator runs the very program the
distributed runtime compiles (`tess_compile.runtime.inductor`: one inductor
compile, forward and backward, shared by all ranks): each rank calls it in its
own thread, and its collectives meet the other threads of their group
(`ThreadComm`), which combine the group's tensors as the simulator does (each
collective's `group_results` in `tess_compile.core.collective_table`), so the
results are those of the eager simulator. Backward runs every rank's
compiled backward in its thread likewise. Lockstep execution cannot run a
compiled graph (its collectives are inside the compiled code), and compiling
the local kernels between collectives one piece at a time would compile
dozens of pieces.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.autograd.function import BackwardCFunction

from tess_compile.core.collective_table import COLLECTIVES
from tess_compile.core.mesh import Mesh
from tess_compile.ops.collectives import Comm, use_comm

__all__ = ["ThreadComm", "grad_in_thread", "run_compiled"]


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
    threads meet and combine their tensors as the simulator does (`Collective.group_results`). Rank 0 records
    into `shared`."""

    def __init__(self, mesh: Mesh, rank: int, meetings: dict, shared: Comm):
        super().__init__()
        self.mesh, self.rank, self.meetings, self.shared = mesh, rank, meetings, shared

    def run(self, op: str, x: torch.Tensor, axis: str, *args) -> torch.Tensor:
        if self.rank == 0:
            self.shared.record(op, axis, x)
        group = self.mesh.group(self.rank, axis)
        meeting = self.meetings[(axis, tuple(group))]
        combine = COLLECTIVES[op].group_results  # broadcast_start arrives at once
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
            # Outside the engine's call AOTAutograd takes a backward for one that keeps the graph, which a
            # backward compiled to reuse saved buffers refuses: it was compiled without them
            # (`CompiledRank(threaded=True)`), and the check reads this (thread-local) flag.
            with use_comm(self.comms[r], phase="backward"), torch._functorch.config.patch(donated_buffer=False):
                found = grad_in_thread([o for o, _ in pairs], [inputs[n] for n in wanted], [g for _, g in pairs])
            return dict(zip(wanted, found))

        out: list = [None] * len(inputs)
        for found in _in_threads(rank_backward, len(self.comms), self.meetings):
            for index, grad in found.items():
                out[index] = grad
        return out


def grad_in_thread(roots: list, inputs: list, grads: list) -> list:
    """`torch.autograd.grad(roots, inputs, grads, allow_unused=True)`, every node of the graph
    between them applied in the calling thread, in topological order.

    The ranks' backwards must run at once, each in its own thread, for their collectives to
    meet. The autograd engine runs every node of a CUDA device on that device's one worker
    thread, so ranks that wait for each other there never finish (the engine's own calls
    from the ranks' threads hung on CUDA). The per-rank graph is a compiled function over
    leaf inputs, so few nodes are walked; none of them carries hooks."""
    wanted = {id(x): n for n, x in enumerate(inputs)}
    found: list = [None] * len(inputs)
    pending: dict = {}  # node -> {output number: summed gradient}
    order = _topological([r.grad_fn for r in roots if r.grad_fn is not None])
    for root, grad in zip(roots, grads):
        if root.grad_fn is None:
            _accumulate(found, wanted.get(id(root)), grad)
        else:
            _add(pending.setdefault(root.grad_fn, {}), root.output_nr, grad)
    with torch.no_grad():
        for node in order:
            received = pending.pop(node, {})
            arity = len(node._input_metadata)
            for (after, number), grad in _apply(node, [received.get(k) for k in range(arity)]):
                if grad is None:
                    continue
                if type(after).__name__ == "AccumulateGrad":
                    _accumulate(found, wanted.get(id(after.variable)), grad)
                else:
                    _add(pending.setdefault(after, {}), number, grad)
    return found


def _topological(starts: list) -> list:
    """The nodes reachable from `starts` (leaves' AccumulateGrad left out), each after every node that feeds it."""
    seen, order = set(), []

    def visit(node):
        if node is None or node in seen or type(node).__name__ == "AccumulateGrad":
            return
        seen.add(node)
        for after, _ in node.next_functions:
            visit(after)
        order.append(node)

    for node in starts:
        visit(node)
    return order[::-1]


def _apply(node, grads: list) -> list:
    """(edge, gradient) for each input of `node` that requires grad. A Python function's backward
    runs through its `apply` (which takes None for a gradient that did not arrive) and returns one
    gradient per argument of its forward, where only tensors have edges: those that required grad
    are the ones `needs_input_grad` marks, in order. A built-in node is called with zeros for the
    gradients that did not arrive and returns one per edge."""
    if isinstance(node, BackwardCFunction):
        outs = _as_tuple(node.apply(*grads))
        outs = [g for g, needed in zip(outs, node.needs_input_grad) if needed]
    else:
        outs = _as_tuple(node(*[g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                                for g, m in zip(grads, node._input_metadata)]))
        outs = [g for g, (after, _) in zip(outs, node.next_functions) if after is not None]
    return list(zip([edge for edge in node.next_functions if edge[0] is not None], outs, strict=True))


def _as_tuple(outs) -> tuple:
    return outs if isinstance(outs, tuple) else (outs,)


def _add(slots: dict, number: int, grad) -> None:
    if grad is not None:
        slots[number] = grad if number not in slots else slots[number] + grad


def _accumulate(found: list, index, grad) -> None:
    if index is not None and grad is not None:
        found[index] = grad if found[index] is None else found[index] + grad


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


def run_compiled(compiled, shared: Comm, rank_inputs: list[list]) -> list[list]:
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
