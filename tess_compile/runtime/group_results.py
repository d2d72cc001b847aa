"""What each collective gives every member of one group: the exact semantics of the
collectives, on the group's tensors in coordinate order.

The simulator (all ranks in lockstep) and the threaded runs of compiled
programs (each rank in its thread) both combine a group's tensors with these
functions, so a collective means the same in every in-process runtime; the
distributed runtime's `DistComm` does the same over torch.distributed.
"""

from __future__ import annotations

import functools

import torch

from tess_compile.core.layout import put_blocks, take_block

__all__ = ["GROUP_RESULTS"]

# Each takes one group's tensors (by coordinate) and returns theirs.


def _broadcast(xs, src):
    return [xs[src].clone() for _ in xs]


def _reduce(xs, dst):
    total = functools.reduce(torch.add, xs)
    return [total if t == dst else torch.zeros_like(x) for t, x in enumerate(xs)]


def _all_reduce(xs):
    total = functools.reduce(torch.add, xs)
    return [total.clone() for _ in xs]


def _keep_first(xs):
    return [x.clone() if t == 0 else torch.zeros_like(x) for t, x in enumerate(xs)]


def _all_gather(xs, parts, dim, groups):
    full = put_blocks(xs, dim, groups)
    return [full.clone() for _ in xs]


def _reduce_scatter(xs, parts, dim, groups):
    total = functools.reduce(torch.add, xs)
    return [take_block(total, dim, groups, parts, t).contiguous() for t in range(parts)]


def _shard_slice(xs, parts, dim, groups):
    return [take_block(x, dim, groups, parts, t).contiguous() for t, x in enumerate(xs)]


def _shard_pad(xs, parts, dim, groups):
    return [put_blocks([x if s == t else torch.zeros_like(x) for s in range(parts)], dim, groups) for t, x in enumerate(xs)]


def _identity(xs):
    return [x.view_as(x) for x in xs]


# op name -> fn(the group's tensors, *the op's own arguments) -> the group's results
GROUP_RESULTS = {
    "broadcast": _broadcast,
    "reduce": _reduce,
    "all_reduce": _all_reduce,
    "keep_first": _keep_first,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "shard_slice": _shard_slice,
    "shard_pad": _shard_pad,
    "grad_sync": _identity,
    "seed_once": _identity,
}
