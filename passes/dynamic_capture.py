"""Stage 1, capture: the symbolic dims of a dynamic capture (`dynamic=True`).

`dynamic_example` gives export the example inputs and their dims: the batch a symbolic multiple
of the ranks that split it, the other dims of the inputs symbolic where the model allows
(`tess_compile.core.dynamic`), but the weight inputs' dims and those marked
`torch._dynamo.mark_static`. `export_dynamic` exports with them, a model whose code differs at a
batch of one with batches of two or more, and turns a model whose code fixes a symbolic dim into
a ValueError with the fix. Reads and writes no meta keys.
"""

from __future__ import annotations

import logging

import torch
from torch.utils import _pytree as pytree

from tess_compile.passes.data_dependent import is_data_dependent
from tess_compile.core.dynamic import export_dims, export_example

__all__ = ["dynamic_example", "export_dynamic"]

log = logging.getLogger("tess_compile.passes")


def dynamic_example(args: tuple, kwargs: dict, batch_factor: int, weight_inputs: dict[int, str]) -> tuple:
    """The example inputs of a dynamic capture and export's dims for them (`export_dims`, `export_example`).
    The weight inputs are held out of both: their dims stay fixed, and none of them is taken for the batch.
    A dim marked `torch._dynamo.mark_static(x, dim)` on an input stays fixed (the torch.compile backend marks
    the dims that Dynamo's graph holds as constants), and a fixed batch need not split evenly."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    held = [_HELD if i in weight_inputs else x for i, x in enumerate(leaves)]
    held_args, held_kwargs = pytree.tree_unflatten(held, spec)
    inputs = (*held_args, *held_kwargs.values())
    if _batch_marked_static(inputs):  # a fixed batch: none to split evenly, none to repeat
        dims = export_dims(held_args, held_kwargs, 1)
    else:
        dims = export_dims(held_args, held_kwargs, batch_factor)
        held_args, held_kwargs = export_example(held_args, held_kwargs, batch_factor)
    dims = tuple(_unmarked(d, x) for d, x in zip(dims, inputs))
    example = pytree.tree_leaves((held_args, held_kwargs))
    args, kwargs = pytree.tree_unflatten([leaves[i] if i in weight_inputs else x for i, x in enumerate(example)], spec)
    return args, kwargs, dims


# A weight input's place while a dynamic capture decides the dims of the others: not a tensor, so fixed.
_HELD = object()


def _unmarked(dims, x):
    """An input's export dims less those marked static on it (top-level tensor inputs)."""
    static = getattr(x, "_dynamo_static_indices", ())
    if not isinstance(dims, dict) or not static:
        return dims
    return {dim: d for dim, d in dims.items() if dim not in static} or None


def _batch_marked_static(inputs: tuple) -> bool:
    """Whether the batch, dim 0 of the first tensor input (as `export_dims` takes it), is marked static."""
    first = next((x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)), None)
    return first is not None and 0 in getattr(first, "_dynamo_static_indices", ())


def export_dynamic(model: torch.nn.Module, args: tuple, kwargs: dict, dims: tuple):
    """Export with symbolic dims; a model whose code fixes the batch is a ValueError with the fix."""
    try:
        # size-oblivious: a symbol may also be 1 (a batch of one block, a sequence of one token)
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            return torch.export.export(model, args, kwargs, dynamic_shapes=dims, strict=False)
    except torch._dynamo.exc.UserError as err:
        if is_data_dependent(err):
            raise  # explained by capture
        if "size()[0] != 1" in str(err) and _batch_of_one(dims):
            # the model's code differs at a batch of 1 (a broadcast): the program takes batches of 2 or more
            log.info("dynamic=True: %s's code differs at a batch of 1; the program takes batches of 2 or more",
                     type(model).__name__)
            return export_dynamic(model, args, kwargs, pytree.tree_map(_least_batch_two, dims))
        said = " ".join(line.strip() for line in str(err).strip().splitlines()[:8] if line.strip())
        raise ValueError(
            f"dynamic=True: {type(model).__name__}'s code fixes a dim that is captured as symbolic (the batch, dim 0 "
            f"of the inputs); torch.export says: {said}\nwrite the model's sizes from its inputs (x.shape[0], "
            "view(-1, ...)) instead of constants, or pass dynamic=False"
        ) from err


def _batch_of_one(dims: tuple) -> bool:
    """Whether the batch dim among export's `dims` may be 1 (a plain `Dim("batch")` of least 1)."""
    return any(_is_batch_of_one(d) for d in pytree.tree_leaves(dims))


def _is_batch_of_one(dim) -> bool:
    return getattr(dim, "__name__", None) == "batch" and getattr(dim, "min", None) == 1


def _least_batch_two(dim):
    return torch.export.Dim("batch", min=2) if _is_batch_of_one(dim) else dim
