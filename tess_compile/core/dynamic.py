"""Symbolic batch and sequence: what a program compiled with `dynamic=True` accepts.

A dynamic compile captures the model with `torch.export` dynamic dims
(`tess_compile.passes.capture`): the batch dim is `f * batch` (f the ranks that split the
batch, so every batch the program takes splits evenly) and every other dim
of an input is left for export to decide (`Dim.AUTO`): a dim that meets a
weight (hidden, features) becomes a constant, a dim that does not (sequence,
the batch of a mask) stays a symbol. The per-rank graph computes its local
sizes from the inputs' sizes at run time (`tess_compile.passes.builder`).

`DynamicShapes` is what the runtime needs of that: each input dim and each
output dim as a formula in the symbols, the symbols' ranges, and the
conditions the compile assumed of them (a rule that asked `s % 2 == 0` of a
symbol: the program holds only where the answer is the same). `bind` reads
the symbols from a call's inputs and refuses, with a ValueError that names
the input, its dims, the mesh and the fix, a call outside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import sympy
import torch
from torch.export import Dim
from torch.utils._sympy.numbers import int_oo

__all__ = ["DynamicShapes", "Limit", "concrete", "export_dims", "export_example", "has_symbols", "local_value"]


def _example_batch(args: tuple, kwargs: dict) -> tuple[int | None, list[int]]:
    """The batch of example inputs, dim 0 of the first tensor among them (None: none has a dim), and
    that tensor's shape."""
    first = next((x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)), None)
    shape = list(first.shape) if first is not None else []
    return (shape[0] if shape else None), shape


def export_dims(args: tuple, kwargs: dict, batch_factor: int) -> tuple:
    """`torch.export`'s `dynamic_shapes` for a dynamic compile, one entry per input in call order
    (`args`, then `kwargs`' values): the batch dim of each tensor whose dim 0 is the batch (the first
    tensor input's dim 0) is `batch_factor * batch`, so that every batch splits over the ranks that
    split it; every other dim of 2 or more is `Dim.AUTO` (export keeps it symbolic unless the model
    ties it to a weight or a constant); dims of 1 and other values stay as they are."""
    batch, shape = _example_batch(args, kwargs)
    if batch is not None and batch % batch_factor:
        raise ValueError(f"dynamic=True: the example inputs' batch {batch} (dim 0 of the first tensor input, shape "
                         f"{shape}) is not divisible by the {batch_factor} ranks that split it: use "
                         f"example inputs whose batch is a multiple of {batch_factor}")
    batch_dim = Dim("batch", min=1) * batch_factor if batch_factor > 1 else Dim("batch", min=1)

    def dims(x):
        if not isinstance(x, torch.Tensor):
            return None
        spec = {i: Dim.AUTO for i, size in enumerate(x.shape) if size >= 2}
        if x.dim() and x.shape[0] == batch and batch >= 2:
            spec[0] = batch_dim
        return spec or None

    return tuple(torch.utils._pytree.tree_map(dims, value, is_leaf=lambda v: v is None)
                 for value in (*args, *kwargs.values()))


def export_example(args: tuple, kwargs: dict, batch_factor: int) -> tuple[tuple, dict]:
    """The example inputs a dynamic compile exports on: as given, or, where the batch is one block
    per rank (`batch == batch_factor`, which export would fix as a constant), each batch input
    repeated twice along the batch. Export reads only their shapes; the program is the same.
    A batch of one that is not split stays one: export fixes it, as torch.compile specialises it."""
    batch, _ = _example_batch(args, kwargs)
    if batch is None or batch != batch_factor or batch == 1:
        return args, kwargs

    def doubled(x):
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch:
            return torch.cat([x, x])
        return x

    return torch.utils._pytree.tree_map(doubled, (args, kwargs))


def concrete(shape) -> tuple[int, ...]:
    """`shape` with each symbolic size replaced by its value in the example the model was captured on."""
    return tuple(int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in shape)


def local_value(val: torch.Tensor, layout, mesh) -> torch.Tensor:
    """A captured (fake) global value's block as a rank holds it under `layout` (a `Layout`): its sizes,
    symbolic ones too, divided by the splits (`Layout.local_shape`)."""
    return val.new_empty(layout.local_shape(val.shape, mesh))


def has_symbols(shape) -> bool:
    return any(isinstance(s, torch.SymInt) for s in shape)


def _expr(size) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


@dataclass(frozen=True)
class Limit:
    """A lookup whose ids are computed from symbolic sizes (`tess_compile.passes.size_limits`): their largest
    value, a formula in the symbols, must be less than the table's rows."""

    largest: sympy.Expr
    rows: int
    table: str  # the table's name, for messages


@dataclass
class DynamicShapes:
    """The symbolic shapes of a dynamic program's inputs and outputs; see the module docstring."""

    inputs: dict[int, tuple[sympy.Expr, ...]]  # flat input index -> each dim's formula
    outputs: list[tuple[sympy.Expr, ...] | None]  # each output's global shape (None: not a tensor)
    ranges: dict[sympy.Symbol, tuple[int, int | None]]  # symbol -> (least, greatest or None)
    conditions: list[sympy.Basic] = field(default_factory=list)  # what the compile assumed of the symbols
    names: dict[sympy.Symbol, str] = field(default_factory=dict)  # symbol -> where it is read, for messages
    limits: list[Limit] = field(default_factory=list)  # lookups that sizes must keep within their tables

    @classmethod
    def of(cls, input_vals: dict[int, torch.Tensor], output_vals: list, shape_env, conditions: list[sympy.Basic],
           input_names: Sequence[str], limits: Sequence[Limit] = ()) -> DynamicShapes | None:
        """From the captured fake values of the inputs (flat index -> value) and the outputs, the
        ShapeEnv of their symbols, the conditions and lookup limits the compile found; None if no
        input dim is symbolic (the program is static)."""
        inputs = {i: tuple(_expr(s) for s in v.shape) for i, v in input_vals.items()}
        symbols = sorted({s for dims in inputs.values() for e in dims for s in e.free_symbols}, key=str)
        if not symbols:
            return None
        ranges = {}
        for symbol in symbols:
            bounds = shape_env.var_to_range[symbol]
            upper = None if bounds.upper in (int_oo, sympy.oo) else int(bounds.upper)
            ranges[symbol] = (int(bounds.lower), upper)
        for dims in inputs.values():
            for e in dims:
                if len(e.free_symbols) == 1 and e.is_Mul:
                    # export keeps the root of a derived dim (the batch, f * batch) at 2 or more; the capture is
                    # size-oblivious (`tess_compile.passes.capture`), so one block per rank holds as well
                    symbol = next(iter(e.free_symbols))
                    ranges[symbol] = (1, ranges[symbol][1])
        names = {}
        for index, dims in inputs.items():
            for dim, e in enumerate(dims):
                for symbol in e.free_symbols:
                    names.setdefault(symbol, f"dim {dim} of {input_names[index]}")
        outputs = [tuple(_expr(s) for s in v.shape) if isinstance(v, torch.Tensor) else None for v in output_vals]
        # a limit is checked on the symbols a call binds: one in other symbols cannot be
        limits = [limit for limit in limits if limit.largest.free_symbols <= set(symbols)]
        return cls(inputs, outputs, ranges, list(conditions), names, limits)

    def describe(self, input_names: Sequence[str]) -> str:
        """One line: each input's dims as formulas, e.g. `positional input 0 [4*s0, s1]`."""
        return "; ".join(f"{input_names[index]} {_show(dims)}" for index, dims in self.inputs.items())

    def bind(self, values: dict[int, torch.Tensor], input_names: Sequence[str], mesh) -> dict[sympy.Symbol, int]:
        """The symbols' values in a call with these inputs (flat index -> tensor); a ValueError for a call the
        program cannot take: a dim that is fixed, a batch that does not split evenly, a size out of range,
        a size that breaks a condition the compile assumed, or sizes that look up past a table."""
        binding: dict[sympy.Symbol, int] = {}
        for index, dims in self.inputs.items():
            shape = tuple(values[index].shape)
            where = f"{input_names[index]} (shape {list(shape)})"
            if len(shape) != len(dims):
                raise ValueError(f"{where} has {len(shape)} dims, but the module was compiled for "
                                 f"{len(dims)} ({_show(dims)}) on mesh {mesh}: pass a tensor of {len(dims)} dims")
            for dim, (e, size) in enumerate(zip(dims, shape)):
                self._bind_dim(binding, e, size, f"dim {dim} of {where}", dims, mesh)
        for symbol, value in binding.items():
            least, greatest = self.ranges[symbol]
            if value < least or (greatest is not None and value > greatest):
                span = f"{least}..{greatest}" if greatest is not None else f"at least {least}"
                raise ValueError(f"{self.names[symbol]} gives {symbol} = {value}, outside the range {span} the model "
                                 f"takes (export found it in the model's code, e.g. a position table's length) on "
                                 f"mesh {mesh}: pass a size in {span}")
        for condition in self.conditions:
            if not bool(condition.xreplace({s: sympy.Integer(v) for s, v in binding.items()})):
                shown = ", ".join(f"{self.names[s]} = {v}" for s, v in binding.items())
                raise ValueError(f"the program was compiled assuming {condition} of its symbolic sizes, which "
                                 f"this call breaks ({shown}) on mesh {mesh}: pass sizes that satisfy it, or "
                                 "compile again with dynamic=False for this shape")
        for limit in self.limits:
            self._check_limit(limit, binding, mesh)
        return binding

    def _check_limit(self, limit: Limit, binding: dict[sympy.Symbol, int], mesh) -> None:
        largest = int(limit.largest.xreplace({s: sympy.Integer(v) for s, v in binding.items()}))
        if largest < limit.rows:
            return
        shown = ", ".join(f"{self.names[s]} = {binding[s]}" for s in sorted(limit.largest.free_symbols, key=str))
        raise ValueError(f"{shown}: the model looks up position {largest} (its largest id, {limit.largest}) in "
                         f"'{limit.table}', which has {limit.rows} rows, on mesh {mesh}: pass sizes whose positions "
                         f"(sequence plus cached length) stay below {limit.rows}, or a model with a longer table")

    def _bind_dim(self, binding: dict, e: sympy.Expr, size: int, where: str, dims: tuple, mesh) -> None:
        if not e.free_symbols:
            if size != int(e):
                why = ("an example batch of 1 fixes the batch, as torch.compile specialises it; compile with an "
                       "example batch of 2 or more to take others" if where.startswith("dim 0") and int(e) == 1
                       else "this dim is fixed by the model's weights or code")
                raise ValueError(f"{where}: dim is {size}, but the module was compiled for {int(e)} there (the "
                                 f"compiled shape is {_show(dims)}; {why}) on mesh {mesh}: pass {int(e)}")
            return
        symbol = next(iter(e.free_symbols))
        factor = e / symbol
        if len(e.free_symbols) == 1 and factor.is_Integer:
            if size % int(factor):
                raise ValueError(f"{where}: {size} is not divisible by {int(factor)} (the ranks that split the batch "
                                 f"on mesh {mesh}): use a batch that is a multiple of {int(factor)}, or "
                                 "compile with batch_split='none' (a batch whole over depth and row)")
            value = size // int(factor)
            if binding.setdefault(symbol, value) == value:
                return
        value = e.xreplace({s: sympy.Integer(v) for s, v in binding.items()})
        if value.free_symbols or int(value) != size:
            raise ValueError(f"{where}: dim is {size}, but the module was compiled for {e} there (the compiled "
                             f"shape is {_show(dims)}; {', '.join(f'{s} = {v}' for s, v in binding.items())}) on "
                             f"mesh {mesh}: pass sizes that agree with each other")

    @staticmethod
    def shape(dims: tuple[sympy.Expr, ...], binding: dict[sympy.Symbol, int]) -> tuple[int, ...]:
        """A shape of formulas at the symbols' values."""
        values = {s: sympy.Integer(v) for s, v in binding.items()}
        return tuple(int(e.xreplace(values)) for e in dims)


def _show(dims: tuple[sympy.Expr, ...]) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"
