"""tess-compile: a compiler-style Tesseract (2.5-D) tensor-parallel sharding pass for PyTorch.

`shard` runs a model on an initialized world of `q*q*d` ranks; `simulate`
runs every rank in this process. Both take the model's own inputs and the
compile options of `CompileOptions` as keywords: a `mode`, "2.5d" (Tesseract,
the default), "2d" (Optimus, d=1), "3d" (d=q) or "1d" (Megatron-LM over the
same q*q*d ranks; see `tess_compile.core.mesh`), a `summa` schedule of the
matrix products: "auto" (the default: each product's cheapest on a cluster,
`cluster=`), "broadcast" (the papers' q steps), "overlap" (step t+1's
broadcasts in flight during step t's product) or "gather" (one all-gather per
operand, one product), and what backward keeps or recomputes.
`check` compares every simulated rank of a model with the model itself
(outputs, gradients, a step) before a long launch. `plan` ranks the modes and
meshes of a model on a cluster by predicted time, each row's whole layout a
`ParallelSpec` (data-parallel replicas and ZeRO, pipeline stages and
microbatches, the `[q, q, d]` mesh and the compile options), which
`parallelize` runs on every rank (a `RankRun`: what the rank runs, its
pipeline stage included) and `simulate(model, spec=...)` in this process;
`profile_cluster` measures the machine it runs on (a `Cluster` to plan with).

The package's layers, each importing only those before it: `core` (mesh,
layouts, options, programs), `ops` (what a per-rank graph calls), the compiler
`tess_compile.passes` (its folder is `passes/` at the top of the repository,
installed under this package's name) beside `runtime` (distributed, simulated
and compiled execution), `analysis` (accounting, cost model, planner, dumps),
`training`, `scale_out` and `generation`; this file, `backend`, `validation`
(`check`, with `keep_float64`: the oracle and the capture kept in float64), `cli` and `moved` (the old module paths, deprecated) are the face.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch

from tess_compile.analysis.compile_entry import Compiled, compile_for
from tess_compile.analysis.graph_dump import dump
from tess_compile.analysis.planner import plan
from tess_compile.analysis.profiling import profile_cluster
from tess_compile.backend import backend
from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import Mesh
from tess_compile.core.options import CompileOptions, takes_compile_options
from tess_compile.core.parallel_spec import ParallelSpec
from tess_compile.core.program import split_example_inputs
from tess_compile.generation.cache_step import is_causal_lm
from tess_compile.generation.generate import Generation
from tess_compile.moved import install as _install_moved_modules
from tess_compile.runtime.dtensors import full_tensor
from tess_compile.runtime.groups import check_device_mesh, check_zero
from tess_compile.runtime.launch import run_local
from tess_compile.runtime.sharded_module import shard_program
from tess_compile.runtime.simulator import SimulatedModule
from tess_compile.scale_out.data_parallel import SimulatedDataParallel, check_batch, split_batch
from tess_compile.scale_out.pipeline import pipeline_stage
from tess_compile.scale_out.rank_run import RankRun, parallelize, stage_modules
from tess_compile.scale_out.simulated_pipeline import simulate_pipeline
from tess_compile.training.clip import clip_grad_norm_
from tess_compile.training.shard_loading import for_dcp, load_pretrained_shards, load_shards_from
from tess_compile.training.train_step import TrainStep, train_step
from tess_compile.validation import check

__all__ = [
    "Cluster",
    "CompileOptions",
    "Mesh",
    "ParallelSpec",
    "RankRun",
    "TrainStep",
    "backend",
    "check",
    "clip_grad_norm_",
    "dump",
    "for_dcp",
    "full_tensor",
    "load_pretrained_shards",
    "load_shards_from",
    "parallelize",
    "pipeline_stage",
    "plan",
    "profile_cluster",
    "run_local",
    "shard",
    "shard_program",
    "simulate",
    "simulate_pipeline",
    "train_step",
]


_install_moved_modules()  # the old module paths, deprecated (tess_compile.moved)


def _with_generation(module, model: torch.nn.Module, mesh: Mesh, compiled: Compiled):
    """`module`, with a working `generate` if `model` is a transformers causal LM compiled with
    `dynamic=True` (`tess_compile.generation`), its programs compiled with the same options and cluster."""
    if compiled.options.dynamic and is_causal_lm(model):
        module.generation = Generation(model, mesh, compiled.options, compiled.cluster)
    return module


# compile= besides True and False: inductor's modes, as torch.compile(mode=...) takes them
# (`tess_compile.runtime.inductor.COMPILE_MODES`, not imported here: importing inductor is slow).
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _check_compile(compile, where: str) -> None:
    if not isinstance(compile, bool) and compile not in _COMPILE_MODES:
        raise ValueError(
            f"{where}(compile={compile!r}): compile is True (run each rank's program through inductor) "
            f"or False (run it as it is), or one of inductor's modes {', '.join(map(repr, _COMPILE_MODES))}"
        )


@takes_compile_options
def simulate(
    model: torch.nn.Module,
    q: int | None = None,
    d: int | None = None,
    *,
    example_inputs,
    options: CompileOptions | None = None,
    spec: ParallelSpec | None = None,
    dp: int | None = None,
    compile: bool = False,
    cluster: Cluster | str | os.PathLike | None = None,
):
    """Compile `model` for the `[q, q, d]` mesh in `mode` and run all `q*q*d` ranks in this process.

    Called with the model's global inputs it returns the model's global outputs.
    After `backward()`, `full_grads()` gives every parameter's full gradient.
    Returns a `tess_compile.runtime.simulator.SimulatedModule`. The compile
    options (`mode`, `summa`, `keep_blocks`, `recompute`, `strict`, `verify`)
    are those of `CompileOptions`; `summa="auto"` and `keep_blocks="auto"`
    compile the fastest candidate on `cluster` that fits its memory (a
    `tess_compile.core.cluster.Cluster`, the path of a JSON file
    `Cluster.save` wrote, or None: `CALIBRATED_CLUSTER`), logged on the
    `tess_compile` logger (docs/modes.md).

    `spec` (a `ParallelSpec`, e.g. a `plan` row's `spec`), in place of `q`, `d`
    and the options, runs every rank of its `dp x pp x [q, q, d]` layout: with
    `dp > 1`, `example_inputs` and each call take the concatenated batch of all
    replicas (a multiple of `dp*d*q`), replica g computes on its g-th slice,
    outputs are concatenated again, and each parameter's gradient is summed over
    the replicas' (exactly the unsharded model's on the whole batch): a
    `tess_compile.scale_out.data_parallel.SimulatedDataParallel`; with `pp > 1`
    the model is cut into its stages as `parallelize` cuts it
    (`tess_compile.scale_out.rank_run.stage_modules`) and each call runs its
    microbatches through them (`simulate_pipeline`). ZeRO, and the microbatches
    of a spec without a pipeline, change what a rank holds, not the values: the
    simulation runs without them. `dp=N` is the deprecated spelling of
    `spec=ParallelSpec(q, d, dp=N)`.

    `compile=True` runs the per-rank program, forward and backward, through
    inductor, as `shard(..., compile=True)` does, each rank in its own thread
    (docs/compiled.md).
    """
    _check_compile(compile, "tess_compile.simulate")
    if spec is None:
        if q is None or d is None:
            raise TypeError("tess_compile.simulate() needs q and d, or spec=")
        if dp is not None:
            warnings.warn("tess_compile.simulate(dp=...) is deprecated: pass spec=tess_compile.ParallelSpec(q, d, "
                          "dp=N, options=...)", FutureWarning, stacklevel=3)
        spec = ParallelSpec(q, d, dp=1 if dp is None else dp, options=options)
    elif q is not None or d is not None or dp is not None or options != CompileOptions():
        raise TypeError("tess_compile.simulate() got spec= beside q, d, dp or compile options: pass the spec alone "
                        "(its compile options are spec.options)")
    return _simulated(model, spec, example_inputs, compile, cluster)


def _simulated(model: torch.nn.Module, spec: ParallelSpec, example_inputs, compile, cluster):
    """Every rank of `spec` in this process (see `simulate`)."""
    mesh, options = spec.mesh, spec.options
    if spec.pp > 1:
        if compile:
            raise ValueError("tess_compile.simulate(compile=True) runs no pipeline: pass a spec with pp=1, or "
                             "compile=False")
        check_batch(example_inputs, "tess_compile.simulate", spec.dp * spec.microbatches)
        args, kwargs = split_batch(*split_example_inputs(example_inputs), spec.dp * spec.microbatches)[0]
        stages = stage_modules(model, spec.pp, kwargs if kwargs else tuple(args))
        return simulate_pipeline(stages, spec.q, spec.d, example_inputs=example_inputs, options=options,
                                 microbatches=spec.microbatches, dp=spec.dp, cluster=cluster)
    if spec.dp == 1:
        compiled = compile_for(model, mesh, example_inputs, options, cluster)
        module = SimulatedModule(compiled.program, recompile=compiled.recompile, compile=compile)
        return _with_generation(module, model, mesh, compiled)
    check_batch(example_inputs, "tess_compile.simulate", num_groups=spec.dp)
    group_args, group_kwargs = split_batch(*split_example_inputs(example_inputs), spec.dp)[0]
    compiled = compile_for(model, mesh, group_kwargs if group_kwargs else tuple(group_args), options, cluster)
    return SimulatedDataParallel([
        _with_generation(SimulatedModule(compiled.program, recompile=compiled.recompile, compile=compile), model, mesh,
                         compiled) for _ in range(spec.dp)])


@takes_compile_options
def shard(
    model: torch.nn.Module,
    q: int,
    d: int,
    *,
    example_inputs,
    options: CompileOptions | None = None,
    device=None,
    timeout: float | timedelta | None = None,
    mesh=None,
    zero: bool = False,
    compile: bool = False,
    cluster: Cluster | str | os.PathLike | None = None,
):
    """Compile `model` for the `[q, q, d]` mesh in `mode`; call on every rank of a world of `q*q*d`.

    Every rank must pass the same model weights and example inputs (a
    ValueError on every rank names the ranks and tensors that differ).
    Returns a module whose parameters are DTensors holding this rank's shards;
    it takes the model's global inputs (the same batch on every rank) and
    returns DTensors on the mesh (plain tensors for scalars). The compile
    options (`mode`, `summa`, `keep_blocks`, `recompute`, `strict`, `verify`)
    are those of `CompileOptions`; "auto" ones are chosen on `cluster` as in
    `simulate` (the pricing is deterministic: every rank compiles the same
    program). `device` defaults to the current CUDA device under NCCL and the
    CPU otherwise; a collective whose peers do not arrive within `timeout`
    (seconds or a timedelta; default 10 minutes) fails with a message.

    `mesh`: a torch DeviceMesh whose dims include "depth", "row" and "col" of
    sizes `(d, q, q)`; its other named dims (e.g. "dp") are data parallel
    (docs/scale_out.md). Call on every rank of the mesh; each data-parallel
    group passes its own batch (`example_inputs` and the calls: that group's
    batch, of one shape everywhere, a multiple of d*q), every rank of a group
    the same. Parameters and outputs are DTensors on `mesh["depth", "row",
    "col"]`; gradients are averaged over the data-parallel dims, as DDP does.
    `zero=True` also shards parameters, gradients and optimizer state over the
    data-parallel dims with FSDP2 (`fully_shard`; parameters become DTensors on
    the whole mesh). Without `mesh`, the whole world is one `[q, q, d]` mesh.

    `zero=True` is deprecated: a layout with ZeRO is a `ParallelSpec(q, d,
    dp=N, zero=3)`, which `parallelize` runs. A transformers causal LM compiled
    with `dynamic=True` generates (`generate`) with or without `mesh` and `zero`.

    `compile=True` (or one of inductor's modes, as torch.compile takes them)
    runs this rank's program, forward and backward, through inductor
    (torch.compile's compiler), its collectives lowered to torch's
    functional collectives in the compiled graphs, on the first call
    (docs/compiled.md).
    """
    _check_compile(compile, "tess_compile.shard")
    if zero:
        warnings.warn("tess_compile.shard(zero=True) is deprecated: describe the layout as "
                      "tess_compile.ParallelSpec(q, d, dp=N, zero=3) and run it with tess_compile.parallelize",
                      FutureWarning, stacklevel=3)
    tess_mesh = options.mesh(q, d)
    if mesh is not None or zero:  # before compiling: a wrong mesh fails at once
        dp_dims = check_device_mesh(mesh, tess_mesh) if mesh is not None else ()
        check_zero(zero, mesh, dp_dims, tess_mesh)
    compiled = compile_for(model, tess_mesh, example_inputs, options, cluster)
    module = shard_program(compiled.program, device=device, timeout=timeout, recompile=compiled.recompile,
                           mesh=mesh, zero=zero, compile=compile)
    return _with_generation(module, model, tess_mesh, compiled)
