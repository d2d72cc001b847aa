"""Collectives of the per-rank graph: custom ops, their adjoints, the communicator.

Layer: ops. Every op names the mesh axis it spans. The ops are defined from
their records in `tess_compile.core.collective_table.COLLECTIVES` (schema,
fake kernel, adjoint); the per-rank graph calls them, and a communicator
(`Comm`) does the work: `DistComm` over torch.distributed, or the simulator
over all ranks at once.

Gradients are exact adjoints (see docs/gradients.md): each op's backward is
the op its record names as `adjoint`. `broadcast_start` is a broadcast that a
communicator may leave running until `wait` is called on its output
(double-buffered SUMMA steps); the simulator and the accounting treat it as a
broadcast (its `counts_as`). Three ops are the identity in forward and exist for
their backward: `grad_sync` (all-reduce of a replicated parameter's gradient
over its replica axis), `seed_once` (a replicated output seeds its gradient
from the replica at coordinate 0 only, so a loss held by every rank counts
once) and `sum_shares` (all-reduce of an activation's gradient shares into the
whole gradient, where a region of values holds whole gradients:
`passes/alike_regions.py`); `identity` is the identity both ways, the adjoint
of the `*_alike` ops, which pass the whole gradient on.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch._C._functorch import unwrap_if_dead

from tess_compile.core.collective_table import COLLECTIVES

__all__ = [
    "ADJOINT",
    "COLLECTIVE_NAMES",
    "COLLECTIVE_OPS",
    "COMMUNICATING",
    "EAGER_TARGETS",
    "Comm",
    "CommRecord",
    "ShapeComm",
    "active_comm",
    "all_gather",
    "all_gather_alike",
    "all_reduce",
    "all_reduce_alike",
    "broadcast",
    "broadcast_start",
    "current_comm",
    "current_phase",
    "grad_sync",
    "identity",
    "keep_first",
    "keep_first_alike",
    "output_like",
    "reduce",
    "reduce_scatter",
    "seed_once",
    "shard_pad",
    "shard_slice",
    "sum_shares",
    "use_comm",
    "wait",
]

# Views of `COLLECTIVES` for callers that want one field of every op (docs/gradients.md shows ADJOINT).
# op name -> the op that is its adjoint, taking the same trailing arguments.
ADJOINT = {name: record.adjoint for name, record in COLLECTIVES.items()}


# Ops that send bytes between ranks, each counted as itself (the others are rank-local).
COMMUNICATING = tuple(name for name, record in COLLECTIVES.items() if record.sends and record.counts_as == name)


class CommRecord(NamedTuple):
    """One collective as one rank saw it (a named tuple: one is made per collective called)."""

    op: str
    axis: str
    num_bytes: int
    phase: str


@dataclass
class Comm:
    """Base of the communicators: the record of what was sent.

    `records` lists a `CommRecord` per collective, oldest first: clear it, run a
    step, read the step's collectives. It is bounded, so that a long run does not
    grow it: at `max_records` (2**17, many steps of a large model) the oldest
    records are dropped down to three quarters of it, so at least the last
    `3 * max_records // 4` remain.
    """

    records: list[CommRecord] = field(default_factory=list)
    max_records: int = 1 << 17

    def record(self, op: str, axis: str, x: torch.Tensor, phase: str | None = None) -> None:
        """`op` on `x` along `axis` in `phase` (the running one where None), where it sends bytes."""
        collective = COLLECTIVES[op]
        if collective.sends:
            self._append(collective.counts_as, axis, x, current_phase() if phase is None else phase)

    def _append(self, op: str, axis: str, x: torch.Tensor, phase: str) -> None:
        """The record of `op` (the op it counts as) on `x` along `axis` in `phase`."""
        records = self.records
        if len(records) >= self.max_records:
            del records[: len(records) - 3 * self.max_records // 4]
        records.append(CommRecord(op, axis, x.numel() * x.element_size(), phase))

    def counts(self, phase: str | None = None) -> dict[tuple[str, str], int]:
        """Number of collectives per (op, axis), in one phase or all."""
        out: dict[tuple[str, str], int] = {}
        for rec in self.records:
            if phase is None or rec.phase == phase:
                out[(rec.op, rec.axis)] = out.get((rec.op, rec.axis), 0) + 1
        return out

    def run(self, op: str, x: torch.Tensor, *args):
        raise NotImplementedError

    def plan(self, op: str, axis: str, *args):
        """`op` along `axis` with its own arguments as one call, `call(x, phase)`: `run` in `phase`.
        A communicator that can make a collective's work once (`DistComm`) makes it here."""

        def call(x: torch.Tensor, phase: str) -> torch.Tensor:
            token = _PHASE.set(phase)
            try:
                return self.run(op, x, axis, *args)
            finally:
                _PHASE.reset(token)

        return call

    def run_all(self, op: str, xs: list[torch.Tensor], axis: str, *args) -> list[torch.Tensor]:
        """`op` on the tensors of every rank this communicator speaks for (here one)."""
        (x,) = xs
        return [self.run(op, x, axis, *args)]

    def wait(self, x: torch.Tensor) -> torch.Tensor:
        """`x` once the asynchronous collective that fills it is done (none here)."""
        return x


_COMM: contextvars.ContextVar[Comm | None] = contextvars.ContextVar("tess_comm", default=None)


_PHASE: contextvars.ContextVar[str] = contextvars.ContextVar("tess_phase", default="forward")


@contextlib.contextmanager
def use_comm(comm: Comm, phase: str = "forward"):
    """Make `comm` carry the collectives called in this block."""
    comm_token, phase_token = _COMM.set(comm), _PHASE.set(phase)
    try:
        yield comm
    finally:
        _COMM.reset(comm_token)
        _PHASE.reset(phase_token)


def active_comm() -> Comm | None:
    """The communicator of the running sharded module, None outside one (a fake run)."""
    return _COMM.get()


def current_comm() -> Comm:
    comm = _COMM.get()
    if comm is None:
        raise RuntimeError(
            "a tess collective ran outside a sharded module: call the module returned "
            "by tess_compile.shard or tess_compile.simulate instead of its graph"
        )
    return comm


def current_phase() -> str:
    return _PHASE.get()


def _run(op: str, x: torch.Tensor, *args) -> torch.Tensor:
    return current_comm().run(op, x, *args)


def _adjoint(op: str, grad: torch.Tensor, *args) -> torch.Tensor:
    """`op`'s adjoint on `grad` by the running communicator; the identity passes `grad` on."""
    adjoint = COLLECTIVES[op].adjoint
    return grad if adjoint == "identity" else _run(adjoint, grad.contiguous(), *args)


def _backward_through(op: str):
    """The autograd formula of `op`: its adjoint, run by the forward's comm."""

    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]
        ctx.comm = _COMM.get()

    def backward(ctx, grad):
        with use_comm(ctx.comm or current_comm(), phase="backward"):
            out = _adjoint(op, grad, *ctx.args)
        return (out,) + (None,) * len(ctx.args)

    return backward, setup_context


def output_like(op: str, x: torch.Tensor, *args) -> torch.Tensor:
    """An empty tensor of the shape that `op` gives for input `x` and its other arguments
    (axis, then the op's own), without communicating: for runs on fake tensors."""
    return COLLECTIVES[op].output_like(x, *args)


class ShapeComm(Comm):
    """A communicator for fake runs: each collective returns a new empty tensor of its output's
    shape (`output_like`), as a real collective returns a new tensor."""

    def run(self, op: str, x: torch.Tensor, *args) -> torch.Tensor:
        return output_like(op, x, *args)


# Collective name -> its graph target (the custom op, or for an identity its autograd function).
_TARGETS: dict[str, object] = {}


def _define(name: str):
    """The custom op `tess::<name>` of the collective's record: its schema, its fake kernel,
    its adjoint as its backward; its work done by the running communicator."""
    collective = COLLECTIVES[name]

    def impl(x, *args):
        return _run(name, x, *args)

    op = torch.library.custom_op(f"tess::{name}", impl, mutates_args=(), schema=collective.schema)
    op.register_fake(collective.output_like)
    backward, setup_context = _backward_through(name)
    op.register_autograd(backward, setup_context=setup_context)
    _TARGETS[name] = getattr(torch.ops.tess, name).default
    return _TARGETS[name]


broadcast = _define("broadcast")


broadcast_start = _define("broadcast_start")


reduce = _define("reduce")


all_reduce = _define("all_reduce")


all_reduce_alike = _define("all_reduce_alike")


keep_first = _define("keep_first")


keep_first_alike = _define("keep_first_alike")


all_gather = _define("all_gather")


all_gather_alike = _define("all_gather_alike")


reduce_scatter = _define("reduce_scatter")


shard_slice = _define("shard_slice")


shard_pad = _define("shard_pad")


class _IdentityWithAdjoint(torch.autograd.Function):
    """Identity forward; backward runs the adjoint op named by `op` (its plan on the forward's
    communicator, phase "backward")."""

    @staticmethod
    def forward(ctx, x, op, axis):
        ctx.op, ctx.axis, ctx.comm = op, axis, _COMM.get()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        adjoint = COLLECTIVES[ctx.op].adjoint
        if adjoint == "identity":
            return grad, None, None
        plan = (ctx.comm or current_comm()).plan(adjoint, ctx.axis)
        return plan(grad.contiguous(), "backward"), None, None


class _Wait(torch.autograd.Function):
    """Identity once the collective filling `x` is done; the gradient passes as it is."""

    @staticmethod
    def forward(ctx, x):
        comm = _COMM.get()
        x = x if comm is None else comm.wait(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def wait(x: torch.Tensor) -> torch.Tensor:
    """`x`, once the `broadcast_start` that made it has arrived."""
    return _Wait.apply(x)


@torch.library.custom_op("tess::wait", mutates_args=())
def _wait_op(x: torch.Tensor) -> torch.Tensor:
    """`wait` in a compiled graph (`tess_compile.runtime.inductor`): a copy of `x` once it has arrived,
    so that its readers follow the wait (a custom op may not return its input)."""
    return current_comm().wait(x).clone()


_wait_op.register_fake(lambda x: torch.empty_like(x))


def grad_sync(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity; the gradient is all-reduced along `axis` (replicated parameters)."""
    return _IdentityWithAdjoint.apply(x, "grad_sync", axis)


def seed_once(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity; only coordinate 0 along `axis` keeps its gradient (replicated outputs)."""
    return _IdentityWithAdjoint.apply(x, "seed_once", axis)


def sum_shares(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity; the gradient's shares are all-reduced along `axis` into the whole gradient."""
    return _IdentityWithAdjoint.apply(x, "sum_shares", axis)


def identity(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity, and so its gradient (the adjoint of the `*_alike` ops)."""
    return _IdentityWithAdjoint.apply(x, "identity", axis)


_TARGETS.update(grad_sync=grad_sync, seed_once=seed_once, sum_shares=sum_shares, identity=identity)


# Graph targets that the runtimes treat as collectives, by the op they count as (`broadcast_start`: broadcast).
COLLECTIVE_OPS = {target: COLLECTIVES[name].counts_as for name, target in _TARGETS.items()}

# The same targets by their own record's name, whose adjoint their backward runs
# (`all_gather_alike` counts as an all-gather; its adjoint is its own).
COLLECTIVE_NAMES = {target: name for name, target in _TARGETS.items()}


class _Collective(torch.autograd.Function):
    """A collective as an eager run calls it: its plan on the running communicator (`Comm.plan`) in
    the running phase, and in backward its adjoint's plan on the same communicator, phase
    "backward" (None: the identity, the gradient passes on): what the custom op and its autograd
    formula (`_backward_through`) do."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward_plan = backward
        return forward(x, _PHASE.get())

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.backward_plan
        return (grad if plan is None else plan(grad.contiguous(), "backward")), None, None


# `_Collective.apply` less its Python layer (`Function.apply`: the default arguments it binds, none
# here, and functorch's transforms, which an eager target hands to it while one runs): a microsecond
# or two a call.
_APPLY = super(torch.autograd.Function, _Collective).apply


def _eager(name: str):
    """The eager target of collective `name`: the running communicator's plan of it (made once per
    op, axis and arguments: `Comm.plan`), under `_Collective` where autograd records it, unless
    the plan's own autograd is the adjoint (`own_adjoint`: a rank-local plan of torch's
    differentiable ops, such as a block's copy for `shard_slice`)."""
    adjoint = COLLECTIVES[name].adjoint

    def call(x, axis, *args):
        comm = _COMM.get()
        if comm is None:
            comm = current_comm()  # raises: no sharded module runs
        forward = comm.plan(name, axis, *args)
        if x.requires_grad and torch.is_grad_enabled() and not getattr(forward, "own_adjoint", False):
            backward = None if adjoint == "identity" else comm.plan(adjoint, axis, *args)
            if torch._C._are_functorch_transforms_active():
                return _Collective.apply(x, forward, backward)
            return _APPLY(unwrap_if_dead(x), forward, backward)
        return forward(x, _PHASE.get())

    call.__name__ = call.__qualname__ = f"eager_{name}"
    return call


# Custom op of a collective -> the function an eager run calls in its place (`tess_compile.runtime.sharded_module`):
# the same work, record and gradient without the dispatch of a `torch.library` custom op through autograd
# (tens of microseconds a call). Traced and compiled graphs keep the custom ops.
EAGER_TARGETS = {target: _eager(name) for name, target in _TARGETS.items() if COLLECTIVES[name].schema is not None}
