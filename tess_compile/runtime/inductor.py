"""The compile=True runtime: a per-rank program through inductor, forward and backward.

`CompiledRank` hands the per-rank FX graph to inductor's `compile_fx`, the
function `torch.compile(backend="inductor")` runs on the graph Dynamo
captures; this graph is captured already, so Dynamo is skipped. AOTAutograd
traces forward and backward under `TracingComm`, a communicator that emits
every collective as its custom op (`tess::broadcast`, ...). So the
collectives' adjoints, the refetches of `fetched_product` (whose backward
still keeps only this rank's own blocks) and the all-reduces of
`split_norm`'s backward land in the compiled graphs as op calls beside
the local kernels, which inductor compiles, products and norms included:
no graph break anywhere.

Under a real process group (the module's communicator is a `DistComm`) the
inner compile lowers every `tess::` collective of the forward and the backward
graph to torch's functional collectives on the axis's process group
(`tess_compile.runtime.functional_collectives`) before inductor's passes see
it: the collectives are inductor's nodes, which its communication passes
(`COMMUNICATION_PASSES`, by backend: overlap reordering over NCCL, none over
gloo) may reorder and bucket, and no Python runs per collective. Elsewhere (the simulator's threads, `threaded=True`, or any other
communicator) the custom ops stay: at run time each calls the communicator in
force (`use_comm`); the compiled backward runs under `backward_comm()`, phase
"backward", as eager autograd does.

`mode` is inductor's, as `torch.compile(mode=...)` takes it (`COMPILE_MODES`):
"reduce-overhead" runs a rank's compiled graphs as CUDA graphs on CUDA and
is ignored elsewhere, as torch.compile ignores it.

Recompute regions (`tess_compile.ops.recompute_region`) stay in force: their nodes carry
`CheckpointPolicy.MUST_RECOMPUTE`, one `ac_graph_id` per region, so the
partitioner saves a region's inputs and recomputes what backward needs of
it, collectives included, in the backward graph.

The ops are pure (no mutation, no effect tokens): every rank compiles the
same graph with the same passes, so whatever inductor reorders or drops,
it does alike on every rank, and the collectives still meet. (An effectful
op would also make the partitioner refuse checkpoint regions.) Lowered, the
ranks' graphs differ only in constants (group names, coordinates), and
inductor issues functional collectives in graph order.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch._inductor import list_mode_options
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils.checkpoint import CheckpointPolicy

from tess_compile.core.functional_lowerings import AxisGroup
from tess_compile.core.meta_keys import RECOMPUTE_REGION
from tess_compile.core.program import Program
from tess_compile.ops.collectives import Comm, CommRecord, use_comm
from tess_compile.ops.recompute_region import region_runs
from tess_compile.runtime.functional_collectives import axis_groups, collectives_in, lower_collectives

__all__ = [
    "BUCKETING_PASSES",
    "COMMUNICATION_PASSES",
    "COMPILE_MODES",
    "OVERLAP_PASSES",
    "CompiledGraph",
    "CompiledRank",
    "TracingComm",
    "communication_passes",
    "compile_mode_options",
    "inductor_graph",
]


class TracingComm(Comm):
    """Each collective as a call of its custom op (what the compiled graphs hold)."""

    def run(self, op: str, x: torch.Tensor, *args) -> torch.Tensor:
        return getattr(torch.ops.tess, op).default(x, *args)

    def wait(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tess.wait.default(x)


def inductor_graph(graph: GraphModule) -> GraphModule:
    """A copy of the per-rank `graph` whose recompute regions are tagged for AOTAutograd."""
    gm = copy.deepcopy(graph)
    runs = region_runs(gm.graph)
    for node in gm.graph.nodes:
        RECOMPUTE_REGION.pop(node)  # the region's name; AOTAutograd reads a policy under the same key
    for region_id, (_, nodes) in enumerate(runs):
        for node in nodes:  # AOTAutograd's own keys
            node.meta.update(recompute=CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=region_id)
    return gm


# Backward compiled with forward (threads share one compiled function); no common-subexpression
# elimination over the joint graph, which would merge a product's backward refetch with its
# forward fetch and so keep the fetched block for backward. No AOTAutograd cache: its entries are
# keyed by the per-rank graph, which every rank shares, and a hit skips the inner compile, where
# this rank's collectives are lowered (and the compiled backward is put under the communicator);
# inductor's own cache, keyed by the graph inductor gets, serves repeated compiles.
_COMPILE_CONFIG = dict(force_non_lazy_backward_lowering=True, cse=False, enable_autograd_cache=False)


# `compile=` of shard and simulate besides True (inductor's default): inductor's modes, as torch.compile takes them.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_mode_options(mode: bool | str | None, threaded: bool = False) -> dict:
    """Inductor's config for `mode` (`torch._inductor.list_mode_options`; True or None: "default"), as
    torch.compile applies it. `threaded` (the simulator's ranks in threads of one process): without CUDA
    graphs, whose capture and replay are not made for ranks in threads that meet at collectives."""
    mode = "default" if mode is None or mode is True else mode
    if mode not in COMPILE_MODES:
        raise ValueError(
            f"compile={mode!r} is not an inductor mode: pass compile=True (inductor's default), "
            f"or one of {', '.join(map(repr, COMPILE_MODES))}, as torch.compile(mode=...) takes them"
        )
    options = dict(list_mode_options(mode))
    if threaded:
        options["triton.cudagraphs"] = False
    return options


# Inductor's passes over the collectives of a program lowered to functional collectives (inductor config).
# OVERLAP_PASSES: the scheduler moves collectives earlier and their waits later, over the compute they can
# overlap, never raising the peak memory (inductor's recommended passes). BUCKETING_PASSES: all-gathers, and
# reduce-scatters, on one process group merged into one collective each (the FX passes of
# `torch._inductor.fx_passes.bucketing`); it starts the gathers of later products early, so their blocks
# outlive the product that uses them, against the memory plan (docs/memory.md): off by default.
OVERLAP_PASSES = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [
        "reorder_communication_preserving_peak_memory",
        "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory",
    ],
}
BUCKETING_PASSES = {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"}
# The passes a lowered program's compile runs, by the backend that carries its tensors on its process groups
# (`communication_passes`), read at each compile (assign another dict to change them, e.g.
# `COMMUNICATION_PASSES["nccl"] = {**OVERLAP_PASSES, **BUCKETING_PASSES}`); a backend not listed: none.
# None over gloo: the moved waits put several collectives of a process group in flight at once, and a
# compiled [2,2,2] program over 8 gloo processes hung so (one rank waiting on an early reduce-scatter, the
# others timed out in a later all-reduce). They did pay there: 10% to 14% a step (docs/compiled.md).
COMMUNICATION_PASSES: dict[str, dict] = {"nccl": dict(OVERLAP_PASSES), "gloo": {}}


def communication_passes(comm, inputs: list) -> dict:
    """The inductor config of a lowered compile's communication passes: `COMMUNICATION_PASSES` of the
    backend that carries the device of `inputs` on the process groups of `comm` (a `DistComm`), e.g.
    "nccl" or "gloo" (gloo also carries CUDA tensors); none where the axes' backends differ."""
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    backends = {group._get_backend(device).name() for group in comm.groups.values()}
    return COMMUNICATION_PASSES.get(backends.pop(), {}) if len(backends) == 1 else {}


@dataclass(frozen=True)
class CompiledGraph:
    """A graph that inductor compiled for a rank, as inductor got it: its `phase` ("forward", or
    "backward"), the targets of its calls (`str(node.target)`, e.g. "_c10d_functional.all_reduce.default"
    or "tess.broadcast.default"), and the collectives that send bytes in it, one `CommRecord` each, as
    the eager program's communicator records them when they run (`functional_collectives.collectives_in`).
    `lowered`: its `tess::` collectives were lowered to functional collectives."""

    phase: str
    ops: tuple[str, ...]
    collectives: tuple[CommRecord, ...]
    lowered: bool


class CompiledRank:
    """One rank's program compiled by inductor, once per grad mode and pattern of inputs that
    require grad. A `dynamic=True` program is compiled symbolic in its inputs' symbolic dims
    (`SymbolicSizes`), so one compile serves every batch and sequence length; as under Dynamo,
    the code is kept with the guards its compile put on the sizes, and a call that breaks them
    compiles again. `backward_comm()` gives the communicator the compiled backward runs under.
    `threaded`: every rank runs it in its own thread of one process, and its backward is applied
    there, outside the autograd engine (`runtime.threaded.grad_in_thread`), so it is compiled
    without the saved buffers that AOTAutograd lets backward reuse only inside the engine's call.

    Called with a `DistComm` (and not `threaded`), its collectives are lowered to torch's functional
    collectives on the comm's process groups (see the module docstring), so `comm.records` gets none of
    them: `graphs` lists what each compiled graph holds. `mode`: inductor's (`compile_mode_options`)."""

    def __init__(self, program: Program, backward_comm: Callable[[], Comm], threaded: bool = False,
                 mode: bool | str | None = None):
        self.graph = inductor_graph(program.graph)
        self.config = dict(_COMPILE_CONFIG, donated_buffer=not threaded)
        self.inductor_config = compile_mode_options(mode, threaded)
        self.threaded = threaded
        self.dynamic = program.dynamic is not None
        self.sizes = SymbolicSizes.of(program.graph) if self.dynamic else None
        self.backward_comm = backward_comm
        self.graphs: list[CompiledGraph] = []  # every graph inductor compiled, oldest first
        self._groups: dict[str, AxisGroup] | None = None  # this rank's process groups, while a compile lowers
        self._passes: dict = {}  # the communication passes of the compile under way (`communication_passes`)
        self._compiled: dict[tuple, list[tuple[Callable[[list], bool], Callable]]] = {}
        self._lock = threading.Lock()

    def compiled_for(self, inputs: list, comm: Comm | None = None) -> Callable:
        """The compiled function for `inputs` (compiled on first use, backward included); its collectives
        lowered to functional collectives on the process groups of `comm`, a `DistComm` (not `threaded`)."""
        key = (torch.is_grad_enabled(), tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs))
        with self._lock:
            compiled = self._compiled.setdefault(key, [])
            for holds, function in compiled:
                if holds(inputs):
                    return function
            self._groups = None if self.threaded else axis_groups(comm)
            self._passes = communication_passes(comm, inputs) if self._groups is not None else {}
            try:
                new = self._compile(inputs, first=not compiled)
            finally:
                self._groups, self._passes = None, {}
            compiled.extend(new)
            return new[-1][1]

    def compiles(self) -> int:
        """How many times inductor compiled this rank's program."""
        return sum(len(c) for c in self._compiled.values())

    def _compile(self, inputs: list, first: bool) -> list[tuple[Callable[[list], bool], Callable]]:
        """Inductor's code for `inputs`, each with the test of the inputs it serves; the last serves `inputs`
        (`first`: the first compile for this grad mode, which compiles a dynamic program's general code)."""
        with use_comm(TracingComm()), torch._functorch.config.patch(self.config), \
                torch._inductor.config.patch({**self.inductor_config, **self._passes}):
            if self.sizes is not None and self.sizes.takes(inputs):
                return self.sizes.compile(self.graph, inputs, self._inner, general=first)
            function = compile_fx(copy.deepcopy(self.graph), list(inputs), inner_compile=self._inner)
        if not self.dynamic:
            return [((lambda _: True), function)]
        shapes = _shapes(inputs)  # a dynamic program's code for these shapes only
        return [((lambda xs: _shapes(xs) == shapes), function)]

    def __call__(self, comm: Comm, inputs: list) -> list:
        """This rank's outputs, the forward's collectives carried by `comm` (lowered onto its process
        groups where it is a `DistComm`)."""
        function = self.compiled_for(inputs, comm)
        with use_comm(comm):
            return function(*inputs)

    def _inner(self, gm: GraphModule, example_inputs, **kwargs):
        """Inductor's inner compile of a forward or backward graph, its collectives lowered first where
        this compile runs on process groups; the graph recorded in `graphs`."""
        phase = "backward" if kwargs.get("is_backward") else "forward"
        collectives = tuple(collectives_in(gm, phase))
        if self._groups is not None:
            lower_collectives(gm, self._groups)
        ops = tuple(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        self.graphs.append(CompiledGraph(phase, ops, collectives, lowered=self._groups is not None))
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        return _under_comm(compiled, self.backward_comm) if phase == "backward" else compiled


def _shapes(inputs: list) -> tuple:
    return tuple((tuple(x.shape), x.stride()) if isinstance(x, torch.Tensor) else x for x in inputs)


@dataclass
class SymbolicSizes:
    """The symbolic dims of a dynamic program's per-rank inputs, for inductor: each symbol of the
    program (a batch captured as `2*s0`: `s0`) is read from the first input dim that holds it, as
    `size // factor`, and passed as an integer input of its own ahead of the tensors, as Dynamo
    passes sizes. So every size inductor sees is a multiple of a symbol it can bind, never
    `2 * (s // 2)`."""

    dims: list[dict[int, tuple[sympy.Symbol, int]]]  # per input: dim -> (symbol, factor)
    reads: dict[sympy.Symbol, tuple[int, int, int]]  # symbol -> (input, dim, factor) it is read from

    @classmethod
    def of(cls, graph: GraphModule) -> SymbolicSizes | None:
        """From the placeholders' captured values; None if a symbolic dim is not `factor * symbol`."""
        dims, reads = [], {}
        for index, node in enumerate(graph.graph.find_nodes(op="placeholder")):
            val = node.meta.get("val")
            found = {}
            for dim, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
                if isinstance(size, torch.SymInt):
                    factor, symbol = size.node.expr.as_coeff_Mul()
                    if not (isinstance(symbol, sympy.Symbol) and factor.is_Integer and factor > 0):
                        return None
                    found[dim] = (symbol, int(factor))
                    reads.setdefault(symbol, (index, dim, int(factor)))
            dims.append(found)
        return cls(dims, reads)

    def takes(self, inputs: list) -> bool:
        """Whether `inputs` fit symbolic code: contiguous where a dim is symbolic (the code's strides)."""
        return all(x.is_contiguous() for x, d in zip(inputs, self.dims) if d)

    def values(self, inputs) -> list[int]:
        """The symbols' values in a call with `inputs`."""
        return [inputs[i].size(dim) // factor for i, dim, factor in self.reads.values()]

    def compile(self, graph: GraphModule, inputs: list, inner, general: bool) -> list[tuple[Callable, Callable]]:
        """Inductor's symbolic code for `graph`, each with the test of the inputs its guards admit: with
        `general`, code for sizes of 2 or more; then, where it does not take `inputs` (a size of 0 or 1, which
        Dynamo specialises too), code for their sizes of 0 and 1."""
        compiled = [self._compile(graph, inputs, inner, general=True)] if general else []
        if not compiled or not compiled[0][0](inputs):
            compiled.append(self._compile(graph, inputs, inner, general=False))
        return compiled

    def _compile(self, graph: GraphModule, inputs: list, inner, general: bool) -> tuple[Callable, Callable]:
        """One compile on fake inputs whose sizes are symbols (hinted at 2 or more with `general`)."""
        shape_env = ShapeEnv()
        fake_mode = FakeTensorMode(shape_env=shape_env)
        symints = {}
        for symbol, value in zip(self.reads, self.values(inputs)):
            hint = max(value, 2) if general else value
            source = ConstantSource(f"size_{symbol}")
            expr = shape_env.create_symbol(hint, source, DimDynamic.DYNAMIC, do_not_specialize_zero_one=True)
            symints[symbol] = shape_env.create_symintnode(expr, hint=hint, source=source)
        examples = [*symints.values()]
        for x, dims in zip(inputs, self.dims):
            if isinstance(x, torch.Tensor):
                x = self._fake(fake_mode, x, dims, symints)
            examples.append(x)
        compiled = compile_fx(_with_size_inputs(graph, len(symints)), examples, inner_compile=inner)
        code = shape_env.produce_guards_expression(examples)

        def holds(xs: list) -> bool:
            return code is None or shape_env.evaluate_guards_expression(code, [*self.values(xs), *map(_as_guarded, xs)])

        return holds, lambda *xs: compiled(*self.values(xs), *xs)

    @staticmethod
    def _fake(fake_mode: FakeTensorMode, x: torch.Tensor, dims: dict, symints: dict) -> torch.Tensor:
        if not dims:
            return fake_mode.from_tensor(x, static_shapes=True)
        shape = [dims[i][1] * symints[dims[i][0]] if i in dims else size for i, size in enumerate(x.shape)]
        with fake_mode:
            return torch.empty(shape, dtype=x.dtype, device=x.device).requires_grad_(x.requires_grad)


class _Empty:
    """An empty tensor as the guards read it: the strides of its sizes, zeros included (torch gives an
    empty tensor the strides of sizes of at least 1, which no element is read at)."""

    def __init__(self, x: torch.Tensor):
        self.shape = x.shape

    def size(self):
        return self.shape

    def stride(self):
        return tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))


def _as_guarded(x):
    return _Empty(x) if isinstance(x, torch.Tensor) and x.numel() == 0 else x


def _with_size_inputs(graph: GraphModule, count: int) -> GraphModule:
    """A copy of `graph` taking `count` integer inputs (unused, for inductor to bind) ahead of its own."""
    gm = copy.deepcopy(graph)
    first = next(iter(gm.graph.find_nodes(op="placeholder")))
    with gm.graph.inserting_before(first):
        for k in range(count):
            gm.graph.placeholder(f"size_{k}")
    gm.recompile()
    return gm


def _under_comm(compiled, backward_comm: Callable[[], Comm]):
    """The compiled backward `compiled` (boxed), run with `backward_comm()`'s collectives."""

    def run(args):
        with use_comm(backward_comm(), phase="backward"):
            return compiled(args)

    run._boxed_call = True
    return run
