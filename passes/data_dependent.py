"""Stage 1, capture: the ValueErrors of a model whose code depends on the values in its tensors.

torch.export traces with fake tensors, which hold shapes but no values. A value read from a tensor
(`.item()`, `.tolist()`, `if mask.any():`, a loop over `nonzero()`) becomes a symbol (u0), and a
branch or a loop on it fails inside export (`GuardOnDataDependentSymNode` and its kin):
`explained_data_dependence` turns that failure into a ValueError that names the model's line (the
innermost model frame of the error's traceback, `tess_compile.passes.source_lines.raised_at`), the expression torch
could not decide and the ways out. An op whose output shape depends on the values (`x[mask]`,
`nonzero`, `unique`) exports, but no layout splits a tensor of unknown size:
`refuse_data_dependent_shapes` names the first such op of the captured graph. Reads and writes no meta
keys. See docs/data_dependent.md.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import (
    GuardOnDataDependentSymNode,
    PendingUnbackedSymbolNotFound,
    free_unbacked_symbols,
)
from torch.utils import _pytree as pytree

from tess_compile.passes.source_lines import raised_at, source_line, with_code

__all__ = ["explained_data_dependence", "is_data_dependent", "refuse_data_dependent_shapes"]

_DATA_DEPENDENT = (GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound, DataDependentOutputException,
                   DynamicOutputShapeException)

_BACKEND = "torch.compile(model, backend=tess_compile.backend(q=..., d=...))"


def is_data_dependent(err: BaseException) -> bool:
    """Whether `err` is export's failure on code that depends on the values in a tensor."""
    if isinstance(err, _DATA_DEPENDENT):
        return True
    return isinstance(err, torch._dynamo.exc.UserError) and "data-dependent" in str(err)


@contextlib.contextmanager
def explained_data_dependence(model: torch.nn.Module):
    """Export's failures on data-dependent code, inside this block, become a ValueError with the model's line."""
    try:
        yield
    except Exception as err:
        if not is_data_dependent(err):
            raise
        where = raised_at(err)
        raise ValueError(
            f"{type(model).__name__}'s forward reads the values in a tensor to decide what to compute, at "
            f"{with_code(where) if where else 'a line of its code'}: torch.export traces without values and "
            f"cannot decide {_undecided(err)}, so the model cannot be captured as one graph to shard. Write it "
            "without reading tensor values: torch.where or a mask instead of the branch (masked_fill with a mask "
            "that holds no True changes nothing), every expert of a mixture run on every token with a zero weight "
            "where it is not routed (transformers' MoE models: experts_implementation=\"batched_mm\"); where the "
            "branch always goes one way, torch._check of its condition before it lets export take that way. Or "
            f"use the torch.compile backend, {_BACKEND}, which breaks the graph at the branch and shards each "
            "piece (docs/data_dependent.md)"
        ) from err


def _undecided(err: BaseException) -> str:
    """The expression torch could not decide, briefly, with the model's names of its symbols where torch has them."""
    text = str(err).strip()
    cond = getattr(err, "cond", None)
    expression = str(cond) if cond is not None else (text.splitlines() or [type(err).__name__])[0]
    named = re.search(r"derived by replacing (.+?) in ", text)  # torch's own note: "`u0` with x.shape[0]"
    if named:
        names = re.sub(r"`(\w+)` with ", r"\1 = ", named.group(1))
        return f"`{expression}` ({names})"
    return f"`{expression}` (its symbols u0, u1, ... stand for values read from tensors)"


def refuse_data_dependent_shapes(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """A ValueError at the first op of `gm` whose output's shape depends on the values in a tensor."""
    for node in gm.graph.nodes:
        tensors = [t for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
        shapes = [list(t.shape) for t in tensors if free_unbacked_symbols(t.shape)]
        if node.op == "call_function" and shapes:
            raise ValueError(
                f"{type(model).__name__}'s forward makes a tensor whose shape depends on the values in a tensor: "
                f"{node.target} at {with_code(source_line(node))} gives shape {shapes[0]}, whose u0, u1, ... are "
                "counted from the data (a boolean index x[mask], nonzero, unique, a size read with .item()), and "
                "the mesh splits tensors into blocks of known sizes. Keep the shapes fixed: compute on every row "
                "and mask the result (torch.where(mask[:, None], f(x), 0)), or pad the picked rows to a fixed "
                f"count. The torch.compile backend, {_BACKEND}, breaks the graph at such an op, but the rows it "
                "picks are the batch of the next piece, which must then be a multiple of d*q "
                "(docs/data_dependent.md)"
            )
