"""Choosing the schedule of the matrix products on one mesh: price each candidate, keep the fastest.

`choose_schedule` compiles a model for one mesh in each (schedule, keep_blocks)
pair its options allow ("auto" is every one), prices each program on a
`Cluster` (`cost_model.predict_time`, `memory.predict_memory`) and returns the
fastest that fits the memory budget, with every candidate priced. "overlap"
runs the "broadcast" program's collectives asynchronously: that program is
priced with forward compute and communication overlapped (the runtime runs
backward collectives synchronously), not compiled again. Candidates that do
not compile are skipped; if none compiles, the first error is raised. The
planner calls it for every mesh.

`resolve_auto` serves the face (`shard`, `simulate`, `dump`, the backend):
options with "auto" become concrete, priced on the cluster given (a `Cluster`
or the path of a JSON file `Cluster.save` wrote) or `CALIBRATED_CLUSTER`, and
the choice is logged on the `tess_compile` logger. 1-D meshes and q == 1 run no
SUMMA steps: auto is "broadcast" without keeping blocks there, unpriced.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import NamedTuple

from torch import nn

from passes.driver import compile_model
from tess_compile.analysis.cluster import CALIBRATED_CLUSTER, Cluster
from tess_compile.analysis.cost_model import StepTime, predict_time
from tess_compile.analysis.memory import MemoryEstimate, predict_memory
from tess_compile.core.mesh import Mesh
from tess_compile.core.options import AUTO, SCHEDULES, CompileOptions
from tess_compile.core.program import Program

__all__ = ["Priced", "Resolved", "ScheduleChoice", "candidates", "choose_schedule", "compile_auto", "load_cluster",
           "resolve_auto"]

log = logging.getLogger("tess_compile")

GB = 1e9


@dataclass(frozen=True)
class Priced:
    """One candidate: a schedule, whether it keeps the fetched blocks, its predicted step and memory."""

    summa: str
    keep_blocks: bool
    time: StepTime
    memory: MemoryEstimate

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
    priced_program: Program  # the program priced for `best` ("overlap": the broadcast one)

    @property
    def program(self) -> Program | None:
        """The program compiled for `options`, or None ("overlap" compiles another than it priced)."""
        return None if self.options.summa == "overlap" else self.priced_program


def has_summa_steps(mesh: Mesh) -> bool:
    """Whether the mesh's matrix products run SUMMA steps (not in 1-D, nor with q == 1)."""
    return mesh.mode != "1d" and mesh.q > 1


def candidates(mesh: Mesh, options: CompileOptions) -> list[tuple[str, bool]]:
    """The (schedule, keep_blocks) pairs to price: every one an "auto" field allows where the
    products run SUMMA steps, else ("broadcast", False) for it; a concrete field as it is."""
    steps = has_summa_steps(mesh)
    schedules = (SCHEDULES if steps else ("broadcast",)) if options.summa == AUTO else (options.summa,)
    keeps = ((False, True) if steps else (False,)) if options.keep_blocks == AUTO else (options.keep_blocks,)
    return [(summa, keep) for summa in schedules for keep in keeps]


def choose_schedule(model: nn.Module, mesh: Mesh, example_inputs, options: CompileOptions,
                    cluster: Cluster = CALIBRATED_CLUSTER, *, budget: float | None = None, overlap: bool = False,
                    **boundary) -> ScheduleChoice:
    """Compile `model` for `mesh` in each of `candidates(mesh, options)` (`compile_model` with
    `boundary`'s keywords) and price each on `cluster`: the fastest within `budget` (bytes per
    rank; default the cluster's memory). `overlap`: both phases overlapped for every candidate
    (`predict_time`)."""
    budget = cluster.memory if budget is None else budget
    compiled: dict[tuple[str, bool], tuple[Program, MemoryEstimate] | Exception] = {}
    priced = []
    for summa, keep in candidates(mesh, options):
        key = ("broadcast" if summa == "overlap" else summa, keep)  # overlap sends what broadcast sends
        if key not in compiled:
            concrete = dataclasses.replace(options, summa=key[0], keep_blocks=keep)
            compiled[key] = _compile(model, mesh, example_inputs, concrete, boundary)
        if isinstance(compiled[key], Exception):
            continue
        program, memory = compiled[key]
        time = predict_time(program, cluster, overlap=overlap or ("forward" if summa == "overlap" else False))
        priced.append(Priced(summa, keep, time, memory))
    if not priced:
        raise next(iter(compiled.values()))  # the first candidate's error
    fitting = [item for item in priced if item.memory.total <= budget]
    best = min(fitting or priced, key=lambda item: item.time.step_s)
    program = compiled[("broadcast" if best.summa == "overlap" else best.summa, best.keep_blocks)][0]
    return ScheduleChoice(dataclasses.replace(options, summa=best.summa, keep_blocks=best.keep_blocks), best,
                          bool(fitting), budget, tuple(priced), program)


def _compile(model, mesh, example_inputs, options, boundary) -> tuple[Program, MemoryEstimate] | Exception:
    """The program of one candidate and its memory, or the error it failed to compile with."""
    try:
        program = compile_model(model, mesh, example_inputs, options=options, **boundary)
    except (ValueError, RuntimeError) as exc:
        log.debug("summa=%s, keep_blocks=%s does not compile on mesh %s: %s", options.summa, options.keep_blocks,
                  mesh, exc)
        return exc
    return program, predict_memory(program)


def load_cluster(cluster: Cluster | str | os.PathLike | None) -> tuple[Cluster, str]:
    """The cluster `cluster=` names, and the words that name it in a message: a `Cluster` as it is,
    a path's JSON file (`Cluster.load`: a ValueError if it is not one), None `CALIBRATED_CLUSTER`."""
    if cluster is None or cluster == CALIBRATED_CLUSTER:
        return CALIBRATED_CLUSTER, "the default cluster (CALIBRATED_CLUSTER)"
    if isinstance(cluster, Cluster):
        return cluster, "the given cluster"
    if isinstance(cluster, (str, os.PathLike)):
        return Cluster.load(cluster), f"cluster {os.fspath(cluster)}"
    raise TypeError(f"cluster={cluster!r} is not a cluster: pass a tess_compile.analysis.cluster.Cluster, the path "
                     "of a JSON file Cluster.save wrote, or None for the calibrated default")


class Resolved(NamedTuple):
    """`resolve_auto`'s answer: the concrete options, the program compiled for them while
    pricing (None: compile it), and the line that says what auto chose ("" if nothing was auto)."""

    options: CompileOptions
    program: Program | None
    summary: str


def resolve_auto(model: nn.Module, mesh: Mesh, example_inputs, options: CompileOptions,
                 cluster: Cluster | str | os.PathLike | None = None, **boundary) -> Resolved:
    """`options` with "auto" replaced by the choice of `choose_schedule` on `cluster` (see
    `load_cluster`, read even if nothing is auto), logged on the `tess_compile` logger."""
    cluster, name = load_cluster(cluster)
    if not options.auto:
        return Resolved(options, None, "")
    fields = ", ".join(f"{field}=auto" for field in options.auto)
    if not has_summa_steps(mesh):
        ((summa, keep),) = candidates(mesh, options)
        summary = f"{fields}: {summa}, keep_blocks={keep} on mesh {mesh} (no SUMMA steps to schedule)"
        log.info("%s", summary)
        return Resolved(dataclasses.replace(options, summa=summa, keep_blocks=keep), None, summary)
    choice = choose_schedule(model, mesh, example_inputs, options, cluster, **boundary)
    summary = f"{fields}: chose {_summary(choice, mesh)} on {name}"
    log.info("%s", summary)
    return Resolved(choice.options, choice.program, summary)


def compile_auto(model: nn.Module, mesh: Mesh, example_inputs, options: CompileOptions,
                 cluster: Cluster | str | os.PathLike | None = None, **boundary) -> tuple[Program, str]:
    """The program of `options` (`compile_model` with `boundary`'s keywords), "auto" resolved on
    `cluster` first (`resolve_auto`, whose priced program is reused), and its summary line."""
    resolved = resolve_auto(model, mesh, example_inputs, options, cluster, **boundary)
    program = resolved.program
    if program is None:
        program = compile_model(model, mesh, example_inputs, options=resolved.options, **boundary)
    return program, resolved.summary


def _summary(choice: ScheduleChoice, mesh: Mesh) -> str:
    """`gather, keep_blocks=False on mesh ... (predicted 1.2 ms/step; broadcast 1.5 ms, ...)`."""
    best = choice.best
    others = [f"{item.label} {_ms(item.time.step_s)}{'' if item.memory.total <= choice.budget else ' (over memory)'}"
              for item in choice.priced if item is not best]
    text = f"{best.summa}, keep_blocks={best.keep_blocks} on mesh {mesh} (predicted {_ms(best.time.step_s)}/step"
    text += f"; {', '.join(others)})" if others else ")"
    if not choice.fits:
        text += f"; none fits the memory of {choice.budget / GB:.3g} GB per rank: the fastest"
    return text


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
