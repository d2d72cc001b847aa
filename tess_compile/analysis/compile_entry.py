"""The one compile entry of the faces: "auto" options resolved once, on the cluster given.

`shard`, `simulate`, `dump`, `check`, the torch.compile backend, pipeline
stages (`pipeline_stage`, `simulate_pipeline`) and generation's programs all
compile through `compile_for`. It loads the cluster (`schedule_choice.load_cluster`),
resolves keep_blocks="auto" on it (`schedule_choice.resolve_auto`, whose priced
program is reused rather than compiled again), and returns the program with
what auto chose and a `recompile(training, autocast)` for another mode of the model
(`tess_compile.passes.driver.mode_compiler` with the resolved options), which
`tess_compile.runtime.programs_by_mode` calls when the model changes mode or runs
under another torch.autocast.
summa="auto" stays "auto": each compile prices every product on the cluster.
`boundary` holds the keywords of `tess_compile.passes.driver.compile_model` that say how a
program meets its caller (weight inputs, local inputs and outputs, carried state).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from tess_compile.passes.capture_reuse import captures_reused
from tess_compile.passes.driver import in_mode, mode_compiler
from tess_compile.analysis.schedule_choice import auto_summary, resolve_auto
from tess_compile.core.autocast import autocast_state, capture_device_type
from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import Mesh
from tess_compile.core.options import CompileOptions
from tess_compile.core.program import Program

__all__ = ["Compiled", "compile_for"]


@dataclass(frozen=True)
class Compiled:
    """A face's compile: the program, the options it was compiled with ("auto" keep_blocks resolved),
    `recompile(training, autocast)` for any mode of the model, the line that says what auto chose ("" if
    nothing was auto) and the cluster it priced on."""

    program: Program
    options: CompileOptions
    recompile: Callable[..., Program]
    summary: str
    cluster: Cluster


def compile_for(model: nn.Module, mesh: Mesh, example_inputs, options: CompileOptions,
                cluster: Cluster | str | os.PathLike | None = None, *, training: bool | None = None,
                **boundary) -> Compiled:
    """Compile `model` for `mesh` on `example_inputs` with `options`, in mode `training` (default the
    model's own, which is restored after) and under the torch.autocast in force for the device the model
    is captured on, "auto" resolved on `cluster` (a `Cluster`, the path of a JSON
    file `Cluster.save` wrote, or None: `CALIBRATED_CLUSTER`); see the module docstring."""
    training = model.training if training is None else training
    autocast = autocast_state(capture_device_type(model, example_inputs))
    with captures_reused():  # keep_blocks="auto" compiles twice, on one capture
        with in_mode(model, training):
            resolved = resolve_auto(model, mesh, example_inputs, options, cluster, autocast=autocast, **boundary)
        recompile = mode_compiler(model, mesh, example_inputs, resolved.options, cluster=resolved.cluster, **boundary)
        program = resolved.program if resolved.program is not None else recompile(training, autocast)
    return Compiled(program, resolved.options, recompile, auto_summary(resolved, program), resolved.cluster)

