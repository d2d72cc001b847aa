"""A whole training step captured in CUDA graphs: the host launches one graph per step.

`StepGraphs(run, module, optimizer)` calls `run(inputs, target)` (`TrainStep._step`: zero,
forward, backward, clipping, the optimizer's step) as torch's "whole network capture" does
(torch.cuda.graphs): per pattern of input shapes, dtypes and scalar hyperparameters, the
first `WARMUP` steps run on a side stream (inductor's compiles, NCCL's communicators, the
optimizer's state), the next is captured in a `torch.cuda.CUDAGraph` on static input
buffers and replayed; later steps copy their inputs into those buffers and replay. Collectives
on NCCL are captured with the rest. Where the step cannot be captured (a CPU module, dynamic
shapes, an optimizer that is not capturable, an error while capturing) it says why once
(a warning) and runs without graphs. A float hyperparameter (e.g. a learning rate that a
scheduler changes) is part of the pattern: pass it as a tensor (`lr=torch.tensor(...)`,
which torch's schedulers fill in place) so that one graph serves every step.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils import _pytree as pytree

__all__ = ["StepGraphs"]

WARMUP = 2  # uncaptured steps per pattern before its capture
MAX_GRAPHS = 4  # patterns captured; steps of further patterns run without graphs
MAX_SEEN = 64  # patterns counted towards their capture; more are forgotten


class StepGraphs:
    """`run` captured per pattern of its inputs (see the module docstring); `__call__(inputs, target)`."""

    def __init__(self, run, module, optimizer):
        self.run, self.module, self.optimizer = run, module, optimizer
        self.seen: dict = {}  # pattern -> uncaptured steps run
        self.graphs: dict = {}  # pattern -> (graph, static inputs, static loss)
        self.told: set[str] = set()
        reason = _cannot_capture(module, optimizer)
        self.stream = torch.cuda.Stream(module.device) if reason is None else None
        self.pool = None
        if reason is not None:
            self._refuse(reason)

    def _refuse(self, reason: str) -> None:
        """Say once why (these) steps run without graphs."""
        if reason not in self.told:
            self.told.add(reason)
            warnings.warn(f"tess_compile.train_step: the step runs without CUDA graphs: {reason}", stacklevel=3)

    def __call__(self, inputs: tuple, target) -> torch.Tensor:
        if self.stream is None:
            return self.run(inputs, target)
        key = _pattern((inputs, target), self.optimizer)
        known = self.graphs.get(key)
        if known is not None:
            return self._replay(known, (inputs, target))
        if len(self.seen) >= MAX_SEEN:
            self.seen.clear()
        count = self.seen[key] = self.seen.get(key, 0) + 1
        if count <= WARMUP:
            return self._on_side_stream(inputs, target)
        if len(self.graphs) >= MAX_GRAPHS:
            self._refuse(f"more than {MAX_GRAPHS} patterns of input shapes and hyperparameters (a float learning "
                         "rate that changes: pass it as a tensor)")
            return self._on_side_stream(inputs, target)
        try:
            known = self._capture((inputs, target))
        except Exception as err:  # noqa: BLE001 - any failure to capture runs the step uncaptured, once told
            self.stream = None
            self._refuse(f"capturing it failed ({type(err).__name__}: {err})")
            return self.run(inputs, target)
        self.graphs[key] = known
        return self._replay(known, (inputs, target))

    def _on_side_stream(self, inputs: tuple, target) -> torch.Tensor:
        current = torch.cuda.current_stream(self.module.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            loss = self.run(inputs, target)
        current.wait_stream(self.stream)
        return loss

    def _capture(self, values) -> tuple:
        device = self.module.device
        static = pytree.tree_map_only(torch.Tensor, lambda x: x.detach().to(device, copy=True), values)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            loss = self.run(*static)
        self.pool = graph.pool()
        return graph, static, loss

    def _replay(self, known: tuple, values) -> torch.Tensor:
        graph, static, loss = known
        for buffer, value in zip(pytree.tree_leaves(static), pytree.tree_leaves(values)):
            if isinstance(buffer, torch.Tensor):
                buffer.copy_(value, non_blocking=True)
        graph.replay()
        return loss.clone()


def _pattern(values, optimizer) -> tuple:
    """What a captured graph holds fixed: the inputs' structure, each tensor's shape, dtype and
    device (other values as they are), and the optimizer's scalar hyperparameters."""
    leaves, spec = pytree.tree_flatten(values)
    shapes = tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)
    hyper = tuple(tuple((k, v) for k, v in group.items() if k != "params" and not isinstance(v, torch.Tensor))
                  for group in optimizer.param_groups)
    return str(spec), shapes, repr(hyper)


def _cannot_capture(module, optimizer) -> str | None:
    """Why the step cannot be captured, or None."""
    if module.device.type != "cuda" or not torch.cuda.is_available():
        return f"the module runs on {module.device.type}, not CUDA"
    if module.compile in ("reduce-overhead", "max-autotune"):
        return f"inductor captures each program in CUDA graphs itself (compile={module.compile!r})"
    if module.program.dynamic is not None:
        return "the program is compiled with dynamic shapes (dynamic=True)"
    if not all(group.get("capturable", False) for group in optimizer.param_groups):
        return (f"{type(optimizer).__name__}'s param groups are not capturable (capturable=True; its state was "
                "made before the train step, or it has no capturable mode)")
    return None
