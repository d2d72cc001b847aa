"""The planner: rank every mode and mesh of a model on a cluster by predicted step time.

`plan` lists the meshes `gpus` ranks allow in each mode (`candidate_meshes`),
compiles the model for each (on the meta device: no weight is allocated),
prices each program with `tess_compile.analysis.cost_model`, and returns one `PlanRow`
per mesh: those that fit the memory budget first, fastest first, then those
over the budget, then those that did not compile, each with the reason.
With `summa="auto"` each product of a 2-D/2.5-D/3-D mesh takes the schedule
priced cheapest for it (`tess_compile.passes.product_schedule`); with `keep_blocks="auto"`
each mesh is priced with and without keeping the fetched blocks and keeps the
fastest that fits (`schedule_choice.choose_schedule`). Each row also
gives the redundant work of its program (forward FLOPs over all ranks / the
unsharded model's, `accounting.redundant_work`) and the cluster's measured error of
predicted step times (`Cluster.time_error`, `PlanRow.error`): a row that fits within
it of the pick is a tie (`PlanRow.tie`). Each row's `spec` is its whole layout as
a `tess_compile.core.parallel_spec.ParallelSpec`, which `parallelize`, `simulate` and
`tess-compile run --spec` take. `plan_table.format_table` prints the rows,
`PlanRow.to_dict` gives a row as JSON values. `plan(progress=...)` reports each
configuration as it starts (a progress bar's callback: `tess-compile plan` shows one).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from tess_compile.passes.capture_reuse import captures_reused
from tess_compile.analysis.accounting import redundant_work, unsharded_forward_flops
from tess_compile.analysis.candidate_meshes import DEFAULT_MODES, candidate_meshes, mesh_label, mesh_sides
from tess_compile.analysis.cost_model import StepTime
from tess_compile.analysis.memory import MemoryEstimate
from tess_compile.analysis.parallel_plan import (
    Outer,
    batch_size,
    boundary_bytes,
    default_microbatches,
    dp_link_is_intra,
    microbatch_inputs,
    num_blocks,
    outer_options,
    price,
    replicas_per_node,
    zero_note,
)
from tess_compile.analysis.plan_search import bound_time, search_order, zero_options
from tess_compile.analysis.schedule_choice import ScheduleChoice, choose_schedule
from tess_compile.analysis.step_tail import README_STEP, StepTail
from tess_compile.core.cluster import CALIBRATED_CLUSTER, Cluster
from tess_compile.core.fake_run import tensor_bytes, tensor_leaves
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.options import AUTO, CompileOptions, renamed
from tess_compile.core.parallel_spec import ParallelSpec
from tess_compile.core.program import describe_schedules

__all__ = [
    "DEFAULT_MODES",
    "GB",
    "PlanRow",
    "Progress",
    "build_inputs",
    "candidate_meshes",
    "mesh_label",
    "mesh_sides",
    "pick",
    "plan",
]

GB = 1e9


log = logging.getLogger("tess_compile")


# progress(done, total, what): `done` of `total` steps finished and `what` the one starting,
# before each step; once more at the end with done == total and what == "".
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class PlanRow:
    """One candidate: its mesh, predicted time and memory, and a note: why it was dropped,
    or (if it fits) which mesh axes cross nodes."""

    mesh: Mesh
    time: StepTime | None = None  # None if it did not compile
    memory: MemoryEstimate | None = None
    note: str = ""
    fits: bool = False  # compiled, and within the memory budget
    summa: str = "broadcast"  # the schedule option of the matrix products it was priced in ("auto": per product)
    keep_blocks: bool = False  # whether its products keep their fetched blocks for backward
    schedules: tuple[tuple[str, int], ...] = ()  # how many products run each schedule
    redundant_work: float | None = None  # forward FLOPs over all ranks / unsharded; None: none to measure
    outer: Outer = Outer()  # data and pipeline parallelism around the mesh
    error: float | None = None  # the cluster's time_error: how far off predicted step times are; None: unmeasured
    tie: bool = False  # fits, is not the pick, and its step time is within `error` of the pick's
    options: CompileOptions | None = None  # the compile options it was priced with (None: the mesh's mode's defaults)

    @property
    def mode(self) -> str:
        return self.mesh.mode

    @property
    def spec(self) -> ParallelSpec:
        """The row's whole layout: its dp, ZeRO, pp, microbatches, mesh and compile options (with fewer
        microbatches than stages, GPipe: 1F1B then runs alike, and torch's Schedule1F1B takes no fewer)."""
        outer, options = self.outer, self.options or CompileOptions(mode=self.mode)
        schedule = outer.schedule if outer.microbatches >= outer.pp else "gpipe"
        return ParallelSpec(self.mesh.q, self.mesh.d, dp=outer.dp, zero=3 if outer.zero else 0, pp=outer.pp,
                            schedule=schedule, microbatches=outer.microbatches, options=options,
                            zero_shard=outer.zero_shard)

    def to_dict(self) -> dict:
        """The row as JSON values, the same keys on every row (None where it did not compile):
        seconds, bytes per rank and the choices it was priced with (docs/planner.md)."""
        time, memory = self.time, self.memory
        return {
            "mode": self.mode,
            "mesh": mesh_sides(self.mesh),
            "tp_ranks": self.mesh.num_ranks,
            "dp": self.outer.dp,
            "pp": self.outer.pp,
            "microbatches": self.outer.microbatches,
            "zero": self.outer.zero,
            "zero_shard": self.outer.zero_shard,
            "compiled": time is not None,
            "fits": self.fits,
            "step_s": None if time is None else time.step_s,
            "time_s": None if time is None else _time_parts(time),
            "comm_bytes": None if time is None else time.comm_bytes,
            "memory_bytes": None if memory is None else _memory_parts(memory),
            "redundant_work": self.redundant_work,
            "summa": self.summa,
            "keep_blocks": self.keep_blocks,
            "schedules": dict(self.schedules),
            "note": self.note,
            "error": self.error,
            "tie": self.tie,
            "spec": self.spec.to_dict(),
        }


def _time_parts(time: StepTime) -> dict:
    """The predicted seconds of a step: the phases and their compute and communication parts."""
    return {"forward": time.forward_s, "backward": time.backward_s, "optimizer": time.optimizer_s,
            "calls": time.call_s, "forward_compute": time.forward_compute_s, "forward_comm": time.forward_comm_s,
            "backward_compute": time.backward_compute_s, "backward_comm": time.backward_comm_s}


def _memory_parts(memory: MemoryEstimate) -> dict:
    """The predicted bytes per rank by kind at the start of backward, their sum, and the total a
    rank needs (the step's peak)."""
    return {"params": memory.params, "grads": memory.grads, "optimizer": memory.optimizer,
            "activations": memory.activations, "transient": memory.transient, "at_backward": memory.at_backward,
            "total": memory.total}


def pick(rows: Sequence[PlanRow]) -> PlanRow | None:
    """The configuration to use: the fastest that fits (the first of `plan`'s rows), or None."""
    return next((row for row in rows if row.fits), None)


def build_inputs(factory_or_model, example_inputs) -> tuple[nn.Module, object]:
    """The model and its inputs: a model as given, or a factory's result built on the meta device."""
    if isinstance(factory_or_model, nn.Module):
        if example_inputs is None:
            raise ValueError(f"plan() got a {type(factory_or_model).__name__} without example_inputs: pass "
                             "example_inputs=, or a factory that returns (model, example_inputs)")
        return factory_or_model, example_inputs
    if not callable(factory_or_model):
        raise TypeError(f"plan() got a {type(factory_or_model).__name__}: pass an nn.Module with "
                         "example_inputs=, or a factory that takes no arguments and returns (model, example_inputs)")
    with torch.device("meta"):
        result = factory_or_model()
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise ValueError(f"the factory returned {type(result).__name__}, not (model, example_inputs): "
                         "return an nn.Module and its inputs, e.g. `return model, torch.randn(16, 128, 1024)`")
    return result


def _evaluate(model: nn.Module, inputs, mesh: Mesh, cluster: Cluster, *, budget: float,
              overlap: bool, summa: str, strict: bool, keep_blocks: bool | str = False,
              recompute: str = "none", tail: StepTail = README_STEP,
              unsharded_flops: Callable[[], int]) -> tuple[PlanRow, StepTime | None]:
    """The row of `mesh`: `model` compiled and priced in `summa` (and, with keep_blocks="auto", with
    and without keeping the fetched blocks; `schedule_choice.choose_schedule`), the fastest option
    that fits the budget, or the fastest with the reason if none fits or it fails to compile; and
    the cheapest time of all priced (None if it failed), which bounds smaller microbatches.
    `unsharded_flops()` gives the unsharded model's forward FLOPs."""
    options = None
    try:
        options = CompileOptions(mode=mesh.mode, summa=summa, keep_blocks=keep_blocks, recompute=recompute,
                                 strict=strict)
        choice = choose_schedule(model, mesh, inputs, options, cluster, budget=budget, overlap=overlap, tail=tail,
                                 priced_only=True)
    except (ValueError, RuntimeError) as exc:
        log.info("plan: %s %s does not compile: %s", mesh.mode, mesh_label(mesh), exc)
        return PlanRow(mesh, note=f"does not compile: {exc}", options=options), None
    best = choice.best
    cheapest = min((item.time for item in choice.priced), key=lambda time: time.step_s)
    chosen = {"summa": best.summa, "keep_blocks": best.keep_blocks, "schedules": best.schedules,
              "redundant_work": redundant_work(choice.program, unsharded_flops()), "options": choice.options}
    if not choice.fits:
        note = f"needs {best.memory.total / GB:.3g} GB per GPU, over the budget of {budget / GB:.3g} GB"
        return PlanRow(mesh, best.time, best.memory, note, **chosen), cheapest
    inter = [axis for axis in AXES if mesh.size(axis) > 1 and not cluster.is_intra_node(mesh, axis)]
    note = f"inter-node: {', '.join(inter)}" if inter else "within one node"
    return PlanRow(mesh, best.time, best.memory, _schedule_note(choice) + note, fits=True, **chosen), cheapest


def _schedule_note(choice: ScheduleChoice) -> str:
    """`tokens over depth_row, gather for 12 products, keep_blocks; `: the token split where the rows split
    a sequence's tokens (`core.row_split`), and what auto chose (per product, or among candidates)."""
    best = choice.best
    rows = choice.program.rows
    words = [f"tokens over {rows.tokens}"] if rows is not None and rows.tokens != "none" else []
    if best.summa == AUTO and best.schedules:
        words.append(describe_schedules(dict(best.schedules)))
    elif len(choice.priced) > 1:
        words.append(f"summa={best.summa}")
    if best.keep_blocks and words:
        words.append("keep_blocks")
    return f"{', '.join(words)}; " if words else ""


def _sort_key(row: PlanRow) -> tuple:
    if row.time is None:
        return (2, 0.0)
    return (0 if row.fits else 1, row.time.step_s)


def plan(
    factory_or_model: Callable[[], tuple[nn.Module, object]] | nn.Module,
    gpus: int,
    *,
    gpus_per_node: int | None = None,
    cluster: Cluster = CALIBRATED_CLUSTER,
    modes: Sequence[str] = DEFAULT_MODES,
    memory_budget: float | None = None,
    example_inputs=None,
    overlap: bool = False,
    summa: str = "auto",
    keep_blocks: bool | str = "auto",
    recompute: str = "none",
    strict: bool = False,
    dp: int | str = 1,
    pp: int | str = 1,
    microbatches: int | None = None,
    zero: bool | str = "auto",
    progress: Progress | None = None,
    tail: StepTail = README_STEP,
    **deprecated,
) -> list[PlanRow]:
    """Every mesh of `gpus` ranks in `modes`, priced on `cluster`, fastest first.

    `factory_or_model`: a function that takes no arguments and returns
    `(model, example_inputs)`, called under `torch.device("meta")`; or a
    model with `example_inputs=`. `gpus_per_node` overrides the cluster's.
    `memory_budget` (bytes per GPU; default the cluster's memory) drops
    the meshes that need more. Rows that fit come first, by predicted step
    time, then those over budget, then those that did not compile; `note`
    says why a row was dropped. Each row's `error` is `cluster.time_error`;
    `tie` marks a row that fits within it of the first (the pick).
    `overlap`: see `tess_compile.analysis.cost_model.predict_time`.
    `summa`: a schedule of the matrix products, or "auto" for each product's
    cheapest (`PlanRow.schedules`). `keep_blocks`: True, False, or
    "auto" to price both and keep the fastest that fits the memory budget
    (`PlanRow.keep_blocks`). `recompute` ("none", "blocks", "selective"; the
    old name `checkpoint=` is deprecated) and `strict` go to `compile_model`.
    `dp` data-parallel replicas and `pp` pipeline stages (numbers, or "auto" for every one that divides the GPUs,
    the batch and the model's repeated blocks) wrap each mesh of
    `gpus / (dp * pp)` ranks, with `microbatches` per step (default
    `parallel_plan.default_microbatches`) and, with `zero`, parameters,
    gradients and optimizer state sharded over dp by FSDP2 (`tess_compile.analysis.parallel_plan`;
    "auto", the default: each configuration with dp > 1 with and without).
    `progress(done, total, what)`, if given, is called before each configuration is
    compiled and priced (`what` names it: "2.5d [4, 4, 4], dp 1, pp 1") and once at the
    end (`Progress`); `tess-compile plan` passes a progress bar.
    `tail`: the step around the model's call that each row prices (`tess_compile.analysis.step_tail`):
    README's loop by default (the output gathered on every rank, a loss outside, `zero_grad()` to None).
    """
    if deprecated:  # checkpoint=, recompute's old name
        given = renamed("tess_compile.plan", deprecated, stacklevel=3)
        if set(given) != {"recompute"}:
            unknown = sorted(set(given) - {"recompute"})[0]
            raise TypeError(f"tess_compile.plan() got an unexpected keyword argument {unknown!r}")
        recompute = given["recompute"]
    if gpus_per_node is not None:
        cluster = replace(cluster, gpus_per_node=gpus_per_node)
    budget = cluster.memory if memory_budget is None else memory_budget
    if not budget > 0:
        raise ValueError(f"memory_budget={memory_budget!r}: use bytes per GPU > 0, e.g. 40e9")
    model, inputs = build_inputs(factory_or_model, example_inputs)
    batch = batch_size(inputs)
    configs = []  # (Outer, mesh, microbatch rows)
    for dp_, pp_ in outer_options(gpus, dp, pp, num_blocks(model), batch):
        meshes = _meshes_or_none(gpus // (dp_ * pp_), modes, fixed=(dp, pp) != ("auto", "auto"))
        rows_per_group = None if batch is None else batch // dp_
        m = microbatches or (1 if rows_per_group is None else default_microbatches(rows_per_group, pp_))
        if rows_per_group is not None and rows_per_group % m:
            raise ValueError(f"microbatches={m} does not divide the batch of {rows_per_group} rows per "
                             f"data-parallel replica (batch {batch}, dp={dp_}): use a divisor of {rows_per_group}")
        micro = None if batch is None else rows_per_group // m
        configs += [(Outer(dp_, pp_, m, sharded, zero_shard=shard), mesh, micro) for mesh in meshes
                    for sharded, shard in zero_options(zero, dp_, replicas_per_node(cluster, mesh.num_ranks, pp_))]
    if not configs:
        raise ValueError(f"no (dp, pp, mesh) of {gpus} GPUs in modes {', '.join(modes)} with dp={dp!r}, pp={pp!r}: "
                         "pick other modes or GPU counts, or let dp and pp be 'auto'")
    with captures_reused():  # one export per microbatch size serves every mesh
        rows = _rows(model, inputs, configs, cluster, budget=budget, overlap=overlap, summa=summa, strict=strict,
                     keep_blocks=keep_blocks, recompute=recompute, tail=tail, progress=progress or _no_progress,
                     units=num_blocks(model))
    return _mark_ties(sorted(rows, key=_sort_key), cluster.time_error)


def _rows(model: nn.Module, inputs, configs: list, cluster: Cluster, *, progress: Progress, units: int,
          **options) -> list[PlanRow]:
    """The row of each configuration (Outer, mesh, microbatch rows) of `plan`: each (mesh, microbatch)
    compiled once (`_evaluate` with `options`), the largest microbatch of each mesh first, the others
    skipped where a bound from it shows they cannot win (`tess_compile.analysis.plan_search`); ZeRO
    in `units` FSDP2 units (the model's repeated blocks)."""
    batch, budget = batch_size(inputs), options["budget"]
    unsharded_flops = functools.cache(lambda rows: unsharded_forward_flops(  # once per microbatch size compiled
        model, inputs if rows in (None, batch) else microbatch_inputs(inputs, batch, rows)))
    boundary = functools.cache(lambda: boundary_bytes(model, inputs))  # once a pipeline is priced
    evaluated: dict[tuple, tuple[PlanRow, StepTime | None]] = {}  # (mesh, micro) -> row, cheapest time priced
    rows: dict[int, PlanRow] = {}
    best = math.inf
    first, rest = search_order(list(enumerate(configs)), key=lambda config: (config[1][1], config[1][2]))
    for done, (number, (outer, mesh, micro)) in enumerate([*first, *rest]):
        what = f"{mesh.mode} {mesh_label(mesh)}, dp {outer.dp}, pp {outer.pp}"
        progress(done, len(configs), what)
        micro_inputs = inputs if micro in (None, batch) else microbatch_inputs(inputs, batch, micro)
        block = _stage_block(boundary, mesh, micro, batch) if outer.pp > 1 else 0
        held_inputs = sum(map(tensor_bytes, tensor_leaves(micro_inputs))) if outer.pp > 1 else 0
        bound = _bound(evaluated, outer, mesh, micro, cluster, budget, block, held_inputs, units)
        if bound is not None and bound.time.step_s > best * (1 + (cluster.time_error or 0)):
            rows[number] = replace(bound, time=None, memory=None, fits=False, note=(
                f"not compiled: a step takes at least {bound.time.step_s:.4g} s here (priced from a larger "
                f"microbatch of the mesh), more than the fastest's {best:.4g} s"))
            continue
        log.info("plan: compiling %s for %s (%d of %d)", type(model).__name__, what, done + 1, len(configs))
        if (mesh, micro) not in evaluated:
            evaluated[(mesh, micro)] = _evaluate(model, micro_inputs, mesh, cluster,
                                                 unsharded_flops=functools.partial(unsharded_flops, micro), **options)
        rows[number] = _around(evaluated[(mesh, micro)][0], outer, cluster, budget, block, held_inputs, units)
        if rows[number].fits:
            best = min(best, rows[number].time.step_s)
    progress(len(configs), len(configs), "")
    return [rows[number] for number in range(len(configs))]


def _bound(evaluated: dict, outer: Outer, mesh: Mesh, micro: int | None, cluster: Cluster, budget: float,
           block: int, held_inputs: int, units: int) -> PlanRow | None:
    """A row whose step is a lower bound of (outer, mesh, micro)'s, from the smallest larger microbatch of
    the mesh priced (`plan_search.bound_time`); None where there is none."""
    larger = [rows for (other, rows), (_, cheapest) in evaluated.items()
              if other == mesh and rows is not None and micro is not None and rows > micro and cheapest is not None]
    if not larger:
        return None
    rows = min(larger)
    row, cheapest = evaluated[(mesh, rows)]
    return _around(replace(row, time=bound_time(cheapest, micro, rows)), outer, cluster, budget, block, held_inputs,
                   units)


def _no_progress(done: int, total: int, what: str) -> None:
    """The `Progress` of a plan nobody watches."""


def _meshes_or_none(gpus: int, modes: Sequence[str], fixed: bool) -> list[Mesh]:
    """`candidate_meshes` (one for a single rank: every mode is the same program there),
    or none where enumerating (dp, pp) leaves a count no mode takes."""
    try:
        meshes = candidate_meshes(gpus, modes)
    except ValueError:
        if fixed:
            raise
        return []
    return meshes[:1] if gpus == 1 else meshes


def _mark_ties(rows: list[PlanRow], error: float | None) -> list[PlanRow]:
    """`rows` (in `plan`'s order) with `error` set on each, and `tie` on each that fits, is not the
    pick, and whose predicted step time is at most the pick's times `1 + error`."""
    best = pick(rows)

    def ties(row: PlanRow) -> bool:
        return (error is not None and row.fits and row is not best
                and row.time.step_s <= best.time.step_s * (1 + error))

    return [replace(row, error=error, tie=ties(row)) for row in rows]


def _stage_block(boundary: Callable[[], int], mesh: Mesh, micro: int | None, batch: int | None) -> int:
    """Bytes of this rank's block of the activation at a stage boundary, for a microbatch of `micro`
    rows: `boundary()`'s share of them, split over the ranks of a 2-D, 2.5-D or 3-D mesh (batch and
    features), whole on every rank of a 1-D one."""
    share = boundary() if micro is None or batch is None else boundary() * micro // batch
    return share if mesh.mode == "1d" else share // mesh.num_ranks


def _around(row: PlanRow, outer: Outer, cluster: Cluster, budget: float, block_bytes: int = 0,
            input_bytes: int = 0, units: int = 1) -> PlanRow:
    """`row` (one microbatch on its mesh) priced with `outer` around it (`block_bytes`: this rank's
    block of the activation a pipeline stage sends; `input_bytes`: one microbatch's inputs; `units`:
    ZeRO's FSDP2 units)."""
    if row.time is None or outer == Outer():
        return replace(row, outer=outer)
    time, memory = price(row.time, row.memory, outer, row.mesh.num_ranks, cluster, block_bytes, input_bytes, units)
    fits = memory.total <= budget
    if not fits:
        note = f"needs {memory.total / GB:.3g} GB per GPU, over the budget of {budget / GB:.3g} GB"
    else:
        note = row.note if row.fits else "within one node"
        link = "intra" if dp_link_is_intra(cluster, outer, row.mesh.num_ranks) else "inter"
        note += f"; {outer.microbatches} microbatches" if outer.pp > 1 else ""
        note += f"; dp {link}-node" if outer.dp > 1 else ""
        note += zero_note(row.time, row.memory, outer, row.mesh.num_ranks, cluster, units) if outer.zero else ""
    return replace(row, time=time, memory=memory, fits=fits, note=note, outer=outer)
