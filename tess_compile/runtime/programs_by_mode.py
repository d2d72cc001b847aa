"""train() and eval(), and torch.autocast, after compiling: one program per mode, others compiled on first use.

A model may run other ops in training than in evaluation: dropout, BatchNorm's
batch statistics against its running ones, any `if self.training:`. The graph
captured is that of the mode the model was in. Under torch.autocast a program
holds autocast's casts (`tess_compile.core.autocast`). `ProgramsByMode` gives a
runtime the program of the mode the runtime module is in at call time (train
or eval, and the autocast in force for its device), and compiles another
mode's the first time it is asked (with the callback the face passes,
`tess_compile.passes.driver.mode_compiler`), as torch.compile recompiles when
`training` or the autocast state changes. Both programs run on the same shards, so their
parameters and buffers must be laid out alike. `ModeModule` is the base of the
runtime modules: it holds the programs, and each program's inductor compile
when it runs compiled (`tess_compile.runtime.inductor`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tess_compile.core.autocast import Autocast, autocast_state
from tess_compile.core.mesh import Mesh
from tess_compile.core.program import INPUT_ROLES, Program
from tess_compile.runtime import state
from tess_compile.runtime.zero import unsharded_over_dp

__all__ = ["ModeModule", "ProgramsByMode"]


class ProgramsByMode:
    """The program of each mode; `recompile(training, autocast)` compiles a missing one (None: the
    one program serves all, as on the torch.compile path, where Dynamo recompiles)."""

    def __init__(self, program: Program, recompile: Callable[..., Program] | None):
        self.first = program
        self._programs = {(program.training, program.autocast): program}
        self._recompile = recompile

    def adopt(self, program: Program) -> Program:
        """`program` (another of the model's programs, e.g. a generation step) to run on these
        shards; ValueError unless its parameters and buffers are laid out as the first's."""
        _check_same_state(self.first, program)
        return program

    def get(self, training: bool, autocast: Autocast | None = None) -> Program:
        if self._recompile is None:
            return self.first
        key = (training, autocast)
        if key not in self._programs:
            other = self._recompile(training, autocast)
            _check_same_state(self.first, other)
            self._programs[key] = other
        return self._programs[key]


class ModeModule(nn.Module):
    """A runtime module that runs the program of the mode it is in (`train()` / `eval()`),
    as its `programs` give it; with `compile` (True or an inductor mode), through inductor, one
    compile per program."""

    def __init__(self, programs: ProgramsByMode, compile: bool | str):
        super().__init__()
        self.programs, self.compile = programs, compile
        self.training = programs.first.training  # the first program is this mode's until train() / eval()
        self._compiled: dict[int, object] = {}  # id(program) -> its CompiledRank
        first = programs.first
        self._constants = {s.name: first.tensors[s.name] for s in first.slots if s.role == "constant"}
        self.generation = None  # a causal LM's `tess_compile.generation.generate.Generation`, set by the face

    @property
    def program(self) -> Program:
        """The program of the mode this module is in and the autocast in force for its device."""
        device = self.__dict__.get("device")
        return self.programs.get(self.training, None if device is None else autocast_state(device.type))

    @property
    def mesh(self) -> Mesh:
        return self.program.mesh

    def generate(self, *args, **kwargs):
        """The model's `generate` on these shards, for a transformers causal LM compiled with
        `dynamic=True` (docs/generation.md); a ZeRO module's parameters whole over the data-parallel
        dims while it runs (`unsharded_over_dp`)."""
        if self.generation is None:
            raise ValueError("generate runs on a transformers causal LM (a PreTrainedModel with generate) "
                             "compiled with dynamic=True: shard or simulate it so")
        with unsharded_over_dp(self):
            return self.generation.generate(self, *args, **kwargs)

    def adopt(self, program: Program) -> Program:
        """Another program of the model readied to run on these shards (`ProgramsByMode.adopt`), its
        constants added to each rank's (`state.add_constants`)."""
        program = self.programs.adopt(program)
        return state.add_constants(program, self._constants, self.rank_modules(), device=self.device)

    def state_layouts(self) -> dict:
        """Parameter and buffer name -> its layout on these shards (a program compiled to run on them
        takes these: `compile_model(..., state_layouts=...)`)."""
        return {name: slot.layout for name, slot in _state_of(self.programs.first).items()}

    def rank_modules(self) -> dict[int, nn.Module]:
        """Rank -> the module of that rank's shards, for the ranks this module runs."""
        raise NotImplementedError

    def compiled_program(self, backward_comm, program: Program | None = None, threaded: bool = False):
        """The `CompiledRank` of this mode's program (or of `program`, one `adopt` readied);
        `backward_comm()` gives the communicator its compiled backward runs under; `threaded`:
        every rank's in its own thread (`CompiledRank`)."""
        from tess_compile.runtime.inductor import CompiledRank  # imports inductor: only when asked for

        program = program or self.program
        if id(program) not in self._compiled:
            self._compiled[id(program)] = CompiledRank(program, backward_comm=backward_comm, threaded=threaded,
                                                       mode=self.compile)
        return self._compiled[id(program)]


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
                f"{slot.role} {name!r} is laid out as {slot.layout} {list(slot.shape)} in {_mode(other)} but "
                f"{before} in {_mode(first)}, the mode the model was compiled in, on mesh {first.mesh}: the two "
                "modes cannot share shards; compile the model in the mode you run it in (model.train() or "
                "model.eval(), and torch.autocast, around sharding), once per mode"
            )


def _mode(program: Program) -> str:
    """"train mode", "eval mode under torch.autocast('cpu', torch.bfloat16)", ..."""
    mode = f"{'train' if program.training else 'eval'} mode"
    return mode if program.autocast is None else f"{mode} under torch.autocast{program.autocast!r}"
