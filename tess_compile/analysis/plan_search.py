"""The planner's search: which configurations to compile, in which order, and which to skip.

A configuration of `tess_compile.analysis.planner.plan` is a mesh, its microbatch (rows of the
batch one call of the tensor-parallel program takes) and the data and pipeline parallelism
around it (`parallel_plan.Outer`). Compiling and pricing a (mesh, microbatch) is the planner's
cost; many configurations share one. A configuration that cannot win is not compiled: its step
is bounded below first, by a cheap estimate from a larger microbatch of the same mesh, and
skipped where the bound is above the best step found so far (by more than the cluster's error of
predicted step times, so that every tie is still priced).

The bound: the tensor-parallel program's time is affine in its microbatch with nonnegative
terms (the matrix products' FLOPs, the activations' bytes and their collectives grow with the
rows; the weights' collectives, the kernels' launches and the latencies do not), and the
cheapest of the schedules priced (`summa="auto"`, `keep_blocks="auto"`) is the least of such
functions, so the time at `rows` is at least `rows / larger` times the cheapest time priced at
`larger >= rows` rows, fitting in memory or not (`bound_time`); the data and pipeline
parallelism around it are then priced as for a compiled row. So the search compiles, for each
mesh, its largest microbatch first (`search_order`), then the others by their bound.

With `zero="auto"` every configuration of more than one data-parallel replica is searched with
and without ZeRO, and as HSDP where its replicas span nodes (`zero_options`): all share the
compile of their mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from tess_compile.analysis.cost_model import StepTime

__all__ = ["bound_time", "search_order", "zero_options"]

# The StepTime fields that grow with a microbatch's rows (the others are per call or per parameter).
_GROWING = ("forward_compute_s", "forward_comm_s", "backward_compute_s", "backward_comm_s", "forward_ahead_s")


def search_order(configs: Sequence[tuple], key) -> tuple[list[tuple], list[tuple]]:
    """`configs` split into those to compile first, the largest microbatch of each mesh (by `key(config)
    -> (mesh, microbatch rows or None)`), and the others, in their order."""
    largest: dict[Hashable, int | None] = {}
    for config in configs:
        mesh, rows = key(config)
        if mesh not in largest or (rows is not None and (largest[mesh] is None or rows > largest[mesh])):
            largest[mesh] = rows
    first = [config for config in configs if key(config)[1] == largest[key(config)[0]]]
    return first, [config for config in configs if key(config)[1] != largest[key(config)[0]]]


def bound_time(cheapest: StepTime, rows: int, larger: int) -> StepTime:
    """A lower bound of the tensor-parallel program's time at `rows` rows a microbatch, from the cheapest
    time priced at `larger >= rows` rows (see the module docstring)."""
    share = rows / larger
    return dataclasses.replace(cheapest, **{name: getattr(cheapest, name) * share for name in _GROWING})


def zero_options(zero: bool | str, dp: int, per_node: int = 0) -> tuple[tuple[bool, int], ...]:
    """(ZeRO, HSDP's shard degree or 0) of each configuration of `dp` replicas to price: without and
    with ZeRO ("auto"), or as `zero` says; never ZeRO over one replica. Where the replicas span
    nodes and `per_node` of them share one, ZeRO also as HSDP: sharded over the most replicas within
    a node (a divisor of dp, more than one), replicated across (`per_node` 0: no HSDP)."""
    if zero not in ("auto", True, False):
        raise ValueError(f"zero={zero!r}: use True, False or 'auto' (both, for dp > 1)")
    if dp == 1:
        return ((False, 0),)
    options = [(False, 0), (True, 0)] if zero == "auto" else [(zero, 0)]
    within = [k for k in range(2, min(dp, per_node + 1)) if dp % k == 0] if dp > per_node else []
    if zero is not False and within:
        options.append((True, within[-1]))
    return tuple(options)
