"""The parallel spec: one frozen object that describes a whole layout, dp x pp x [q, q, d].

A `ParallelSpec` says how many data-parallel replicas there are and whether they shard the
parameters, gradients and optimizer state (ZeRO-3, by FSDP2), how many pipeline stages, in
which schedule and over how many microbatches, the tensor-parallel mesh `[q, q, d]` and its
mode, and the compile options. Ranks fill a tensor-parallel group first, then the pipeline
stages, then the replicas (the Tesseract paper's Figure 6): the world is the DeviceMesh
`(dp, pp, depth, row, col)` of `dp * pp * q*q*d` ranks. With `zero_shard` FSDP2 shards over groups
of that many neighbouring replicas and replicates over the groups (HSDP: `dp = replicas x shards`).

`tess_compile.plan` gives one per row (`PlanRow.spec`), `tess-compile plan --json` writes them and
`--pick FILE` the fastest; `tess_compile.parallelize(model, spec, ...)` gives what a rank runs,
`tess_compile.simulate(model, spec=spec, ...)` runs every rank in this process, and
`tess-compile run --spec FILE` launches it. `to_dict` / `from_dict` and `save` / `load` read and
write it as JSON (docs/scale_out.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from tess_compile.core.mesh import Mesh
from tess_compile.core.options import CompileOptions

__all__ = ["PIPELINE_SCHEDULES", "ParallelSpec", "ZERO_LEVELS"]

# The schedules of a pipeline (torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B).
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
# ZeRO levels: none (each replica holds everything; gradients averaged as DDP does), or 3 (FSDP2
# shards parameters, gradients and optimizer state over the replicas).
ZERO_LEVELS = (0, 3)


@dataclass(frozen=True)
class ParallelSpec:
    """A whole layout: `dp` replicas (ZeRO level `zero`) of a pipeline of `pp` stages (its `schedule`,
    `microbatches` a step) of `[q, q, d]` tensor-parallel groups compiled with `options` (their
    `mode` is the mesh's). With `pp = 1`, `microbatches > 1` accumulates the gradients of that many
    parts of the batch."""

    q: int = 1
    d: int = 1
    dp: int = 1
    zero: int = 0
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    options: CompileOptions = field(default_factory=CompileOptions)
    zero_shard: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.options, CompileOptions):
            raise ValueError(f"ParallelSpec(options={self.options!r}): pass a tess_compile.CompileOptions")
        self.mesh  # noqa: B018  (the mesh's own ValueError for a q and d the mode does not take)
        for name in ("dp", "pp", "microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelSpec({name}={value!r}): {name} is a count, an int >= 1")
        if isinstance(self.zero, bool) or self.zero not in ZERO_LEVELS:
            raise ValueError(f"ParallelSpec(zero={self.zero!r}): the ZeRO levels are 0 (none) and 3 (FSDP2 shards "
                             "parameters, gradients and optimizer state over the replicas): pass zero=0 or zero=3")
        if self.zero and self.dp == 1:
            raise ValueError("ParallelSpec(zero=3, dp=1): ZeRO shards over the data-parallel replicas: pass dp > 1, "
                             "or zero=0")
        if self.zero_shard and not (self.zero and isinstance(self.zero_shard, int) and 1 < self.zero_shard < self.dp
                                    and self.dp % self.zero_shard == 0):
            raise ValueError(f"ParallelSpec(dp={self.dp}, zero={self.zero}, zero_shard={self.zero_shard!r}): HSDP shards "
                             "ZeRO-3 over groups of zero_shard replicas, a divisor of dp between 1 and dp: pass zero=3 "
                             "and such a zero_shard, or zero_shard=0 (shard over all dp)")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"ParallelSpec(schedule={self.schedule!r}): use one of {', '.join(PIPELINE_SCHEDULES)}")
        if self.pp > 1 and self.schedule == "1f1b" and self.microbatches < self.pp:
            raise ValueError(f"ParallelSpec(pp={self.pp}, microbatches={self.microbatches}, schedule='1f1b'): 1F1B "
                             f"runs at least as many microbatches as stages: pass microbatches >= {self.pp}, or "
                             "schedule='gpipe'")
        if self.pp > 1 and self.options.dynamic:
            raise ValueError(f"ParallelSpec(pp={self.pp}) with dynamic=True: pipeline stages compile per shape; "
                             "pass dynamic=False, or pp=1")

    @property
    def mode(self) -> str:
        return self.options.mode

    @property
    def mesh(self) -> Mesh:
        """The tensor-parallel mesh `[q, q, d]` in the options' mode."""
        return self.options.mesh(self.q, self.d)

    @property
    def world_size(self) -> int:
        """The ranks of the whole layout: `dp * pp * q*q*d`."""
        return self.dp * self.pp * self.mesh.num_ranks

    def describe(self) -> str:
        """`dp 2 x pp 2 x 2.5d [q=2, q=2, d=2] (1f1b, 4 microbatches), ZeRO-3`."""
        tensor = str(self.mesh) if self.mode == "1d" else f"{self.mode} {self.mesh}"
        text = f"dp {self.dp} x pp {self.pp} x {tensor}"
        if self.pp > 1 or self.microbatches > 1:
            text += f" ({self.schedule + ', ' if self.pp > 1 else ''}{self.microbatches} microbatches)"
        if self.zero_shard:
            return text + f", HSDP ({self.dp // self.zero_shard} replicas of ZeRO-3 over {self.zero_shard})"
        return text + (f", ZeRO-{self.zero}" if self.zero else "")

    def to_dict(self) -> dict:
        """The spec as JSON values: its counts and names, and its options by field."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        return {**values, "options": dataclasses.asdict(self.options)}

    @classmethod
    def from_dict(cls, data: dict) -> ParallelSpec:
        """The spec `to_dict` gave (missing keys take their defaults); a ValueError naming an unknown key."""
        if not isinstance(data, dict):
            raise ValueError(f"a parallel spec is a JSON object, not {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        option_names = [f.name for f in dataclasses.fields(CompileOptions)]
        options = data.get("options", {})
        unknown = [key for key in data if key not in names] + [key for key in options if key not in option_names]
        if unknown:
            raise ValueError(f"unknown keys {unknown} in a parallel spec: its keys are {', '.join(names)}, and the "
                             f"options' {', '.join(option_names)}")
        return cls(**{key: value for key, value in data.items() if key != "options"}, options=CompileOptions(**options))

    def save(self, path: str | os.PathLike) -> None:
        """Write the spec as JSON to `path`."""
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_dict(), file, indent=2)
            file.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ParallelSpec:
        """The spec in the JSON file at `path` (`save`'s); a ValueError naming the file if it is not one."""
        try:
            with open(path, encoding="utf-8") as file:
                return cls.from_dict(json.load(file))
        except (OSError, json.JSONDecodeError, ValueError, TypeError) as exc:
            raise ValueError(f"{os.fspath(path)!r} is not a parallel spec ({exc}): write one with "
                             "ParallelSpec.save or `tess-compile plan --pick FILE`") from None
