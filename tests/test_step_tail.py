"""The step's tail (`tess_compile.analysis.step_tail`): what README's loop adds around a sharded module's
call, priced in the step's peak (`memory.step_peak`), in time (`tail_time`) and by the planner.

One small program (1-D p=4, a weight and then work on a wide activation, so that the step's peak comes
before any weight's gradient), each option against the module's own step (`MODULE_LOSS`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tess_compile.analysis.memory import param_shards, predict_memory, step_peak
from tess_compile.analysis.planner import plan
from tess_compile.analysis.step_record import record_step
from tess_compile.analysis.step_tail import MODULE_LOSS, README_STEP, StepTail, tail_time
from tess_compile.core.cluster import CALIBRATED_CLUSTER
from tess_compile.core.mesh import Mesh
from tess_compile.passes.driver import compile_model

MESH = Mesh(1, 4, "1d")
FLOAT = 4  # bytes


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 64, bias=False)

    def forward(self, x):
        return (self.proj(x).exp() * 2).exp()


def _inputs():
    return (torch.randn(32, 8, 16),)


@pytest.fixture(scope="module")
def program():
    return compile_model(Wide(), MESH, _inputs())


def _output_bytes(program) -> tuple[int, int]:
    """(local, global) bytes of the program's one output."""
    (layout,), (shape,) = program.output_layouts, program.output_shapes
    return FLOAT * torch.Size(layout.local_shape(shape, MESH)).numel(), FLOAT * torch.Size(shape).numel()


def _added(program, tail: StepTail) -> int:
    return step_peak(program, tail) - step_peak(program, MODULE_LOSS)


def test_zero_grad_to_zeros_keeps_every_gradient_into_the_next_step(program):
    grads = sum(numel * size for numel, size in param_shards(program))
    assert _added(program, StepTail(gather=False, loss=None, set_to_none=False)) == grads


def test_the_gather_holds_every_ranks_block_and_the_whole_output(program):
    local, whole = _output_bytes(program)
    # the all-gather's block from each rank and the output assembled from them, at once; the module's
    # own step holds one block's seed at its peak
    assert _added(program, StepTail(gather=True, loss=None)) == MESH.num_ranks * local + whole - local


def test_a_loss_outside_adds_its_backwards_temporary(program):
    local, _ = _output_bytes(program)
    # the mean square's backward: the gradient of the output and 2 * output at once (the module's own
    # step: one seed), and the loss and its gradient, a float each
    assert _added(program, StepTail(gather=False)) == local + 2 * FLOAT


def test_predict_memory_defaults_to_readmes_loop(program):
    assert predict_memory(program).peak == step_peak(program, README_STEP) > step_peak(program, MODULE_LOSS)


def test_tail_time_prices_the_gather_and_the_loss(program):
    local, _ = _output_bytes(program)
    assert tail_time(program, CALIBRATED_CLUSTER, MODULE_LOSS).forward_s == 0
    gathered = tail_time(program, CALIBRATED_CLUSTER, README_STEP)
    assert gathered.comm_bytes == local
    assert gathered.comm_s == CALIBRATED_CLUSTER.collective_seconds("all_gather", 4, local, True, alone=True)
    local_loss = tail_time(program, CALIBRATED_CLUSTER, StepTail(gather=False))
    assert local_loss.comm_s == 0 and 0 < local_loss.forward_s < gathered.forward_s and local_loss.backward_s > 0


def test_the_planner_adds_the_tail_to_each_row(program):
    rows = {name: plan(Wide(), 4, example_inputs=_inputs(), modes=("1d",), dp=1, pp=1, summa="broadcast",
                       keep_blocks=False, tail=tail)[0] for name, tail in (("module", MODULE_LOSS), ("readme", README_STEP))}
    extra = tail_time(program, CALIBRATED_CLUSTER, README_STEP)
    added = rows["readme"].time.step_s - rows["module"].time.step_s
    assert added == pytest.approx(extra.forward_s + extra.backward_s + extra.comm_s, rel=1e-9)
    assert rows["readme"].memory.total - rows["module"].memory.total == _added(program, README_STEP)


def test_the_cli_flags_name_a_tail():
    from argparse import Namespace

    from tess_compile.cli.plan import step_tail

    assert step_tail(Namespace(step="readme", zero_grad="none")) == README_STEP
    assert step_tail(Namespace(step="module", zero_grad="zeros")) == StepTail(gather=False, loss=None,
                                                                               set_to_none=False)


@pytest.mark.parametrize("tail", [README_STEP, StepTail(gather=False)], ids=["readme", "local-loss"])
def test_a_step_record_holds_the_programs_kernels_and_saved_bytes_whatever_the_loss(program, tail):
    """`record_step` leaves the tail's gather and loss out, their kernels and saved tensors (`tail_time`
    prices them), so that one record serves the program's kernels, saved bytes and memory."""
    own = record_step(program, {}, MODULE_LOSS)
    record = record_step(program, {}, tail)
    assert record.phases == own.phases
    assert record.saved == own.saved


def test_zero_grad_to_zeros_adds_each_gradients_accumulation_to_backward(program):
    """Gradients kept as zeros are accumulated into (an add a parameter) where `set_to_none` hands them over."""
    own = record_step(program, {}, MODULE_LOSS).phases["backward"]
    kept = record_step(program, {}, StepTail(set_to_none=False)).phases["backward"]
    assert kept.num_kernels == own.num_kernels + len(param_shards(program))


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam])
def test_the_recorded_first_step_leaves_the_optimizers_own_state(optimizer):
    """The step record makes an AdamW's first-step state without running the step (`_first_step`): the same
    keys, values, shapes, dtypes and layouts as torch's own first step leaves, so the memory stays torch's."""
    from tess_compile.analysis.step_record import _first_step

    states = []
    for first in (lambda opt: opt.step(), _first_step):
        params = [nn.Parameter(torch.randn(3, 4).t()), nn.Parameter(torch.randn(5, dtype=torch.float64))]
        opt = optimizer(params, lr=0.1)
        for param in params:
            param.grad = torch.zeros_like(param)
        first(opt)
        states.append([opt.state[param] for param in params])
    for made, real in zip(*reversed(states)):
        assert made.keys() == real.keys()
        for key, value in real.items():
            assert (made[key].shape, made[key].dtype, made[key].stride()) == (value.shape, value.dtype, value.stride())
            assert torch.equal(made[key], value), key
