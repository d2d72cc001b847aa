"""Capture's checkpoint regions: calls of `torch.utils.checkpoint.checkpoint` in the model, traced
as their plain ops, each call's nodes one recompute region.

`traced_checkpoints` is the context that export runs in; `mark_checkpoints` then writes
`RECOMPUTE_REGION` = "checkpoint N" (`tess_compile.core.meta_keys`) on each call's nodes, from
the number that tracing left in torch's `meta["custom"]`. The runtimes recompute each region in
backward (`tess_compile.ops.recompute_region`).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.fx.traceback import annotate

from tess_compile.core.meta_keys import RECOMPUTE_REGION

__all__ = ["mark_checkpoints", "traced_checkpoints"]

# The key, inside torch's `meta["custom"]` (`torch.fx.traceback.annotate`), of a region's number.
_REGION_KEY = "tess_recompute"


@contextlib.contextmanager
def traced_checkpoints():
    """Trace `torch.utils.checkpoint.checkpoint` calls as their plain ops, each call's
    nodes annotated with its number (the outermost call's, when nested).

    Both of checkpoint's paths are replaced while tracing: the non-reentrant one's
    context generator, and the reentrant one's autograd function, whose forward
    would run without grad (its outputs traced detached). The per-rank program
    recomputes the region the same way whichever path the model asked for.
    """
    numbers, depth = itertools.count(), [0]

    @contextlib.contextmanager
    def region():
        if depth[0]:
            yield
            return
        depth[0] += 1
        try:
            with annotate({_REGION_KEY: next(numbers)}):
                yield
        finally:
            depth[0] -= 1

    def without_reentrant(function, preserve_rng_state, context_fn, *args, **kwargs):
        with region():
            yield

    class Reentrant:
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            with region():
                return function(*args)

    saved = torch_checkpoint._checkpoint_without_reentrant_generator, torch_checkpoint.CheckpointFunction
    torch_checkpoint._checkpoint_without_reentrant_generator = without_reentrant
    torch_checkpoint.CheckpointFunction = Reentrant
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator, torch_checkpoint.CheckpointFunction = saved


def mark_checkpoints(gm: torch.fx.GraphModule) -> None:
    """`RECOMPUTE_REGION` "checkpoint N" on the ops that `traced_checkpoints` annotated with N."""
    for node in gm.graph.nodes:
        number = (node.meta.get("custom") or {}).get(_REGION_KEY)
        if number is not None and node.op == "call_function":
            RECOMPUTE_REGION.set(node, f"checkpoint {number}")
