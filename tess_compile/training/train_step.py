"""A whole training step as one call: `step = tess_compile.train_step(module, optimizer, loss_fn, clip=1.0)`.

`step(*inputs, target=...)` takes the global batch as `RankRun.step` does and runs zero_grad,
forward, the loss, backward, gradient clipping and the optimizer's step; it returns the loss.
Inside the step the per-rank program takes the parameters' local tensors as leaves whose
gradients autograd adds into one flat buffer per dtype (`tess_compile.runtime.grad_buffers`):
zeroing is one kernel per buffer, the clipping norm one reduction per run of equal replica
counts and one all-reduce, the clipping one multiply per buffer, and the optimizer's own
fused (or foreach) kernels run on the local tensors (`_LocalOptimizer`). The parameters stay
the DTensors the user sees, their `.grad` DTensor views of the buffers, the optimizer's state
DTensors of the same storage, so `clip_grad_norm_`, `state_dict()` and DCP see the same
values. With `compile=True` on CUDA the step is captured in CUDA graphs
(`tess_compile.training.step_graphs`). See docs/training.md.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from tess_compile.runtime.grad_buffers import GradBuffers
from tess_compile.training.step_graphs import StepGraphs

__all__ = ["TrainStep", "train_step"]

_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)  # torch's optimizers with a fused kernel


def train_step(module, optimizer: torch.optim.Optimizer, loss_fn=None, *, clip: float | None = None,
               norm_type: float = 2.0, graphs: bool | None = None) -> TrainStep:
    """A whole training step of `module` (what `tess_compile.shard` returned, or a `RankRun` of
    `parallelize` without a pipeline) with `optimizer` (built on `module.parameters()`).

    `loss_fn(output, target)` gets the output as full tensors (`tess_compile.full_tensor`) and
    returns the mean loss (default: the RankRun's). `clip`: the largest gradient norm of
    `norm_type` over the whole model (`clip_grad_norm_`'s), None for none. An optimizer that has
    not stepped yet and was left to choose its kernels (`fused=None, foreach=None`) is set to
    fused where torch has a fused kernel (Adam, AdamW, SGD), else foreach. `graphs`: capture
    the step in CUDA graphs; by default with `compile=True` on CUDA.
    """
    return TrainStep(module, optimizer, loss_fn, clip=clip, norm_type=norm_type, graphs=graphs)


class TrainStep:
    """`step(*inputs, target=None) -> loss`; `step.norm`: the last step's gradient norm before
    clipping (a tensor on the module's device), None without `clip`."""

    def __init__(self, module, optimizer, loss_fn=None, *, clip=None, norm_type=2.0, graphs=None):
        self.run = None
        if hasattr(module, "spec") and hasattr(module, "module"):  # a RankRun
            if module.stage is not None or module.spec.microbatches > 1:
                raise ValueError(f"tess_compile.train_step({module.spec.describe()}): a step of one forward and "
                                 "backward; a pipeline or microbatches run RankRun.step, then the optimizer")
            self.run, loss_fn, module = module, loss_fn or module.loss_fn, module.module
        if loss_fn is None:
            raise ValueError("tess_compile.train_step needs loss_fn=(output, target) -> the mean loss "
                             "(the output as full tensors)")
        if not hasattr(module, "feeding_leaves"):
            raise ValueError(f"tess_compile.train_step takes what tess_compile.shard or parallelize returned, "
                             f"not a {type(module).__name__}")
        self.module, self.optimizer, self.loss_fn = module, optimizer, loss_fn
        self.clip, self.norm_type, self.norm = clip, float(norm_type), None
        on_cuda = module.device.type == "cuda"
        if graphs is None:  # inductor's modes with CUDA graphs of their own capture each program themselves
            graphs = on_cuda and module.compile in (True, "default", "max-autotune-no-cudagraphs")
        _choose_kernels(optimizer, module, capturable=bool(graphs) and on_cuda)
        self.local = _LocalOptimizer(optimizer)
        self.graphs = StepGraphs(self._step, module, optimizer) if graphs else None
        self._walked: set[int] = set()  # ids of the programs whose reached parameters are known

    def __call__(self, *inputs, target=None) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs(inputs, target)
        return self._step(inputs, target)

    def _step(self, inputs: tuple, target) -> torch.Tensor:
        """The step on the global batch `inputs` (then a dict of keyword inputs, if any)."""
        if self.run is not None:
            ((args, kwargs, target),) = self.run._part(inputs, target)  # this replica's part of the batch
        else:
            args, kwargs = _split(inputs)
        module = self.module
        with module.feeding_leaves() as buffers:
            buffers.zero_()
            output = module.full_outputs(*args, **kwargs)
        loss = self.loss_fn(output, target)
        if id(module.program) not in self._walked:
            buffers.keep_reached(loss)
            self._walked.add(id(module.program))
        loss.backward()
        buffers.adopt_late()
        if self.clip is not None:
            self.norm = _clip(module, buffers, self.clip, self.norm_type)
        self.local.step(buffers)
        loss = loss.detach()
        if self.run is not None and self.run.spec.dp > 1:  # the mean over the replicas, as RankRun.step's
            loss = loss.clone()
            dist.all_reduce(loss, group=self.run.device_mesh.get_group("dp"))
            loss /= self.run.spec.dp
        return loss


def _split(inputs: tuple) -> tuple[tuple, dict]:
    kwargs = inputs[-1] if inputs and isinstance(inputs[-1], dict) else {}
    return tuple(inputs[:-1] if kwargs else inputs), dict(kwargs)


def _clip(module, buffers: GradBuffers, max_norm: float, norm_type: float) -> torch.Tensor:
    """Scale the gradients as `torch.nn.utils.clip_grad_norm_` does on the unsharded model: by
    `max_norm / (norm + 1e-6)`, at most 1; returns the norm (float64, on the module's device)."""
    share = buffers.norm_share(norm_type).to(module.device)
    infinite = math.isinf(norm_type)
    if module.world.size > 1:
        share = module.world.all_reduce(share, "gradient norm of train_step",
                                        dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM)
    total = share if infinite else share.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for tensor in buffers.tensors():
        tensor.mul_(coef.to(tensor.dtype))
    return total


def _choose_kernels(optimizer, module, capturable: bool) -> None:
    """Give a fresh optimizer that was left to choose fused kernels where torch has them, else foreach;
    `capturable` where the step is captured in CUDA graphs."""
    if optimizer.state:
        return
    fused_ok = isinstance(optimizer, _FUSED) and module.device.type in _get_fused_kernels_supported_devices()
    for group in optimizer.param_groups:
        floating = all(torch.is_floating_point(p) for p in group["params"])
        if group.get("fused") is None and group.get("foreach") is None:
            if fused_ok and floating:
                group["fused"] = True
            elif "foreach" in group:
                group["foreach"] = True
        if capturable and "capturable" in group:
            group["capturable"] = True


class _LocalOptimizer:
    """The user's optimizer stepped on the parameters' leaves: its param groups and state are swapped
    for the leaves and their local state tensors (the same storage as its DTensor state) for the
    step. State the step makes (the first step) is given to the optimizer as DTensors placed like
    the parameters; a `load_state_dict` makes the local state again."""

    def __init__(self, optimizer):
        self.optimizer, self.buffers = optimizer, None
        self.state: defaultdict = defaultdict(dict)
        self.group_leaves: list[list] = []
        self.missing: list[tuple] = []  # (parameter, leaf) without state yet
        optimizer.register_load_state_dict_post_hook(self._forget)

    def _forget(self, optimizer) -> None:
        self.buffers = None

    def _build(self, buffers: GradBuffers) -> None:
        opt, leaf_of = self.optimizer, buffers.leaf_of
        self.buffers, self.state, self.missing = buffers, defaultdict(dict), []
        self.group_leaves = [[leaf_of.get(id(p), p) for p in group["params"]] for group in opt.param_groups]
        for group in opt.param_groups:
            for p in group["params"]:
                leaf = leaf_of.get(id(p))
                if leaf is None:
                    continue
                if p in opt.state:
                    self.state[leaf] = {k: v._local_tensor if isinstance(v, DTensor) else v
                                        for k, v in opt.state[p].items()}
                else:
                    self.missing.append((p, leaf))

    def step(self, buffers: GradBuffers) -> None:
        opt = self.optimizer
        if self.buffers is not buffers or len(self.group_leaves) != len(opt.param_groups):
            self._build(buffers)
        held, state = [group["params"] for group in opt.param_groups], opt.state
        for group, leaves in zip(opt.param_groups, self.group_leaves):
            group["params"] = leaves
        opt.state = self.state
        try:
            opt.step()
        finally:
            for group, params in zip(opt.param_groups, held):
                group["params"] = params
            opt.state = state
        if self.missing:
            self._publish()

    def _publish(self) -> None:
        """The state the step made for leaves, as the optimizer's state of their parameters."""
        still = []
        for p, leaf in self.missing:
            if leaf not in self.state:
                still.append((p, leaf))
                continue
            self.optimizer.state[p] = {k: _like_param(v, p, leaf) for k, v in self.state[leaf].items()}
        self.missing = still


def _like_param(value, param: DTensor, leaf: torch.Tensor):
    """A state tensor of a leaf's shape as a DTensor placed like `param` (its local tensor `value`
    itself); scalars (a step count) as they are."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != leaf.shape:
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())
