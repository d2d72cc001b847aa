"""The collectives of the per-rank graph: one record each, everything about it in one place.

A `Collective` holds a collective's name and custom-op schema, its adjoint
(its backward, docs/gradients.md), whether it sends bytes and which op it
counts as, the shape of its result, its exact result on one group's tensors,
its implementation over torch.distributed, its lowering to torch's functional
collectives, and its price per algorithm. Every consumer reads `COLLECTIVES`:

- `tess_compile.ops.collectives` defines the custom ops (`tess::<name>`) from
  the schemas, their fake kernels from `output_like` and their autograd
  formulas from the adjoints; its `Comm.record` counts `sends`, by `counts_as`;
- `tess_compile.runtime.dist_comm.DistComm` runs `on_process_group`; the
  simulator and the threaded runs of compiled programs run `group_results`;
  a compiled program under a process group runs `functional` in its graphs
  (`tess_compile.runtime.functional_collectives`; the lowerings are
  `tess_compile.core.functional_lowerings`);
- `tess_compile.analysis.accounting` counts bytes by `sends` and `adjoint`,
  `tess_compile.analysis.symbolic_shapes` scales a dim by `scale`;
- `tess_compile.core.cluster` prices a collective by its `price`, and so the
  cost model and the schedule choice do.

Layer: core. The cluster (core) prices from this table, and everything
else that reads it (ops, passes, runtime, analysis) sits above core, so
no layer imports upwards. The implementations over torch.distributed take
the communicator as their first argument (`groups[axis]`, `coord(axis)`,
`pending`: a `DistComm`), so this module imports nothing above core.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tess_compile.core import functional_lowerings as functional
from tess_compile.core import group_calls
from tess_compile.core.layout import in_rank_order, ordering, placing, put_blocks, split_dim, take_block

__all__ = ["COLLECTIVES", "Collective", "PriceRule"]

# g -> (latency steps, bandwidth factor): a collective of `n` bytes over `g` ranks takes
# `steps * alpha + factor * n / B` (`tess_compile.core.cluster.collective_time`).
PriceRule = Callable[[int], tuple[float, float]]


@dataclass(frozen=True)
class Collective:
    """One collective: what it is, what it gives, what it costs.

    `group_results(xs, *own)` takes one group's tensors by coordinate along the
    axis and the op's own arguments (after the axis), and gives each member's
    result. `on_process_group(comm, axis, *own)` makes this rank's call over
    torch.distributed once (its group, its options, this rank's coordinate:
    `tess_compile.core.group_calls`), a function that gives the result of a
    contiguous input; `functional(group, *own, x)` the same in torch's
    functional collectives, for a compiled graph (`AxisGroup`: this rank's
    group along the axis; None for the identities, which no compiled graph
    holds). `scale`: the result's size along the op's `dim`
    argument is the input's times `parts ** scale` (0: the input's shape).
    `price` maps an algorithm ("ring", "tree") to its `PriceRule` for the bytes
    a rank passes in (as `accounting` counts them); an op counted as another
    (`counts_as`) is priced as that one.
    """

    name: str
    schema: str | None  # of the custom op `tess::<name>`; None: an identity whose backward is `adjoint`
    adjoint: str
    group_results: Callable[..., list[torch.Tensor]]
    on_process_group: Callable[..., torch.Tensor]
    sends: bool = False  # sends bytes between ranks (the others are rank-local)
    counts_as: str = ""  # the op it is recorded, counted and priced as; "" for itself
    scale: int = 0
    price: dict[str, PriceRule] = field(default_factory=dict)
    # its backward receives the whole gradient on every rank, not shares (`passes/alike_regions.py`):
    # its adjoint is the rank-local part of its `counts_as`'s adjoint
    whole_gradient: bool = False
    functional: Callable[..., torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not self.counts_as:
            object.__setattr__(self, "counts_as", self.name)
        assert (self.schema is None) == (self.functional is None), f"{self.name}: a custom op needs a lowering"

    def output_like(self, x: torch.Tensor, *args) -> torch.Tensor:
        """An empty tensor of the result's shape for input `x` and the other arguments
        (axis, then the op's own): the fake kernel."""
        if self.scale == 0:
            return x.new_empty(x.shape)  # contiguous, as every communicator returns it
        _, parts, dim, _ = args
        shape = list(x.shape)
        shape[dim] = shape[dim] * parts if self.scale > 0 else shape[dim] // parts
        return x.new_empty(shape)


def _copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `x`: the layout every op's fake kernel gives its result, whatever strides
    the input came with (inductor checks a custom op's output strides against its fake kernel's)."""
    return x.clone(memory_format=torch.contiguous_format)


def _zeros(x: torch.Tensor) -> torch.Tensor:
    return x.new_zeros(x.shape)


def _sum(xs: list[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(torch.add, xs)


def _log2(g: int) -> int:
    """Rounds of a binomial tree (recursive doubling) over `g` ranks: ceil(log2 g)."""
    return math.ceil(math.log2(g))


# Prices (the bytes `n` each rank passes to the op: broadcast, reduce and all_reduce the whole
# tensor; all_gather the local input, its output g * n; reduce_scatter the full input, its
# output n / g).
# ring: NCCL's default for large messages; broadcast and reduce pipelined along a chain in
# many chunks, so one message time, as NCCL's bus bandwidth says. all_reduce is a
# reduce-scatter and an all-gather.
# tree: binomial tree and recursive doubling/halving (Thakur, Rabenseifner and Gropp 2005;
# L = ceil(log2 g); exact for g a power of two).
_PIPELINED = {"ring": lambda g: (g - 1, 1), "tree": lambda g: (_log2(g), _log2(g))}


# broadcast(x, axis, src): every member gets the copy of coordinate `src`; adjoint reduce.


def _broadcast_group(xs, src):
    return [_copy(xs[src]) for _ in xs]


def _broadcast(comm, axis, src):
    call = group_calls.broadcast(comm.groups[axis], src)

    def broadcast(x):
        out = _copy(x)
        call(out)
        return out

    return broadcast


def _broadcast_start(comm, axis, src):
    """A broadcast left running until `comm.wait(out)` (the overlap schedule's)."""
    call, pending = group_calls.broadcast(comm.groups[axis], src), comm.pending

    def broadcast_start(x):
        out = _copy(x)
        pending[out.untyped_storage().data_ptr()] = (call(out, async_op=True), axis)
        return out

    return broadcast_start


# reduce(x, axis, dst): the sum at coordinate `dst`, zeros elsewhere; adjoint broadcast.


def _reduce_group(xs, dst):
    total = _copy(_sum(xs))
    return [total if t == dst else _zeros(x) for t, x in enumerate(xs)]


def _reduce(comm, axis, dst):
    call, keeps = group_calls.reduce(comm.groups[axis], dst), comm.coord(axis) == dst

    def reduce(x):
        out = _copy(x)
        call(out)
        return out if keeps else _zeros(x)

    return reduce


# all_reduce(x, axis): the sum on every member; its own adjoint.


def _all_reduce_group(xs):
    total = _sum(xs)
    return [_copy(total) for _ in xs]


def _all_reduce(comm, axis):
    call = group_calls.all_reduce(comm.groups[axis])

    def all_reduce(x):
        out = _copy(x)
        call(out)
        return out

    return all_reduce


# keep_first(x, axis): coordinate 0 keeps its tensor, the others get zeros; its own adjoint.


def _keep_first_group(xs):
    return [_copy(x) if t == 0 else _zeros(x) for t, x in enumerate(xs)]


def _keep_first(comm, axis):
    return _own_adjoint(lambda x: _copy(x)) if comm.coord(axis) == 0 else _zeros


def _own_adjoint(work: Callable) -> Callable:
    """`work`, a function made for one plan, marked as one whose autograd (torch's own, of its
    differentiable ops) is its op's adjoint on this rank: an eager run calls it without an autograd
    Function (`own_adjoint`). A copy passes the gradient on (`keep_first` at coordinate 0), a block
    of the input gives the gradient in place among zeros (`shard_slice`), the input in place among
    zeros gives the gradient's block (`shard_pad`)."""
    work.own_adjoint = True
    return work


# all_gather(x, axis, parts, dim, groups): every member's block along `dim` joined
# (`put_blocks`); adjoint reduce_scatter.


def _all_gather_group(xs, parts, dim, groups):
    full = put_blocks(xs, dim, groups)
    return [full.clone() for _ in xs]


def _all_gather(comm, axis, parts, dim, groups):
    """One `all_gather_single` of the flattened blocks (NCCL's native all-gather into
    one tensor; gloo takes only the concatenated form), put in place by one copy."""
    call = group_calls.all_gather_single(comm.groups[axis])
    place = _ByShape(lambda shape: placing(shape, parts, dim, groups, in_rank_order(shape, dim, groups)))

    def all_gather(x):
        gathered = x.new_empty(parts * x.numel())
        call(gathered, x.reshape(-1))
        return place[x.shape](gathered)

    return all_gather


# reduce_scatter(x, axis, parts, dim, groups): member t's block t (`take_block`) of the sum;
# adjoint all_gather.


def _reduce_scatter_group(xs, parts, dim, groups):
    total = _sum(xs)
    return [take_block(total, dim, groups, parts, t).contiguous() for t in range(parts)]


def _reduce_scatter(comm, axis, parts, dim, groups):
    """One `reduce_scatter_single` of the blocks (`take_block`'s) flattened in rank order (NCCL's
    native call): one copy puts them in that order, none if they are in it already."""
    call = group_calls.reduce_scatter_single(comm.groups[axis])
    order = _ByShape(lambda shape: (ordering(shape, parts, dim, groups, in_rank_order(shape, dim, groups)),
                                     split_dim(shape, dim, shape[dim] // parts)))

    def reduce_scatter(x):
        blocks, shape = order[x.shape]
        blocks = blocks(x)
        out = x.new_empty(blocks.numel() // parts)
        call(out, blocks)
        return out.view(shape)

    return reduce_scatter


class _ByShape(dict):
    """`made[shape]`: `make(shape)`, made once per input shape (a graph node's is one; a dynamic
    program's vary, so at most 64 are kept); a shape already made costs a dict's lookup alone."""

    def __init__(self, make: Callable):
        super().__init__()
        self.make = make

    def __missing__(self, shape):
        if len(self) >= 64:
            self.clear()
        value = self[shape] = self.make(shape)
        return value


# shard_slice(x, axis, parts, dim, groups): member t keeps its block t, no traffic; adjoint
# shard_pad (its block in place, zeros elsewhere).


def _shard_slice_group(xs, parts, dim, groups):
    return [take_block(x, dim, groups, parts, t).contiguous() for t, x in enumerate(xs)]


def _shard_slice(comm, axis, parts, dim, groups):
    coord = comm.coord(axis)
    return _own_adjoint(lambda x: take_block(x, dim, groups, parts, coord).clone())


def _shard_pad_group(xs, parts, dim, groups):
    return [_padded(x, t, parts, dim, groups) for t, x in enumerate(xs)]


def _shard_pad(comm, axis, parts, dim, groups):
    coord = comm.coord(axis)
    return _own_adjoint(lambda x: _padded(x, coord, parts, dim, groups))


def _padded(x, coord, parts, dim, groups):
    return put_blocks([x if t == coord else torch.zeros_like(x) for t in range(parts)], dim, groups)


# grad_sync, seed_once and sum_shares: identities in forward, for their backward (all_reduce of a
# replicated parameter's gradient; keep_first of a replicated output's; all_reduce of the shares of an
# activation's gradient, `passes/alike_regions.py`). identity: the identity both ways.


def _identity_group(xs):
    return [x.view_as(x) for x in xs]


def _identity(comm, axis):
    return lambda x: x.view_as(x)


_ROOTED = "(Tensor x, str axis, int {}) -> Tensor"


_SPLIT = "(Tensor x, str axis, int parts, int dim, int groups) -> Tensor"


_RECORDS = (
    Collective("broadcast", _ROOTED.format("src"), "reduce", _broadcast_group, _broadcast, sends=True,
               price=_PIPELINED, functional=functional.broadcast),
    Collective("broadcast_start", _ROOTED.format("src"), "reduce", _broadcast_group, _broadcast_start, sends=True,
               counts_as="broadcast", functional=functional.broadcast_start),
    Collective("reduce", _ROOTED.format("dst"), "broadcast", _reduce_group, _reduce, sends=True, price=_PIPELINED,
               functional=functional.reduce),
    Collective("all_reduce", "(Tensor x, str axis) -> Tensor", "all_reduce", _all_reduce_group, _all_reduce,
               sends=True, price={"ring": lambda g: (2 * (g - 1), 2 * (g - 1) / g),
                                  "tree": lambda g: (_log2(g), _log2(g))}, functional=functional.all_reduce),
    # an all-reduce into values every rank holds the whole gradient of: its adjoint passes it on
    Collective("all_reduce_alike", "(Tensor x, str axis) -> Tensor", "identity", _all_reduce_group, _all_reduce,
               sends=True, counts_as="all_reduce", whole_gradient=True, functional=functional.all_reduce),
    Collective("keep_first", "(Tensor x, str axis) -> Tensor", "keep_first", _keep_first_group, _keep_first,
               functional=functional.keep_first),
    # keep_first of a value whose gradient every rank holds whole: its adjoint passes that gradient on
    Collective("keep_first_alike", "(Tensor x, str axis) -> Tensor", "identity", _keep_first_group, _keep_first,
               counts_as="keep_first", whole_gradient=True, functional=functional.keep_first),
    Collective("all_gather", _SPLIT, "reduce_scatter", _all_gather_group, _all_gather, sends=True, scale=1,
               price={"ring": lambda g: (g - 1, g - 1), "tree": lambda g: (_log2(g), g - 1)},
               functional=functional.all_gather),
    # an all-gather into a tail every rank computes alike: its adjoint takes the rank's own block
    Collective("all_gather_alike", _SPLIT, "shard_slice", _all_gather_group, _all_gather, sends=True, scale=1,
               counts_as="all_gather", whole_gradient=True, functional=functional.all_gather),
    Collective("reduce_scatter", _SPLIT, "all_gather", _reduce_scatter_group, _reduce_scatter, sends=True, scale=-1,
               price={"ring": lambda g: (g - 1, (g - 1) / g), "tree": lambda g: (_log2(g), (g - 1) / g)},
               functional=functional.reduce_scatter),
    Collective("shard_slice", _SPLIT, "shard_pad", _shard_slice_group, _shard_slice, scale=-1,
               functional=functional.rank_local(_shard_slice)),
    Collective("shard_pad", _SPLIT, "shard_slice", _shard_pad_group, _shard_pad, scale=1,
               functional=functional.rank_local(_shard_pad)),
    Collective("grad_sync", None, "all_reduce", _identity_group, _identity),
    Collective("seed_once", None, "keep_first", _identity_group, _identity),
    # the gradient's shares summed into the whole gradient on every rank (Megatron-LM's f)
    Collective("sum_shares", None, "all_reduce", _identity_group, _identity),
    # the adjoint of the ops whose backward passes the whole gradient on
    Collective("identity", None, "identity", _identity_group, _identity),
)


# name -> its record, in the order the custom ops are defined.
COLLECTIVES: dict[str, Collective] = {record.name: record for record in _RECORDS}
