"""The compile driver: a model in, a `Program` out, the passes called in order.

    capture (+ boundary, autocast) -> (shorten blocks) -> (causal convs) -> (recompute blocks) -> place
            -> (verify placed) -> rewrite
            -> merge products -> alike regions -> (recompute selective) -> (expand blocks) -> bucket gradients
            -> verify rewritten -> report repeated work

`compile_model` runs them as plain calls, one line a pass; a pass that fails
with anything but a user's ValueError is named in a RuntimeError. After each
pass the observers registered with `tess_compile.passes.observers.add_pass_observer` see its graph (a stage dump
registers itself so; `tess_compile.analysis.graph_dump`); the driver never
imports an analysis. The boundary and autocast passes belong to capture's stage: the observers
see capture's graph with their marks and casts. The result, a `Program`, is what both runtimes execute; it is
assembled from what the passes left in `meta` (`tess_compile.core.meta_keys`).

Block reuse: a model whose layers repeat (`tess_compile.passes.repeated_blocks`, five or more)
is placed and rewritten as four of them, block 2 standing for the middle ones, and its per-rank
block 2 is copied for the others (`tess_compile.passes.expand_blocks`): the per-rank graph of a
whole compile, for the price of four blocks. The checks run on the short per-rank graph; the
`Program` carries `Repeats`, the same program with fewer middle blocks, which the analyses price
it from. Where the blocks do not come out alike, and with recompute="selective" (whose choice
weighs the whole graph's saved bytes), the whole graph is compiled.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from tess_compile.passes.alike_regions import alike_regions
from tess_compile.passes.autocast_casts import apply_autocast, needs_casts
from tess_compile.passes.boundary import mark_boundary
from tess_compile.passes.bucket_gradients import bucket_gradients
from tess_compile.passes.capture import capture, shape_env_of
from tess_compile.passes.capture_reuse import owned
from tess_compile.passes.causal_convs import fuse_causal_convs
from tess_compile.passes.expand_blocks import block_labels, expand_blocks, expand_slots, expanded_schedules
from tess_compile.passes.merge_products import merge_products
from tess_compile.passes.observers import PassResult, notify
from tess_compile.passes.place import place
from tess_compile.passes.recompute_blocks import mark_blocks
from tess_compile.passes.recompute_selective import mark_selective
from tess_compile.passes.repeated_blocks import RepeatedBlocks, find_repeated_blocks, shorten
from tess_compile.passes.repeated_work import report_repeated_work
from tess_compile.passes.rewrite import rewrite
from tess_compile.passes.size_limits import lookup_limits
from tess_compile.passes.verify import verify_placed, verify_rewritten
from tess_compile.core.autocast import Autocast
from tess_compile.core.cluster import CALIBRATED_CLUSTER, Cluster
from tess_compile.core.dynamic import DynamicShapes, concrete, local_value
from tess_compile.core.layout import Layout
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import (
    ALIAS_OF,
    ARG_LAYOUTS,
    CONSTANT_VALUE,
    DTYPE,
    GLOBAL_SHAPE,
    GUARDS,
    IN_SPEC,
    LAYOUT,
    LOCAL_INPUT,
    OUT_SPEC,
    ROLE,
    STATE_KEYS,
    TENSORS,
    WEIGHT_INPUT,
)
from tess_compile.core.options import AUTO, CompileOptions
from tess_compile.core.row_split import RowSplit, batch_parts, resolve_row_split
from tess_compile.passes.token_order import with_token_order
from tess_compile.core.program import Program, Repeats, Slot, describe_schedules, input_names, split_example_inputs
from tess_compile.ops.recompute_region import outline_regions

__all__ = ["compile_model", "in_mode", "mode_compiler", "row_split_for"]

log = logging.getLogger("tess_compile")


def compile_model(
    model: torch.nn.Module,
    mesh: Mesh,
    example_inputs,
    *,
    options: CompileOptions | None = None,
    weight_inputs: dict[int, str] | None = None,
    replicate_outputs: bool = False,
    local_inputs: bool = False,
    local_outputs: bool = False,
    carried: dict[int, int] | None = None,
    state_layouts: dict[str, Layout] | None = None,
    cluster: Cluster | None = None,
    autocast: Autocast | None = None,
    reuse_blocks: bool = True,
    priced_only: bool = False,
    **keywords,
) -> Program:
    """Capture `model` on `example_inputs` and compile it for `mesh`.

    `options` (a `CompileOptions` of the mesh's mode), or its fields as `keywords`,
    choose the schedule of the products, what backward keeps or recomputes, and the
    checks (docs/modes.md, docs/memory.md). With summa="auto" (the default) each
    product takes the schedule priced cheapest on `cluster` (default
    `CALIBRATED_CLUSTER`; `tess_compile.passes.product_schedule`); keep_blocks="auto" must be
    resolved first (`tess_compile.analysis.schedule_choice`).

    `weight_inputs` and `replicate_outputs` serve graphs whose weights are
    inputs and whose outputs go on as plain tensors (the torch.compile path).
    `local_inputs` and `local_outputs` serve pipeline stages
    (`tess_compile.scale_out.pipeline`): positional tensor inputs arrive as
    this rank's blocks in their home layout (batch over depth and row,
    features over col) instead of whole, and their gradients are this rank's
    blocks; outputs leave as this rank's blocks in the home layout of their
    shape, so one stage's output block is the next stage's input block.
    `carried` (flat output index -> flat input index) serves state a caller feeds
    back (a KV cache, `tess_compile.generation`): each such output leaves as this
    rank's block in the layout it is computed in, and its input arrives as this
    rank's block in that same layout (`tess_compile.passes.place`).
    `state_layouts` (parameter or buffer name -> layout) fixes those tensors' layouts, for a program
    that runs on the shards of another (a generation step on a sharded module's).
    `autocast` (device type, dtype): the program runs under that torch.autocast, its casts written
    into the graph (`tess_compile.passes.autocast_casts`); the runtimes run it with autocast off.
    `reuse_blocks=False` compiles every repeated block (module docstring): the same program, slower.
    `priced_only=True` (the planner's) gives a program only to price: with block reuse its graph is the
    short per-rank graph, which `Program.repeats` extends, and which must not run; and unless `strict`,
    the report of repeated work names the ops that run replicated only (the planner prints the
    redundant work).
    """
    options = CompileOptions.resolve("compile_model", options, keywords, mode=mesh.mode)
    if options.keep_blocks == AUTO:
        raise ValueError("keep_blocks='auto' must be resolved before compiling: every face of tess_compile prices "
                         "both on a cluster (tess_compile.analysis.compile_entry.compile_for); here pass "
                         "keep_blocks=True or False")
    if options.dynamic and local_inputs:
        raise ValueError("dynamic=True is not supported for pipeline stages yet (their inputs arrive as this rank's "
                         "blocks, whose sizes are not the global ones): compile the stages with dynamic=False")
    args, kwargs = split_example_inputs(example_inputs)
    start = time.perf_counter()
    run = _Passes(mesh, options.dynamic)
    rows = row_split_for(options, mesh, args, kwargs, weight_inputs)
    batch_factor = batch_parts(rows.batch, mesh) if options.dynamic else None
    gm = run("capture", capture, model, args, kwargs, weight_inputs=weight_inputs, batch_factor=batch_factor,
             autocast=autocast, shared=True, guarded=False)
    rows = with_token_order(gm, rows, options, mesh)
    if local_inputs or local_outputs or carried or needs_casts(gm, autocast):
        # capture's stage, annotated in place: the observers (and the stage dumps' numbering) see it as capture
        gm = owned(gm)
        gm = mark_boundary(gm, mesh, local_inputs=local_inputs, local_outputs=local_outputs, carried=carried)
        gm = apply_autocast(gm, autocast)
    cluster = CALIBRATED_CLUSTER if cluster is None else cluster
    lower = functools.partial(_lower, run, mesh, options, cluster, replicate_outputs=replicate_outputs,
                              rows=rows, state_layouts=state_layouts)
    found = find_repeated_blocks(gm)
    bucket = functools.partial(bucket_gradients, mesh=mesh, **({"block_path": found.path} if found else {}))
    blocks = found if reuse_blocks and options.recompute != "selective" else None
    if blocks is not None:
        placed, short = lower(run("shorten blocks", shorten, gm, blocks))
        first = expand_blocks(short, blocks, 0)  # the program with two middle blocks, if they are alike
        if first is None:
            log.info("repeated blocks: blocks 1 and 2 of %s do not come out alike; the whole graph is compiled",
                     blocks.path)
            blocks = None
    if blocks is None:
        placed, short = lower(owned(gm))
        whole, checked = short, None
    elif priced_only:
        whole, checked = None, bucket(first)
    else:
        whole, checked = run("expand blocks", expand_blocks, short, blocks, blocks.count - 4), bucket(first)
    gm = run("bucket gradients", bucket, whole) if whole is not None else None
    # always: a wrong rule shows here, not at the first forward (block reuse: on the four blocks compiled)
    run("verify rewritten", verify_rewritten, checked or gm, mesh, placed=placed, guarded=False)
    run("report repeated work", report_repeated_work, checked or gm, mesh, placed=placed, strict=options.strict,
        count_flops=not priced_only)
    log.info("compiled %s for mesh %s in %.2fs", type(model).__name__, mesh, time.perf_counter() - start)
    common = (placed, model.training, autocast, rows)
    if blocks is None:
        program = _program(gm, mesh, *common, dynamic=options.dynamic)
    else:
        program = _reused(gm, short, checked, blocks, bucket, mesh, common, options.dynamic)
    return _logged(program, options, cluster)


def _reused(gm: GraphModule | None, short: GraphModule, checked: GraphModule, blocks: RepeatedBlocks,
            bucket: Callable, mesh: Mesh, common: tuple, dynamic: bool) -> Program:
    """The program of a compile with block reuse, with its `Repeats`: of the whole per-rank graph `gm`, or
    where that was not built (priced only) of the short one, `short`, with the whole's slots and schedule
    counts (a program to price, not to run)."""
    copies = blocks.count - 4
    if gm is not None:
        program, schedules = _program(gm, mesh, *common, dynamic=dynamic), None
    else:
        program = _program(short, mesh, *common, dynamic=dynamic, slots=expand_slots(_slots(checked), blocks, copies))
        schedules = expanded_schedules(short, blocks, copies)[1]
    program.repeats = _repeats(short, blocks, bucket, mesh, common, checked, dynamic, schedules)
    return program


def _logged(program: Program, options: CompileOptions, cluster: Cluster) -> Program:
    """`program`, the schedules summa="auto" chose logged."""
    if options.summa == AUTO and program.schedules:
        log.info("summa=auto on mesh %s: %s (priced on %s)", program.mesh, describe_schedules(program.schedules),
                 "CALIBRATED_CLUSTER" if cluster == CALIBRATED_CLUSTER else "the given cluster")
    return program


def _lower(run: _Passes, mesh: Mesh, options: CompileOptions, cluster: Cluster, captured: GraphModule,
           **place_options) -> tuple[GraphModule, GraphModule]:
    """The placed graph of `captured` and its per-rank graph, the gradient buckets not yet made."""
    if place_options["rows"].token_axes():
        captured = run("causal convs", fuse_causal_convs, captured)
    if options.recompute == "blocks":  # before place, which keeps no partial sums over the tokens into a region
        captured = run("recompute blocks", mark_blocks, captured, mesh)
    placed = run("place", place, captured, mesh, strict=options.strict, **place_options)
    if options.checked:
        placed = run("verify placed", verify_placed, placed, mesh)
    gm = run("rewrite", rewrite, placed, mesh, summa=options.summa, keep_blocks=options.keep_blocks, cluster=cluster,
             context=options.context)
    gm = run("merge products", merge_products, gm, mesh)
    gm = run("alike regions", alike_regions, gm, mesh)
    if options.recompute == "selective":
        gm = run("recompute selective", mark_selective, gm, mesh)
    return placed, gm


def _program(gm: GraphModule, mesh: Mesh, placed: GraphModule, training: bool, autocast: Autocast | None,
             rows: RowSplit, *, dynamic: bool, slots: list[Slot] | None = None) -> Program:
    """The `Program` of the per-rank graph `gm` (with `slots`, default those of its placeholders), whose
    outputs and inputs are those of `placed`."""
    return Program(
        mesh=mesh,
        graph=gm,
        slots=_slots(gm) if slots is None else slots,
        output_layouts=_output_layouts(placed),
        output_shapes=_output_shapes(placed),
        in_spec=IN_SPEC.of(gm),
        out_spec=OUT_SPEC.of(gm),
        tensors=TENSORS.of(gm),
        state_keys=STATE_KEYS.of(gm),
        training=training,
        autocast=autocast,
        runnable=outline_regions(gm),
        dynamic=_dynamic_shapes(placed, mesh) if dynamic else None,
        rows=rows,
    )


def row_split_for(options: CompileOptions, mesh: Mesh, args: tuple, kwargs: dict,
                  weight_inputs: dict[int, str] | None = None) -> RowSplit:
    """How the rows of these example inputs split under `options` (`tess_compile.core.row_split`): their
    batch is dim 0 of the first tensor input that is not a weight, their token count dim 1 of the first
    integer input of two or more dims, else of the first float input of three or more."""
    leaves = [x for i, x in enumerate(pytree.tree_leaves((args, kwargs)))
              if i not in (weight_inputs or {}) and isinstance(x, torch.Tensor) and x.dim()]
    batch = leaves[0].shape[0] if leaves else None
    sequences = [x for x in leaves if x.dim() >= 2 and not x.is_floating_point()]
    sequences += [x for x in leaves if x.dim() >= 3 and x.is_floating_point()]
    length = sequences[0].shape[1] if sequences and not options.dynamic else None  # no guard on a symbol
    return resolve_row_split(options.batch_split, options.token_split, batch, length, mesh, options.dynamic)


def _repeats(short: GraphModule, blocks: RepeatedBlocks, bucket: Callable, mesh: Mesh, common: tuple,
             checked: GraphModule, dynamic: bool, schedules: dict[str, int] | None) -> Repeats:
    """The `Repeats` of a program compiled with block reuse from the per-rank graph `short` (its buckets
    not made): the program with m middle blocks is `short` with m - 2 copies of block 2, bucketed
    (`checked` for m = 2)."""

    @functools.cache
    def with_middle(middle: int) -> Program:
        gm = checked if middle == 2 else bucket(expand_blocks(short, blocks, middle - 2))
        return _program(gm, mesh, *common, dynamic=dynamic)

    def labels(program: Program) -> dict:
        return block_labels(program.graph, blocks)

    return Repeats(blocks.count - 2, with_middle, labels, schedules)


class _Passes:
    """Runs the passes of one compile: checks that each gives a graph, names a pass that
    fails (`guarded`: anything but a user's ValueError becomes a RuntimeError naming it),
    and reports each to the observers (`tess_compile.passes.observers`).

    In a dynamic compile the passes ask of symbolic sizes size-obliviously: a rule's `size == 1`
    of a symbolic sequence is False without a guard, the general case, which holds at 1 too."""

    def __init__(self, mesh: Mesh, dynamic: bool = False):
        self.mesh, self.dynamic, self.index, self.nodes = mesh, dynamic, 0, None

    def __call__(self, name: str, run_pass, *args, guarded: bool = True, **kwargs) -> GraphModule:
        start = time.perf_counter()
        try:
            with torch.fx.experimental._config.patch(backed_size_oblivious=self.dynamic):
                gm = run_pass(*args, **kwargs)
        except ValueError:
            raise
        except Exception as err:
            if not guarded:
                raise
            raise RuntimeError(f"tess-compile pass {name!r} failed on mesh {self.mesh}: {err}") from err
        if not isinstance(gm, GraphModule):
            raise AssertionError(f"tess-compile pass {name!r} returned {type(gm).__name__}, not a GraphModule")
        seconds = time.perf_counter() - start
        nodes = len(gm.graph.nodes)
        log.debug("pass %s: %d nodes in %.3fs", name, nodes, seconds)
        notify(PassResult(self.index, name, gm, self.mesh, self.nodes, seconds))
        self.index, self.nodes = self.index + 1, nodes
        return gm


def _dynamic_shapes(placed: GraphModule, mesh: Mesh) -> DynamicShapes | None:
    """The symbolic shapes of a dynamic compile's inputs and outputs, and the conditions on the
    symbols that the passes after capture assumed (the guards they added), if any dim is symbolic."""
    placeholders = [n for n in placed.graph.nodes if n.op == "placeholder"]
    inputs = {ROLE.of(n)[1]: _as_received(n, mesh) for n in placeholders
              if ROLE.of(n)[0] == "input" and isinstance(n.meta["val"], torch.Tensor)}
    names = input_names(IN_SPEC.of(placed))
    output = next(n for n in placed.graph.nodes if n.op == "output")
    outputs = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in pytree.tree_leaves(output.args[0])]
    shape_env = shape_env_of(placed)
    if shape_env is None:
        log.info("dynamic shapes: none (every input dim is fixed)")
        return None
    added = shape_env.guards[GUARDS.of(placed):]
    conditions = [guard.expr for guard in added if guard.expr.free_symbols]
    for guard in added:
        log.debug("dynamic shapes: the compile assumed %s at %s", guard.expr, guard.sloc)
    dynamic = DynamicShapes.of(inputs, outputs, shape_env, conditions, names, lookup_limits(placed))
    log.info("dynamic shapes: %s",
             dynamic.describe(names) if dynamic is not None else "none (every input dim is fixed)")
    return dynamic


def _as_received(node: torch.fx.Node, mesh: Mesh) -> torch.Tensor:
    """An input's captured value as a call passes it: whole, or a local input's block."""
    val = node.meta["val"]
    return local_value(val, LAYOUT.of(node), mesh) if LOCAL_INPUT.has(node) else val


def _slots(gm: GraphModule) -> list[Slot]:
    """A `Slot` per placeholder of the per-rank graph `gm`, in order."""
    slots = []
    for node in gm.graph.find_nodes(op="placeholder"):
        role, name = ROLE.of(node)
        if CONSTANT_VALUE.has(node) or not LAYOUT.has(node):
            slots.append(Slot(role, str(name), None, (), None))
            continue
        if role == "input" and LOCAL_INPUT.has(node):
            role = "local input"  # this rank's block, in the layout placement gave it
        elif role == "input":
            role = "weight" if WEIGHT_INPUT.has(node) else "input"  # whole: its layout is replicated
        slots.append(Slot(role, str(name), LAYOUT.of(node), GLOBAL_SHAPE.of(node), DTYPE.of(node), ALIAS_OF.get(node)))
    return slots


def _output_shapes(placed: GraphModule) -> list[tuple[int, ...] | None]:
    output = next(n for n in placed.graph.nodes if n.op == "output")
    values = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in pytree.tree_leaves(output.args[0])]
    return [concrete(v.shape) if isinstance(v, torch.Tensor) else None for v in values]


def _output_layouts(placed: GraphModule) -> list[Layout | None]:
    output = next(n for n in placed.graph.nodes if n.op == "output")
    needed = ARG_LAYOUTS.of(output)
    return [needed.get(n) if isinstance(n, torch.fx.Node) else None for n in pytree.tree_leaves(output.args[0])]


def mode_compiler(model: torch.nn.Module, mesh: Mesh, example_inputs, options: CompileOptions,
                  **boundary) -> Callable[..., Program]:
    """`compile(training, autocast=None)`: `compile_model(model, mesh, example_inputs, options=options,
    autocast=autocast, **boundary)` with the model in train (True) or eval (False) mode, the model's own
    mode restored after (`tess_compile.runtime.programs_by_mode` calls it for a mode not compiled yet)."""

    def compile_in(training: bool, autocast: Autocast | None = None) -> Program:
        with in_mode(model, training):
            return compile_model(model, mesh, example_inputs, options=options, autocast=autocast, **boundary)

    return compile_in


@contextlib.contextmanager
def in_mode(model: torch.nn.Module, training: bool) -> Iterator[None]:
    """`model` in train (True) or eval (False) mode inside the block, its own mode restored after."""
    was = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was)
