"""`tess_compile.train_step`: a whole training step as one call, against PyTorch's eager loop.

Fast: a gloo world of one in float64 (losses, clipped norms, gradients and weights after fused
AdamW equal the unsharded model's; a parameter the loss does not reach keeps no gradient and
is not stepped; the optimizer's state stays DTensors), and the step's host work beyond
forward and backward: the same number of kernels for a model of one block as of two (no
kernel per parameter). Slow: 8 gloo processes, [2,2,2] (2.5-D) and mode 1d, against the
unsharded model's loop with `torch.nn.utils.clip_grad_norm_`.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import tess_compile
from tess_compile.runtime.launch import run_local
from tests.conftest import assert_close_rel
from tests.models import GPTStack
from tests.test_training_loop import LR, make_case, rel_err

STEPS, CLIP = 3, 0.05  # the clip is below every step's norm: clipping scales each step


def _mse(output, target):
    return (output - target).square().mean()


class _WithUnused(nn.Module):
    """A GPT stack and a linear that the forward never calls (no gradient, never stepped)."""

    def __init__(self):
        super().__init__()
        self.stack = GPTStack(8, 2, 1)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.stack(x)


def _reference_step(model, opt, x, target, norm_type=2.0):
    opt.zero_grad()
    loss = _mse(model(x), target)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, norm_type)
    opt.step()
    return loss.detach(), norm


def test_world_of_one_steps_like_the_eager_loop(world_of_one):
    torch.manual_seed(3)
    model = _WithUnused().double()
    x, target = torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64)
    sharded = tess_compile.shard(copy.deepcopy(model), 1, 1, example_inputs=(x,), timeout=60)
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
    step = tess_compile.train_step(sharded, opt, _mse, clip=CLIP)
    assert opt.param_groups[0]["fused"] is True  # chosen for an optimizer left to choose
    reference_opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    for _ in range(STEPS):
        loss, norm = _reference_step(model, reference_opt, x, target)
        assert_close_rel(step(x, target=target), loss, 1e-12, "loss")
        assert_close_rel(step.norm, norm, 1e-12, "norm")
    for name, param in sharded.named_parameters():
        expected = model.get_parameter(name)
        if expected.grad is None:
            assert param.grad is None and name.startswith("unused"), name
            assert torch.equal(param.full_tensor(), expected), name  # not stepped
            continue
        assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements, name
        assert_close_rel(param.grad.full_tensor(), expected.grad, 1e-12, f"grad {name}")
        assert_close_rel(param.full_tensor(), expected, 1e-12, name)
        assert isinstance(opt.state[param]["exp_avg"], DTensor), name
    saved = get_optimizer_state_dict(sharded, opt)["state"]
    assert_close_rel(saved["stack.ln_f.weight"]["exp_avg"].full_tensor(),
                     reference_opt.state[model.stack.ln_f.weight]["exp_avg"], 1e-12, "exp_avg")


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _ops_beyond_forward_and_backward(layers: int) -> int:
    """Kernels of one train step less those of its forward, loss and backward alone."""
    torch.manual_seed(0)
    model = GPTStack(8, 2, layers)
    x = torch.randn(2, 4, 8)
    sharded = tess_compile.shard(model, 1, 1, example_inputs=(x,), timeout=60)
    step = tess_compile.train_step(sharded, torch.optim.AdamW(sharded.parameters()), _mse, clip=1.0)
    step(x, target=x)
    with _CountOps() as whole:
        step(x, target=x)
    with _CountOps() as alone, sharded.feeding_leaves():
        _mse(sharded.full_outputs(x), x).backward()
    return whole.count - alone.count


def test_host_work_per_step_not_per_parameter(world_of_one):
    """Zeroing, clipping and the optimizer's step: the same kernels for 12 parameters as for 24."""
    one, two = _ops_beyond_forward_and_backward(1), _ops_beyond_forward_and_backward(2)
    assert one == two and one <= 24, (one, two)


def test_graphs_on_cpu_say_why_once(world_of_one):
    x = torch.randn(2, 4, 8)
    sharded = tess_compile.shard(GPTStack(8, 2, 1), 1, 1, example_inputs=(x,), timeout=60)
    with pytest.warns(UserWarning, match="without CUDA graphs: the module runs on cpu"):
        step = tess_compile.train_step(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), _mse, graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(x, target=x)
        step(x, target=x)


def _case(mode: str):
    """(model, inputs, targets, loss_fn) of a mode: the tied attention LM of test_training_loop on
    [2,2,2]; on 1-D over 8 ranks (which its 2 heads do not divide) an MLP, float64."""
    if mode == "2.5d":
        model, ids, targets = make_case(2, 2)
        return model, ids, targets, lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten())
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)).double()
    return model, torch.randn(4, 3, 8, dtype=torch.float64), torch.randn(4, 3, 8, dtype=torch.float64), _mse


def _worker(rank, world_size):
    torch.set_num_threads(1)
    errors = {}
    for mode, norm_type in (("2.5d", 2.0), ("1d", math.inf)):
        model, inputs, targets, loss_fn = _case(mode)
        sharded = tess_compile.shard(copy.deepcopy(model), 2, 2, example_inputs=(inputs,), mode=mode, timeout=60)
        opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
        step = tess_compile.train_step(sharded, opt, loss_fn, clip=CLIP, norm_type=norm_type)
        reference_opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        worst = 0.0
        for _ in range(STEPS):
            reference_opt.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, norm_type)
            reference_opt.step()
            worst = max(worst, rel_err(step(inputs, target=targets), loss), rel_err(step.norm.cpu(), norm))
        for name, param in sharded.named_parameters():
            expected = model.get_parameter(name)
            worst = max(worst, rel_err(param.full_tensor(), expected), rel_err(param.grad.full_tensor(), expected.grad))
        # torch's clip on the DTensor gradients sees the step's clipped gradients
        clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type)
        worst = max(worst, rel_err(sharded.clip_grad_norm_(1e9, norm_type), clipped))
        errors[mode] = worst
    return errors


@pytest.mark.slow
def test_train_step_on_q2d2_and_1d_matches_the_eager_loop():
    for errors in run_local(_worker, 8, timeout_s=240):
        for mode, error in errors.items():
            assert error <= 1e-12, (mode, error)


def test_replicas_count_grouped_splits_as_splits(fake_mesh):
    """A grouped split (`_StridedShard`) is a split: a vector split so over col has the 2 * 2
    replicas of the depth and row axes."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    from tess_compile.runtime.grad_buffers import replicas

    value = DTensor.from_local(torch.zeros(4), fake_mesh, (Replicate(), Replicate(), _StridedShard(0, split_factor=2)),
                               run_check=False)
    assert replicas(value) == 4
