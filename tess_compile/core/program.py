"""A compiled model, `Program`: the per-rank graph and how to feed and read it.

What the compiler (`tess_compile.passes.driver`) produces and every runtime, analysis and
scale-out wrapper reads: the per-rank graph, one `Slot` per placeholder (a
parameter, buffer, constant or input and its layout), the output layouts,
the pytree specs of the model's inputs and outputs, and the model's tensors.
`Program.flatten_inputs` checks a call against what the program was
compiled for before anything runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from tess_compile.core.dynamic import DynamicShapes
from tess_compile.core.layout import Layout, local_block
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import CONSTANT_VALUE, SCHEDULE_COUNTS
from tess_compile.core.row_split import RowSplit

__all__ = ["INPUT_ROLES", "Program", "Repeats", "Slot", "describe_schedules", "input_name", "input_names",
           "split_example_inputs"]

# Slot roles whose values arrive as the module's inputs on every call. A "local input"
# (`compile_model(..., local_inputs=True)`, a pipeline stage's) is this rank's block of
# the input in its layout, not the whole input.
INPUT_ROLES = ("input", "weight", "local input")


@dataclass(frozen=True)
class Slot:
    """One placeholder of the per-rank graph: a parameter, buffer, constant or input."""

    role: str  # "param", "buffer", "constant", "alias", "input", "local input" or "weight" (a weight given as input)
    name: str  # the model's qualified name, or (inputs and weights) the input's index as text
    layout: Layout | None
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    alias_of: str | None = None  # for "alias": the name of the tied tensor


@dataclass(frozen=True)
class Repeats:
    """How a program compiled with block reuse (`tess_compile.passes.repeated_blocks`) repeats: its
    repeated blocks are a first, `middle` alike ones and a last; `short(m)` is the same program with
    m middle blocks (m >= 2), whose middle blocks 2 .. m are copies of one, and `labels(program)` each
    node of such a program's graph by its block (the middle copies by their number; None: none). The
    analyses price a program from two short ones (`tess_compile.analysis.block_reuse`)."""

    middle: int
    short: Callable[[int], Program]
    labels: Callable[[Program], dict]
    # A program compiled only to be priced (its graph the short one): the whole's schedule counts.
    schedules: dict[str, int] | None = None


@dataclass
class Program:
    """A compiled model: the per-rank graph and how to feed and read it."""

    mesh: Mesh
    graph: GraphModule
    slots: list[Slot]
    output_layouts: list[Layout | None]
    output_shapes: list[tuple[int, ...] | None]  # each output's global shape (None: not a tensor)
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    tensors: dict[str, torch.Tensor]  # the model's parameters, buffers, constants
    state_keys: list[str]  # the model's state-dict keys, in its order
    training: bool = True  # the model's mode when it was captured
    # The torch.autocast it runs under, (device type, dtype), its casts in the graph; None: none.
    autocast: tuple[str, torch.dtype] | None = None
    # The per-rank graph as the runtimes run it, its recompute regions outlined
    # (`tess_compile.ops.recompute_region`); None: the graph itself (it has none).
    runnable: GraphModule | None = None
    # A `dynamic=True` compile's symbolic input and output shapes (None: every shape is fixed).
    dynamic: DynamicShapes | None = None
    # How the inputs' batch and tokens split (`tess_compile.core.row_split`); None: not recorded.
    rows: RowSplit | None = None
    # Compiled with block reuse: the same program with fewer middle blocks (None: compiled whole).
    repeats: Repeats | None = None

    def __post_init__(self) -> None:
        if self.runnable is None:
            self.runnable = self.graph

    @property
    def params(self) -> list[Slot]:
        return [s for s in self.slots if s.role == "param"]

    @property
    def schedules(self) -> dict[str, int]:
        """How many matrix products run each schedule (`SCHEDULE_COUNTS`, written by `tess_compile.passes.rewrite`;
        of a program priced only, its repeats' whole count)."""
        if self.repeats is not None and self.repeats.schedules is not None:
            return self.repeats.schedules
        return SCHEDULE_COUNTS.get(self.graph, {})

    def local_tensor(self, slot: Slot, rank: int, full: torch.Tensor | None = None, device=None) -> torch.Tensor:
        """The block of a parameter/buffer/constant that `rank` holds (a copy, on `device`; of an
        uneven split, its true chunk).

        Of a meta tensor (a model built on the meta device): an uninitialised
        tensor of the block's shape, so that the full tensor never exists.
        """
        full = self.tensors[slot.name] if full is None else full
        if full.is_meta:
            return torch.empty(slot.layout.chunk_shape(slot.shape, self.mesh, rank), dtype=slot.dtype, device=device)
        return local_block(full.detach(), slot.layout, self.mesh, rank).to(device or full.device, copy=True)

    def flatten_inputs(self, args: tuple, kwargs: dict, device: torch.device | str | None = None) -> list:
        """The call's inputs as the flat list the per-rank graph takes, in the compiled order.

        ValueError, before anything runs, for a call the program was not
        compiled for: other arguments or structure, a tensor of another shape
        (a dynamic program's symbolic dims: `call_output_shapes`) or dtype, a value (not a
        tensor) other than the compiled one, or (if `device` is given, for a runtime that
        does not move inputs) a tensor
        on another device. Keywords may come in any order.
        """
        if not kwargs and len(args) == self._num_positional_leaves and all(isinstance(a, torch.Tensor) for a in args):
            leaves = list(args)  # the compiled structure: tensors, positional only
        else:
            args, kwargs = self._match_structure(tuple(args), dict(kwargs))
            leaves = pytree.tree_leaves((args, kwargs))
        for index, slot in self._input_slots:
            if index >= len(leaves):
                continue
            value = leaves[index]
            if not self._plain_input(slot, index, value, device):  # else: checked already
                self._check_input(slot, self._input_names[index], value, self._compiled_constants.get(index), device)
        return leaves

    def _plain_input(self, slot: Slot, index: int, value, device) -> bool:
        """Whether `value` is a tensor of the slot's compiled shape, dtype (and `device`) for a slot of
        fixed shape: the common call, checked without `_check_input`'s names."""
        return (isinstance(value, torch.Tensor) and slot.dtype is not None and slot.role != "local input"
                and (self.dynamic is None or index not in self.dynamic.inputs)
                and value.shape == slot.shape and value.dtype == slot.dtype
                and (device is None or value.device == torch.device(device)))

    @functools.cached_property
    def _input_slots(self) -> list[tuple[int, Slot]]:
        """(flat input index, slot) of each input slot."""
        return [(int(s.name), s) for s in self.slots if s.role in INPUT_ROLES]

    @functools.cached_property
    def _num_positional_leaves(self) -> int | None:
        """n if the program takes n positional inputs, each one leaf (a tensor), and no keywords."""
        n = self.in_spec.child(0).num_children if self.in_spec.num_children == 2 else -1
        return n if n >= 0 and self.in_spec == pytree.tree_structure(((0,) * n, {})) else None

    @functools.cached_property
    def whole_inputs(self) -> list[int]:
        """Flat indices of the inputs that arrive whole on every rank (not a pipeline stage's local
        blocks): the runtimes sum their gradients over the ranks."""
        return [index for index, slot in self._input_slots if slot.role != "local input"]

    def call_output_shapes(self, flat_inputs: list) -> list[tuple[int, ...] | None]:
        """The global shape of each output of a call with these (flat) inputs: the compiled shapes, or
        a dynamic program's at the call's sizes. For a dynamic program this is the check of its
        symbolic dims (`DynamicShapes.bind`), a ValueError for sizes it cannot take: the runtimes
        call it after `flatten_inputs`, before anything runs."""
        if self.dynamic is None:
            return self.output_shapes
        values = {index: flat_inputs[index] for index in self.dynamic.inputs}
        binding = self.dynamic.bind(values, self._input_names, self.mesh)
        return [None if dims is None else self.dynamic.shape(dims, binding) for dims in self.dynamic.outputs]

    @functools.cached_property
    def _input_names(self) -> list[str]:
        return input_names(self.in_spec)

    def _match_structure(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """`(args, kwargs)` with the keywords in the compiled order; a one-line
        ValueError if the call's structure is not the compiled one."""
        if pytree.tree_structure((args, kwargs)) == self.in_spec:
            return args, kwargs
        fix = "call it with the same arguments as example_inputs"
        compiled_args, compiled_kwargs = self.in_spec.child(0), self.in_spec.child(1)
        keys = list(compiled_kwargs.context or [])
        if len(args) != compiled_args.num_children or sorted(kwargs) != sorted(keys):
            raise ValueError(
                f"called with {len(args)} positional and keywords {sorted(kwargs)}, but compiled for "
                f"{compiled_args.num_children} positional and keywords {sorted(keys)}: {fix}"
            )
        kwargs = {key: kwargs[key] for key in keys}
        named = [(f"positional input {i}", value, compiled_args.child(i)) for i, value in enumerate(args)]
        named += [(f"keyword input {key!r}", kwargs[key], compiled_kwargs.child(i)) for i, key in enumerate(keys)]
        offset = 0
        for name, value, spec in named:
            difference = _first_difference(value, spec, name, offset)
            if difference is not None:
                where, got, wanted, index = difference
                wanted = self._describe_spec(wanted, index)
                raise ValueError(f"{where} is {_describe_value(got)}, but compiled for {wanted}: {fix}")
            offset += spec.num_leaves
        if pytree.tree_structure((args, kwargs)) == self.in_spec:
            return args, kwargs
        raise ValueError(f"the call's inputs do not have the structure the module was compiled for: {fix}")

    def _describe_spec(self, spec: pytree.TreeSpec, index: int) -> str:
        """What the compiled program takes at `spec`, whose first leaf is flat input `index`."""
        if not spec.is_leaf():
            return _describe_container(spec)
        slot = next((s for s in self.slots if s.role in INPUT_ROLES and s.name == str(index)), None)
        if slot is not None and slot.dtype is not None:
            return f"a tensor of shape {list(slot.shape)}"
        compiled = self._compiled_constants
        return f"the value {compiled[index]!r}" if index in compiled else "one tensor or value"

    @functools.cached_property
    def _compiled_constants(self) -> dict[int, object]:
        """The values (not tensors) the program was compiled for, by flat input index."""
        placeholders = [n for n in self.graph.graph.nodes if n.op == "placeholder"]
        return {
            int(slot.name): CONSTANT_VALUE.of(node)
            for slot, node in zip(self.slots, placeholders)
            if slot.role in INPUT_ROLES and CONSTANT_VALUE.has(node)
        }

    def _check_input(self, slot: Slot, name: str, value, compiled, device) -> None:
        fix = "call it with the same arguments as example_inputs"
        if slot.dtype is None:  # compiled for a value such as a flag: the program is specialised to it
            if isinstance(value, torch.Tensor):
                raise ValueError(f"{name} is a tensor, but compiled for the value {compiled!r}: {fix}")
            if _plain(value) and _plain(compiled) and not _same_value(value, compiled):
                raise ValueError(
                    f"{name} is {value!r}, but the module was compiled for {compiled!r} (values that are not "
                    f"tensors are fixed at compile time): call it with {compiled!r}, or compile again with "
                    f"example_inputs that hold {value!r}"
                )
            return
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{name} is {_describe_value(value)}, but compiled for a tensor of shape {list(slot.shape)} "
                f"and dtype {slot.dtype}: {fix}"
            )
        if self.dynamic is not None and int(slot.name) in self.dynamic.inputs:
            pass  # its dims are checked together (`DynamicShapes.bind`)
        elif slot.role == "local input":
            local = tuple(slot.layout.local_shape(slot.shape, self.mesh))
            if tuple(value.shape) != local:
                raise ValueError(
                    f"{name} has shape {list(value.shape)}, but this rank's block of the stage input (global "
                    f"shape {list(slot.shape)}, layout {slot.layout}) is {list(local)} on mesh {self.mesh}: pass "
                    "this rank's block, as the previous stage's rank of the same coordinates gives it"
                )
        elif tuple(value.shape) != slot.shape:
            raise ValueError(
                f"{name} has shape {list(value.shape)}, but the module was compiled for "
                f"{list(slot.shape)} on mesh {self.mesh}: compile again with example_inputs of this shape"
            )
        if value.dtype != slot.dtype:
            raise ValueError(
                f"{name} has dtype {value.dtype}, but the module was compiled for {slot.dtype}: cast it "
                f"(.to({slot.dtype})), or compile again with example_inputs of dtype {value.dtype}"
            )
        if device is not None and value.device != torch.device(device):
            raise ValueError(
                f"{name} is on device {value.device}, but the module runs on {torch.device(device)}: "
                f"move it there (.to({str(torch.device(device))!r}))"
            )


def input_names(in_spec: pytree.TreeSpec) -> list[str]:
    """`input_name` of each flat input of a call with this structure."""
    dummy = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    return [input_name(path) for path, _ in pytree.tree_flatten_with_path(dummy)[0]]


def input_name(path) -> str:
    """'positional input 0' or "keyword input 'mask'", then the place inside it ('[1]')."""
    top, key, *inside = path
    name = f"positional input {key.idx}" if top.idx == 0 else f"keyword input {key.key!r}"
    return name + "".join(str(k) for k in inside)


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _same_value(a, b) -> bool:
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    return a == b or (a != a and b != b)  # NaN is NaN


def _first_difference(value, spec: pytree.TreeSpec, where: str, index: int):
    """`(where, value, spec, index)` at the outermost place where `value`'s structure
    leaves `spec`'s (a leaf for a container, another container type, length or keys),
    `index` the flat input index of its first leaf; None if the structures agree."""
    got = pytree.tree_structure(value)
    if got == spec:
        return None
    same_node = got.type == spec.type and got.num_children == spec.num_children and got.context == spec.context
    if spec.is_leaf() or not same_node:
        return where, value, spec, index
    children, _ = pytree.SUPPORTED_NODES[spec.type].flatten_fn(value)
    keys = spec.context if isinstance(value, dict) else range(len(children))
    child_index = index
    for child, key, child_spec in zip(children, keys, spec.children()):
        difference = _first_difference(child, child_spec, f"{where}[{key!r}]", child_index)
        if difference is not None:
            return difference
        child_index += child_spec.num_leaves
    return where, value, spec, index


def _describe_value(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    if value is None:
        return "None"
    return f"{type(value).__name__} {value!r}"


def _describe_container(spec: pytree.TreeSpec) -> str:
    if spec.type is type(None):
        return "None"
    if spec.type is dict:
        return f"a dict with keys {sorted(map(str, spec.context))}"
    if spec.type in (list, tuple):
        return f"a {spec.type.__name__} of {spec.num_children}"
    return f"a {spec.type.__name__} of {spec.num_children} parts"


def describe_schedules(schedules: dict[str, int]) -> str:
    """`gather for 12 products, broadcast for 1` (most first)."""
    ranked = sorted(schedules.items(), key=lambda item: -item[1])
    return ", ".join(f"{name} for {count} product{'s' if count != 1 else ''}" for name, count in ranked)


def split_example_inputs(example_inputs) -> tuple[tuple, dict]:
    """`example_inputs` as (args, kwargs): a tensor, a tuple of args, or a dict of kwargs."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise ValueError(
        f"example_inputs is a {type(example_inputs).__name__}: pass a tensor, a tuple of "
        "positional inputs, or a dict of keyword inputs"
    )
