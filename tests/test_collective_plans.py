"""The eager path's collectives are made once and each call does only its plan's work.

`DistComm.plan` makes each (op, axis, arguments) once: its process group's call with its options
(`tess_compile.core.group_calls`), this rank's coordinate, the views that put blocks in rank order,
its record. A call, forward and backward, then runs no maker, no torch.distributed Python wrapper
and only a few of our Python frames, counted here with `sys.setprofile` (no clock is read). What
the plans compute is `tests/test_collective_table.py`'s (every op against its group results) and
`tests/test_runtime_overhead.py`'s (the eager graph against the custom ops).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import tess_compile
from tess_compile.core import group_calls
from tess_compile.core.collective_table import COLLECTIVES
from tess_compile.core.mesh import Mesh
from tess_compile.ops.collectives import EAGER_TARGETS, use_comm
from tess_compile.runtime.dist_comm import DistComm

PACKAGE = str(Path(tess_compile.__file__).parent)

# (op, axis, its own arguments) on a [4, 8, 6] block of [2,2,2]: rooted, reducing, and the split ops with
# blocks out of rank order (a copy puts them in place)
CASES = [("broadcast", "col", (1,)), ("reduce", "row", (0,)), ("all_reduce", "depth", ()),
         ("all_gather", "col", (2, 2, 1)), ("reduce_scatter", "row", (2, 2, 1))]

# what a call may run of ours: the eager target, the plans and their record, the process group's call
HOT = {"call", "plan", "forward", "backward", "<lambda>", "_append", "broadcast", "reduce", "all_reduce", "all_gather",
       "reduce_scatter", "_copy", "_zeros"}


def _our_calls(step) -> list[str]:
    """The functions of tess_compile that `step()` calls (Python frames entered), by name."""
    names = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return names


def _wrapper_called(*args, **kwargs):
    raise AssertionError("a plan called torch.distributed's Python wrapper")


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_a_collective_call_runs_its_plan_alone(fake_mesh, case):
    op, axis, args = case
    comm = DistComm(Mesh(2, 2), fake_mesh, timedelta(seconds=60))
    target = EAGER_TARGETS[getattr(torch.ops.tess, op).default]
    x = torch.randn(4, 8, 6, dtype=torch.float64, requires_grad=True)

    def step():
        y = target(x, axis, *args)
        y.backward(torch.ones_like(y))

    with use_comm(comm):
        step()  # makes the op's plan and its adjoint's
        plans = dict(comm._plans)
        wrappers = [mock.patch.object(dist, name, _wrapper_called)
                    for name in ("broadcast", "reduce", "all_reduce", "all_gather_single", "reduce_scatter_single")]
        for wrapper in wrappers:
            wrapper.start()
        try:
            calls = _our_calls(step)
        finally:
            for wrapper in wrappers:
                wrapper.stop()
    # the op and its adjoint, made on the first call
    assert comm._plans == plans and set(plans) == {(op, axis, *args), (COLLECTIVES[op].adjoint, axis, *args)}
    assert set(calls) <= HOT, set(calls) - HOT
    assert len(calls) <= 16, calls  # forward and backward: the target, two plans, their records and group calls
    assert [record.phase for record in comm.records] == ["forward", "backward"] * 2


def test_a_complex_tensor_goes_through_torch_distributed(fake_mesh):
    """What torch.distributed's wrapper changes before the group's call (a complex tensor, viewed as
    real) is left to it."""
    group = fake_mesh.get_group("col")
    seen = []
    with mock.patch.object(dist, "all_reduce", lambda t, group: seen.append(t.dtype)):
        group_calls.all_reduce(group)(torch.zeros(3, dtype=torch.complex128))
        group_calls.all_reduce(group)(torch.zeros(3, dtype=torch.float64))
    assert seen == [torch.complex128]


@pytest.mark.parametrize("rank", [0, 1], ids=["col0", "col1"])
@pytest.mark.parametrize("op, args", [("keep_first", ()), ("shard_slice", (2, 2, 1)), ("shard_pad", (2, 2, 1))],
                         ids=["keep_first", "shard_slice", "shard_pad"])
def test_a_rank_local_plan_differentiates_as_its_adjoint(rank, op, args):
    """A rank-local plan marked `own_adjoint` (keep_first at coordinate 0, shard_slice, shard_pad) runs
    without an autograd Function: torch's own gradient of it is its adjoint's result, exactly."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("depth", "row", "col"))
        comm = DistComm(Mesh(2, 2), mesh, timedelta(seconds=60))
        x = torch.randn(4, 8, 6, dtype=torch.float64, requires_grad=True)
        with use_comm(comm):
            y = EAGER_TARGETS[getattr(torch.ops.tess, op).default](x, "col", *args)
            grad = torch.randn_like(y)
            (dx,) = torch.autograd.grad(y, x, grad)
            expected_y = comm.plan(op, "col", *args)(x.detach(), "forward")
            expected_dx = comm.plan(COLLECTIVES[op].adjoint, "col", *args)(grad, "backward")
    finally:
        dist.destroy_process_group()
    assert torch.equal(y, expected_y) and torch.equal(dx, expected_dx)
    through_function = type(y.grad_fn).__name__ == "_CollectiveBackward"
    assert through_function == (op == "keep_first" and rank == 1)  # zeros: no gradient of their own
