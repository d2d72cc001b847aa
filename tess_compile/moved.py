"""The module paths tess_compile had before its layers (core, ops, runtime, analysis,
training, scale_out), kept as deprecated aliases.

`import tess_compile.cost_model` (or `from tess_compile.launch import run_local`)
still works: the old path is a module whose names are looked up in the modules
that hold their code now, with a FutureWarning that says where to import from.
`tess_compile/__init__.py` installs the finder. (`tess_compile.training` is a
package now; `tess_compile.clip_grad_norm_` is what its old module held.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "install"]

# old module -> the modules that hold its names now
MOVED = {
    "tess_compile.analysis.cluster": ("tess_compile.core.cluster",),
    "tess_compile.accounting": ("tess_compile.analysis.accounting", "tess_compile.core.fake_run",
                                "tess_compile.core.mesh"),
    "tess_compile.calibration": ("tess_compile.analysis.calibration",),
    "tess_compile.checkpoint": ("tess_compile.training.shard_loading",),
    "tess_compile.collectives": ("tess_compile.ops.collectives",),
    "tess_compile.compiled": ("tess_compile.runtime.inductor",),
    "tess_compile.compiler": ("tess_compile.passes.driver", "tess_compile.core.program"),
    "tess_compile.cost_model": ("tess_compile.analysis.cost_model", "tess_compile.core.cluster",
                                "tess_compile.analysis.memory"),
    "tess_compile.data_parallel": ("tess_compile.scale_out.data_parallel", "tess_compile.runtime.groups",
                                   "tess_compile.runtime.zero"),
    "tess_compile.distributed": ("tess_compile.runtime.sharded_module", "tess_compile.runtime.dist_comm",
                                 "tess_compile.runtime.groups", "tess_compile.runtime.dtensors",
                                 "tess_compile.runtime.consistency"),
    "tess_compile.dynamo_backend": ("tess_compile.backend",),
    "tess_compile.grad_buckets": ("tess_compile.ops.grad_bucket",),
    "tess_compile.graph_dump": ("tess_compile.analysis.graph_dump", "tess_compile.analysis.graph_views"),
    "tess_compile.launch": ("tess_compile.runtime.launch",),
    "tess_compile.layout": ("tess_compile.core.layout",),
    "tess_compile.mesh": ("tess_compile.core.mesh",),
    "tess_compile.norms": ("tess_compile.ops.split_norm",),
    "tess_compile.parallel_plan": ("tess_compile.analysis.parallel_plan",),
    "tess_compile.pipeline": ("tess_compile.scale_out.pipeline", "tess_compile.scale_out.simulated_pipeline",
                              "tess_compile.scale_out.stage_ports"),
    "tess_compile.planner": ("tess_compile.analysis.planner", "tess_compile.analysis.plan_table"),
    "tess_compile.products": ("tess_compile.ops.fetched_product",),
    "tess_compile.regions": ("tess_compile.ops.recompute_region",),
    "tess_compile.simulator": ("tess_compile.runtime.simulator", "tess_compile.runtime.threaded"),
    "tess_compile.state": ("tess_compile.runtime.state",),
    "tess_compile.symbolic": ("tess_compile.analysis.symbolic", "tess_compile.analysis.symbolic_shapes"),
    "tess_compile.train_eval": ("tess_compile.runtime.programs_by_mode", "tess_compile.passes.driver"),
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED`; each becomes a module that reads its names from the new ones."""

    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        homes = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} is deprecated: its code moved to {', '.join(homes)}; import from there",
                      FutureWarning, stacklevel=2)
        parts = [importlib.import_module(home) for home in homes]

        def lookup(name: str):
            for part in parts:
                if hasattr(part, name):
                    return getattr(part, name)
            raise AttributeError(f"module {module.__name__!r} (moved to {', '.join(homes)}) has no attribute {name!r}")

        module.__getattr__ = lookup
        module.__doc__ = f"Deprecated alias of {', '.join(homes)}."


def install() -> None:
    """Put the finder of the old paths on `sys.meta_path` (once)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
