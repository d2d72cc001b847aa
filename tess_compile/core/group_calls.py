"""torch.distributed's collectives on one process group, made once and called many times.

Layer: core. `torch.distributed.broadcast` and its kin build their options, check their arguments
and look up the group on every call, a few microseconds of Python each time, before they call the
group's own method (`ProcessGroup.broadcast`, ...) and wait for its work. A collective of the
per-rank graph always runs on the same group with the same options, so `DistComm` makes its call
once here (`broadcast(group, src)`, ...) and each call is the group's method and the wait: the
same C++ call, the same options (no timeout of their own: the group's, which the module's timeout
set, still applies to the wait), the same errors.

Where `torch.distributed`'s wrapper does more than that, the call goes through it: a dtype other
than the plain real ones (`_PASSED`: the wrapper views complex as real, float8 as bytes on older
GPUs), a tensor subclass or a torch function mode that redirects the call (`has_torch_function`),
or a group without the method (the GPU machines' older torch names the single-tensor gathers
differently; the stand-in groups of tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BroadcastOptions,
    ReduceOptions,
    ReduceScatterOptions,
)
from torch.overrides import has_torch_function, has_torch_function_unary

__all__ = ["all_gather_single", "all_reduce", "broadcast", "reduce", "reduce_scatter_single"]

# dtypes that torch.distributed's wrappers pass as they are (they view complex ones as real, and float8
# as bytes on older GPUs); any other, or a tensor with a torch function (`has_torch_function`), goes
# through the wrapper
_PASSED = frozenset((torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                     torch.int16, torch.int8, torch.uint8, torch.bool))


def _options(kind, **fields):
    options = kind()
    for name, value in fields.items():
        setattr(options, name, value)
    return options


def broadcast(group, src: int) -> Callable[..., object]:
    """`call(t, async_op=False)`: `dist.broadcast(t, group=group, group_src=src)`."""
    method = getattr(group, "broadcast", None)
    options = {flag: _options(BroadcastOptions, rootRank=src, rootTensor=0, asyncOp=flag)
               for flag in (False, True)}

    def call(t: torch.Tensor, async_op: bool = False):
        if method is None or t.dtype not in _PASSED or has_torch_function_unary(t):  # the wrapper's case
            return dist.broadcast(t, group=group, group_src=src, async_op=async_op)
        work = method([t], options[async_op])
        if async_op:
            return work
        if work is not None:
            work.wait()
        return None

    return call


def reduce(group, dst: int) -> Callable[[torch.Tensor], None]:
    """`call(t)`: `dist.reduce(t, group=group, group_dst=dst)`."""
    options = _options(ReduceOptions, reduceOp=dist.ReduceOp.SUM, rootRank=dst, asyncOp=False)
    return _waited(getattr(group, "reduce", None), options, lambda t: dist.reduce(t, group=group, group_dst=dst), listed=True)


def all_reduce(group) -> Callable[[torch.Tensor], None]:
    """`call(t)`: `dist.all_reduce(t, group=group)`."""
    options = _options(AllreduceOptions, reduceOp=dist.ReduceOp.SUM, asyncOp=False)
    return _waited(getattr(group, "allreduce", None), options, lambda t: dist.all_reduce(t, group=group), listed=True)


def all_gather_single(group) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """`call(out, x)`: torch 2.13's `dist.all_gather_single(out, x, group=group)`
    (`all_gather_into_tensor` before)."""
    fallback = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    options = _options(AllgatherOptions, asyncOp=False)
    return _waited(getattr(group, "all_gather_single", None), options,
                   lambda out, x: fallback(out, x, group=group))


def reduce_scatter_single(group) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """`call(out, x)`: torch 2.13's `dist.reduce_scatter_single(out, x, group=group)`
    (`reduce_scatter_tensor` before)."""
    fallback = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    options = _options(ReduceScatterOptions, reduceOp=dist.ReduceOp.SUM, asyncOp=False)
    return _waited(getattr(group, "reduce_scatter_single", None), options,
                   lambda out, x: fallback(out, x, group=group))


def _waited(method, options, fallback: Callable, listed: bool = False) -> Callable[..., None]:
    """The group's `method` on the call's tensors (a list of the one tensor where `listed`, else
    `out, x`) with `options`, waited for; `fallback`, torch.distributed's own call, where the
    wrapper would change the call (a dtype not `_PASSED`, a torch function) or there is no `method`."""
    if method is None:
        return fallback
    if listed:
        def call(t: torch.Tensor) -> None:
            if t.dtype not in _PASSED or has_torch_function_unary(t):  # the wrapper's case
                return fallback(t)
            work = method([t], options)
            if work is not None:
                work.wait()
            return None

        return call

    def call(out: torch.Tensor, x: torch.Tensor) -> None:
        if out.dtype not in _PASSED or x.dtype not in _PASSED or has_torch_function((out, x)):  # the wrapper's case
            return fallback(out, x)
        work = method(out, x, options)
        if work is not None:
            work.wait()
        return None

    return call
