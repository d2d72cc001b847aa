"""Choosing how the matrix products run: "auto" options priced on a cluster.

summa="auto" is resolved inside each compile: every product takes the schedule
priced cheapest for it on the cluster (`tess_compile.passes.product_schedule`; the compile
takes `cluster=`). keep_blocks="auto" needs whole programs: `choose_schedule`
compiles a model for one mesh with and without keeping the fetched blocks,
prices each program on a `Cluster` (`cost_model.predict_time`,
`memory.predict_memory`) and returns the fastest that fits the memory budget,
with every candidate priced. A summa="auto" program over the budget is
compiled once more in the broadcast schedule, whose products hold one fetched
block at a time. Candidates that do not compile are skipped; if none compiles,
the first error is raised. The planner calls it for every mesh. Its loop,
compile each candidate and keep the cheapest (`compile_each`, `cheapest`), is
the decode planner's too (`tess_compile.analysis.decode_plan`).

`resolve_auto` serves the faces' one compile entry
(`tess_compile.analysis.compile_entry.compile_for`): it loads the cluster given
(a `Cluster` or the path of a JSON file `Cluster.save` wrote;
`CALIBRATED_CLUSTER` by default) and resolves keep_blocks="auto" on it;
`auto_summary` says, in one line that it logs and the dump prints, what auto
chose. 1-D meshes and q == 1 run no SUMMA steps: nothing to choose there.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from torch import nn

from tess_compile.passes.driver import compile_model
from tess_compile.analysis.cost_model import StepTime, predict_time
from tess_compile.analysis.memory import MemoryEstimate, predict_memory
from tess_compile.analysis.step_tail import README_STEP, StepTail, tail_time
from tess_compile.core.cluster import CALIBRATED_CLUSTER, Cluster
from tess_compile.core.mesh import Mesh
from tess_compile.core.options import AUTO, CompileOptions
from tess_compile.core.program import Program, describe_schedules

__all__ = ["Priced", "Resolved", "ScheduleChoice", "auto_summary", "candidates", "cheapest", "choose_schedule",
           "compile_each", "has_summa_steps", "load_cluster", "resolve_auto"]

log = logging.getLogger("tess_compile")

GB = 1e9

T = TypeVar("T")


@dataclass(frozen=True)
class Priced:
    """One candidate: its schedule option, whether it keeps the fetched blocks, its predicted step
    and memory, and how many products run each schedule (`Program.schedules`)."""

    summa: str
    keep_blocks: bool
    time: StepTime
    memory: MemoryEstimate
    schedules: tuple[tuple[str, int], ...] = ()

    @property
    def label(self) -> str:
        return f"{self.summa}+keep" if self.keep_blocks else self.summa


@dataclass(frozen=True)
class ScheduleChoice:
    """The fastest candidate within the budget (the fastest of all if none is: `fits` False),
    the options it compiles with, and every candidate priced, in the order tried."""

    options: CompileOptions
    best: Priced
    fits: bool
    budget: float
    priced: tuple[Priced, ...]
    program: Program  # the program compiled for `options`, which `best` priced


def has_summa_steps(mesh: Mesh) -> bool:
    """Whether the mesh's matrix products run SUMMA steps (not in 1-D, nor with q == 1)."""
    return mesh.mode != "1d" and mesh.q > 1


def candidates(mesh: Mesh, options: CompileOptions) -> list[tuple[str, bool]]:
    """The (summa, keep_blocks) pairs to compile and price: keep_blocks="auto" gives both where the
    products run SUMMA steps, else False; summa as it is ("auto" resolves in each compile)."""
    if options.keep_blocks != AUTO:
        return [(options.summa, options.keep_blocks)]
    return [(options.summa, keep) for keep in ((False, True) if has_summa_steps(mesh) else (False,))]


def choose_schedule(model: nn.Module, mesh: Mesh, example_inputs, options: CompileOptions,
                    cluster: Cluster = CALIBRATED_CLUSTER, *, budget: float | None = None, overlap: bool = False,
                    tail: StepTail = README_STEP, **boundary) -> ScheduleChoice:
    """Compile `model` for `mesh` in each of `candidates(mesh, options)` (`compile_model` with
    `boundary`'s keywords, summa="auto" priced on `cluster`) and price each on `cluster`: the
    fastest within `budget` (bytes per rank; default the cluster's memory). If no summa="auto"
    candidate fits, the broadcast schedule's are priced too. `overlap`: both phases overlapped
    for every candidate (`predict_time`). `tail`: the step around the call that is priced with it
    (`tess_compile.analysis.step_tail`; README's loop by default)."""
    budget = cluster.memory if budget is None else budget

    def price(pairs: list[tuple[str, bool]]) -> list[tuple[Priced, Program] | Exception]:
        tried = [dataclasses.replace(options, summa=summa, keep_blocks=keep) for summa, keep in pairs]
        priced = functools.partial(_priced, cluster=cluster, overlap=overlap, tail=tail)
        return compile_each(model, mesh, example_inputs, tried, priced, cluster, **boundary)

    pairs = candidates(mesh, options)
    results = price(pairs)
    if options.summa == AUTO and has_summa_steps(mesh) and not any(
            item.memory.total <= budget for item, _ in _compiled(results)):
        results += price([("broadcast", keep) for _, keep in pairs])
    best, program, fits = cheapest(results, lambda item: item.time.step_s, lambda item: item.memory.total <= budget)
    return ScheduleChoice(dataclasses.replace(options, summa=best.summa, keep_blocks=best.keep_blocks), best,
                          fits, budget, tuple(item for item, _ in _compiled(results)), program)


def compile_each(model: nn.Module, mesh: Mesh, example_inputs, tried: Sequence[CompileOptions],
                 price: Callable[[CompileOptions, Program], T], cluster: Cluster, *, quiet: bool = False,
                 **boundary) -> list[tuple[T, Program] | Exception]:
    """`model` compiled for `mesh` with each options of `tried` (`compile_model` with `boundary`'s keywords,
    summa="auto" priced on `cluster`), each program priced by `price(options, program)`: `(price, program)`,
    in order, or the error a candidate failed to compile with. `quiet`: the compiles' warnings (what runs
    replicated) are not shown."""
    results = []
    for options in tried:
        try:
            with warnings.catch_warnings():
                if quiet:
                    warnings.simplefilter("ignore")
                program = compile_model(model, mesh, example_inputs, options=options, cluster=cluster, **boundary)
        except (ValueError, RuntimeError) as exc:
            log.debug("%s does not compile on mesh %s: %s", options, mesh, exc)
            results.append(exc)
            continue
        results.append((price(options, program), program))
    return results


def cheapest(results: list, seconds: Callable[[T], float],
             fits: Callable[[T], bool] = lambda item: True) -> tuple[T, Program, bool]:
    """Of `compile_each`'s results, the price of least `seconds` among those that `fits` (among all, if none
    fits), its program, and whether it fits; the first error if none compiled."""
    compiled = _compiled(results)
    if not compiled:
        raise results[0]  # the first candidate's error
    fitting = [pair for pair in compiled if fits(pair[0])]
    item, program = min(fitting or compiled, key=lambda pair: seconds(pair[0]))
    return item, program, bool(fitting)


def _compiled(results: list) -> list[tuple]:
    return [result for result in results if not isinstance(result, Exception)]


def _priced(options: CompileOptions, program: Program, *, cluster: Cluster, overlap: bool,
            tail: StepTail = README_STEP) -> Priced:
    """One candidate's program priced: its step time and memory on `cluster`, with `tail` around the call
    (its kernels and its gather's all-gather added to forward's and backward's: `step_tail.tail_time`)."""
    time, extra = predict_time(program, cluster, overlap=overlap), tail_time(program, cluster, tail)
    time = dataclasses.replace(time, forward_compute_s=time.forward_compute_s + extra.forward_s,
                               forward_comm_s=time.forward_comm_s + extra.comm_s,
                               backward_compute_s=time.backward_compute_s + extra.backward_s,
                               forward_bytes=time.forward_bytes + extra.comm_bytes)
    return Priced(options.summa, options.keep_blocks, time, predict_memory(program, tail),
                  tuple(program.schedules.items()))


def load_cluster(cluster: Cluster | str | os.PathLike | None) -> tuple[Cluster, str]:
    """The cluster `cluster=` names, and the words that name it in a message: a `Cluster` as it is,
    a path's JSON file (`Cluster.load`: a ValueError if it is not one), None `CALIBRATED_CLUSTER`."""
    if cluster is None or cluster == CALIBRATED_CLUSTER:
        return CALIBRATED_CLUSTER, "the default cluster (CALIBRATED_CLUSTER)"
    if isinstance(cluster, Cluster):
        return cluster, "the given cluster"
    if isinstance(cluster, (str, os.PathLike)):
        return Cluster.load(cluster), f"cluster {os.fspath(cluster)}"
    raise TypeError(f"cluster={cluster!r} is not a cluster: pass a tess_compile.core.cluster.Cluster, the path "
                     "of a JSON file Cluster.save wrote, or None for the calibrated default")


class Resolved(NamedTuple):
    """`resolve_auto`'s answer: the options to compile (summa may stay "auto": each compile prices
    it), the program compiled for them while pricing (None: compile it), the line that says what
    keep_blocks="auto" chose ("" if it was not auto), and the cluster with the words that name it."""

    options: CompileOptions
    program: Program | None
    summary: str
    cluster: Cluster
    cluster_name: str


def resolve_auto(model: nn.Module, mesh: Mesh, example_inputs, options: CompileOptions,
                 cluster: Cluster | str | os.PathLike | None = None, **boundary) -> Resolved:
    """`options` with keep_blocks="auto" replaced by the choice of `choose_schedule` on `cluster`
    (see `load_cluster`, read even if nothing is auto), logged on the `tess_compile` logger."""
    cluster, name = load_cluster(cluster)
    if options.keep_blocks != AUTO:
        return Resolved(options, None, "", cluster, name)
    if not has_summa_steps(mesh):
        summary = f"keep_blocks=auto: False on mesh {mesh} (no SUMMA steps to schedule)"
        log.info("%s", summary)
        return Resolved(dataclasses.replace(options, keep_blocks=False), None, summary, cluster, name)
    choice = choose_schedule(model, mesh, example_inputs, options, cluster, **boundary)
    summary = f"keep_blocks=auto: chose {_summary(choice, mesh)} on {name}"
    log.info("%s", summary)
    return Resolved(choice.options, choice.program, summary, cluster, name)


def auto_summary(resolved: Resolved, program: Program) -> str:
    """What auto chose for `program`: the keep_blocks line, and the products' schedules of summa="auto"."""
    lines = [resolved.summary] if resolved.summary else []
    if resolved.options.summa == AUTO and program.schedules:
        lines.append(f"summa=auto on mesh {program.mesh}: {describe_schedules(program.schedules)} "
                     f"(priced on {resolved.cluster_name})")
    return "; ".join(lines)


def _summary(choice: ScheduleChoice, mesh: Mesh) -> str:
    """`keep_blocks=False on mesh ... (predicted 1.2 ms/step; gather+keep 1.5 ms, ...)`."""
    best = choice.best
    others = [f"{item.label} {_ms(item.time.step_s)}{'' if item.memory.total <= choice.budget else ' (over memory)'}"
              for item in choice.priced if item is not best]
    schedule = "" if best.summa == AUTO else f"{best.summa}, "
    text = f"{schedule}keep_blocks={best.keep_blocks} on mesh {mesh} (predicted {_ms(best.time.step_s)}/step"
    text += f"; {', '.join(others)})" if others else ")"
    if not choice.fits:
        text += f"; none fits the memory of {choice.budget / GB:.3g} GB per rank: the fastest"
    return text


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
