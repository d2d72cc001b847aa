"""train() and eval() after compiling: one program per mode, the other compiled on first use.

A model may run other ops in training than in evaluation: dropout, BatchNorm's
batch statistics against its running ones, any `if self.training:`. The graph
captured is that of the mode the model was in. `ProgramsByMode` gives a
runtime the program of the mode the runtime module is in at call time, and
compiles the other mode's from the same model the first time it is asked, as
torch.compile recompiles when `training` changes (and, like it, keeps a
reference to the model). Both programs run on the same shards, so their
parameters and buffers must be laid out alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tess_compile.compiler import INPUT_ROLES, Program, compile_model

__all__ = ["ProgramsByMode", "mode_compiler"]


def mode_compiler(model: torch.nn.Module, *args, **options) -> Callable[[bool], Program]:
    """`compile(training)`: `compile_model(model, *args, **options)` with the model in
    train (True) or eval (False) mode, the model's own mode restored after."""

    def compile_in(training: bool) -> Program:
        was = model.training
        model.train(training)
        try:
            return compile_model(model, *args, **options)
        finally:
            model.train(was)

    return compile_in


class ProgramsByMode:
    """The program of each mode; `recompile(training)` compiles a missing one (None: the
    one program serves both, as on the torch.compile path, where Dynamo recompiles),
    `prepare` readies it for the runtime."""

    def __init__(self, program: Program, recompile: Callable[[bool], Program] | None,
                 prepare: Callable[[Program], Program] = lambda program: program):
        self.first = program
        self._programs = {program.training: program}
        self._recompile, self._prepare = recompile, prepare

    def get(self, training: bool) -> Program:
        if self._recompile is None:
            return self.first
        if training not in self._programs:
            other = self._prepare(self._recompile(training))
            _check_same_state(self.first, other)
            self._programs[training] = other
        return self._programs[training]


def _state_of(program: Program) -> dict:
    return {s.name: s for s in program.slots if s.role not in INPUT_ROLES and s.role != "constant"}


def _check_same_state(first: Program, other: Program) -> None:
    """ValueError unless every parameter and buffer of `other` is laid out as in `first`."""
    theirs = _state_of(first)
    for name, slot in _state_of(other).items():
        mine = theirs.get(name)
        if mine is None or (mine.layout, mine.shape, mine.dtype) != (slot.layout, slot.shape, slot.dtype):
            before = "absent" if mine is None else f"{mine.layout} {list(mine.shape)}"
            raise ValueError(
                f"{slot.role} {name!r} is laid out as {slot.layout} {list(slot.shape)} in "
                f"{'train' if other.training else 'eval'} mode but {before} in the mode the model was compiled in, "
                f"on mesh {first.mesh}: the two modes cannot share shards; compile the model in the mode you run "
                "it in (model.train() or model.eval() before sharding), once per mode"
            )
